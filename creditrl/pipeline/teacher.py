"""The on-policy distillation teacher (``distill.teacher``): which weights, loaded frozen.

``self``: the actor's initial weights (``model.path``); ``embedded``: the embedded SmolLM2; a
model directory (``config.json``); or a run directory or one of its checkpoints, whose actor is
rebuilt from the run's ``config.yaml`` (read as data: nothing it names is imported) and given
the checkpoint's weights (LoRA adapters merged). The teacher's tokenizer must be the student's:
``creditrl.config.validate`` refuses another vocabulary when the config is loaded; and its
embedding must take every token id the student can sample (a smaller ``vocab_size`` with the
same tokenizer files is refused here, when it is loaded).
"""

from __future__ import annotations

from pathlib import Path

import torch

from creditrl.config import Config
from creditrl.errors import ConfigError
from creditrl.models import load_reference, torch_dtype

__all__ = ["is_run_or_checkpoint", "load_teacher"]


def is_run_or_checkpoint(path: Path) -> bool:
    """``path`` is a run directory (it has ``checkpoints/``) or a ``checkpoints/step_*`` one."""
    return (path / "checkpoints").is_dir() or path.parent.name == "checkpoints"


# creditrl train has no --trust-run-code: it imports the extensions its own config names
TRAIN_REMEDY = (
    "if they register it, list them in trainer.extensions of the config you train with "
    "(creditrl train imports those: they run code)"
)


def _run_actor(path: Path, teacher: str) -> torch.nn.Module:
    from creditrl.config.run_config import load_run_config
    from creditrl.exporting.sources import find_checkpoint
    from creditrl.exporting.weights import load_actor
    from creditrl.weights.tensors import merged_model

    ckpt = find_checkpoint(path)
    try:
        run_cfg = load_run_config(ckpt.config_file, remedy=TRAIN_REMEDY)
    except ConfigError as err:
        raise ConfigError(f"distill.teacher={teacher!r}: {err}") from None
    return merged_model(load_actor(ckpt, run_cfg))


def load_teacher(cfg: Config, vocab_size: int) -> torch.nn.Module:
    """The frozen teacher ``distill.teacher`` names, in ``model.dtype``, eval mode and
    ``requires_grad=False``; a one-line ``ConfigError`` when nothing can be loaded from it, or
    when it embeds fewer than ``vocab_size`` token ids (those the student can sample)."""
    teacher = cfg.distill.teacher
    if teacher is None:
        raise ConfigError("distill.teacher is not set: this run has no teacher")
    if teacher in ("self", "embedded"):
        source = cfg.model.path if teacher == "self" else "embedded"
        model = load_reference(source, cfg.model.dtype, cfg.model.cache_dir)
    elif is_run_or_checkpoint(path := Path(teacher).expanduser()):
        model = _run_actor(path, teacher).to(torch_dtype(cfg.model.dtype))
    else:
        model = load_reference(path, cfg.model.dtype)
    embeds = model.get_input_embeddings().num_embeddings
    if embeds < vocab_size:
        raise ConfigError(
            f"distill.teacher={teacher!r} embeds {embeds} token ids, fewer than the "
            f"{vocab_size} the student (model.path) can sample: the teacher scores the "
            "student's token ids, so it needs at least the student's vocabulary size"
        )
    return model.requires_grad_(False).eval()

"""``export``: one checkpoint of a run as a standard Hugging Face directory with a model card."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from transformers.utils.hub import convert_file_size_to_int

from creditrl.config.run_config import load_run_config
from creditrl.errors import UserError
from creditrl.exporting.card import model_card
from creditrl.exporting.options import DEFAULT_MAX_SHARD_SIZE, DTYPES
from creditrl.exporting.out_dir import MARKER, check_out_dir, staged_dir, write_marker
from creditrl.exporting.sources import find_checkpoint
from creditrl.exporting.weights import export_tokenizer, load_actor, write_adapter, write_merged
from creditrl.models import resolve_model_path, torch_dtype
from creditrl.version import __version__

__all__ = ["ExportResult", "export"]


@dataclass(frozen=True)
class ExportResult:
    """What ``export`` wrote: the directory, the checkpoint it came from, the files, and the
    newer damaged checkpoints it skipped (one ``"step_N (file: problem)"`` each)."""

    out_dir: Path
    checkpoint: Path
    step: int
    files: tuple[str, ...]
    skipped: tuple[str, ...]
    notes: tuple[str, ...]


def _check_options(dtype: str | None, max_shard_size: int | str) -> int:
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    try:
        size = convert_file_size_to_int(max_shard_size)
    except (TypeError, ValueError):
        size = 0
    if isinstance(max_shard_size, bool) or size <= 0:
        raise UserError(
            f"max shard size {max_shard_size!r} is not a positive size such as 5GB, 500MB or a "
            "number of bytes"
        )
    return size


def export(
    run_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
    dtype: str | None = None,
    adapter: bool = False,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    trust_run_code: bool = False,
) -> ExportResult:
    """Write a run's checkpoint as a Hugging Face directory that ``AutoModelForCausalLM`` and
    ``AutoTokenizer.from_pretrained`` load without creditrl.

    - ``run_dir``: a run directory (its newest complete checkpoint, or that of ``step``) or a
      ``checkpoints/step_NNNNNN`` directory.
    - ``dtype``: ``float32``, ``bfloat16`` or ``float16``; None: the run's ``model.dtype``.
    - ``adapter``: a LoRA run's adapters alone, as a peft directory (default: merged weights).
    - ``overwrite``: replace an earlier export in ``out_dir`` (any other non-empty directory
      is refused; ``creditrl.exporting.out_dir``).
    - ``max_shard_size``: safetensors files are split past this size (``"5GB"``, bytes).
    - ``trust_run_code``: import the ``trainer.extensions`` the run's config names (default:
      the config is read as data, ``creditrl.config.run_config``).

    Everything is written into a temporary directory beside ``out_dir`` and renamed into place,
    so a failure leaves nothing behind. Bad input raises a one-line ``UserError``.
    """
    shard_bytes = _check_options(dtype, max_shard_size)
    out = Path(out_dir).expanduser()
    ckpt = find_checkpoint(run_dir, step)
    check_out_dir(out, ckpt.run_dir, overwrite)
    cfg = load_run_config(ckpt.config_file, trust_code=trust_run_code)
    if adapter and cfg.model.lora_rank <= 0:
        raise UserError(
            f"--adapter needs a LoRA run; {ckpt.config_file} has model.lora_rank=0, so the "
            "run trained every weight: export without --adapter"
        )
    dtype = dtype or str(torch_dtype(cfg.model.dtype)).removeprefix("torch.")
    model = load_actor(ckpt, cfg)
    base_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    tokenizer = export_tokenizer(base_dir)
    card, skipped = model_card(cfg, ckpt, out.name, base_dir, adapter, dtype, __version__)
    with staged_dir(out, ckpt.run_dir, overwrite) as tmp:
        if adapter:
            write_adapter(model, tmp, torch_dtype(dtype))
        else:
            write_merged(model, tmp, torch_dtype(dtype), shard_bytes)
        tokenizer.save_pretrained(str(tmp))
        (tmp / "README.md").write_text(card, encoding="utf-8")
        written = [p.name for p in tmp.iterdir()]
        write_marker(tmp, written, ckpt.step, __version__)
    files = tuple(sorted([*written, MARKER]))
    notes = (f"{ckpt.run_dir / 'metrics.jsonl'}: {skipped} unreadable lines skipped",) * (
        skipped > 0
    )
    return ExportResult(out, ckpt.directory, ckpt.step, files, ckpt.skipped, notes)

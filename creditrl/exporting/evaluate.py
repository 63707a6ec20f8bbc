"""Validation of any model: ``"embedded"``, a Hugging Face directory, a run directory or one of
its checkpoints (``creditrl eval``, ``creditrl eval --compare A B``).

A run or checkpoint is evaluated through its export (merged weights in the run's
``model.dtype``, written to a temporary directory), so evaluating a run and its export give
the same numbers. The config is the one given, else the config.yaml of the first run among the
models, else the defaults; ``key=value`` overrides apply on top. Every model of one call is
evaluated under that same config (same prompts, same seeds), each in a fresh worker.

A run's config is read as data (``creditrl.config.run_config``): one that names code (its
``trainer.extensions``, a scorer or estimator file, an agent program or tool file) is refused
unless ``trust_run_code`` (``--trust-run-code``) says to run it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from creditrl.config import Config
from creditrl.config.loader import load_config, load_config_with_sources
from creditrl.config.run_config import TRUST_FLAG, load_run_config, run_code
from creditrl.errors import ConfigError, UserCodeError, UserError
from creditrl.exporting.exporter import export
from creditrl.exporting.sources import (
    RunCheckpoint,
    find_checkpoint,
    is_checkpoint_dir,
    is_model_dir,
)

__all__ = ["EvalPlan", "evaluated_model", "plan_eval", "resolve", "validation_metrics"]

MODEL_PATH = "model.path="


def resolve(spec: str) -> RunCheckpoint | str:
    """A run or checkpoint directory -> its checkpoint; ``"embedded"`` or a Hugging Face model
    directory -> the path as given. Anything else is a one-line ``UserError``."""
    if spec == "embedded":
        return spec
    path = Path(spec).expanduser()
    if is_checkpoint_dir(path) or (path / "checkpoints").is_dir():
        return find_checkpoint(path)
    if (path / "config.json").is_file():
        return spec
    if is_model_dir(path):
        raise UserError(
            f"{spec} is a LoRA adapter directory: evaluate the run it came from, or export "
            "that run without --adapter"
        )
    raise UserError(
        f"model {spec!r} is not 'embedded', a run directory, a checkpoint "
        "(RUN/checkpoints/step_NNNNNN) or a Hugging Face model directory (config.json)"
    )


@dataclass(frozen=True)
class EvalPlan:
    """The models to evaluate (as given and resolved), the shared config file (None: the
    defaults), the overrides, warnings about overrides the config will not use, whether the
    config file is a run's (read as data), and whether the user trusts the runs' code."""

    specs: tuple[str, ...]
    targets: tuple[RunCheckpoint | str, ...]
    config_file: Path | None
    overrides: tuple[str, ...]
    warnings: tuple[str, ...]
    from_run: bool = False
    trust_run_code: bool = False

    def config_for(self, model_dir: str) -> Config:
        """The shared config with ``model.path=model_dir`` (a full model: no LoRA)."""
        overrides = [*self.overrides, f"model.path={model_dir}", "model.lora_rank=0"]
        if self.from_run:
            return load_run_config(self.config_file, overrides, trust_code=self.trust_run_code)
        return load_config(self.config_file, overrides)


def _run_config_file(path: Path, overrides: Sequence[str], trust_run_code: bool) -> None:
    """UserCodeError if the run's config at ``path`` names code and the user does not trust
    it (its ``trainer.extensions`` are not imported while it is read)."""
    code = run_code(load_run_config(path, overrides, trust_code=trust_run_code))
    if code and not trust_run_code:
        raise UserCodeError(
            f"{path} names code ({'; '.join(code)}), which creditrl eval would run: pass "
            f"{TRUST_FLAG} if you trust the run, or give a config file of your own"
        )


def plan_eval(
    items: Sequence[str], compare: Sequence[str] | None = None, *, trust_run_code: bool = False
) -> EvalPlan:
    """Read ``[CONFIG.yaml | MODEL] [key=value ...]`` (a directory is the model, a file the
    config; ``model.path=`` names the model too) or, with ``compare``, two models.
    ``trust_run_code``: a run's config may name code to import and run."""
    config_file: Path | None = None
    overrides: list[str] = []
    specs: list[str] = list(compare or [])
    for item in items:
        if item.startswith(MODEL_PATH) and not compare:
            specs.append(item[len(MODEL_PATH) :])
        elif "=" in item:
            overrides.append(item)
        elif Path(item).is_file() and config_file is None:
            config_file = Path(item)
        elif (Path(item).is_dir() or item == "embedded") and not compare:
            specs.append(item)
        else:
            raise UserError(
                f"{item!r} is not a config file, a model or run directory, or key=value"
                + (" (with --compare, the models are the two after --compare)" if compare else "")
            )
    if len(specs) > 1 and not compare:
        raise UserError(f"one model at a time ({', '.join(specs)}); use --compare A B for two")
    if not specs:
        specs = [load_config(config_file, overrides).model.path]
    targets = tuple(resolve(spec) for spec in specs)
    warnings: list[str] = []
    runs = [t.config_file for t in targets if isinstance(t, RunCheckpoint)]
    from_run = config_file is None and bool(runs)
    if config_file is not None:  # the user's file: say which of its settings go unused
        warnings = load_config_with_sources(config_file, overrides).warnings
    elif from_run:  # a run's config.yaml (every key set, so no warnings), read as data
        config_file = runs[0]
        _run_config_file(config_file, overrides, trust_run_code)
    else:
        warnings = load_config_with_sources(None, overrides).warnings
    return EvalPlan(
        tuple(specs),
        targets,
        config_file,
        tuple(overrides),
        tuple(warnings),
        from_run,
        trust_run_code,
    )


@contextmanager
def evaluated_model(target: RunCheckpoint | str, trust_run_code: bool = False) -> Iterator[str]:
    """The model directory (or ``"embedded"``) that validation loads for ``target``: a
    checkpoint is exported into a temporary directory, removed afterwards."""
    if not isinstance(target, RunCheckpoint):
        yield target
        return
    with tempfile.TemporaryDirectory(prefix="creditrl-eval-") as tmp:
        out = Path(tmp) / f"{target.run_dir.name}-step{target.step}"
        export(target.directory, out, trust_run_code=trust_run_code)
        yield str(out)


def validation_metrics(cfg: Config) -> dict[str, float]:
    """``StepPipeline.validate`` on ``cfg``'s validation rows with a rollout-only worker of
    ``model.path`` (no optimizer, no reference, no critic), in this process."""
    from creditrl.models import load_tokenizer, resolve_model_path
    from creditrl.pipeline.step import StepPipeline, build_reward_manager, build_run_datasets
    from creditrl.preflight import preflight
    from creditrl.workers.hybrid import HybridWorker

    preflight(cfg)
    if cfg.trainer.num_threads > 0:
        torch.set_num_threads(cfg.trainer.num_threads)
    torch.manual_seed(cfg.trainer.seed)
    tokenizer = load_tokenizer(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    _, val_data = build_run_datasets(cfg, tokenizer)
    if val_data is None or len(val_data) == 0:
        raise ConfigError(
            "nothing to evaluate: the config has no validation rows (set data.val_size > 0, "
            "or data.val_files with data.train_files, or give env.verifiers's environment an "
            "eval_dataset)"
        )
    worker = HybridWorker(cfg, roles=("rollout",))
    reward = build_reward_manager(cfg, tokenizer)
    try:
        pipeline = StepPipeline(cfg, worker, reward, tokenizer)
        return pipeline.validate([val_data[i] for i in range(len(val_data))])
    finally:
        reward.close()

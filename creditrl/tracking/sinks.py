"""Metric sinks: one Tracker fans each step's metrics out to jsonl, TensorBoard, wandb, MLflow.

``metrics.jsonl`` is always written: one JSON object per line, ``{"step", "time", **metrics}``,
flushed per line so a running run can be read; non-finite values are written as null.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from creditrl.bounded_json import RUN_RECORD_LIMITS, loads_bounded

__all__ = ["LOGGERS", "JsonlSink", "Tracker", "truncate_jsonl"]

log = logging.getLogger(__name__)

LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


class Sink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _as_float(key: str, value: Any) -> float:
    """A metric value as a Python float (accepts numbers, bools, 0-d tensors and arrays)."""
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"metric {key!r} is not a number: {value!r}") from e


def _json_number(value: float) -> float | None:
    return value if math.isfinite(value) else None


def truncate_jsonl(path: Path, step: int) -> int:
    """Keep only lines of ``path`` with ``"step" <= step``, each step once (its last record),
    and rewrite it atomically and durably; returns the lines dropped. ``step=-1`` drops every
    record (a run starting over).

    Unreadable lines (e.g. half-written by a crash) are dropped with a warning.
    """
    if not path.exists():
        return 0
    by_step: dict[int, str] = {}
    dropped = 0
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row_step = loads_bounded(line, RUN_RECORD_LIMITS)["step"]
        except (KeyError, TypeError, ValueError):
            log.warning("%s line %d is not a metrics record; dropped on resume", path, lineno)
            dropped += 1
            continue
        if not isinstance(row_step, int) or row_step > step:
            dropped += 1
            continue
        if row_step in by_step:
            dropped += 1
            del by_step[row_step]  # the last record of a step stays, where it was written
        by_step[row_step] = line
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("".join(f"{line}\n" for line in by_step.values()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return dropped


class JsonlSink:
    """Appends ``{"step", "time", **metrics}`` to ``output_dir/metrics.jsonl``, one flushed line
    per call."""

    def __init__(self, output_dir: Path) -> None:
        self.path = output_dir / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step, "time": time.time()}
        row |= {k: _json_number(v) for k, v in metrics.items()}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def truncate_after(self, step: int) -> int:
        """Drop lines with step > ``step`` (resume); returns how many were dropped."""
        self._file.close()
        dropped = truncate_jsonl(self.path, step)
        self._file = self.path.open("a", encoding="utf-8")
        return dropped

    def close(self) -> None:
        self._file.close()


class ConsoleSink:
    """No-op: the console view is ``creditrl.tracking.progress.TrainingProgress``."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        return None

    def close(self) -> None:
        return None


class TensorBoardSink:
    """``torch.utils.tensorboard.SummaryWriter`` under ``output_dir/tensorboard``."""

    def __init__(self, output_dir: Path, config_dict: Mapping[str, Any], run_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"))
        config = json.dumps(config_dict, indent=2, default=str)
        self._writer.add_text("config", f"run {run_name}\n\n```\n{config}\n```")

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Weights & Biases in offline mode, files under ``output_dir/wandb``."""

    def __init__(self, output_dir: Path, config_dict: Mapping[str, Any], run_name: str) -> None:
        import wandb

        self._wandb = wandb
        self._run = wandb.init(
            project="creditrl",
            name=run_name,
            config=dict(config_dict),
            dir=str(output_dir),
            mode="offline",
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config as ``{"a.b": "value"}`` (MLflow params are flat strings)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= _flatten(value, f"{name}.")
        else:
            out[name] = str(value)[:500]
    return out


class MlflowSink:
    """MLflow with a local file store at ``output_dir/mlruns`` (experiment "creditrl")."""

    def __init__(self, output_dir: Path, config_dict: Mapping[str, Any], run_name: str) -> None:
        import mlflow

        self._mlflow = mlflow
        mlflow.set_tracking_uri((output_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment("creditrl")
        self._run = mlflow.start_run(run_name=run_name)
        mlflow.log_params(_flatten(config_dict))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


_OPTIONAL = {
    "tensorboard": (TensorBoardSink, "tensorboard", "pip install tensorboard"),
    "wandb": (WandbSink, "wandb", "pip install wandb"),
    "mlflow": (MlflowSink, "mlflow", "pip install mlflow"),
}


class Tracker:
    """Fans ``log(metrics, step)`` out to the sinks named in ``loggers`` (jsonl is always on).

    Names: ``console`` (no-op here; the progress bar shows it), ``jsonl``, ``tensorboard``,
    ``wandb`` (offline), ``mlflow`` (local file store). An optional sink whose package is not
    installed is skipped with a warning; an unknown name raises ValueError.
    """

    def __init__(
        self,
        output_dir: Path,
        loggers: list[str],
        config_dict: Mapping[str, Any],
        run_name: str,
    ) -> None:
        unknown = [name for name in loggers if name not in LOGGERS]
        if unknown:
            raise ValueError(f"unknown logger(s) {unknown}; choices: {list(LOGGERS)}")
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = JsonlSink(self.output_dir)
        self.sinks: dict[str, Sink] = {"jsonl": self.jsonl}
        for name in dict.fromkeys(loggers):
            if name == "console":
                self.sinks[name] = ConsoleSink()
            elif name in _OPTIONAL:
                cls, package, install = _OPTIONAL[name]
                try:
                    self.sinks[name] = cls(self.output_dir, config_dict, run_name)
                except ImportError as e:
                    log.warning(
                        "logger %r skipped: package %r is not importable (%s); %s to enable it",
                        name,
                        package,
                        e,
                        install,
                    )

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Send one step's metrics (numbers, bools, 0-d tensors) to every sink."""
        values = {key: _as_float(key, value) for key, value in metrics.items()}
        for sink in self.sinks.values():
            sink.log(values, int(step))

    def truncate_after(self, step: int) -> int:
        """On resume from ``step``: drop metrics.jsonl lines with a larger step and repeats of a
        step (``-1``: every line, for a run that starts over)."""
        return self.jsonl.truncate_after(step)

    def close(self) -> None:
        """Close every sink (idempotent)."""
        for sink in self.sinks.values():
            sink.close()
        self.sinks = {}

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

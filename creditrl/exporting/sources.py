"""What a path given to ``creditrl export`` or ``creditrl eval`` is: a run directory, one of its
checkpoints, or a Hugging Face model directory. Everything is checked before a model loads, and
each problem is one ``DataError`` line naming the path.

A checkpoint is used only when ``checkpoint_damage`` finds it complete (manifest sizes and
hashes, safetensors headers, ``state.json``), and the actor's part of ``state.json`` (written by
``creditrl.workers.checkpoint_io``) is checked for type and range before it names any file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from creditrl.bounded_json import read_json_file
from creditrl.errors import DataError
from creditrl.trainers.checkpoint import STEP_DIR, checkpoint_damage

__all__ = [
    "MAX_ALIASES",
    "MAX_WORLD_SIZE",
    "RunCheckpoint",
    "find_checkpoint",
    "is_checkpoint_dir",
    "is_model_dir",
]

MAX_WORLD_SIZE = 4096  # ranks a sharded checkpoint may name (one file each)
MAX_ALIASES = 100_000  # tied-weight aliases in the actor's meta


@dataclass(frozen=True)
class RunCheckpoint:
    """A complete checkpoint of a run: its directory, step, the actor's meta, and the newer
    checkpoints skipped because they are damaged (``"step_000003 (file: problem)"``)."""

    run_dir: Path
    directory: Path
    step: int
    actor_meta: dict[str, Any]
    skipped: tuple[str, ...] = ()

    @property
    def config_file(self) -> Path:
        """The run's resolved config (``trainer.output_dir/config.yaml``)."""
        return self.run_dir / "config.yaml"


def is_model_dir(path: Path) -> bool:
    """A Hugging Face model directory (``config.json``) or a peft adapter directory."""
    return (path / "config.json").is_file() or (path / "adapter_config.json").is_file()


def is_checkpoint_dir(path: Path) -> bool:
    """A ``step_NNNNNN`` directory (complete or not)."""
    return path.is_dir() and STEP_DIR.fullmatch(path.name) is not None


def _steps(checkpoints: Path) -> list[tuple[int, Path]]:
    found = []
    for path in checkpoints.iterdir():
        match = STEP_DIR.fullmatch(path.name)
        if match is not None and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _actor_meta(directory: Path) -> dict[str, Any]:
    """state.json's ``parts.actor``, checked for type and range (``checkpoint_damage`` has
    already parsed the file)."""
    payload = read_json_file(directory / "state.json")
    parts = payload.get("parts")
    meta = parts.get("actor") if isinstance(parts, dict) else None
    where = f"checkpoint {directory}: state.json"
    if not isinstance(meta, dict):
        raise DataError(f"{where} records no actor weights (parts.actor is missing)")
    fmt, world = meta.get("format"), meta.get("world_size")
    if fmt not in ("full", "sharded"):
        raise DataError(f"{where}: parts.actor.format must be 'full' or 'sharded'")
    if not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= MAX_WORLD_SIZE:
        raise DataError(
            f"{where}: parts.actor.world_size must be an integer in 1..{MAX_WORLD_SIZE}"
        )
    aliases, sharded = meta.get("model_aliases"), meta.get("model_sharded")
    if not _str_map(aliases) or len(aliases) > MAX_ALIASES:
        raise DataError(f"{where}: parts.actor.model_aliases must map names to names")
    if not isinstance(sharded, list) or not all(isinstance(s, str) for s in sharded):
        raise DataError(f"{where}: parts.actor.model_sharded must be a list of names")
    return {"format": fmt, "world_size": world, "model_aliases": aliases, "model_sharded": sharded}


def _checked(run_dir: Path, directory: Path, skipped: tuple[str, ...] = ()) -> RunCheckpoint:
    damage = checkpoint_damage(directory)
    if damage is not None:
        raise DataError(f"checkpoint {directory} is damaged ({damage}); choose another --step")
    if not (run_dir / "config.yaml").is_file():
        raise DataError(
            f"checkpoint {directory}: its run directory {run_dir} has no config.yaml, which "
            "says how the model was built (export from the run directory a run wrote)"
        )
    step = int(STEP_DIR.fullmatch(directory.name).group(1))
    return RunCheckpoint(run_dir, directory, step, _actor_meta(directory), skipped)


def _from_checkpoint_dir(path: Path, step: int | None) -> RunCheckpoint:
    own = int(STEP_DIR.fullmatch(path.name).group(1))
    if step is not None and step != own:
        raise DataError(f"{path} is the checkpoint of step {own}, not of --step {step}")
    if path.parent.name != "checkpoints":
        raise DataError(
            f"checkpoint {path} is not inside a run's checkpoints/ folder, so its run's "
            "config.yaml cannot be found: give the run directory"
        )
    return _checked(path.parent.parent, path)


def _from_run_dir(run_dir: Path, step: int | None) -> RunCheckpoint:
    steps = _steps(run_dir / "checkpoints")
    if not steps:
        raise DataError(f"run {run_dir} has no checkpoint yet (checkpoints/ holds no step_*)")
    if step is not None:
        named = dict(steps)
        if step not in named:
            have = ", ".join(str(s) for s, _ in steps)
            raise DataError(f"run {run_dir} has no checkpoint of step {step} (it has {have})")
        return _checked(run_dir, named[step])
    skipped = []
    for _, path in reversed(steps):
        damage = checkpoint_damage(path)
        if damage is None:
            return _checked(run_dir, path, tuple(skipped))
        skipped.append(f"{path.name} ({damage})")
    raise DataError(f"run {run_dir} has no complete checkpoint: {'; '.join(skipped)}")


def find_checkpoint(path: str | Path, step: int | None = None) -> RunCheckpoint:
    """The checkpoint ``path`` names: a run directory (its newest complete checkpoint, or the
    one of ``step``) or a ``checkpoints/step_NNNNNN`` directory of a run."""
    path = Path(path).expanduser()
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise DataError(f"step must be a non-negative integer, got {step!r}")
    if not path.is_dir():
        raise DataError(f"{path} is not a directory (expected a run directory or a checkpoint)")
    if is_checkpoint_dir(path):
        return _from_checkpoint_dir(path, step)
    if (path / "checkpoints").is_dir():
        return _from_run_dir(path, step)
    if is_model_dir(path):
        raise DataError(f"{path} is a Hugging Face model directory, not a run or a checkpoint")
    raise DataError(
        f"{path} is neither a run directory (no checkpoints/) nor a checkpoint "
        "(checkpoints/step_NNNNNN)"
    )

"""Atomic, verified checkpoints: models, optimizers, schedulers, RNG, sampler and trainer state.

Layout: ``checkpoints/step_000010/`` holding the files the worker group writes (per model and
optimizer, full or sharded: ``creditrl.workers.checkpoint_io``; per-rank random streams),
the controller's ``rng.safetensors`` and ``state.json``, and ``manifest.json`` (every file's
size, and its sha256 when it is at most 4 MiB), written last. The file ``checkpoints/latest``
names the newest checkpoint written.

Saving: a checkpoint is written into a temporary directory; its files, the manifest and the
directory are fsync'd, the directory is renamed into place and its parent fsync'd; then
``latest`` is replaced (written, fsync'd, renamed, parent fsync'd). A crash or power loss
leaves the old checkpoint or the new one, never a partial one under a ``step_*`` name.

Resuming: the newest ``step_*`` directory that is complete (every manifest file present with its
size and hash, every safetensors header readable, ``state.json`` parseable and of that step) is
used, whatever ``latest`` says; each newer damaged one is named in one warning line and is
removed by the next save (as are checkpoints after the resumed step). Directories that all fail
the check stop the run with a ``DataError`` rather than start it over.

``prepare_output_dir``: ``trainer.resume=never`` into a directory that holds a previous run is
refused unless ``trainer.overwrite=true``, which moves that run's files into
``<output_dir>/overwritten/<time>/`` (nothing is deleted).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from creditrl.errors import ConfigError, DataError
from creditrl.trainers.state_io import rng_state, set_rng_state

__all__ = ["MANIFEST", "CheckpointManager", "checkpoint_damage", "prepare_output_dir"]

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
HASH_MAX_BYTES = 4 << 20  # files up to this size also get a sha256 in the manifest
STEP_DIR = re.compile(r"step_(\d{6,})")
# a run's files in trainer.output_dir, moved aside by trainer.overwrite=true (async/ also
# holds the launcher's live logs, so only the learner's journal moves)
RUN_FILES = (
    "checkpoints",
    "metrics.jsonl",
    "rollouts",
    "config.yaml",
    "tensorboard",
    "wandb",
    "mlruns",
    "async/acks.jsonl",
    "async/dropped.jsonl",
)


def _fsync(path: Path, directory: bool = False) -> None:
    """Flush ``path`` (a file, or with ``directory`` its entries) to stable storage."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _seal(directory: Path) -> None:
    """fsync every file under ``directory``, write its manifest (fsync'd), fsync the
    directories."""
    files: dict[str, dict[str, Any]] = {}
    dirs = [directory]
    for path in sorted(directory.rglob("*")):
        if path.is_dir():
            dirs.append(path)
            continue
        _fsync(path)
        size = path.stat().st_size
        entry: dict[str, Any] = {"size": size}
        if size <= HASH_MAX_BYTES:
            entry["sha256"] = _sha256(path)
        files[path.relative_to(directory).as_posix()] = entry
    _write_synced(directory / MANIFEST, json.dumps({"version": 1, "files": files}))
    for path in reversed(dirs):
        _fsync(path, directory=True)


def _manifest_files(directory: Path) -> dict[str, dict[str, Any]] | str:
    """The manifest's ``{name: {"size", "sha256"?}}``, or why it cannot be used."""
    path = directory / MANIFEST
    if not path.is_file():
        return f"{MANIFEST}: missing"
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return f"{MANIFEST}: not a readable manifest"
    if not isinstance(files, dict):
        return f"{MANIFEST}: not a readable manifest"
    for name, entry in files.items():
        parts = PurePosixPath(name).parts
        if (
            not parts
            or PurePosixPath(name).is_absolute()
            or ".." in parts
            or not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
        ):
            return f"{MANIFEST}: bad entry {str(name)[:80]!r}"
    return files


def _file_damage(directory: Path, name: str, entry: dict[str, Any]) -> str | None:
    path = directory / name
    if not path.is_file():
        return f"{name}: missing"
    size, expected = path.stat().st_size, entry["size"]
    if size < expected:
        return f"{name}: truncated to {size} of {expected} bytes"
    if size > expected:
        return f"{name}: {size} bytes, {expected} written"
    if "sha256" in entry and _sha256(path) != entry["sha256"]:
        return f"{name}: content differs from what was written (sha256)"
    if name.endswith(".safetensors"):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as err:  # safetensors raises its own error types for a bad header
            return f"{name}: unreadable safetensors header ({str(err).splitlines()[0][:120]})"
    return None


def _state_damage(directory: Path, step: int) -> str | None:
    try:
        payload = json.loads((directory / "state.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return "state.json: not valid JSON"
    if not isinstance(payload, dict) or not {"step", "state", "parts", "rng"} <= payload.keys():
        return "state.json: lacks step, state, parts or rng"
    if payload["step"] != step:
        return f"state.json: step {str(payload['step'])[:20]}, the directory says {step}"
    return None


def checkpoint_damage(directory: Path) -> str | None:
    """Why ``directory`` is not a complete checkpoint ("file: problem"), or None."""
    match = STEP_DIR.fullmatch(directory.name)
    if match is None:
        return f"{directory.name}: not a step_NNNNNN directory"
    files = _manifest_files(directory)
    if isinstance(files, str):
        return files
    if "state.json" not in files:
        return "state.json: not in the manifest"
    for name, entry in files.items():
        damage = _file_damage(directory, name, entry)
        if damage is not None:
            return damage
    return _state_damage(directory, int(match.group(1)))


def _previous_run(out: Path) -> list[str]:
    """What in ``out`` shows an earlier run: checkpoint directories, metrics rows."""
    found = []
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir():
        steps = sorted(p.name for p in checkpoints.iterdir() if STEP_DIR.fullmatch(p.name))
        if steps:
            found.append(f"checkpoints up to {steps[-1]}")
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    return found


def prepare_output_dir(out: Path, resume: str, overwrite: bool) -> Path | None:
    """Before a run writes into ``out``: with ``resume="never"``, refuse (``ConfigError``) a
    directory that holds an earlier run, or with ``overwrite`` move that run's files into
    ``out/overwritten/<time>/`` and return that folder. None when nothing was moved."""
    out = Path(out)
    found = _previous_run(out) if resume == "never" else []
    if not found:
        return None
    if not overwrite:
        raise ConfigError(
            f"trainer.output_dir={out} already holds a run ({'; '.join(found)}) and "
            "trainer.resume=never: set trainer.resume=auto to continue it, "
            "trainer.overwrite=true to start over (its files move to "
            f"{out / 'overwritten'}/), or choose another trainer.output_dir"
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = out / "overwritten" / stamp, 1
    while aside.exists():
        aside, n = out / "overwritten" / f"{stamp}.{n}", n + 1
    aside.mkdir(parents=True)
    moved = [name for name in RUN_FILES if (out / name).exists()]
    for name in moved:
        (aside / name).parent.mkdir(parents=True, exist_ok=True)
        os.rename(out / name, aside / name)
        _fsync((out / name).parent, directory=True)
    log.warning("trainer.overwrite=true: the earlier run's %s moved to %s", ", ".join(moved), aside)
    return aside


class CheckpointManager:
    """Saves and restores the named (model, optimizer, scheduler) triples of a run."""

    def __init__(self, root: Path, max_keep: int = 2) -> None:
        self.root = Path(root)
        self.max_keep = max(int(max_keep), 1)

    def _steps(self) -> list[tuple[int, Path]]:
        """The ``step_*`` directories, ascending by step."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = STEP_DIR.fullmatch(path.name)
            if match is not None and path.is_dir():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def latest(self, report: bool = True) -> Path | None:
        """The newest complete checkpoint, or None when there is no ``step_*`` directory.

        With ``report``, each newer damaged checkpoint is logged as one line ("checkpoint
        step_000020 is damaged (file: problem); resuming from step_000010"), and so is a
        missing or dangling ``latest``. Raises ``DataError`` when every one is damaged."""
        damaged: list[tuple[str, str]] = []
        chosen = None
        for _, path in reversed(self._steps()):
            damage = checkpoint_damage(path)
            if damage is None:
                chosen = path
                break
            damaged.append((path.name, damage))
        if chosen is None:
            if damaged:
                listed = "; ".join(f"{name}: {why}" for name, why in damaged)
                raise DataError(
                    f"no complete checkpoint in {self.root} ({listed}): set "
                    "trainer.resume=never trainer.overwrite=true to start over, or choose "
                    "another trainer.output_dir"
                )
            return None
        if report:
            for name, why in damaged:
                log.warning(
                    "checkpoint %s is damaged (%s); resuming from %s", name, why, chosen.name
                )
            self._report_pointer(chosen, {name for name, _ in damaged})
        return chosen

    def _report_pointer(self, chosen: Path, damaged: set[str]) -> None:
        """Log a ``latest`` that is missing or names something other than ``chosen``."""
        pointer = self.root / "latest"
        try:
            named = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            named = None
        if named == chosen.name or named in damaged:
            return
        if named is None:
            what = "is missing"
        elif STEP_DIR.fullmatch(named) and (self.root / named).is_dir():
            what = f"names {named}, older than the newest complete checkpoint"
        else:
            what = f"names {named[:80]!r}, which is not a checkpoint here"
        log.warning("%s %s; resuming from %s", pointer, what, chosen.name)

    def save(
        self,
        step: int,
        write_parts: Callable[[str], dict[str, Any]],
        state: dict[str, Any],
        generators: dict[str, torch.Generator] | None = None,
    ) -> Path:
        """Write ``step``'s checkpoint atomically and durably and prune old ones; returns its
        directory. ``write_parts(directory)`` writes the models' files and returns their JSON
        meta."""
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"step_{step:06d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=self.root))
        parts_meta = write_parts(str(tmp))
        rng_tensors, rng_meta = rng_state(generators or {})
        save_file(rng_tensors, str(tmp / "rng.safetensors"))
        payload = {"step": step, "state": state, "parts": parts_meta, "rng": rng_meta}
        (tmp / "state.json").write_text(json.dumps(payload), encoding="utf-8")
        _seal(tmp)
        final = self.root / name
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(self.root, directory=True)
        pointer_tmp = self.root / ".latest.tmp"
        _write_synced(pointer_tmp, name)
        os.replace(pointer_tmp, self.root / "latest")
        _fsync(self.root, directory=True)
        self._prune(step)
        return final

    def load(
        self,
        path: Path,
        read_parts: Callable[[str, dict[str, Any]], None],
        generators: dict[str, torch.Generator] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Restore from ``path`` (``read_parts(directory, meta)`` loads the models); returns
        (step, state)."""
        payload = json.loads((path / "state.json").read_text(encoding="utf-8"))
        read_parts(str(path), payload["parts"])
        set_rng_state(load_file(str(path / "rng.safetensors")), payload["rng"], generators or {})
        return int(payload["step"]), payload["state"]

    def _prune(self, saved: int) -> None:
        """Keep the ``max_keep`` newest checkpoints up to ``saved``; later ones belong to a
        timeline abandoned by resuming from an earlier checkpoint."""
        steps = self._steps()
        later = [path for step, path in steps if step > saved]
        kept = [path for step, path in steps if step <= saved]
        for old in later + kept[: max(len(kept) - self.max_keep, 0)]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".step_*"):
            shutil.rmtree(stale, ignore_errors=True)

"""Atomic, verified checkpoints: models, optimizers, schedulers, RNG, sampler and trainer state.

Layout: ``checkpoints/step_000010/`` holding the files the worker group writes (per model and
optimizer, full or sharded: ``creditrl.workers.checkpoint_io``; per-rank random streams),
the controller's ``rng.safetensors`` and ``state.json``, and ``manifest.json`` (every file's
size, and its sha256 when it is at most 4 MiB), written last. The file ``checkpoints/latest``
names the newest checkpoint written.

Saving: a checkpoint is written into a temporary directory; its files, the manifest and the
directory are fsync'd, the directory is renamed into place and its parent fsync'd; then
``latest`` is replaced (written, fsync'd, renamed, parent fsync'd). A crash, power loss or
Ctrl-C leaves the old checkpoint or the new one, never a partial one under a ``step_*`` name.
A save that fails to write (a full disk) removes its temporary files and stops the run with a
``CheckpointWriteError`` naming the directory and the newest checkpoint left intact.

Resuming: the newest ``step_*`` directory that is complete (every manifest file present, a
regular file, with its size and hash, every safetensors header readable, ``state.json``
parseable and of that step) and whose tensors fit the models (``restore``) is used, whatever
``latest`` says; each newer damaged or unfitting one is named in one warning line and is
removed by the next save (as are checkpoints after the resumed step). When every complete one
fails to fit in the same way, it was written for another model: ``CheckpointMismatchError``.
Directories that all fail otherwise stop the run with a ``DataError`` rather than start it
over. Symbolic links (a ``step_*`` entry, ``latest``, a file in a checkpoint) are never
followed, and their targets never printed; the next save removes or replaces them.

``prepare_output_dir``: ``trainer.resume=never`` into a directory that holds a previous run is
refused unless ``trainer.overwrite=true``, which moves that run's files into
``<output_dir>/overwritten/<time>/`` (nothing is deleted).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from creditrl.bounded_json import read_json_file
from creditrl.errors import ConfigError, DataError, UserError
from creditrl.trainers.state_io import rng_state, set_rng_state
from creditrl.workers.checkpoint_io import CheckpointMismatchError

__all__ = [
    "MANIFEST",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "checkpoint_damage",
    "prepare_output_dir",
]

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
HASH_MAX_BYTES = 4 << 20  # files up to this size also get a sha256 in the manifest
STEP_DIR = re.compile(r"step_(\d{6,})")
POINTER_MAX_BYTES = 64  # ``latest`` holds one step name; more is not read
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


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (a full disk, say); nothing of it was kept."""


def _write_synced(path: Path, text: str) -> None:
    """Write ``text`` to a new file ``path`` and fsync it; an entry already there (a planted
    link, say) is removed first, never written through."""
    path.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    with os.fdopen(os.open(path, flags, 0o644), "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _remove(path: Path) -> None:
    """Delete ``path`` if it is there: a directory's tree, else the entry itself (a link is
    removed, never followed)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
        return
    with contextlib.suppress(OSError):
        path.unlink()


def _entry_problem(directory: Path, name: str) -> str | None:
    """``name`` under ``directory`` is "missing" or "not a regular file" (it, or a folder on its
    way, is a link, a directory or a device), or None."""
    path = directory
    for part in PurePosixPath(name).parts:
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return "missing"
        if stat.S_ISLNK(mode):
            return "not a regular file (a symbolic link, not followed)"
    return None if stat.S_ISREG(mode) else "not a regular file"


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
    problem = _entry_problem(directory, MANIFEST)
    if problem is not None:
        return f"{MANIFEST}: {problem}"
    try:
        files = read_json_file(path)["files"]
    except (OSError, ValueError, KeyError, TypeError):
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
    problem = _entry_problem(directory, name)
    if problem is not None:
        return f"{name}: {problem}"
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
        payload = read_json_file(directory / "state.json")
    except (OSError, ValueError):  # JsonLimitError too: a text too deep or large to decode
        return "state.json: not valid JSON"
    if not isinstance(payload, dict) or not {"step", "state", "parts", "rng"} <= payload.keys():
        return "state.json: lacks step, state, parts or rng"
    if payload["step"] != step:
        return f"state.json: step {str(payload['step'])[:20]}, the directory says {step}"
    if not isinstance(payload["state"], dict):
        return "state.json: its state is not a JSON object"
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


def _pointer(path: Path) -> tuple[str | None, str]:
    """(the text ``latest`` holds, or None with why not: "is missing", "is a symbolic link, not
    followed", ...). Reads at most ``POINTER_MAX_BYTES`` of a regular file, never a link's
    target."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None, "is missing"
    if stat.S_ISLNK(mode):
        return None, "is a symbolic link, not followed"
    if not stat.S_ISREG(mode):
        return None, "is not a regular file"
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        with os.fdopen(os.open(path, flags), "rb") as f:
            data = f.read(POINTER_MAX_BYTES + 1)
    except OSError as err:
        return None, f"is unreadable ({err.strerror})"
    if len(data) > POINTER_MAX_BYTES:
        return None, f"holds more than {POINTER_MAX_BYTES} bytes, not a checkpoint name"
    return data.decode("utf-8", "replace").strip(), ""


def _read_state(directory: Path) -> dict[str, Any]:
    """``state.json`` of a checkpoint that ``checkpoint_damage`` passed."""
    return read_json_file(directory / "state.json")


def _another_model(path: Path, problem: str) -> str:
    return (
        f"checkpoint {path} was written for another model ({problem}): resume with the model "
        "it was trained with, or start over with trainer.resume=never trainer.overwrite=true "
        "or another trainer.output_dir"
    )


class CheckpointManager:
    """Saves and restores the named (model, optimizer, scheduler) triples of a run."""

    def __init__(self, root: Path, max_keep: int = 2) -> None:
        self.root = Path(root)
        self.max_keep = max(int(max_keep), 1)

    def _entries(self) -> list[tuple[int, Path]]:
        """Every ``step_*`` entry (directory, link or other), ascending by step."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = STEP_DIR.fullmatch(path.name)
            if match is not None:
                found.append((int(match.group(1)), path))
        return sorted(found)

    def _steps(self) -> list[tuple[int, Path]]:
        """The ``step_*`` directories (not links to one), ascending by step."""
        return [(s, p) for s, p in self._entries() if p.is_dir() and not p.is_symlink()]

    def _links(self) -> list[Path]:
        """The ``step_*`` entries that are symbolic links: never followed."""
        return [p for _, p in self._entries() if p.is_symlink()]

    def _scan(self) -> Iterator[tuple[Path, str | None]]:
        """Each ``step_*`` directory, newest first, with why it is damaged (None: complete)."""
        for _, path in reversed(self._steps()):
            yield path, checkpoint_damage(path)

    def latest(self, report: bool = True) -> Path | None:
        """The newest complete checkpoint, or None when there is no ``step_*`` directory.

        With ``report``, each newer damaged checkpoint is logged as one line ("checkpoint
        step_000020 is damaged (file: problem); resuming from step_000010"), and so are a
        missing or dangling ``latest`` and ``step_*`` links. Raises ``DataError`` when every
        one is damaged."""
        skipped: list[tuple[str, str]] = []
        for path, damage in self._scan():
            if damage is None:
                if report:
                    self._report(skipped, path)
                return path
            skipped.append((path.name, damage))
        return self._none_usable(skipped, report)

    def restore(
        self,
        read_parts: Callable[[str, dict[str, Any]], str | None],
        generators: dict[str, torch.Generator] | None = None,
        report: bool = True,
    ) -> tuple[Path, int, dict[str, Any]] | None:
        """Load the newest complete checkpoint that fits the models: ``read_parts(directory,
        meta)`` loads them and returns None, or why they do not fit (having loaded nothing).
        Returns (directory, step, state), or None when there is no ``step_*`` directory.

        With ``report``, each newer damaged or unfitting checkpoint is logged as one line, as
        in ``latest``. Raises ``CheckpointMismatchError`` when every complete checkpoint fails
        to fit in the same way (written for another model), ``DataError`` when none is usable
        otherwise."""
        skipped: list[tuple[str, str]] = []
        misfits: list[tuple[Path, str]] = []
        for path, damage in self._scan():
            if damage is None:
                payload = _read_state(path)
                misfit = read_parts(str(path), payload["parts"])
                if misfit is None:
                    set_rng_state(
                        load_file(str(path / "rng.safetensors")), payload["rng"], generators or {}
                    )
                    if report:
                        self._report(skipped, path)
                    return path, int(payload["step"]), payload["state"]
                misfits.append((path, misfit))
                damage = misfit
            skipped.append((path.name, damage))
        if misfits and len({problem for _, problem in misfits}) == 1:
            raise CheckpointMismatchError(_another_model(*misfits[0]))
        return self._none_usable(skipped, report)

    def _none_usable(self, skipped: list[tuple[str, str]], report: bool) -> None:
        """No checkpoint to resume from: None when there was none; a ``DataError`` listing
        ``skipped`` (name, problem) when all were damaged."""
        if report:
            self._report_links()
        if skipped:
            listed = "; ".join(f"{name}: {why}" for name, why in skipped)
            raise DataError(
                f"no usable checkpoint in {self.root} ({listed}): set "
                "trainer.resume=never trainer.overwrite=true to start over, or choose "
                "another trainer.output_dir"
            )
        return None

    def _report(self, skipped: list[tuple[str, str]], chosen: Path) -> None:
        for name, why in skipped:
            log.warning("checkpoint %s is damaged (%s); resuming from %s", name, why, chosen.name)
        self._report_links()
        self._report_pointer(chosen, {name for name, _ in skipped})

    def _report_links(self) -> None:
        for path in self._links():
            log.warning("%s is a symbolic link, not followed; the next save removes it", path)

    def _report_pointer(self, chosen: Path, damaged: set[str]) -> None:
        """Log a ``latest`` that is missing, a link, or names something other than
        ``chosen`` (its text escaped, a link's target never read)."""
        pointer = self.root / "latest"
        named, why = _pointer(pointer)
        if named == chosen.name or named in damaged:
            return
        if named is None:
            what = why
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
        meta. A write that fails (OSError, e.g. a full disk) or is interrupted leaves no
        temporary files; the failure is a ``CheckpointWriteError``."""
        name = f"step_{step:06d}"
        tmp: Path | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=self.root))
            parts_meta = write_parts(str(tmp))
            rng_tensors, rng_meta = rng_state(generators or {})
            save_file(rng_tensors, str(tmp / "rng.safetensors"))
            payload = {"step": step, "state": state, "parts": parts_meta, "rng": rng_meta}
            (tmp / "state.json").write_text(json.dumps(payload), encoding="utf-8")
            _seal(tmp)
            final = self.root / name
            _remove(final)
            os.rename(tmp, final)
            _fsync(self.root, directory=True)
            pointer_tmp = self.root / ".latest.tmp"
            _write_synced(pointer_tmp, name)
            os.replace(pointer_tmp, self.root / "latest")
            _fsync(self.root, directory=True)
        except BaseException as err:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            _remove(self.root / ".latest.tmp")
            if isinstance(err, OSError | SafetensorError):  # safetensors' Rust I/O errors
                raise CheckpointWriteError(self._write_failed(name, err)) from err
            raise
        self._prune(step)
        return final

    def _write_failed(self, name: str, err: BaseException) -> str:
        reason = " ".join(str(err).split())[:200]
        try:
            newest = self.latest(report=False)
        except DataError:
            newest = None
        kept = (
            f"the newest complete checkpoint is {newest.name}"
            if newest is not None
            else "there is no complete checkpoint"
        )
        return (
            f"could not write checkpoint {name} in {self.root} ({reason}); its partial files "
            f"were removed and {kept}: free space (or fix the directory), then rerun the same "
            "command to resume"
        )

    def load(
        self,
        path: Path,
        read_parts: Callable[[str, dict[str, Any]], str | None],
        generators: dict[str, torch.Generator] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Restore from ``path`` (``read_parts(directory, meta)`` loads the models and returns
        None, or why they do not fit: then ``CheckpointMismatchError``); returns (step,
        state)."""
        payload = _read_state(path)
        problem = read_parts(str(path), payload["parts"])
        if problem is not None:
            raise CheckpointMismatchError(_another_model(path, problem))
        set_rng_state(load_file(str(path / "rng.safetensors")), payload["rng"], generators or {})
        return int(payload["step"]), payload["state"]

    def _prune(self, saved: int) -> None:
        """Keep the ``max_keep`` newest checkpoints up to ``saved``; later ones belong to a
        timeline abandoned by resuming from an earlier checkpoint. ``step_*`` links and
        leftover temporary directories go too."""
        steps = self._steps()
        later = [path for step, path in steps if step > saved]
        kept = [path for step, path in steps if step <= saved]
        for old in later + kept[: max(len(kept) - self.max_keep, 0)] + self._links():
            _remove(old)
        for stale in self.root.glob(".step_*"):
            _remove(stale)

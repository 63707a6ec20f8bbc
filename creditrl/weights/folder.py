"""The folder channel: versioned policy weights on disk; the learner publishes, samplers load.

Layout under ``root``: ``v00000007/weights.safetensors`` + ``v00000007/meta.json`` per
version, and ``latest`` (JSON ``{"version": 7, "dir": "v00000007", "run": ...}``, ``run`` the
publishing run's id when it has one) replaced atomically after the version directory is
complete. The newest ``keep`` versions are kept; a sampler that finds
its version pruned re-reads ``latest`` and loads the newer one. ``meta.json``'s ``kind`` is the
publication's (``full``, ``merged`` or ``adapter``: ``creditrl.weights.tensors``).

The folder is the publisher's alone: it holds the run lock ``run.lock`` while it publishes (a
second run naming the same ``asynchronous.weight_dir`` is refused in one line), and a folder
holding anything but what it writes (``OWN_NAMES``) is refused in one line, so nothing of the
user's is ever pruned. Only its own temporary names (``PARTIAL_NAMES``), left by a crash, are
removed when it starts. ``start_clean()`` removes every version (``latest`` first), for a run
that must not continue the versions another run left (``published_by()`` tells whose they are).

``FolderChannel`` is the ``WeightChannel`` over it (``publish=True``: the learner's side, which
claims the folder; else a sampler's, which reads it); ``WeightPublisher`` and
``WeightSubscriber`` are its two halves.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from creditrl.bounded_json import JsonLimits, read_json_file
from creditrl.errors import ConfigError
from creditrl.run_lock import LOCK_NAME, RunLock
from creditrl.weights.background import OneInFlight
from creditrl.weights.channel import WeightChannel
from creditrl.weights.tensors import apply_state, load_tensors, publishable_state, snapshot_tensors

__all__ = ["FolderChannel", "WeightPublisher", "WeightSubscriber"]

WEIGHTS_FILE = "weights.safetensors"
META_FILE = "meta.json"
POINTER = "latest"
_POINTER_LIMITS = JsonLimits(max_bytes=4096, max_depth=4, max_items=64)  # latest, meta.json
WEIGHT_DIR_KEY = "asynchronous.weight_dir"
VERSION_DIR = re.compile(r"v\d{8}")
# a version folder or a pointer being written (tempfile's names: 8 of [a-z0-9_])
PARTIAL_NAMES = re.compile(r"\.v\d{8}\.[a-z0-9_]{8}|\.latest\.[a-z0-9_]{8}\.tmp")
OWN_NAMES = re.compile(
    rf"{re.escape(POINTER)}|{re.escape(LOCK_NAME)}|{VERSION_DIR.pattern}|{PARTIAL_NAMES.pattern}"
)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def _claim(root: Path) -> RunLock:
    """Lock the weight folder ``root`` (made if missing) for this run and remove the partial
    publications a crash left; a one-line ``ConfigError`` naming ``asynchronous.weight_dir``,
    before anything is written there, when it holds anything the publisher does not write."""
    for entry in sorted(root.iterdir()) if root.is_dir() else ():
        name = entry.name
        own = OWN_NAMES.fullmatch(name) is not None and not entry.is_symlink()
        if not own or (VERSION_DIR.fullmatch(name) and not entry.is_dir()):
            raise ConfigError(
                f"{WEIGHT_DIR_KEY}={root} holds {name[:80]!r}, which is not a weight version "
                "creditrl wrote; the learner prunes this folder, so give it an empty folder of "
                "its own (null: <trainer.output_dir>/weights)"
            )
    lock = RunLock.acquire(root, WEIGHT_DIR_KEY)
    for entry in root.iterdir():
        if PARTIAL_NAMES.fullmatch(entry.name):  # a publication cut short by a crash
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    return lock


class WeightPublisher:
    """The learner's side: ``publish(model, version)`` writes a complete version directory,
    then moves ``latest`` to it, then prunes all but the newest ``keep`` versions. It holds
    the folder (``_claim``) until ``lock.release()``.

    With ``background=True`` the weights are copied at once (the caller may keep training) and
    written by a thread; at most one publication is in flight (a new one first waits for the
    previous), and ``wait()`` blocks until the last is visible, re-raising its error if any.
    """

    def __init__(
        self, root: str | Path, keep: int = 3, lora_sync: str = "merged", run: str | None = None
    ) -> None:
        self.root = Path(root)
        self.keep = max(int(keep), 1)
        self.lora_sync = lora_sync
        self.run = run  # written into ``latest``: whose versions these are
        self.lock = _claim(self.root)
        self._job = OneInFlight(f"publishing weights under {self.root} failed")

    def publish(self, model: torch.nn.Module, version: int, background: bool = False) -> Path:
        """Publish ``model``'s weights as ``version``; returns the version directory."""
        self.wait()
        kind, tensors = publishable_state(model, self.lora_sync)
        stored, aliases = snapshot_tensors(tensors)
        final = self.root / f"v{version:08d}"
        if not background:
            self._write(stored, aliases, kind, version)
            return final
        self._job.run(self._write, stored, aliases, kind, version)
        return final

    def wait(self) -> None:
        """Block until the publication in flight (if any) is complete."""
        self._job.wait()

    def _write(
        self, stored: dict[str, torch.Tensor], aliases: dict[str, str], kind: str, version: int
    ) -> None:
        name = f"v{version:08d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=self.root))
        save_file(stored, str(tmp / WEIGHTS_FILE), metadata={"aliases": json.dumps(aliases)})
        _write_json(tmp / META_FILE, {"version": version, "kind": kind, "time": time.time()})
        final = self.root / name
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        pointer: dict[str, Any] = {"version": version, "dir": name}
        if self.run is not None:
            pointer["run"] = self.run
        _write_json(self.root / POINTER, pointer)
        self._prune(keep=final)

    def latest(self) -> int | None:
        """The version ``latest`` points at, or None."""
        return WeightSubscriber(self.root).latest()

    def published_by(self) -> str | None:
        """The run id ``latest`` names (None: no pointer, or one written without an id)."""
        try:
            pointer = read_json_file(self.root / POINTER, _POINTER_LIMITS)
        except FileNotFoundError:
            return None
        run = pointer.get("run") if isinstance(pointer, dict) else None
        return run if isinstance(run, str) else None

    def start_clean(self) -> list[int]:
        """Remove every published version, ``latest`` first (a reader then finds none); the
        version numbers removed."""
        self.wait()
        (self.root / POINTER).unlink(missing_ok=True)
        removed = []
        for entry in sorted(self.root.iterdir()):
            if VERSION_DIR.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(int(entry.name[1:]))
        return removed

    def _prune(self, keep: Path) -> None:
        versions = sorted(
            p
            for p in self.root.iterdir()
            if VERSION_DIR.fullmatch(p.name) and not p.is_symlink() and (p / META_FILE).is_file()
        )
        for old in [p for p in versions if p != keep][: max(len(versions) - self.keep, 0)]:
            shutil.rmtree(old, ignore_errors=True)


class WeightSubscriber:
    """A sampler's side: ``maybe_load(model, current)`` loads the newest version if it is newer
    than ``current``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def latest(self) -> int | None:
        """The published version ``latest`` names, or None before the first publication."""
        pointer = self._pointer()
        return None if pointer is None else pointer[0]

    def _pointer(self) -> tuple[int, Path] | None:
        """(version, folder) that ``latest`` names, or None before the first publication; a
        pointer that is not what ``publish`` writes (bounded JSON, a non-negative int version,
        the folder ``v<version:08d>`` directly under the root) is a ValueError naming it."""
        try:
            pointer = read_json_file(self.root / POINTER, _POINTER_LIMITS)
        except FileNotFoundError:
            return None
        version = pointer.get("version") if isinstance(pointer, dict) else None
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"{self.root / POINTER}: no version number in it")
        if pointer.get("dir") != f"v{version:08d}":
            raise ValueError(
                f"{self.root / POINTER}: names folder {str(pointer.get('dir'))[:80]!r}, not "
                f"v{version:08d} (only published versions under {self.root} are loaded)"
            )
        return version, self.root / f"v{version:08d}"

    def unreadable(self) -> str | None:
        """Why no published version can be read here, in words naming the folder and what is
        missing (the folder, ``latest``, the version folder it names); None when it can."""
        try:
            mode = os.stat(self.root).st_mode
        except FileNotFoundError:
            return f"{self.root} does not exist here"
        except OSError as e:
            return f"{self.root} cannot be read here ({e.strerror})"
        if not stat.S_ISDIR(mode):
            return f"{self.root} is not a folder"
        try:
            pointer = self._pointer()
        except OSError as e:
            return f"{self.root / POINTER} cannot be read ({e.strerror})"
        except ValueError as e:
            return str(e)
        if pointer is None:
            return f"{self.root} holds no {POINTER!r} (no version published there)"
        if not (pointer[1] / META_FILE).is_file():
            return f"{pointer[1]} (named by {POINTER!r}) is missing"
        return None

    def maybe_load(self, model: torch.nn.Module, current: int, attempts: int = 5) -> int:
        """Load the newest version into ``model`` if it is newer than ``current``; returns the
        version ``model`` now holds. A version pruned while being read is retried."""
        return self.maybe_load_folder(lambda folder: self._load(model, folder), current, attempts)

    def maybe_load_folder(
        self, load: Callable[[Path], object], current: int, attempts: int = 5
    ) -> int:
        """``load(folder)`` the newest version's folder if it is newer than ``current`` (an
        engine that reads published folders itself); returns the version now held. A version
        pruned while being read (FileNotFoundError) is retried."""
        for _ in range(attempts):
            pointer = self._pointer()
            if pointer is None:
                return current
            version, folder = pointer
            if version <= current:
                return current
            try:
                load(folder)
            except FileNotFoundError:
                continue
            return version
        raise RuntimeError(f"could not read a complete weight version under {self.root}")

    def _load(self, model: torch.nn.Module, folder: Path) -> None:
        meta = read_json_file(folder / META_FILE, _POINTER_LIMITS)
        apply_state(model, meta["kind"], load_tensors(folder / WEIGHTS_FILE), folder)


class FolderChannel(WeightChannel):
    """The ``WeightChannel`` over a weight folder ``root`` (module docstring). With
    ``publish=True`` it claims the folder (``lock``: the run lock, held until released) and
    publishes there as run ``run``, keeping the newest ``keep`` versions, LoRA models as
    ``lora_sync`` says; else it only reads it. ``version``: what this side loaded (a publisher
    loads nothing)."""

    def __init__(
        self,
        root: str | Path,
        *,
        publish: bool = False,
        keep: int = 3,
        lora_sync: str = "merged",
        version: int = 0,
        run: str | None = None,
    ) -> None:
        super().__init__(version)
        self.root = Path(root)
        self.reader = WeightSubscriber(self.root)
        self.writer = WeightPublisher(self.root, keep, lora_sync, run) if publish else None
        self.lock = None if self.writer is None else self.writer.lock

    def publish(self, model: torch.nn.Module, version: int, *, background: bool = False) -> None:
        """A complete ``v<version>`` folder, then ``latest`` moved to it (module docstring);
        with ``background`` the weights are copied now and written by a thread."""
        if self.writer is None:
            raise RuntimeError(f"this channel reads {self.root}; publish=True publishes there")
        self.writer.publish(model, version, background=background)

    def newest(self) -> int | None:
        """The version ``latest`` names (checked: ``WeightSubscriber.latest``)."""
        return self.reader.latest()

    def unreadable(self) -> str | None:
        """Why no published version can be read here (``WeightSubscriber.unreadable``)."""
        return self.reader.unreadable()

    def published_by(self) -> str | None:
        """The run whose versions the folder holds (``WeightPublisher.published_by``)."""
        return None if self.writer is None else self.writer.published_by()

    def start_clean(self) -> list[int]:
        """Remove every published version (``WeightPublisher.start_clean``)."""
        if self.writer is None:
            raise RuntimeError(f"this channel reads {self.root}; only its publisher removes")
        return self.writer.start_clean()

    def load(self, model: torch.nn.Module, then: Callable[[], object] | None = None) -> bool:
        return self._hold(self.reader.maybe_load(model, self.version), then)

    def load_folder(self, read: Callable[[Path], object]) -> bool:
        return self._hold(self.reader.maybe_load_folder(read, self.version), None)

    def wait(self) -> None:
        """Block until the publication in flight is visible, re-raising its error if any."""
        if self.writer is not None:
            self.writer.wait()

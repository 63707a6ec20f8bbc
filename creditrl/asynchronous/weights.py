"""Versioned policy weights on disk: the learner publishes, samplers load between batches.

Layout under ``root``: ``v00000007/weights.safetensors`` + ``v00000007/meta.json`` per
version, and ``latest`` (JSON ``{"version": 7, "dir": "v00000007"}``) replaced atomically after
the version directory is complete. The newest ``keep`` versions are kept; a sampler that finds
its version pruned re-reads ``latest`` and loads the newer one.

What is published (``meta.json`` ``kind``): ``full`` (a plain model's state dict), ``merged``
(a LoRA model's base weights with each adapter's delta W + (alpha/r) B A added: samplers load
it into a plain model) or ``adapter`` (the LoRA adapter tensors alone: samplers hold the same
LoRA wrapping). Tied tensors (``lm_head.weight`` = ``model.embed_tokens.weight``) are stored
once; their aliases are recorded in the safetensors metadata. safetensors + JSON only.

The folder is the publisher's alone: it holds the run lock ``run.lock`` while it publishes (a
second run naming the same ``asynchronous.weight_dir`` is refused in one line), and a folder
holding anything but what it writes (``OWN_NAMES``) is refused in one line, so nothing of the
user's is ever pruned. Only its own temporary names (``PARTIAL_NAMES``), left by a crash, are
removed when it starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from creditrl.bounded_json import JsonLimits, read_json_file
from creditrl.errors import ConfigError
from creditrl.trainers.run_lock import LOCK_NAME, RunLock

__all__ = [
    "WeightPublisher",
    "WeightSubscriber",
    "load_tensors",
    "merged_state_dict",
    "publishable_state",
    "save_tensors",
    "snapshot_tensors",
]

WEIGHTS_FILE = "weights.safetensors"
META_FILE = "meta.json"
POINTER = "latest"
_POINTER_LIMITS = JsonLimits(max_bytes=4096, max_depth=4, max_items=64)  # latest, meta.json
LORA_SYNC = ("merged", "adapter")
WEIGHT_DIR_KEY = "asynchronous.weight_dir"
VERSION_DIR = re.compile(r"v\d{8}")
# a version folder or a pointer being written (tempfile's names: 8 of [a-z0-9_])
PARTIAL_NAMES = re.compile(r"\.v\d{8}\.[a-z0-9_]{8}|\.latest\.[a-z0-9_]{8}\.tmp")
OWN_NAMES = re.compile(
    rf"{re.escape(POINTER)}|{re.escape(LOCK_NAME)}|{VERSION_DIR.pattern}|{PARTIAL_NAMES.pattern}"
)


def _is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain-model state dict of a LoRA (peft) model with its active adapters merged:
    W' = W + get_delta_weight = W + (alpha / r) B A for each adapted linear. The training
    model is not modified."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    out: dict[str, torch.Tensor] = {}
    for key, value in base.state_dict().items():
        if ".lora_" not in key:
            out[key.replace(".base_layer.", ".")] = value.detach()
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight = f"{name}.weight"
                    out[weight] = out[weight] + module.get_delta_weight(adapter).to(out[weight])
    return out


def publishable_state(model: torch.nn.Module, lora_sync: str) -> tuple[str, dict[str, Any]]:
    """(kind, tensors) to publish for ``model``: ``full`` for a plain model; for a peft model
    ``merged`` or ``adapter`` as ``lora_sync`` says."""
    if not _is_peft(model):
        return "full", {k: v.detach() for k, v in model.state_dict().items()}
    if lora_sync not in LORA_SYNC:
        raise ValueError(f"asynchronous.lora_sync must be one of {LORA_SYNC}, got {lora_sync!r}")
    if lora_sync == "merged":
        return "merged", merged_state_dict(model)
    from peft import get_peft_model_state_dict

    return "adapter", {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


def snapshot_tensors(
    tensors: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(fresh contiguous CPU copies, aliases): tensors sharing memory are copied once and the
    other names recorded as ``{alias: stored name}``."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, tuple[int, ...], torch.dtype], str] = {}
    for key, value in tensors.items():
        ident = (value.data_ptr(), tuple(value.shape), value.dtype)
        if ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        stored[key] = value.detach().to("cpu", copy=True).contiguous()
    return stored, aliases


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``tensors`` as safetensors, tensors that share memory once (aliases in the
    metadata)."""
    stored, aliases = snapshot_tensors(tensors)
    save_file(stored, str(path), metadata={"aliases": json.dumps(aliases)})


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Inverse of ``save_tensors`` (aliases point at the same tensor)."""
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    for alias, target in aliases.items():
        tensors[alias] = tensors[target]
    return tensors


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

    def __init__(self, root: str | Path, keep: int = 3, lora_sync: str = "merged") -> None:
        self.root = Path(root)
        self.keep = max(int(keep), 1)
        self.lora_sync = lora_sync
        self.lock = _claim(self.root)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def publish(self, model: torch.nn.Module, version: int, background: bool = False) -> Path:
        """Publish ``model``'s weights as ``version``; returns the version directory."""
        self.wait()
        kind, tensors = publishable_state(model, self.lora_sync)
        stored, aliases = snapshot_tensors(tensors)
        final = self.root / f"v{version:08d}"
        if not background:
            self._write(stored, aliases, kind, version)
            return final
        self._thread = threading.Thread(
            target=self._write_logged, args=(stored, aliases, kind, version), daemon=True
        )
        self._thread.start()
        return final

    def wait(self) -> None:
        """Block until the publication in flight (if any) is complete."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"publishing weights under {self.root} failed") from error

    def _write_logged(self, *args: Any) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # surfaced by the next publish() or wait()
            self._error = e

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
        _write_json(self.root / POINTER, {"version": version, "dir": name})
        self._prune(keep=final)

    def latest(self) -> int | None:
        """The version ``latest`` points at, or None."""
        return WeightSubscriber(self.root).latest()

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
        self._apply(model, meta["kind"], load_tensors(folder / WEIGHTS_FILE), folder)

    @staticmethod
    @torch.no_grad()
    def _apply(model: torch.nn.Module, kind: str, tensors: dict[str, Any], folder: Path) -> None:
        if kind == "adapter":
            if not _is_peft(model):
                raise TypeError(f"{folder} holds LoRA adapters but the sampler model has no LoRA")
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(model, tensors)
            if result.unexpected_keys:
                raise KeyError(f"{folder}: adapter keys unknown here: {result.unexpected_keys}")
            return
        if _is_peft(model):
            raise TypeError(f"{folder} holds {kind} weights: load them into a plain model")
        model.load_state_dict(tensors, strict=True)

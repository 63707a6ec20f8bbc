"""Atomic checkpoints: models, optimizers, schedulers, RNG, sampler and trainer state.

Layout: ``checkpoints/step_000010/`` holding the files the worker group writes (per model and
optimizer, full or sharded: ``creditrl.workers.checkpoint_io``; per-rank random streams),
the controller's ``rng.safetensors`` and ``state.json``; the file
``checkpoints/latest`` names the newest complete one. A checkpoint is written into a temporary
directory and renamed into place, then ``latest`` is replaced atomically: a crash leaves either
the old or the new checkpoint, never a partial one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from creditrl.trainers.state_io import rng_state, set_rng_state

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Saves and restores the named (model, optimizer, scheduler) triples of a run."""

    def __init__(self, root: Path, max_keep: int = 2) -> None:
        self.root = Path(root)
        self.max_keep = max(int(max_keep), 1)

    def latest(self) -> Path | None:
        """The newest complete checkpoint directory, or None."""
        pointer = self.root / "latest"
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / "state.json").is_file() else None

    def save(
        self,
        step: int,
        write_parts: Callable[[str], dict[str, Any]],
        state: dict[str, Any],
        generators: dict[str, torch.Generator] | None = None,
    ) -> Path:
        """Write ``step``'s checkpoint atomically and prune old ones; returns its directory.
        ``write_parts(directory)`` writes the models' files and returns their JSON meta."""
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"step_{step:06d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=self.root))
        parts_meta = write_parts(str(tmp))
        rng_tensors, rng_meta = rng_state(generators or {})
        save_file(rng_tensors, str(tmp / "rng.safetensors"))
        payload = {"step": step, "state": state, "parts": parts_meta, "rng": rng_meta}
        (tmp / "state.json").write_text(json.dumps(payload))
        final = self.root / name
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        pointer_tmp = self.root / ".latest.tmp"
        pointer_tmp.write_text(name)
        os.replace(pointer_tmp, self.root / "latest")
        self._prune(keep=final)
        return final

    def load(
        self,
        path: Path,
        read_parts: Callable[[str, dict[str, Any]], None],
        generators: dict[str, torch.Generator] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Restore from ``path`` (``read_parts(directory, meta)`` loads the models); returns
        (step, state)."""
        payload = json.loads((path / "state.json").read_text())
        read_parts(str(path), payload["parts"])
        set_rng_state(load_file(str(path / "rng.safetensors")), payload["rng"], generators or {})
        return int(payload["step"]), payload["state"]

    def _prune(self, keep: Path) -> None:
        done = sorted(p for p in self.root.glob("step_*") if (p / "state.json").is_file())
        for old in [p for p in done if p != keep][: max(len(done) - self.max_keep, 0)]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".step_*"):
            shutil.rmtree(stale, ignore_errors=True)

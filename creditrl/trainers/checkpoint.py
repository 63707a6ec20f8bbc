"""Atomic checkpoints: models, optimizers, schedulers, RNG, sampler and trainer state.

Layout: ``checkpoints/step_000010/`` holding ``<name>.model.safetensors`` per model,
``<name>.optim.safetensors`` per optimizer, ``rng.safetensors`` and ``state.json``; the file
``checkpoints/latest`` names the newest complete one. A checkpoint is written into a temporary
directory and renamed into place, then ``latest`` is replaced atomically: a crash leaves either
the old or the new checkpoint, never a partial one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from creditrl.trainers.state_io import load_optimizer, rng_state, save_optimizer, set_rng_state

__all__ = ["CheckpointManager", "Trainable"]

Trainable = tuple[torch.nn.Module, torch.optim.Optimizer | None, Any]


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
        parts: dict[str, Trainable],
        state: dict[str, Any],
        generators: dict[str, torch.Generator],
    ) -> Path:
        """Write ``step``'s checkpoint atomically and prune old ones; returns its directory."""
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"step_{step:06d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=self.root))
        optim_meta = {}
        for key, (model, optimizer, scheduler) in parts.items():
            save_model(model, str(tmp / f"{key}.model.safetensors"))
            if optimizer is not None:
                optim_meta[key] = {
                    "optimizer": save_optimizer(optimizer, tmp / f"{key}.optim.safetensors"),
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                }
        rng_tensors, rng_meta = rng_state(generators)
        save_file(rng_tensors, str(tmp / "rng.safetensors"))
        payload = {"step": step, "state": state, "optim": optim_meta, "rng": rng_meta}
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
        self, path: Path, parts: dict[str, Trainable], generators: dict[str, torch.Generator]
    ) -> tuple[int, dict[str, Any]]:
        """Restore models, optimizers, schedulers and RNG from ``path``; returns (step, state)."""
        payload = json.loads((path / "state.json").read_text())
        for key, (model, optimizer, scheduler) in parts.items():
            file = path / f"{key}.model.safetensors"
            if not file.is_file():
                raise FileNotFoundError(f"checkpoint {path} has no weights for {key!r}")
            load_model(model, str(file))
            if optimizer is not None and key in payload["optim"]:
                meta = payload["optim"][key]
                load_optimizer(optimizer, path / f"{key}.optim.safetensors", meta["optimizer"])
                if scheduler is not None and meta["scheduler"] is not None:
                    scheduler.load_state_dict(meta["scheduler"])
        set_rng_state(load_file(str(path / "rng.safetensors")), payload["rng"], generators)
        return int(payload["step"]), payload["state"]

    def _prune(self, keep: Path) -> None:
        done = sorted(p for p in self.root.glob("step_*") if (p / "state.json").is_file())
        for old in [p for p in done if p != keep][: max(len(done) - self.max_keep, 0)]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".step_*"):
            shutil.rmtree(stale, ignore_errors=True)

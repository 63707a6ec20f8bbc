"""Optimizer, scheduler and RNG state as safetensors + JSON (no pickle)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

__all__ = ["load_optimizer", "rng_state", "save_optimizer", "set_rng_state"]


def save_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> dict[str, Any]:
    """Write the optimizer's tensors to ``path`` (safetensors); return the JSON-safe rest."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, entry in state["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[name] = value
    save_file(tensors, str(path))
    return {"param_groups": state["param_groups"], "scalars": scalars}


def load_optimizer(optimizer: torch.optim.Optimizer, path: Path, meta: dict[str, Any]) -> None:
    """Inverse of ``save_optimizer``."""
    tensors = load_file(str(path))
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    for idx, entry in meta.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(entry)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def rng_state(generators: dict[str, torch.Generator]) -> tuple[dict[str, torch.Tensor], dict]:
    """torch/numpy/python RNG states plus named generators: (tensors, JSON-safe dict)."""
    tensors = {"torch": torch.get_rng_state()}
    tensors.update({f"gen.{k}": g.get_state() for k, g in generators.items()})
    np_state = np.random.get_state()
    py_state = random.getstate()
    meta = {
        "numpy": [np_state[0], np_state[1].tolist(), *map(float, np_state[2:])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    return tensors, meta


def set_rng_state(
    tensors: dict[str, torch.Tensor], meta: dict, generators: dict[str, torch.Generator]
) -> None:
    """Restore what ``rng_state`` captured."""
    torch.set_rng_state(tensors["torch"])
    for name, gen in generators.items():
        if f"gen.{name}" in tensors:
            gen.set_state(tensors[f"gen.{name}"])
    kind, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), int(pos), int(has_gauss), cached))
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))

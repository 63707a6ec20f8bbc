"""RNG state as safetensors + JSON (no pickle)."""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state"]


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

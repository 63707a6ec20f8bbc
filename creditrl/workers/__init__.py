"""Actor, reference and critic workers: plain classes that take and return tensors/Batches.

Names are imported on first use, so ``creditrl.workers.checks`` is read without torch."""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "ActorWorker": "creditrl.workers.actor",
    "CriticWorker": "creditrl.workers.critic",
    "micro_batch_indices": "creditrl.workers.micro_batches",
    "packed_policy_forward": "creditrl.workers.packing",
    "packed_value_forward": "creditrl.workers.packing",
    "policy_forward": "creditrl.workers.forward",
    "value_forward": "creditrl.workers.critic",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    """``creditrl.workers.NAME`` from the module that defines it, imported now."""
    if name not in _HOMES:
        raise AttributeError(f"module 'creditrl.workers' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)

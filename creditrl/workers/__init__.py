"""Actor, reference and critic workers: plain classes that take and return tensors/Batches.

Names are imported on first use, so ``creditrl.workers.checks`` is read without torch."""

from __future__ import annotations

from creditrl.lazy import names_on_first_use

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


__getattr__ = names_on_first_use(__name__, _HOMES)

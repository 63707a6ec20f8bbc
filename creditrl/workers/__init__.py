"""Actor, reference and critic workers: plain classes that take and return tensors/Batches."""

from creditrl.workers.actor import ActorWorker
from creditrl.workers.critic import CriticWorker, value_forward
from creditrl.workers.forward import policy_forward
from creditrl.workers.micro_batches import micro_batch_indices
from creditrl.workers.packing import packed_policy_forward, packed_value_forward

__all__ = [
    "ActorWorker",
    "CriticWorker",
    "micro_batch_indices",
    "packed_policy_forward",
    "packed_value_forward",
    "policy_forward",
    "value_forward",
]

"""Actor, reference and critic workers: plain classes that take and return tensors/Batches."""

from creditrl.workers.actor import ActorWorker
from creditrl.workers.critic import CriticWorker, value_forward
from creditrl.workers.forward import policy_forward

__all__ = ["ActorWorker", "CriticWorker", "policy_forward", "value_forward"]

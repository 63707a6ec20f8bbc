"""The interface the trainer calls, and its in-process implementation.

A worker group runs the roles of spec 002's single-controller design on one or more
data-parallel ranks. Each method names its dispatch mode (``creditrl.controller.dispatch``);
``LocalWorkerGroup`` is one rank in this process (no copies, no serialisation), and
``RayWorkerGroup`` runs the same ``HybridWorker`` on N Ray actors. The trainer cannot tell
them apart.
"""

from __future__ import annotations

from typing import Any

from creditrl.batch import Batch
from creditrl.config import Config
from creditrl.controller.dispatch import Dispatch

__all__ = ["METHODS", "LocalWorkerGroup", "WorkerGroup"]

# method -> (dispatch mode, whether DP splitting must be exact)
METHODS: dict[str, tuple[Dispatch, bool]] = {
    "generate": (Dispatch.DP, False),
    "compute_log_prob": (Dispatch.DP, False),
    "compute_ref_log_prob": (Dispatch.DP, False),
    "compute_teacher_log_prob": (Dispatch.DP, False),
    "compute_values": (Dispatch.DP, False),
    "update_actor": (Dispatch.DP, True),
    "update_critic": (Dispatch.DP, True),
    "save_checkpoint": (Dispatch.ALL, False),
    "load_checkpoint": (Dispatch.ALL, False),
}


class WorkerGroup:
    """What the trainer calls; subclasses implement ``call``."""

    world_size: int = 1

    def call(self, method: str, batch: Batch | None = None, **kwargs: Any) -> Any:
        """Run ``method`` on the ranks as ``METHODS`` says and combine the answers."""
        raise NotImplementedError

    def generate(
        self, prompts: Batch, greedy: bool = False, temperature: float | None = None
    ) -> Batch:
        """One response per prompt row: responses, response_mask, rollout_log_probs, ..."""
        return self.call("generate", prompts, greedy=greedy, temperature=temperature)

    def compute_log_prob(self, batch: Batch, temperature: float) -> Batch:
        """``old_log_probs`` and ``entropys``."""
        return self.call("compute_log_prob", batch, temperature=temperature)

    def compute_ref_log_prob(self, batch: Batch, temperature: float) -> Batch:
        """``ref_log_prob``."""
        return self.call("compute_ref_log_prob", batch, temperature=temperature)

    def compute_teacher_log_prob(self, batch: Batch, temperature: float) -> Batch:
        """``teacher_log_prob`` (the distillation teacher's rows: its prompt, the responses)."""
        return self.call("compute_teacher_log_prob", batch, temperature=temperature)

    def compute_values(self, batch: Batch) -> Batch:
        """``values``."""
        return self.call("compute_values", batch)

    def update_actor(self, batch: Batch, temperature: float) -> dict[str, float]:
        """PPO epochs of the policy; metrics."""
        return self.call("update_actor", batch, temperature=temperature)

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Value-loss epochs; metrics."""
        return self.call("update_critic", batch)

    def save_checkpoint(self, directory: str) -> dict[str, Any]:
        """Every rank writes its part into ``directory``; returns the JSON meta."""
        return self.call("save_checkpoint", directory=directory)

    def load_checkpoint(self, directory: str, meta: dict[str, Any]) -> str | None:
        """Every rank restores from ``directory``; None, or why it does not fit the models
        (nothing loaded)."""
        return self.call("load_checkpoint", directory=directory, meta=meta)

    def shutdown(self) -> None:
        """Release the workers."""


class LocalWorkerGroup(WorkerGroup):
    """One rank in this process: calls go straight to a ``HybridWorker`` (built with
    ``worker_kwargs``)."""

    def __init__(self, cfg: Config, **worker_kwargs: Any) -> None:
        from creditrl.workers.hybrid import HybridWorker

        self.worker = HybridWorker(cfg, **worker_kwargs)
        self.world_size = 1

    def call(self, method: str, batch: Batch | None = None, **kwargs: Any) -> Any:
        if method not in METHODS:
            raise AttributeError(f"worker groups have no method {method!r}")
        fn = getattr(self.worker, method)
        return fn(batch, **kwargs) if batch is not None else fn(**kwargs)

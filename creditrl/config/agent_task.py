"""Whether a config's prompts are an agent task's (``data.task`` names one registered with
``creditrl.agents.registries.register_agent_task``, and no ``data.train_files`` replace it):
decided here once for the datasets a run builds, its preflight, its distillation check and
``creditrl check-tokenization``. The registry is found by its kind in the ground-floor
``creditrl.registry`` (``creditrl.catalog`` makes every registry), so ``creditrl.config``
imports no registry's layer."""

from __future__ import annotations

from creditrl.config.schema import DataConfig
from creditrl.registry import registry

__all__ = ["agent_task_names", "is_agent_task"]


def agent_task_names() -> tuple[str, ...]:
    """The agent tasks registered so far."""
    return tuple(registry("agent task").names())


def is_agent_task(data: DataConfig) -> bool:
    """``data.task`` is a registered agent task and is used: no ``data.train_files`` replace it
    (an agent task builds its own rows, system prompt and tools)."""
    return bool(data.task) and not data.train_files and data.task in agent_task_names()

"""The agent tasks' registry: ``data.task`` names built by ``creditrl.agents.tasks`` (the
rows of a multi-turn task with tools), declared by dotted path and imported when built, so a
config is checked without importing the task's module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from creditrl.registry import Registry

__all__ = ["AGENT_TASKS", "register_agent_task"]

AGENT_TASKS: Registry = Registry("agent task")
"""``data.task`` names built here: ``fn(cfg, tools) -> (train rows, val rows)``."""
AGENT_TASKS.add("calc_multiturn", "creditrl.agents.tasks:_calc_task")
AGENT_TASKS.add("kgqa", "creditrl.agents.tasks:_kgqa_task")


def register_agent_task(name: str) -> Callable[[Any], Any]:
    """Decorator: ``fn(cfg: Config, tools: ToolRegistry) -> (train, val)`` lists of
    ``PromptRow`` builds ``data.task=name`` (with the tools the rows' system prompt lists)."""
    return AGENT_TASKS.register(name)

"""The config check that needs whether the prompts are an agent task's (an agent task brings its
own prompts: ``creditrl.config.agent_task.is_agent_task``) and the policy losses' declarations:
distillation's (``creditrl.config.teacher_check.check_distill``), registered with
``creditrl.config.checks``."""

from __future__ import annotations

from creditrl.config.agent_task import is_agent_task
from creditrl.config.checks import register_config_check
from creditrl.config.schema import Config
from creditrl.config.teacher_check import check_distill
from creditrl.core.checks import loss_reads_teacher

__all__: list[str] = []


@register_config_check("distill")
def _check_distill(cfg: Config) -> None:
    """``check_distill`` with what the registries declare."""
    check_distill(cfg, loss_reads_teacher(cfg), is_agent_task(cfg.data))

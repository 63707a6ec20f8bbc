"""The config check that needs ``creditrl.agents``' task registry (an agent task brings its own
prompts) and the policy losses' declarations: distillation's
(``creditrl.config.teacher_check.check_distill``), registered with ``creditrl.config.checks``."""

from __future__ import annotations

from creditrl.agents.tasks import AGENT_TASKS
from creditrl.config.checks import register_config_check
from creditrl.config.schema import Config
from creditrl.config.teacher_check import check_distill
from creditrl.core.checks import loss_reads_teacher

__all__: list[str] = []


@register_config_check("distill", order=300)
def _check_distill(cfg: Config) -> None:
    """``check_distill`` with what the registries declare."""
    agent_task = cfg.data.task in AGENT_TASKS and not cfg.data.train_files
    check_distill(cfg, loss_reads_teacher(cfg), agent_task)

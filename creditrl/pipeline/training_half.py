"""The training half of a step, as both loops run it: ``creditrl train`` (``RLTrainer``) and the
async learner differ only in where a step's batch comes from (the in-process rollout, or groups
collected from samplers), so the rest is one implementation here: the critic warm-up decision,
the stage calls (``StepPipeline.training_half``), the first-mini-batch health check, and the
step's metrics (data metrics with the critic's, timing, throughput, the agent hook).
"""

from __future__ import annotations

from typing import Any

import torch

from creditrl.batch import Batch
from creditrl.config import Config
from creditrl.pipeline.step import StepPipeline
from creditrl.plain_text import as_text
from creditrl.rewards.manager import extra_means
from creditrl.rollout.strategies import strategy_traits
from creditrl.tracking import (
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
)
from creditrl.tracking.health import FirstMinibatchMonitor
from creditrl.workers.placement import update_autocast

__all__ = ["TrainingHalf"]


class TrainingHalf:
    """The training half of ``pipeline`` for one run; ``console`` shows the health warning
    (None: not shown, e.g. on learner ranks other than 0)."""

    def __init__(
        self, cfg: Config, pipeline: StepPipeline, tokenizer: Any, console: Any | None
    ) -> None:
        self.cfg = cfg
        self.pipeline = pipeline
        self.tokenizer = tokenizer
        self.console = console
        self.use_critic = pipeline.plan.needs_critic
        self.health = FirstMinibatchMonitor.for_autocast(update_autocast(cfg))

    def updates_actor(self, step: int) -> bool:
        """Step ``step`` (1-based) updates the actor: after ``trainer.critic_warmup`` steps of
        critic-only updates, or always without a critic."""
        return step > self.cfg.trainer.critic_warmup or not self.use_critic

    def run(
        self,
        batch: Batch,
        step: int,
        timing: dict[str, float],
        *,
        keep_rollout: torch.Tensor | bool,
        on_policy: bool = True,
    ) -> tuple[Batch, dict[str, float]]:
        """The stages of step ``step`` on ``batch`` (critic warm-up included), then the
        first-mini-batch health check (``on_policy``: the ratio must start at 1; its warning is
        shown once). Returns the batch with every field written, and the update's metrics."""
        batch, metrics = self.pipeline.training_half(
            batch, timing, keep_rollout=keep_rollout, update_actor=self.updates_actor(step)
        )
        warning = self.health.check(metrics, on_policy)
        if warning and self.console is not None:
            self.console.print("[yellow]warning:[/yellow]", as_text(warning))
        return batch, metrics

    def scored_elsewhere_metrics(self, batch: Batch) -> dict[str, float]:
        """What ``creditrl train`` logs from its reward stage and a batch scored elsewhere (an
        async sampler's groups) carries the inputs of: ``reward/<key>_mean`` of the scorer's
        numeric extras (an environment's rubric parts, ``reward/vf_*``: ``extra_means``) and,
        with the structured reward, the tool-use shares ``agent/called_tool`` and
        ``agent/tool_then_correct`` (``tool_use_metrics``) from the trajectories' tool calls
        and global rewards."""
        metrics: dict[str, float] = {}
        if "reward_extra_info" in batch:
            rows = [r if isinstance(r, dict) else {} for r in batch["reward_extra_info"]]
            keys = dict.fromkeys(k for r in rows for k in r)
            metrics.update(extra_means({k: [r.get(k) for r in rows] for k in keys}))
        if not self.pipeline.plan.structured_reward or "tool_calls" not in batch:
            return metrics
        from creditrl.agents.rewards import tool_use_metrics

        rewards = (
            batch["structured_rewards"] if "structured_rewards" in batch else [{}] * len(batch)
        )
        global_rewards = [r.get("global_rewards", {}) for r in rewards]
        metrics.update(tool_use_metrics(list(batch["tool_calls"]), global_rewards)[0])
        return metrics

    def step_metrics(
        self, batch: Batch, timing: dict[str, float], whole: Batch | None = None
    ) -> dict[str, float]:
        """The step's metrics once ``timing["step"]`` is set: data metrics of ``batch`` (with
        ``critic/values/*`` when there is a critic), ``timing_s/*``, ``perf/*`` over ``whole``
        (the step's batch over every rank; default ``batch``) and, for agent runs, the agent
        hook's ``tools/*``, ``num_turns/*``, ``agent/*`` and ``tokenization/*`` (it also writes
        the drift reports and ``trajectory_score`` into ``batch`` for the rollout dump)."""
        metrics = compute_data_metrics(batch, use_critic=self.use_critic)
        metrics.update(compute_timing_metrics(timing, batch))
        metrics.update(compute_throughput_metrics(timing, batch if whole is None else whole))
        if strategy_traits(self.cfg).multi_turn:
            from creditrl.agents.hooks import after_step

            metrics.update(after_step(batch, self.tokenizer, self.cfg.agent))
        return metrics

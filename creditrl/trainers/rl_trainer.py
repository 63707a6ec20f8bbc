"""The synchronous PPO-family loop (spec 002's stage order), one short method per stage.

A step: prompts -> uid -> repeat(n) -> generate -> (ReMax greedy baseline) -> reward (maybe in
the background) -> old log-probs -> reference log-probs -> values -> scores -> (DAPO shaping and
filtering) -> KL into rewards -> rollout IS weights -> advantages -> critic update -> actor
update -> metrics, rollout dump, validation, checkpoint, sampler hook.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.markup import escape

from creditrl.batch import Batch, balance_batch
from creditrl.config import Config
from creditrl.config.loader import save_resolved_config, to_dict
from creditrl.controller import build_worker_group
from creditrl.core import get_kl_controller
from creditrl.data import ResumableSampler, build_datasets, collate_prompts
from creditrl.errors import NothingToLearnError
from creditrl.models import load_tokenizer, resolve_model_path
from creditrl.preflight import preflight
from creditrl.rewards import RewardManager
from creditrl.tracking import (
    RolloutDumper,
    Timer,
    Tracker,
    TrainingProgress,
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
)
from creditrl.tracking.health import FirstMinibatchMonitor
from creditrl.trainers import stages
from creditrl.trainers.checkpoint import CheckpointManager, prepare_output_dir

__all__ = ["RLTrainer", "RunSummary"]


@dataclass
class RunSummary:
    """What the end-of-run summary shows."""

    output_dir: Path
    steps: int
    val_before: dict[str, float] = field(default_factory=dict)
    val_after: dict[str, float] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """The keys ``creditrl.tracking.print_summary`` reads."""
        return {
            "val_score_before": self.val_before.get("val/score"),
            "val_score_after": self.val_after.get("val/score"),
            "rewards": self.rewards,
            "trend_k": max(1, min(5, len(self.rewards) // 2)),
            "steps": self.steps,
            "total_time_s": self.seconds,
            "output_dir": str(self.output_dir),
        }


class RLTrainer:
    """Builds every component from a Config and runs the loop. ``fit()`` resumes from the
    latest checkpoint in ``trainer.output_dir`` unless ``trainer.resume=never``."""

    def __init__(self, cfg: Config, console: Any = None) -> None:
        self.cfg = cfg
        self.console = console or Console()
        for notice in preflight(cfg):  # user code, data files and scorers, before any model
            self.console.print(f"[yellow]note:[/yellow] {escape(notice)}")
        if cfg.trainer.num_threads > 0:
            torch.set_num_threads(cfg.trainer.num_threads)
        torch.manual_seed(cfg.trainer.seed)
        self.out = Path(cfg.trainer.output_dir)
        prepare_output_dir(self.out, cfg.trainer.resume, cfg.trainer.overwrite)
        self.out.mkdir(parents=True, exist_ok=True)
        self.use_critic = cfg.algorithm.adv_estimator == "gae"
        self.use_ref = cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss
        # Provably on-policy: the HF engine samples with the actor's own weights, and without
        # top-k/top-p its sampling distribution is the actor's at the same temperature. Rollout
        # IS compares recomputed log-probs with the sampler's, so it turns the reuse off (with
        # reused log-probs its weights would be exactly 1: a silent no-op).
        self.reuse_rollout_log_probs = (
            cfg.actor.use_rollout_log_probs
            and not cfg.algorithm.rollout_is.enable
            and cfg.rollout.engine == "hf"
            and cfg.rollout.top_k <= 0
            and cfg.rollout.top_p >= 1.0
            and not (cfg.agent.enable and not cfg.agent.state_masking)
        )
        self.n = cfg.rollout.n
        self._build_data()
        self.workers = build_worker_group(cfg)
        if cfg.agent.enable and cfg.agent.reward_manager == "structured":
            from creditrl.agents.rewards import StructuredRewardManager

            self.reward = StructuredRewardManager(cfg.reward, cfg.agent, self.tokenizer)
        else:
            self.reward = RewardManager(cfg.reward, self.tokenizer)
        self.health = FirstMinibatchMonitor.for_autocast(cfg.actor.autocast)
        self.kl_ctrl = get_kl_controller(
            cfg.algorithm.kl_ctrl.type,
            cfg.algorithm.kl_ctrl.kl_coef,
            cfg.algorithm.kl_ctrl.target_kl,
            cfg.algorithm.kl_ctrl.horizon,
        )
        self.uid_rng = np.random.default_rng(cfg.trainer.seed)
        self.checkpoints = CheckpointManager(self.out / "checkpoints", cfg.trainer.max_checkpoints)
        self.tracker = Tracker(self.out, cfg.trainer.logger, to_dict(cfg), self.out.name)
        save_resolved_config(cfg, self.out / "config.yaml")
        self.dumper = RolloutDumper(self.out, cfg.trainer.rollout_dump_rows, self.tokenizer)
        self.step = 0

    # ---- construction -------------------------------------------------------------------

    def _build_data(self) -> None:
        cfg = self.cfg
        self.model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        self.tokenizer = load_tokenizer(self.model_path)
        from creditrl.agents.tasks import AGENT_TASKS, build_agent_datasets

        if cfg.data.task in AGENT_TASKS and not cfg.data.train_files:
            self.train_data, self.val_data = build_agent_datasets(cfg, self.tokenizer)
        else:
            self.train_data, self.val_data = build_datasets(cfg.data, self.tokenizer)
        self.sampler = ResumableSampler(
            len(self.train_data), cfg.data.train_batch_size, cfg.data.seed, cfg.data.shuffle
        )

    # ---- checkpoint ---------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        state = {
            "sampler": self.sampler.state_dict(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "uid_rng": self.uid_rng.bit_generator.state,
            "val_before": getattr(self, "val_before", {}),
        }
        return self.checkpoints.save(self.step, self.workers.save_checkpoint, state)

    def maybe_resume(self) -> bool:
        """Restore the newest complete checkpoint (damaged newer ones are logged and skipped);
        without one, a rerun starts over and drops the earlier attempt's metrics rows."""
        if self.cfg.trainer.resume == "never":
            return False
        latest = self.checkpoints.latest()
        if latest is None:
            self.tracker.truncate_after(-1)
            return False
        self.step, state = self.checkpoints.load(latest, self.workers.load_checkpoint)
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.uid_rng.bit_generator.state = state["uid_rng"]
        self.val_before = state.get("val_before", {})
        self.tracker.truncate_after(self.step)
        return True

    # ---- one step, stage by stage --------------------------------------------------------

    def next_prompts(self) -> Batch:
        """The next prompts from the sampler, one uid each, repeated n times (interleaved),
        with a ``sample_seed`` per trajectory (the same samples on any number of workers)."""
        rows = [self.train_data[i] for i in next(self.sampler)]
        prompts = collate_prompts(rows, self.tokenizer.pad_token_id)
        stages.add_uids(prompts, self.uid_rng)
        prompts = prompts.repeat(self.n, interleave=True)
        stages.add_sample_seeds(prompts, self.uid_rng)
        return prompts

    def generate(self, prompts: Batch) -> Batch:
        batch = self.workers.generate(prompts)
        batch.meta.update(
            temperature=self.cfg.rollout.temperature,
            max_response_length=self.cfg.rollout.max_response_length,
            eos_token_id=self.tokenizer.eos_token_id,
            step=self.step,
        )
        return batch

    def remax_baseline(self, prompts: Batch, batch: Batch) -> None:
        """ReMax: the reward of the greedy response to each prompt, as ``reward_baselines``."""
        greedy = self.workers.generate(prompts, greedy=True)
        batch["reward_baselines"] = self.reward(greedy).scores.float()

    def old_log_probs(self, batch: Batch) -> None:
        """log pi_old of the responses: recomputed by the actor, or, when the rollout sampled
        from exactly the actor's distribution (``reuse_rollout_log_probs``), taken from it."""
        if self.reuse_rollout_log_probs:
            batch["old_log_probs"] = batch["rollout_log_probs"].clone()
            return
        stages.merge(batch, self.workers.compute_log_prob(batch, self.cfg.rollout.temperature))

    def balance(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """Reorder samples so each data-parallel rank gets about the same number of tokens."""
        if self.workers.world_size == 1 or not self.cfg.trainer.balance_batch:
            return batch, {}
        if len(batch) % self.workers.world_size:
            return batch, {}
        balanced = balance_batch(batch, self.workers.world_size)
        return balanced.batch, balanced.metrics

    def collect(self, timing: dict[str, float]) -> tuple[Batch, Any, dict[str, float]]:
        """Generate until the batch is full (DAPO's filter keeps only groups whose scores vary)."""
        metrics: dict[str, float] = {}
        kept: list[Batch] = []
        wanted = self.cfg.data.train_batch_size * self.n
        filter_cfg = self.cfg.algorithm.filter_groups
        for attempt in range(max(filter_cfg.max_num_gen_batches, 1) if filter_cfg.enable else 1):
            prompts = self.next_prompts()
            with Timer("gen", timing):
                batch = self.generate(prompts)
            if self.cfg.algorithm.adv_estimator == "remax":
                with Timer("gen_greedy", timing):
                    self.remax_baseline(prompts, batch)
            with Timer("reward", timing):
                result = self.reward.submit(batch).result()
            self._attach_scores(batch, result)
            metrics.update(result.metrics)
            if not filter_cfg.enable:
                return batch, result, metrics
            keep = stages.varied_groups(batch)
            kept.append(batch[torch.from_numpy(keep)])
            metrics["dapo/gen_batches"] = attempt + 1
            if sum(len(b) for b in kept) >= wanted:
                break
        batch = Batch.concat(kept)[:wanted] if kept else batch
        metrics["dapo/kept_fraction"] = len(batch) / wanted
        if len(batch) == 0:
            raise NothingToLearnError(
                f"algorithm.filter_groups: no group's scores varied in "
                f"max_num_gen_batches={filter_cfg.max_num_gen_batches} generation batches "
                "(every sample of a prompt scored the same), so there is nothing to learn from; "
                "raise algorithm.filter_groups.max_num_gen_batches or rollout.n, sample more "
                "diversely (rollout.temperature), or use an easier task"
            )
        return batch, None, metrics

    def _attach_scores(self, batch: Batch, result: Any) -> None:
        result.write_to(batch)

    def train_step(self) -> dict[str, float]:
        """One full step; returns its metrics."""
        cfg = self.cfg
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        start = time.perf_counter()
        if cfg.algorithm.filter_groups.enable:
            batch, _, reward_metrics = self.collect(timing)
            metrics.update(reward_metrics)
            with Timer("old_log_prob", timing):
                self.old_log_probs(batch)
        else:
            prompts = self.next_prompts()
            with Timer("gen", timing):
                batch = self.generate(prompts)
            if cfg.algorithm.adv_estimator == "remax":
                with Timer("gen_greedy", timing):
                    self.remax_baseline(prompts, batch)
            future = self.reward.submit(batch)
            if not cfg.reward.async_reward:
                with Timer("reward", timing):
                    result = future.result()
            with Timer("old_log_prob", timing):
                self.old_log_probs(batch)
            if cfg.reward.async_reward:
                with Timer("reward_wait", timing):
                    result = future.result()
            self._attach_scores(batch, result)
            metrics.update(result.metrics)
        batch, balance_metrics = self.balance(batch)
        metrics.update(balance_metrics)
        if self.use_ref:
            with Timer("ref", timing):
                stages.merge(
                    batch, self.workers.compute_ref_log_prob(batch, cfg.rollout.temperature)
                )
        if self.use_critic:
            with Timer("values", timing):
                stages.merge(batch, self.workers.compute_values(batch))
        with Timer("adv", timing):
            metrics.update(stages.kl_into_rewards(batch, cfg.algorithm, self.kl_ctrl.value))
            if "actor/reward_kl_penalty" in metrics:
                self.kl_ctrl.update(metrics["actor/reward_kl_penalty"], len(batch))
            metrics.update(
                stages.apply_overlong_penalty(batch, cfg.algorithm, cfg.rollout.max_response_length)
            )
            metrics.update(stages.rollout_mismatch_metrics(batch))
            metrics.update(stages.rollout_is_weights(batch, cfg.algorithm))
            stages.compute_advantages(batch, cfg.algorithm)
        if self.use_critic:
            with Timer("update_critic", timing):
                metrics.update(self.workers.update_critic(batch))
        if self.step > cfg.trainer.critic_warmup or not self.use_critic:
            with Timer("update_actor", timing):
                metrics.update(self.workers.update_actor(batch, cfg.rollout.temperature))
            warning = self.health.check(metrics)
            if warning:
                self.console.print(f"[yellow]warning:[/yellow] {escape(warning)}")
        timing["step"] = time.perf_counter() - start
        metrics.update(compute_data_metrics(batch, use_critic=self.use_critic))
        metrics.update(compute_timing_metrics(timing, batch))
        metrics.update(compute_throughput_metrics(timing, batch))
        if cfg.agent.enable:
            from creditrl.agents.hooks import after_step

            metrics.update(after_step(batch, self.tokenizer, cfg.agent))
        self.dumper.dump(batch, self.step)
        self.sampler.update(batch)
        self.last_batch = batch
        return metrics

    # ---- validation ----------------------------------------------------------------------

    def validate(self) -> dict[str, float]:
        """Greedy (or ``val_temperature``) responses on the validation set: val/<source>/score
        (mean@1), and pass@k when ``val_n`` > 1."""
        if self.val_data is None or len(self.val_data) == 0:
            return {}
        cfg = self.cfg.rollout
        rows = [self.val_data[i] for i in range(len(self.val_data))]
        scores: dict[str, list[float]] = {}
        for start in range(0, len(rows), max(cfg.micro_batch_size // max(cfg.val_n, 1), 1)):
            chunk = rows[start : start + max(cfg.micro_batch_size // max(cfg.val_n, 1), 1)]
            prompts = collate_prompts(chunk, self.tokenizer.pad_token_id).repeat(cfg.val_n)
            batch = self.workers.generate(
                prompts, greedy=cfg.val_temperature == 0, temperature=cfg.val_temperature or None
            )
            result = self.reward(batch)
            sources = list(batch["data_source"])
            for i, score in enumerate(result.scores.tolist()):
                scores.setdefault(sources[i], []).append(score)
        out: dict[str, float] = {
            "val/score": float(np.mean([v for vs in scores.values() for v in vs]))
        }
        for source, values in scores.items():
            arr = np.array(values).reshape(-1, cfg.val_n)
            out[f"val/{source}/score"] = float(arr.mean())
            if cfg.val_n > 1:
                out[f"val/{source}/pass@{cfg.val_n}"] = float((arr.max(axis=1) > 0.5).mean())
        return out

    # ---- the loop ------------------------------------------------------------------------

    def fit(self) -> RunSummary:
        cfg = self.cfg.trainer
        began = time.perf_counter()
        resumed = self.maybe_resume()
        if resumed:
            self.console.print(
                f"resuming {self.out} from step {self.step} of {cfg.total_steps}"
                + (
                    " (already finished: raise trainer.total_steps or use a new trainer.output_dir)"
                    if self.step >= cfg.total_steps
                    else ""
                )
            )
        summary = RunSummary(output_dir=self.out, steps=cfg.total_steps)
        if not resumed and cfg.val_before_train:
            self.val_before = self.validate()
            self.tracker.log(self.val_before, step=0)
        summary.val_before = getattr(self, "val_before", {})
        progress = TrainingProgress(cfg.total_steps, self.step, self.console)
        last_val: dict[str, float] = {}
        try:
            while self.step < cfg.total_steps:
                self.step += 1
                metrics = self.train_step()
                if cfg.test_freq > 0 and (
                    self.step % cfg.test_freq == 0 or self.step == cfg.total_steps
                ):
                    last_val = self.validate()
                    metrics.update(last_val)
                self.tracker.log(metrics, step=self.step)
                progress.update(self.step, metrics)
                summary.rewards.append(metrics.get("critic/score/mean", float("nan")))
                if (
                    cfg.save_freq > 0 and self.step % cfg.save_freq == 0
                ) or self.step == cfg.total_steps:
                    self.save_checkpoint()
        except BaseException:
            progress.close()
            self.close()
            raise
        progress.close()
        summary.val_after = last_val
        summary.seconds = time.perf_counter() - began
        self.close()
        return summary

    def close(self) -> None:
        """Release the workers, the reward pool and the metric sinks."""
        self.workers.shutdown()
        self.tracker.close()
        self.reward.close()

"""The synchronous loop: prompts -> the step pipeline (``creditrl.pipeline.step``: generation
half, then training half) -> metrics, rollout dump, validation, checkpoint. It reads top to
bottom; every stage is one call away.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from creditrl.batch import Batch, balance_batch
from creditrl.config import Config
from creditrl.config.loader import save_resolved_config, to_dict
from creditrl.controller import build_worker_group
from creditrl.data import ResumableSampler
from creditrl.errors import DataError, NothingToLearnError
from creditrl.models import load_tokenizer, resolve_model_path
from creditrl.pipeline import stages
from creditrl.pipeline.step import (
    StepPipeline,
    build_reward_manager,
    build_run_datasets,
    rollout_log_probs_reusable,
)
from creditrl.pipeline.training_half import TrainingHalf
from creditrl.plain_text import as_text
from creditrl.preflight import preflight
from creditrl.tracking import (
    RolloutDumper,
    Timer,
    Tracker,
    TrainingProgress,
)
from creditrl.trainers.checkpoint import CheckpointManager, prepare_output_dir
from creditrl.trainers.loop import TrainingLoop
from creditrl.trainers.prompts import batch_seed, prompt_batch
from creditrl.trainers.schedule import Schedule
from creditrl.workers.placement import check_device, describe, device_type
from creditrl.workers.precision import autocast_choice, sampling_choice

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


class RLTrainer(TrainingLoop):
    """Builds every component from a Config and runs the loop (``TrainingLoop``) with the
    in-process rollout as its batch source. ``fit()`` resumes from the newest complete
    checkpoint in ``trainer.output_dir`` unless ``trainer.resume=never``."""

    def __init__(self, cfg: Config, console: Any = None) -> None:
        self.cfg = cfg
        self.console = console or Console(highlight=False, emoji=False)
        self.out = Path(cfg.trainer.output_dir)
        check_device(cfg)  # CUDA asked for and not here: one line, before anything waits
        self.build_holding_folder(True)

    def _build(self) -> None:
        cfg = self.cfg
        for notice in preflight(cfg):  # user code, data files and scorers, before any model
            self.console.print("[yellow]note:[/yellow]", as_text(notice))
        if cfg.trainer.num_threads > 0:
            torch.set_num_threads(cfg.trainer.num_threads)
        torch.manual_seed(cfg.trainer.seed)
        prepare_output_dir(self.out, cfg.trainer.resume, cfg.trainer.overwrite)
        self.reuse_rollout_log_probs = rollout_log_probs_reusable(cfg)
        self.n = cfg.rollout.n
        self.val_before: dict[str, float] = {}
        self.val_latest: dict[str, float] = {}  # the newest validation, kept by checkpoints
        self._build_data()
        self.workers = build_worker_group(cfg)
        self.reward = build_reward_manager(cfg, self.tokenizer)
        self.pipeline = StepPipeline(cfg, self.workers, self.reward, self.tokenizer)
        self.training = TrainingHalf(cfg, self.pipeline, self.tokenizer, self.console)
        self.console.print(as_text(describe(cfg), style="dim"))
        choice = autocast_choice(cfg.actor.autocast, device_type(cfg))
        self.console.print(as_text(choice, style="dim"))
        sampling = sampling_choice(cfg, device_type(cfg))
        if sampling is not None:
            self.console.print(as_text(sampling, style="dim"))
        self.prompts_drawn = 0  # the stream's place: uids and sample seeds follow from it
        self.checkpoints = CheckpointManager(self.out / "checkpoints", cfg.trainer.max_checkpoints)
        self.schedule = Schedule.from_config(cfg.trainer)
        self.tracker = Tracker(self.out, cfg.trainer.logger, to_dict(cfg), self.out.name)
        save_resolved_config(cfg, self.out / "config.yaml")
        self.dumper = RolloutDumper(self.out, cfg.trainer.rollout_dump_rows, self.tokenizer)
        self.step = 0

    def _build_data(self) -> None:
        cfg = self.cfg
        self.model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        self.tokenizer = load_tokenizer(self.model_path)
        self.train_data, self.val_data = build_run_datasets(cfg, self.tokenizer)
        self.sampler = ResumableSampler(
            len(self.train_data), cfg.data.train_batch_size, cfg.data.seed, cfg.data.shuffle
        )

    @property
    def kl_ctrl(self) -> Any:
        """The KL-in-reward coefficient controller (the pipeline's)."""
        return self.pipeline.kl_ctrl

    # ---- checkpoint ---------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """The data order's place and the prompts drawn so far."""
        return {"sampler": self.sampler.state_dict(), "prompts_drawn": self.prompts_drawn}

    def load_state(self, path: Path, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        drawn = state.get("prompts_drawn", self.step * self.cfg.data.train_batch_size)
        self.prompts_drawn = int(drawn)  # (a checkpoint from before it was saved: estimated)

    def interruption(self) -> str:
        """One line for a Ctrl-C: the step reached, and where rerunning the same command
        resumes (the newest complete checkpoint on disk)."""
        try:
            latest = self.checkpoints.latest(report=False)
        except DataError:
            latest = None
        where = f"interrupted at step {self.step} of {self.cfg.trainer.total_steps}"
        if latest is None:
            return f"{where}; no checkpoint in {self.checkpoints.root} yet: rerunning starts over"
        return (
            f"{where}; rerun the same command to resume from the latest checkpoint in "
            f"{self.checkpoints.root} ({latest.name})"
        )

    # ---- one step ------------------------------------------------------------------------

    def next_prompts(self) -> Batch:
        """The next prompts from the sampler, one uid each, repeated n times (interleaved),
        with a ``sample_seed`` and ``traj_id`` per trajectory: drawn as async sampler 0 draws
        them (``creditrl.trainers.prompts``), so its samples are the same."""
        rows = [self.train_data[i] for i in next(self.sampler)]
        first = self.prompts_drawn
        self.prompts_drawn += len(rows)
        uids = [f"train:{first + k}" for k in range(len(rows))]
        seed = batch_seed(self.cfg.trainer.seed, 0, first)
        return prompt_batch(rows, self.tokenizer.pad_token_id, self.n, uids, seed)

    def collect(self, timing: dict[str, float]) -> tuple[Batch, dict[str, float]]:
        """Generate and score until the batch is full: once, or (DAPO dynamic sampling) until
        ``max_num_gen_batches`` generation batches gave enough groups whose scores vary. Scoring
        overlaps the old log-prob pass when ``reward.async_reward`` and nothing is filtered."""
        cfg, metrics = self.cfg, {}
        filtering = cfg.algorithm.filter_groups
        wanted = cfg.data.train_batch_size * self.n
        kept: list[Batch] = []
        for attempt in range(filtering.max_num_gen_batches if filtering.enable else 1):
            batch, future = self.pipeline.generation_half(self.next_prompts(), self.step, timing)
            if not filtering.enable:
                if cfg.reward.async_reward:
                    with Timer("old_log_prob", timing):
                        batch = self.pipeline.old_log_probs(batch, self.keep_rollout)
                    metrics.update(self.pipeline.score(batch, future, timing, "reward_wait"))
                else:
                    metrics.update(self.pipeline.score(batch, future, timing, "reward"))
                return batch, metrics
            metrics.update(self.pipeline.score(batch, future, timing, "reward"))
            kept.append(batch[torch.from_numpy(stages.varied_groups(batch))])
            metrics["dapo/gen_batches"] = attempt + 1
            if sum(len(b) for b in kept) >= wanted:
                break
        batch = Batch.concat(kept)[:wanted]
        metrics["dapo/kept_fraction"] = len(batch) / wanted
        if len(batch) == 0:
            raise NothingToLearnError(
                f"algorithm.filter_groups: no group's scores varied in "
                f"max_num_gen_batches={filtering.max_num_gen_batches} generation batches "
                "(every sample of a prompt scored the same), so there is nothing to learn from; "
                "raise algorithm.filter_groups.max_num_gen_batches or rollout.n, sample more "
                "diversely (rollout.temperature), or use an easier task"
            )
        return batch, metrics

    @property
    def keep_rollout(self) -> bool:
        """Take ``old_log_probs`` from the rollout (provably the actor's own distribution)."""
        return self.reuse_rollout_log_probs

    def balance(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """Reorder samples so each data-parallel rank gets about the same number of tokens."""
        world = self.workers.world_size
        if world == 1 or not self.cfg.trainer.balance_batch or len(batch) % world:
            return batch, {}
        balanced = balance_batch(batch, world)
        return balanced.batch, balanced.metrics

    def next_batch(self, timing: dict[str, float]) -> tuple[Batch, dict[str, float], None]:
        """The in-process rollout: collect, then balance over the data-parallel ranks."""
        batch, metrics = self.collect(timing)
        batch, balance_metrics = self.balance(batch)
        metrics.update(balance_metrics)
        return batch, metrics, None

    def update(self, batch: Batch, timing: dict[str, float]) -> tuple[Batch, dict[str, float]]:
        return self.training.run(batch, self.step, timing, keep_rollout=self.keep_rollout)

    def after_update(self, batch: Batch, whole: Batch | None, timing: dict[str, float]) -> None:
        self.sampler.update(batch)

    def validate(self) -> dict[str, float]:
        """Validation metrics on the held-out rows (``StepPipeline.validate``)."""
        if self.val_data is None:
            return {}
        return self.pipeline.validate([self.val_data[i] for i in range(len(self.val_data))])

    # ---- the loop ------------------------------------------------------------------------

    def begin(self, resumed: bool) -> None:
        if resumed:
            total = self.cfg.trainer.total_steps
            note = f"resuming {self.out} from step {self.step} of {total}"
            if self.step >= total:
                note += " (already finished: raise trainer.total_steps or use a new output_dir)"
            self.console.print(as_text(note))

    def progress(self) -> TrainingProgress:
        return TrainingProgress(self.cfg.trainer.total_steps, self.step, self.console)

    def summary(self, seconds: float) -> RunSummary:
        total = self.cfg.trainer.total_steps
        return RunSummary(self.out, total, self.val_before, self.val_latest, self.scores, seconds)

    def close(self) -> None:
        """Release the workers, the reward pool, the metric sinks and the output folder."""
        try:
            self.workers.shutdown()
            self.tracker.close()
            self.reward.close()
        finally:
            self.release_folder()

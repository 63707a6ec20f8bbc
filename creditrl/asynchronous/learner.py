"""The training worker (spec 003): pulls whole groups, trains, publishes versioned weights.

The learner is ``creditrl train``'s loop (``creditrl.trainers.loop.TrainingLoop``: resume,
validation on the schedule, the training half with the critic warm-up and the health check,
metrics with the critic's and the agent hook, dumps, checkpoints, the summary) with groups from
samplers as its batch source. What is async, top to bottom of a step:

1. ``next_batch``: receive groups until ``data.train_batch_size`` of them are buffered
   (``creditrl.asynchronous.receiver``: every message checked, stale groups dropped, rejections
   counted and acknowledged), concatenate the oldest into one Batch (``staleness`` per
   sample) and, with several learner ranks, scatter whole groups over torch.distributed;
2. ``update`` (every rank): the training half, with ``old_log_probs`` the behaviour log-probs
   for on-policy rows and recomputed under the current policy for stale rows
   (``old_log_probs=learner``, corrected by rollout importance weights pi_old / pi_behaviour
   when ``max_staleness`` > 0), reference and teacher log-probs unless the sampler sent them
   (``asynchronous.ref_on``, ``distill.teacher_on``: the learner then builds no teacher);
3. ``after_update``: publish the step's version (``weight_server.LearnerChannel``), then
   acknowledge the groups (journaled first); metrics add ``async/*`` and ``fleet/*`` (the
   samplers: ``creditrl.asynchronous.fleet``), the dump staleness.

Resume: the model, optimizer, ledger, version and fleet come from the latest checkpoint; the
acknowledgement journal tells how many episodes were trained after it (their updates are
lost: reported as dropped); the version continues past anything published before the crash.

With several ranks, loss metrics are summed over ranks; data metrics and the rollout dump
cover rank 0's shard (whole groups, ``data.train_batch_size / learners`` of them).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from creditrl.asynchronous.ranks import check_replicas, scatter_groups, stop_on_every_rank
from creditrl.asynchronous.receiver import AsyncRolloutDumper, GroupReceiver
from creditrl.asynchronous.settings import (
    check_async_config,
    start_versions,
    teacher_on_sampler,
)
from creditrl.asynchronous.staleness import (
    BufferedGroup,
    StalenessProgress,
    concat_groups,
    staleness_metrics,
)
from creditrl.asynchronous.weight_server import learner_channel
from creditrl.batch import Batch
from creditrl.config import Config
from creditrl.config.loader import to_dict
from creditrl.controller import LocalWorkerGroup
from creditrl.models import load_tokenizer, resolve_model_path
from creditrl.pipeline.step import (
    StepPipeline,
    build_reward_manager,
    build_run_datasets,
    rollout_log_probs_reusable,
)
from creditrl.pipeline.training_half import TrainingHalf
from creditrl.plain_text import as_text
from creditrl.tracking import Timer, Tracker
from creditrl.trainers.checkpoint import CheckpointManager, prepare_output_dir
from creditrl.trainers.loop import TrainingLoop
from creditrl.trainers.schedule import Schedule
from creditrl.workers.hybrid import ADDITIVE_METRICS

__all__ = ["ADDITIVE_METRICS", "AsyncRolloutDumper", "Learner", "concat_groups"]


class Learner(GroupReceiver, TrainingLoop):
    """Rank ``rank`` of ``world`` learner ranks (rank 0 owns the socket, the weights directory,
    the ledger, the metrics and the checkpoints)."""

    def __init__(
        self,
        cfg: Config,
        rank: int = 0,
        world: int = 1,
        *,
        port: int | None = None,
        console: Any = None,
    ) -> None:
        check_async_config(cfg)
        self.cfg, self.rank, self.world, self.port = cfg, rank, world, port
        self.main = rank == 0
        self.console = console or Console(stderr=True, highlight=False, emoji=False)
        self.out = Path(cfg.trainer.output_dir)
        # rank 0 holds the output folder (`creditrl async` hands its held lock to this process)
        self.build_holding_folder(self.main)

    def _build(self) -> None:
        """Threads, seed, the workers, the training half, checkpoints, receiving, outputs."""
        cfg, a = self.cfg, self.cfg.asynchronous
        threads = a.learner_threads or cfg.trainer.num_threads
        if threads > 0:
            torch.set_num_threads(threads)
        torch.manual_seed(cfg.trainer.seed)
        self.n = cfg.rollout.n
        self.schedule = Schedule.from_config(cfg.trainer)  # creditrl train's validations, saves
        self.reuse_behaviour = rollout_log_probs_reusable(cfg)  # on-policy rows, as in train
        algorithm = cfg.algorithm
        if a.old_log_probs == "learner" and (a.max_staleness or a.staleness_policy == "keep"):
            rollout_is = dataclasses.replace(cfg.algorithm.rollout_is, enable=True)
            algorithm = dataclasses.replace(cfg.algorithm, rollout_is=rollout_is)
        model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        self.tokenizer = load_tokenizer(model_path)
        # the training half of the step pipeline, over the same hybrid worker as `creditrl train`
        self.workers = LocalWorkerGroup(cfg, with_teacher=not teacher_on_sampler(cfg))
        self.actor = self.workers.worker.actor
        # token ids a group may hold: those the embedding accepts (>= len(tokenizer) when the
        # model pads its vocabulary, and sampling can pick the padded rows)
        embeddings = self.actor.model.get_input_embeddings().num_embeddings
        self.vocab_size = max(embeddings, len(self.tokenizer))
        self.val_rows = self._validation_rows() if self.main else []
        reward = build_reward_manager(cfg, self.tokenizer) if self.val_rows else None
        self.pipeline = StepPipeline(cfg, self.workers, reward, self.tokenizer, algorithm)
        # the synchronous trainer's training half: critic warm-up, health check, metrics, hooks
        self.training = TrainingHalf(
            cfg, self.pipeline, self.tokenizer, self.console if self.main else None
        )
        self.checkpoints = CheckpointManager(self.out / "checkpoints", cfg.trainer.max_checkpoints)
        self.init_receiving(cfg, self.vocab_size, self.out, self.tokenizer)
        self.step = 0
        self.weights = self.workers.worker.weights  # the actor's channel: it holds the version
        self.val_before, self.val_latest = {}, {}
        self.resume_report: dict[str, int] = {}
        self.staleness: list[float] = []  # mean staleness of each step of this fit
        self.taken: list[BufferedGroup] = []  # the groups of the step being trained
        if self.main:
            prepare_output_dir(self.out, cfg.trainer.resume, cfg.trainer.overwrite)
            self.out.mkdir(parents=True, exist_ok=True)
            self.publisher = learner_channel(cfg, self.port, self.console.print, self.counters)
            self.held.append(self.publisher.lock)  # released with the output folder
            self.tracker = Tracker(self.out, cfg.trainer.logger, to_dict(cfg), self.out.name)
            self.dumper = AsyncRolloutDumper(
                self.out, cfg.trainer.rollout_dump_rows, self.tokenizer
            )

    def _validation_rows(self) -> list[Any]:
        """The held-out rows validated at the steps ``self.schedule`` names (rank 0), as
        ``creditrl train`` builds them; none when no step validates."""
        if not self.schedule.validates_ever:
            return []
        _, val = build_run_datasets(self.cfg, self.tokenizer)
        return [] if val is None else [val[i] for i in range(len(val))]

    def validate(self) -> dict[str, float]:
        return self.pipeline.validate(self.val_rows) if self.val_rows else {}

    # ---- checkpoints ---------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """The weight version, the ledger, the counters and the fleet (``Fleet.state_dict``)."""
        return {"version": self.version, "ledger": self.ledger.state_dict(),
                "counters": dict(self.counters), "fleet": self.fleet.state_dict()}  # fmt: skip

    def save_checkpoint(self) -> Path:
        path = super().save_checkpoint()
        self.journal.checkpointed()
        return path

    def load_state(self, path: Path, state: dict[str, Any]) -> None:
        """Every rank restores the version; rank 0 the fleet (``restore_fleet``), rebuilds the
        ledger from the journal and reports the in-flight episodes whose updates were lost."""
        self.version = int(state["version"])
        self.ledger.load_state_dict(state["ledger"])
        self.counters.update(state["counters"])
        if not self.main:
            return
        self.restore_fleet(path, state)
        dropped = self.journal.recover(self.step, self.ledger)
        self.resume_report = {"step": self.step, "dropped_groups": dropped["groups"],
                              "dropped_episodes": dropped["episodes"]}  # fmt: skip
        self.console.print(
            as_text(
                f"learner: resumed from step {self.step} ({path.name}); "
                f"{dropped['episodes']} in-flight episode(s) in {dropped['groups']} group(s) "
                "were trained after that checkpoint and are dropped"
            )
        )

    # ---- one step ------------------------------------------------------------------------

    def next_batch(self, timing: dict[str, float]) -> tuple[Batch, dict[str, float], Batch | None]:
        """Rank 0 collects the step's groups; every rank gets its share of them."""
        self.taken, full = [], None
        if self.main:
            with Timer("wait", timing):
                self.taken = self.collect()
            full = concat_groups([g.batch for g in self.taken], self.tokenizer.pad_token_id)
            full["staleness"] = self.version - full["weight_version"]
            self.group_stats.add_trained(full, self.cfg.asynchronous.max_staleness, self.version)
        rows = self.groups_per_step // self.world * self.n
        return scatter_groups(full, self.world, rows), {}, full

    def keep_rollout(self, batch: Batch) -> torch.Tensor:
        """Rows whose ``old_log_probs`` are the behaviour log-probs: every row with
        ``old_log_probs=sampler``; else the rows sampled by the current version when those are
        exactly this policy's; the rest are recomputed here (and corrected by rollout IS)."""
        if self.cfg.asynchronous.old_log_probs == "sampler":
            return torch.ones(len(batch), dtype=torch.bool)
        if self.reuse_behaviour:
            return batch["staleness"] == 0
        return torch.zeros(len(batch), dtype=torch.bool)

    def update(self, batch: Batch, timing: dict[str, float]) -> tuple[Batch, dict[str, float]]:
        """The training half of step ``self.step`` (``TrainingHalf.run``, as ``creditrl train``
        runs it) on this rank's groups; returns the batch with every field it wrote, and the
        metrics. The first-mini-batch check holds when every row's ``old_log_probs`` are this
        policy's: recomputed here (``old_log_probs=learner``) or from on-policy rows."""
        on_policy = self.cfg.asynchronous.old_log_probs == "learner" or not batch["staleness"].any()
        keep, version = self.keep_rollout(batch), self.version
        out = self.training.run(batch, self.step, timing, keep_rollout=keep, on_policy=on_policy)
        self.version = version + 1  # a step is a version, a critic warm-up step's too
        return out

    def after_update(self, batch: Batch, whole: Batch | None, timing: dict[str, float]) -> None:
        """Rank 0 publishes the weights (every ``publish_every`` versions and at the last step)
        and acknowledges the trained groups."""
        if not self.main:
            return
        last = self.step == self.cfg.trainer.total_steps
        if self.version % self.cfg.asynchronous.publish_every == 0 or last:
            with Timer("publish", timing):  # a copy now; written by a background thread
                self.publisher.publish(self.actor.model, self.version, background=True)
        self.acknowledge_trained(self.taken)

    def source_metrics(self, whole: Batch) -> dict[str, float]:
        metrics = staleness_metrics(whole["staleness"])
        metrics.update(self.group_stats.metrics())
        metrics.update(self.training.scored_elsewhere_metrics(whole))
        metrics.update(self.receiving_metrics())
        if self.resume_report and self.step == self.resume_report["step"] + 1:
            dropped = float(self.resume_report["dropped_episodes"])
            metrics["async/dropped_on_resume_episodes"] = dropped
        self.staleness.append(metrics["async/staleness/mean"])
        return metrics

    # ---- the loop ------------------------------------------------------------------------

    def begin(self, resumed: bool) -> None:
        """Rank 0 binds the socket, readies the weight folder (``start_versions``), says where."""
        if not self.main:
            return
        self.open_socket(self.port)
        say = self.console.print
        self.version = start_versions(self.cfg, self.publisher, self.actor.model, self.version, say)
        self.console.print(
            as_text(
                f"learner: listening on {self.socket.address} ({self.socket.security}); "
                f"step {self.step} of "
                f"{self.cfg.trainer.total_steps}, weights v{self.version}"
            )
        )

    def more(self) -> bool:
        return not stop_on_every_rank(
            self.step >= self.cfg.trainer.total_steps, self.world, self.main
        )

    def progress(self) -> Any:
        return StalenessProgress(self.cfg.trainer.total_steps, self.console)

    def check_ranks(self, saving: bool) -> None:
        if saving and self.world > 1:
            check_replicas(self.actor.model, self.rank, self.step, self.main)

    def summary(self, seconds: float) -> dict[str, Any]:
        """Steps, version, seconds, mean staleness, the counters and the resume report."""
        mean_staleness = sum(self.staleness) / len(self.staleness) if self.staleness else math.nan
        summary = {"steps": self.step, "version": self.version, "seconds": seconds,
                   "mean_staleness": mean_staleness,
                   **{k: int(v) for k, v in self.counters.items()},
                   **{f"resume_{k}": v for k, v in self.resume_report.items()}}  # fmt: skip
        if self.main:
            self.console.print(as_text(f"learner: done {json.dumps(summary)}"))
        return summary

    def close(self) -> None:
        """Rank 0: finish publishing, stop the samplers, close the metrics and the reward,
        and release the output folder."""
        if not self.main:
            return
        try:
            self.publisher.close()  # publications in flight written, the weight port closed
            self.stop_samplers()
            self.tracker.close()
            if self.pipeline.reward is not None:
                self.pipeline.reward.close()
        finally:
            self.release_folder()

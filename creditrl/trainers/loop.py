"""The one training loop: ``creditrl train`` (``RLTrainer``) and the async learner
(``creditrl.asynchronous.learner.Learner``) are this loop with different batch sources.

Shared here, one implementation each: resume (the newest checkpoint that fits, the KL
controller and the validations with it), validation on the schedule's steps
(``creditrl.trainers.schedule``), one step (the batch, the training half with the critic
warm-up and the health check, the step's metrics with the critic's and the agent hook, the
rollout dump), metrics, progress (with a line for a step's failed episodes, and a stop after
``agent.max_failed_steps`` steps of nothing else), checkpoints and the summary. A loop says
where a step's batch comes from (``next_batch``) and what its rows' old log-probs are
(``update``), and may act after the update (``after_update``: the learner publishes weights and
acknowledges groups) and add metrics (``source_metrics``). Only the main process (rank 0)
validates, logs, dumps and saves.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from creditrl.batch import Batch
from creditrl.run_lock import RunLock
from creditrl.trainers.failures import EpisodeFailures

__all__ = ["TrainingLoop", "saved_metrics"]


def saved_metrics(value: Any) -> dict[str, float]:
    """A checkpoint's saved validation metrics: the name -> number entries of a mapping."""
    if not isinstance(value, dict):
        return {}
    return {
        k: float(v)
        for k, v in value.items()
        if isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
    }


class TrainingLoop:
    """The loop over ``self.step`` to ``trainer.total_steps``. A subclass builds ``cfg``,
    ``console``, ``workers``, ``pipeline``, ``training`` (``TrainingHalf``), ``schedule``,
    ``checkpoints`` and, on the main process, ``tracker`` and ``dumper``; it implements
    ``next_batch``, ``update``, ``validate``, ``progress``, ``summary`` and ``close``."""

    main = True  # this process validates, logs, dumps and saves
    step = 0
    val_before: dict[str, float]
    val_latest: dict[str, float]  # the newest validation, kept by checkpoints
    scores: list[float]  # critic/score/mean of each step of this fit

    def build_holding_folder(self, hold: bool) -> None:
        """Take ``trainer.output_dir``'s run lock when ``hold`` (the main process: one run per
        folder, held until ``release_folder``), then ``_build()``, which may add the locks of
        other folders it writes to ``held``; they are released if building fails."""
        self.held: list[RunLock] = [RunLock.acquire(self.out)] if hold else []
        try:
            self._build()
        except BaseException:
            self.release_folder()
            raise

    def release_folder(self) -> None:
        """Release the locks taken by ``build_holding_folder`` (if any), the newest first."""
        while self.held:
            self.held.pop().release()

    # ---- what a loop says --------------------------------------------------------------------

    def next_batch(self, timing: dict[str, float]) -> tuple[Batch, dict[str, float], Batch | None]:
        """(this step's batch for this rank, the metrics of getting it, the whole step's batch
        over every rank: None when it is the same)."""
        raise NotImplementedError

    def update(self, batch: Batch, timing: dict[str, float]) -> tuple[Batch, dict[str, float]]:
        """The training half on ``batch`` (``TrainingHalf.run``, with the loop's old log-probs)."""
        raise NotImplementedError

    def after_update(self, batch: Batch, whole: Batch | None, timing: dict[str, float]) -> None:
        """What follows the update, before the step's metrics (every rank)."""

    def source_metrics(self, whole: Batch) -> dict[str, float]:
        """Metrics of the batch source for the step (main process)."""
        return {}

    def checkpoint_state(self) -> dict[str, Any]:
        """The loop's own state saved with each checkpoint."""
        return {}

    def load_state(self, path: Path, state: dict[str, Any]) -> None:
        """Restore ``checkpoint_state`` from checkpoint ``path``."""

    def begin(self, resumed: bool) -> None:
        """After resuming (or the validation before the first step), before the first step."""

    def more(self) -> bool:
        """Another step follows."""
        return self.step < self.cfg.trainer.total_steps

    def check_ranks(self, saving: bool) -> None:
        """After each step, on every rank (``saving``: a checkpoint follows)."""

    def validate(self) -> dict[str, float]:
        raise NotImplementedError

    def progress(self) -> Any:
        """An object with ``update(step, metrics)`` and ``close()``."""
        raise NotImplementedError

    def summary(self, seconds: float) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # ---- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """The models (``workers.save_checkpoint``), the KL controller, the validations and
        the loop's state, as checkpoint ``step``."""
        state = {
            "kl_ctrl": self.pipeline.kl_ctrl.state_dict(),
            "val_before": self.val_before,
            "val_latest": self.val_latest,
            **self.checkpoint_state(),
        }
        return self.checkpoints.save(self.step, self.workers.save_checkpoint, state)

    def maybe_resume(self) -> bool:
        """Restore the newest complete checkpoint that fits the models (damaged or unfitting
        newer ones are logged and skipped) unless ``trainer.resume=never``; without one, a rerun
        starts over and drops the earlier attempt's metrics rows."""
        if self.cfg.trainer.resume == "never":
            return False
        restored = self.checkpoints.restore(self.workers.load_checkpoint, report=self.main)
        if restored is None:
            if self.main:
                self.tracker.truncate_after(-1)
            return False
        path, self.step, state = restored
        self.pipeline.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.val_before = saved_metrics(state.get("val_before"))
        self.val_latest = saved_metrics(state.get("val_latest"))
        self.load_state(path, state)
        if self.main:
            self.tracker.truncate_after(self.step)
        return True

    # ---- one step ----------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """One step: the batch -> the training half -> what follows it -> the step's metrics
        and the rollout dump (main process)."""
        timing: dict[str, float] = {}
        start = time.perf_counter()
        batch, metrics, whole = self.next_batch(timing)
        batch, update = self.update(batch, timing)
        metrics.update(update)
        self.after_update(batch, whole, timing)
        if not self.main:
            return metrics
        timing["step"] = time.perf_counter() - start
        metrics.update(self.training.step_metrics(batch, timing, whole=whole))
        metrics.update(self.source_metrics(batch if whole is None else whole))
        self.dumper.dump(batch, self.step)
        self.last_batch = batch
        return metrics

    # ---- the loop ----------------------------------------------------------------------------

    def fit(self) -> Any:
        """Resume or validate first, train to ``trainer.total_steps`` (validating and saving on
        the schedule's steps), close, and return the summary."""
        began = time.perf_counter()
        self.scores = []
        progress = None
        try:  # a refused checkpoint or a Ctrl-C before the first step still closes the loop
            resumed = self.maybe_resume()
            if self.main and not resumed and self.schedule.validates(0):
                self.val_before = self.validate()
                if self.val_before:  # nothing to validate on: no row
                    self.tracker.log(self.val_before, step=0)
            self.begin(resumed)
            progress = self.progress() if self.main else None
            failures = EpisodeFailures(self.console, self.cfg.agent.max_failed_steps)
            while self.more():
                self.step += 1
                metrics = self.train_step()
                saving = self.schedule.saves(self.step)
                self.check_ranks(saving)
                if not self.main:
                    continue
                if self.schedule.validates(self.step):
                    self.val_latest = self.validate()
                    metrics.update(self.val_latest)
                self.tracker.log(metrics, step=self.step)
                progress.update(self.step, metrics)
                failures.check(self.step, self.last_batch)
                self.scores.append(metrics.get("critic/score/mean", math.nan))
                if saving:
                    self.save_checkpoint()
        finally:
            if progress is not None:
                progress.close()
            self.close()
        return self.summary(time.perf_counter() - began)

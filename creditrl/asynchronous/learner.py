"""The training worker (spec 003): pulls whole groups, trains, publishes versioned weights.

One step, top to bottom (``Learner.fit``):

1. ``collect``: receive groups until ``data.train_batch_size`` of them are buffered; every
   message is checked first (``validation``): one that fails (or that the learner fails on
   before it joins a batch) is acknowledged ``rejected``, counted (``async/rejected``,
   ``async/rejected/<reason>``) and logged with its sender and seq, and a sender rejected
   ``asynchronous.max_rejects`` times is disconnected (every later message of it is answered
   ``disconnected`` and otherwise ignored); groups whose staleness (learner version - sampling
   version) exceeds ``max_staleness`` are dropped, counted and acknowledged ``stale``; a group
   seen before is acknowledged ``duplicate``; a group that would take the buffered bytes past
   ``settings.max_buffered_bytes`` is rejected ``buffer_full`` (counted like any rejection,
   but not toward ``max_rejects``: a flood from one peer never disconnects the others);
2. concatenate the oldest groups into one Batch (``staleness`` per sample) and, with several
   learner ranks, scatter whole groups over torch.distributed;
3. ``update`` (every rank): the synchronous trainer's training half
   (``creditrl.pipeline.training_half``: critic warm-up, health check, metrics, agent hook):
   ``old_log_probs`` (the behaviour log-probs for on-policy rows,
   recomputed under the current policy for stale rows: ``old_log_probs=learner``), reference
   log-probs (unless the sampler sent them), DAPO overlong shaping, KL into rewards, rollout
   importance weights pi_old / pi_behaviour (the staleness correction), group advantages,
   the policy update (``actor.policy_loss``: ``ppo`` for GRPO, ``gspo``; KL to the reference
   with ``actor.use_kl_loss``);
4. version += 1, publish the weights, acknowledge the groups (journaled first), log metrics
   and the rollout dump (with per-sample staleness), checkpoint.

Resume: the model, optimizer, ledger and version come from the latest checkpoint; the
acknowledgement journal tells how many episodes were trained after it (their updates are
lost: reported as dropped); the version continues past anything published before the crash.

With several ranks, loss metrics are summed over ranks; data metrics and the rollout dump
cover rank 0's shard (whole groups, ``data.train_batch_size / learners`` of them).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from creditrl.asynchronous.delivery import AckJournal, DeliveryLedger
from creditrl.asynchronous.messages import (
    Message,
    MessageError,
    ack_message,
    check_sampler_id,
    encode,
    reject_message,
)
from creditrl.asynchronous.settings import (
    check_async_config,
    json_limits,
    max_buffered_bytes,
    max_message_bytes,
    needs_reference,
    weight_root,
)
from creditrl.asynchronous.staleness import (
    BufferedGroup,
    GroupBuffer,
    concat_groups,
    staleness_metrics,
)
from creditrl.asynchronous.transport import LearnerSocket
from creditrl.asynchronous.validation import AGENT_FIELDS, STRUCTURED_FIELDS, GroupLimits
from creditrl.asynchronous.weights import WeightPublisher
from creditrl.batch import Batch
from creditrl.config import Config
from creditrl.config.loader import to_dict
from creditrl.controller import LocalWorkerGroup
from creditrl.controller.distributed import broadcast_bytes, scatter_batches
from creditrl.models import (
    load_tokenizer,
    resolve_model_path,
)
from creditrl.pipeline.plan import structured_reward
from creditrl.pipeline.step import (
    StepPipeline,
    build_reward_manager,
    build_run_datasets,
    rollout_log_probs_reusable,
)
from creditrl.pipeline.training_half import TrainingHalf
from creditrl.plain_text import as_text
from creditrl.rollout.strategies import strategy_traits
from creditrl.tracking import RolloutDumper, Timer, Tracker
from creditrl.trainers.checkpoint import CheckpointManager, prepare_output_dir
from creditrl.trainers.schedule import Schedule
from creditrl.workers.hybrid import ADDITIVE_METRICS

__all__ = ["ADDITIVE_METRICS", "AsyncRolloutDumper", "Learner"]

log = logging.getLogger(__name__)
_DRAIN = 256  # messages handled per receive call, so a flood never starves the step loop


class AsyncRolloutDumper(RolloutDumper):
    """The rollout dump plus ``staleness``, ``weight_version``, ``episode_id``, ``sampler_id``."""

    def rows(self, batch: Batch, step: int) -> list[dict[str, Any]]:
        rows = super().rows(batch, step)
        for i, row in enumerate(rows):
            row["staleness"] = int(batch["staleness"][i])
            row["weight_version"] = int(batch["weight_version"][i])
            row["episode_id"] = str(batch["episode_id"][i])
            row["sampler_id"] = str(batch["sampler_id"][i])
        return rows


class Learner:
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
        a = cfg.asynchronous
        threads = a.learner_threads or cfg.trainer.num_threads
        if threads > 0:
            torch.set_num_threads(threads)
        torch.manual_seed(cfg.trainer.seed)
        self.out = Path(cfg.trainer.output_dir)
        self.n = cfg.rollout.n
        self.schedule = Schedule.from_config(cfg.trainer)  # creditrl train's validations, saves
        self.groups_per_step = cfg.data.train_batch_size
        self.use_ref = needs_reference(cfg)
        # the behaviour log-probs of rows sampled by the current version are exactly this
        # policy's when the engine samples the actor's distribution (no IS needed there)
        self.reuse_behaviour = rollout_log_probs_reusable(cfg)  # as `creditrl train` decides
        algorithm = cfg.algorithm
        if a.old_log_probs == "learner" and a.max_staleness > 0:  # stale rows: rollout IS
            rollout_is = dataclasses.replace(cfg.algorithm.rollout_is, enable=True)
            algorithm = dataclasses.replace(cfg.algorithm, rollout_is=rollout_is)
        model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        self.tokenizer = load_tokenizer(model_path)
        # the training half of the step pipeline, over the same hybrid worker as `creditrl train`
        self.workers = LocalWorkerGroup(cfg)
        self.actor = self.workers.worker.actor
        # token ids a group may hold: those the embedding accepts (>= len(tokenizer) when the
        # model pads its vocabulary, and sampling can pick the padded rows)
        embeddings = self.actor.model.get_input_embeddings().num_embeddings
        self.vocab_size = max(embeddings, len(self.tokenizer))
        self.val_rows = self._validation_rows() if self.main else []
        reward = build_reward_manager(cfg, self.tokenizer) if self.val_rows else None
        self.pipeline = StepPipeline(cfg, self.workers, reward, self.tokenizer, algorithm)
        self.algorithm = self.pipeline.algorithm
        # the synchronous trainer's training half: critic warm-up, health check, metrics, hooks
        self.training = TrainingHalf(
            cfg, self.pipeline, self.tokenizer, self.console if self.main else None
        )
        structured = structured_reward(cfg)
        optional = {"ref_log_prob": self.use_ref and a.ref_on == "sampler",
                    "rm_scores": cfg.reward.reward_model.enable,
                    **dict.fromkeys(AGENT_FIELDS, strategy_traits(cfg).multi_turn),
                    **dict.fromkeys(STRUCTURED_FIELDS, structured)}  # fmt: skip
        self.limits = GroupLimits(
            n=self.n,
            vocab_size=self.vocab_size,
            max_prompt=cfg.data.max_prompt_length,
            max_response=cfg.rollout.max_response_length,
            optional=frozenset(name for name, sent in optional.items() if sent),
            temperature=cfg.rollout.temperature,
        )
        self.kl_ctrl = self.pipeline.kl_ctrl
        self.checkpoints = CheckpointManager(self.out / "checkpoints", cfg.trainer.max_checkpoints)
        self.ledger = DeliveryLedger()
        self.journal = AckJournal(self.out / "async" / "acks.jsonl")
        self.buffer = GroupBuffer(a.max_staleness)
        self.json_limits = json_limits(cfg)
        self.buffer_limit = max_buffered_bytes(cfg)
        self.counters: dict[str, int] = defaultdict(int)
        self.counters["rejected"] = 0
        self.rejects: dict[str, int] = defaultdict(int)  # rejected messages per sender
        self.blocked: set[str] = set()  # senders disconnected after max_rejects rejections
        self.samplers: set[str] = set()
        self.incarnation = uuid.uuid4().hex
        self.step = 0
        self.version = 0
        self.resume_report: dict[str, int] = {}
        self.socket: LearnerSocket | None = None
        if self.main:
            prepare_output_dir(self.out, cfg.trainer.resume, cfg.trainer.overwrite)
            self.out.mkdir(parents=True, exist_ok=True)
            self.publisher = WeightPublisher(weight_root(cfg), a.keep_weight_versions, a.lora_sync)
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

    # ---- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """Write the models (as ``creditrl train`` does), ledger, version and counters."""
        state = {
            "version": self.version,
            "ledger": self.ledger.state_dict(),
            "counters": dict(self.counters),
            "kl_ctrl": self.kl_ctrl.state_dict(),
        }
        path = self.checkpoints.save(self.step, self.workers.save_checkpoint, state)
        self.journal.checkpointed()
        return path

    def maybe_resume(self) -> bool:
        """Restore the latest checkpoint (every rank); rank 0 rebuilds the ledger from the
        journal and reports the in-flight episodes whose updates were lost."""
        if self.cfg.trainer.resume == "never":
            return False
        latest = self.checkpoints.latest(report=self.main)
        if latest is None:  # a rerun of a run killed before its first checkpoint starts over
            if self.main:
                self.tracker.truncate_after(-1)
            return False

        self.step, state = self.checkpoints.load(latest, self.workers.load_checkpoint)
        self.version = int(state["version"])
        self.ledger.load_state_dict(state["ledger"])
        self.counters.update(state["counters"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.main:
            dropped = self.journal.recover(self.step, self.ledger)
            self.resume_report = {
                "step": self.step,
                "dropped_groups": dropped["groups"],
                "dropped_episodes": dropped["episodes"],
            }
            self.tracker.truncate_after(self.step)
            self.console.print(
                as_text(
                    f"learner: resumed from step {self.step} ({latest.name}); "
                    f"{dropped['episodes']} in-flight episode(s) in {dropped['groups']} group(s) "
                    "were trained after that checkpoint and are dropped"
                )
            )
        return True

    # ---- receiving -----------------------------------------------------------------------

    def _ack(self, sampler_id: str, acks: list[tuple[int, str, int]], journal: bool = True) -> None:
        """Journal (durably), mark consumed, then tell the sampler."""
        if journal:
            self.journal.record(self.step, sampler_id, acks)
            for seq, _, _ in acks:
                self.ledger.add(sampler_id, seq)
        pairs = [(seq, status) for seq, status, _ in acks]
        self.socket.send(sampler_id, ack_message(self.incarnation, self.version, pairs))

    def _handle(self, sender: str, message: Message) -> int:
        """Act on one message that decoded; returns 1 for a group that passed every check."""
        if sender in self.blocked:
            self._refuse(sender)
            return 0
        if message.kind == "hello":
            self.samplers.add(sender)
            header = {"incarnation": self.incarnation, "weight_version": self.version}
            self.socket.send(sender, encode("welcome", header))
            return 0
        if message.kind != "episodes":
            err = MessageError(f"a sampler may not send {message.kind!r} messages", "protocol")
            self._reject(sender, err)
            return 0
        seq, batch = int(message.header["seq"]), message.batch
        try:
            version = int(message.header["weight_version"])
            group = BufferedGroup(sender, seq, version, batch, nbytes=message.nbytes)
            self.limits.check(batch, sender, seq, group.version, self.version)
        except MessageError as e:
            e.seq = seq
            self._reject(sender, e)
            return 0
        except Exception as e:  # a failure on one group never ends the run
            log.exception("learner: failed on group %s:%d before it joined a batch", sender, seq)
            self._reject(sender, MessageError(f"{type(e).__name__}: {e}", "error", seq))
            return 0
        self.samplers.add(sender)
        if self.ledger.consumed(sender, seq):
            self.counters["duplicate_groups"] += 1
            self._ack(sender, [(seq, "duplicate", len(batch))], journal=False)
            return 1
        if self.buffer.holds(sender, seq):
            self.counters["duplicate_groups"] += 1
            return 1
        if self.buffer.is_stale(group, self.version):
            self.counters["received_groups"] += 1
            self._drop_stale([group])
            return 1
        if self.buffer.nbytes + group.nbytes > self.buffer_limit:
            err = MessageError(
                f"group {sender}:{seq} of {group.nbytes} bytes would take the buffered groups "
                f"({self.buffer.nbytes} bytes) past {self.buffer_limit}",
                "buffer_full",
                seq,
            )
            self._reject(sender, err, strike=False)
            return 0
        self.counters["received_groups"] += 1
        self.buffer.add(group)
        return 1

    def _reject(self, sender: str, err: MessageError, strike: bool = True) -> None:
        """Count, log and acknowledge a rejected message; disconnect a sender rejected
        ``asynchronous.max_rejects`` times (counting only rejections that ``strike``). A group
        with a seq from a valid sampler id is journaled and marked consumed, like every other
        acknowledged group."""
        if sender in self.blocked:
            self._refuse(sender)
            return
        self.counters["rejected"] += 1
        self.counters[f"rejected/{err.reason}"] += 1
        self.rejects[sender] += int(strike)
        log.warning(
            "learner: rejected message from sampler %r (seq %s, reason %s): %s",
            sender, err.seq, err.reason, err,
        )  # fmt: skip
        seq = err.seq
        try:
            check_sampler_id(sender)
            valid_sender = True
        except MessageError:
            valid_sender = False
        if seq is not None and valid_sender and not self.ledger.consumed(sender, seq):
            self.journal.record(self.step, sender, [(seq, "rejected", 0)])
            self.ledger.add(sender, seq)
        self.socket.send(sender, reject_message(self.incarnation, self.version, seq, err.reason))
        limit = self.cfg.asynchronous.max_rejects
        if strike and limit and self.rejects[sender] >= limit:
            self.blocked.add(sender)
            self.samplers.discard(sender)
            self.counters["disconnected_samplers"] += 1
            log.error(
                "learner: sampler %r disconnected after %d rejected messages "
                "(asynchronous.max_rejects=%d); its further messages are ignored",
                sender, self.rejects[sender], limit,
            )  # fmt: skip
            self._refuse(sender, ignored=False)

    def _refuse(self, sender: str, ignored: bool = True) -> None:
        """Answer a disconnected sender ``disconnected`` and nothing else (``ignored``: the
        message it answers is counted as ignored)."""
        self.counters["ignored_messages"] += int(ignored)
        reason = (
            f"disconnected after {self.rejects[sender]} rejected messages "
            f"(asynchronous.max_rejects={self.cfg.asynchronous.max_rejects})"
        )
        header = {"reason": reason, "rejected": self.rejects[sender]}
        self.socket.send(sender, encode("disconnected", header))

    def _drop_stale(self, groups: list[BufferedGroup]) -> None:
        by_sampler: dict[str, list[tuple[int, str, int]]] = defaultdict(list)
        for g in groups:
            by_sampler[g.sampler_id].append((g.seq, "stale", len(g.batch)))
            self.counters["dropped_stale_groups"] += 1
            self.counters["dropped_stale_episodes"] += len(g.batch)
        for sampler_id, acks in by_sampler.items():
            self._ack(sampler_id, acks)

    def _receive(self, timeout_s: float) -> int:
        """Handle the messages arriving within ``timeout_s`` (at most ``_DRAIN``); returns how
        many groups passed the checks."""
        groups = 0
        for handled in range(_DRAIN):
            try:
                got = self.socket.recv(timeout_s if handled == 0 else 0.0)
            except MessageError as e:
                self._reject(e.sender if e.sender is not None else "?", e)
                continue
            if got is None:
                break
            groups += self._handle(*got)
        dropped = self.socket.disconnects()
        if dropped:
            self.counters["peer_disconnects"] += dropped
            log.info(
                "learner: %d sampler connection(s) closed (a sampler exiting, or one sending a "
                "frame over %d bytes: asynchronous.max_message_mb)",
                dropped, max_message_bytes(self.cfg),
            )  # fmt: skip
        return groups

    def collect(self) -> list[BufferedGroup]:
        """Block until ``data.train_batch_size`` fresh-enough groups are buffered; take them."""
        last_arrival = time.monotonic()
        timeout = self.cfg.asynchronous.data_timeout_s
        while True:
            self._drop_stale(self.buffer.drop_stale(self.version))
            if len(self.buffer) >= self.groups_per_step:
                return self.buffer.take(self.groups_per_step)
            if self._receive(1.0):
                last_arrival = time.monotonic()
            elif time.monotonic() - last_arrival > timeout:
                raise TimeoutError(
                    f"learner: no episode for {timeout:.0f}s on {self.socket.address} "
                    f"({len(self.buffer)} of {self.groups_per_step} groups buffered); are the "
                    "samplers running? (asynchronous.data_timeout_s)"
                )

    # ---- one update (every rank) ---------------------------------------------------------

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
        on_policy = self.cfg.asynchronous.old_log_probs == "learner" or not bool(
            batch["staleness"].any()
        )
        keep = self.keep_rollout(batch)
        return self.training.run(batch, self.step, timing, keep_rollout=keep, on_policy=on_policy)

    # ---- the loop ------------------------------------------------------------------------

    def _control(self, stop: bool) -> bool:
        """Rank 0 tells every rank whether another step follows; returns ``stop``."""
        if self.world == 1:
            return stop
        data = json.dumps({"stop": stop}).encode() if self.main else None
        return bool(json.loads(broadcast_bytes(data))["stop"])

    def _scatter(self, batch: Batch | None) -> Batch:
        if self.world == 1:
            return batch
        parts = None
        if self.main:
            per_rank = self.groups_per_step // self.world * self.n
            parts = [batch[r * per_rank : (r + 1) * per_rank] for r in range(self.world)]
        return scatter_batches(parts)

    def train_step(self) -> dict[str, float]:
        """One step (rank 0 collects and acknowledges; every rank updates)."""
        timing: dict[str, float] = {}
        start = time.perf_counter()
        groups: list[BufferedGroup] = []
        full = None
        if self.main:
            with Timer("wait", timing):
                groups = self.collect()
            full = concat_groups([g.batch for g in groups], self.tokenizer.pad_token_id)
            full["staleness"] = self.version - full["weight_version"]
        batch = self._scatter(full)
        batch, metrics = self.update(batch, timing)
        self.version += 1
        if not self.main:
            return metrics
        a = self.cfg.asynchronous
        if self.version % a.publish_every == 0 or self.step == self.cfg.trainer.total_steps:
            with Timer("publish", timing):  # a copy now; written by a background thread
                self.publisher.publish(self.actor.model, self.version, background=True)
        by_sampler: dict[str, list[tuple[int, str, int]]] = defaultdict(list)
        for g in groups:
            by_sampler[g.sampler_id].append((g.seq, "trained", len(g.batch)))
        for sampler_id, acks in by_sampler.items():
            self._ack(sampler_id, acks)
        self.counters["trained_groups"] += len(groups)
        timing["step"] = time.perf_counter() - start
        metrics.update(self.training.step_metrics(batch, timing, whole=full))
        metrics.update(self._async_metrics(full))
        self.dumper.dump(batch, self.step)
        self.last_batch = batch
        return metrics

    def _async_metrics(self, full: Batch) -> dict[str, float]:
        metrics = staleness_metrics(full["staleness"])
        metrics.update({f"async/{k}": float(v) for k, v in self.counters.items()})
        metrics.update(
            {
                "async/weight_version": float(self.version),
                "async/buffered_groups": float(len(self.buffer)),
                "async/buffered_bytes": float(self.buffer.nbytes),
                "async/samplers": float(len(self.samplers)),
            }
        )
        if self.resume_report and self.step == self.resume_report["step"] + 1:
            metrics["async/dropped_on_resume_episodes"] = float(
                self.resume_report["dropped_episodes"]
            )
        return metrics

    def fit(self) -> dict[str, Any]:
        """Train ``trainer.total_steps`` steps; returns a summary (rank 0)."""
        cfg = self.cfg
        began = time.perf_counter()
        resumed = self.maybe_resume()
        if self.main and not resumed and self.schedule.validates(0) and self.val_rows:
            self.tracker.log(self.pipeline.validate(self.val_rows), step=0)
        if self.main:
            self.socket = LearnerSocket(
                cfg.asynchronous,
                port=self.port,
                max_message_bytes=max_message_bytes(cfg),
                json_limits=self.json_limits,
            )
            published = self.publisher.latest()
            if published is not None and published >= self.version:
                # versions published before a crash (or by an earlier run) are never reused:
                # these weights continue as a new version
                self.version = published + 1
                self.publisher.publish(self.actor.model, self.version)
            self.console.print(
                as_text(
                    f"learner: listening on {self.socket.address}; step {self.step} of "
                    f"{cfg.trainer.total_steps}, weights v{self.version}"
                )
            )
        staleness: list[float] = []
        try:
            while not self._control(self.step >= cfg.trainer.total_steps):
                self.step += 1
                metrics = self.train_step()
                save = self.schedule.saves(self.step)
                if save and self.world > 1:
                    self._check_replicas()
                if not self.main:
                    continue
                if self.val_rows and self.schedule.validates(self.step):
                    metrics.update(self.pipeline.validate(self.val_rows))
                self.tracker.log(metrics, step=self.step)
                staleness.append(metrics["async/staleness/mean"])
                self.console.print(
                    f"learner step {self.step}/{cfg.trainer.total_steps}: "
                    f"score {metrics.get('critic/score/mean', float('nan')):.3f}, "
                    f"staleness {metrics['async/staleness/mean']:.2f}, "
                    f"{metrics['perf/time_per_step']:.1f}s"
                )
                if save:
                    self.save_checkpoint()
        finally:
            if self.main:
                self.publisher.wait()
                self._stop_samplers()
                self.tracker.close()
                if self.pipeline.reward is not None:
                    self.pipeline.reward.close()
        summary = {
            "steps": self.step,
            "version": self.version,
            "seconds": time.perf_counter() - began,
            "mean_staleness": sum(staleness) / len(staleness) if staleness else float("nan"),
            **{k: int(v) for k, v in self.counters.items()},
            **{f"resume_{k}": v for k, v in self.resume_report.items()},
        }
        if self.main:
            self.console.print(as_text(f"learner: done {json.dumps(summary)}"))
        return summary

    def _check_replicas(self) -> None:
        """Every rank must hold rank 0's weights (same summed gradients, same steps): compare
        a float64 checksum of the parameters; RuntimeError on a divergent rank."""
        with torch.no_grad():
            mine = sum(float(p.double().sum()) for p in self.actor.model.parameters())
        data = json.dumps({"checksum": mine}).encode() if self.main else None
        expected = json.loads(broadcast_bytes(data))["checksum"]
        if mine != expected:
            raise RuntimeError(
                f"learner rank {self.rank}: weights diverged from rank 0 at step {self.step} "
                f"(parameter checksum {mine!r} != {expected!r})"
            )

    def _stop_samplers(self) -> None:
        if self.socket is None:
            return
        for sampler_id in sorted(self.samplers):
            self.socket.send(sampler_id, encode("stop", {"reason": "learner finished"}))
        time.sleep(0.2)  # let the io thread flush the stop messages (linger is 0)
        self.socket.close()
        self.socket = None

"""The sampling worker (spec 003): behaviour policy (and optionally the reference), prompts,
``rollout.n`` answers per prompt, scores, log-probs, and whole groups pushed to the learner.

One batch of the loop, top to bottom (``Sampler.run``):

1. handle what the learner sent (acknowledgements drop groups from the outbox, ``rejected``
   ones too, logged and counted: a rejected group is never resent; ``stop`` ends the loop;
   ``disconnected`` ends it with exit code 1; a new learner incarnation means it restarted:
   resend everything unacknowledged);
2. load the newest published weights, if newer (only once the learner has answered this
   sampler: before, the weight folder may still hold what another run left, which the learner
   removes before it answers; nothing is sampled until then; between batches; with
   ``asynchronous.partial_rollout`` also between decode chunks inside one,
   ``creditrl.asynchronous.partial``: unfinished rows continue on the new weights; multi-turn
   episodes: before every engine call, ``EngineTurnGenerator.weights``), through the
   sampler's weight channel (``creditrl.weights.FolderChannel``, which holds the version the
   engine samples with: ``Sampler.version``; ``asynchronous.weight_channel`` picks the folder
   or the wire from the learner's weight port, ``creditrl.asynchronous.weight_server``, said in
   one line once the learner has answered); published weights it cannot read (a folder it
   cannot see, a weight port that does not answer) are said in one line naming the folder or
   port and what is missing, and it exits after ``asynchronous.data_timeout_s`` of that; wait
   while ``max_inflight_groups`` groups are unacknowledged (back-pressure, pinging) or while a
   batch sampled now would be too stale when trained (``max_staleness``: newer weights first);
3. draw the prompts as ``creditrl train`` does (``creditrl.trainers.prompts``);
4. ``produce``: draw prompts, the generation half of the step pipeline (any registered engine,
   or the agent loop over it; the greedy baseline when the estimator requires one; the
   reward manager ``creditrl train`` uses), reference log-probs (``ref_on=sampler``), the
   distillation teacher's (``distill.teacher_on=sampler``: its prompt, then the sampled ids,
   as the learner's stage computes them), split into groups stamped with episode ids and the
   weight version that sampled them (the oldest of their tokens' versions);
5. save each group to the outbox, save the data position, send the groups (a group larger
   than the learner accepts, ``settings.max_message_bytes``, is dropped here, logged and
   counted, instead of being dropped unseen by the learner's socket).

``rollout_log_probs`` (from the engine, exact under the behaviour policy at the sampling
temperature) are the behaviour policy's log-probs the learner's corrections need.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from creditrl.asynchronous.delivery import Outbox
from creditrl.asynchronous.messages import (
    Message,
    MessageError,
    encode,
    episodes_message,
    group_of,
)
from creditrl.asynchronous.partial import PartialRollout, group_versions
from creditrl.asynchronous.settings import (
    check_async_config,
    max_message_bytes,
    needs_reference,
    sampler_id_of,
    state_root,
    teacher_on_sampler,
)
from creditrl.asynchronous.transport import SamplerSocket
from creditrl.asynchronous.weight_server import WeightClient, choose_channel, sampler_channel
from creditrl.batch import Batch
from creditrl.config import Config
from creditrl.data import ResumableSampler
from creditrl.pipeline.step import (
    StepPipeline,
    build_reward_manager,
    build_run_datasets,
    sampled_temperature,
)
from creditrl.plain_text import as_text
from creditrl.rollout import engine_traits
from creditrl.rollout.strategies import strategy_traits
from creditrl.tracking import Timer, Tracker
from creditrl.trainers.prompts import batch_seed, prompt_batch
from creditrl.weights import ChosenLater, WireChannel
from creditrl.workers.hybrid import HybridWorker

__all__ = ["Sampler", "trim_group"]

log = logging.getLogger(__name__)


def trim_group(group: Batch) -> Batch:
    """Drop the prompt columns that are padding in every row and the response columns past the
    group's longest response (``attention_mask`` decides); the rows are otherwise unchanged."""
    t = group["responses"].shape[1]
    attention = group["attention_mask"]
    p = attention.shape[1] - t
    used = attention.bool().any(dim=0)
    first = int(used[:p].long().argmax())
    resp = used[p:].nonzero()
    width = int(resp[-1]) + 1 if len(resp) else 1
    out = Batch(dict(group.tensors.items()), group.non_tensors, group.meta)
    for name, x in group.tensors.items():
        if name in ("input_ids", "attention_mask", "position_ids"):
            out[name] = x[:, first : p + width].clone()
        elif name == "prompts":
            out[name] = x[:, first:].clone()
        elif x.ndim == 2 and x.shape[1] == t:
            out[name] = x[:, :width].clone()
    return out


class Sampler:
    """Sampler number ``index`` of a run described by ``cfg`` (see the module docstring)."""

    def __init__(
        self, cfg: Config, index: int = 0, *, port: int | None = None, console: Any = None
    ) -> None:
        check_async_config(cfg)
        a = cfg.asynchronous
        self.cfg, self.index, self.port = cfg, index, port
        self.sampler_id = sampler_id_of(index)
        self.started = uuid.uuid4().hex[:16]  # this process's id in its hellos (fleet restarts)
        self.console = console or Console(stderr=True, highlight=False, emoji=False)
        threads = a.sampler_threads or cfg.trainer.num_threads
        if threads > 0:
            torch.set_num_threads(threads)
        torch.manual_seed(cfg.trainer.seed + 1 + index)
        self.n = cfg.rollout.n
        self.groups_per_batch = a.sampler_batch_groups or cfg.data.train_batch_size
        self.max_inflight = a.max_inflight_groups or 2 * cfg.data.train_batch_size
        # the behaviour policy: the rollout role of the hybrid worker `creditrl train` uses (any
        # registered engine, the selected rollout strategy over it, the reference when it is here)
        with_ref = needs_reference(cfg) and a.ref_on == "sampler"
        self.with_teacher = teacher_on_sampler(cfg)
        self.worker = HybridWorker(
            cfg, roles=("rollout",), with_ref=with_ref, with_teacher=self.with_teacher
        )
        torch.manual_seed(cfg.trainer.seed + 1 + index)
        self.tokenizer = self.worker.tokenizer
        self.train_data, _ = build_run_datasets(cfg, self.tokenizer)
        self.data = ResumableSampler(
            len(self.train_data), self.groups_per_batch, cfg.data.seed + index, cfg.data.shuffle
        )
        self.reward = build_reward_manager(cfg, self.tokenizer)
        self.pipeline = StepPipeline(cfg, self.worker, self.reward, self.tokenizer)
        self.with_ref = with_ref
        # the published weights: loaded into the policy (then pushed to an engine holding its
        # own copy), or read by an engine that loads published folders itself
        self.weights = sampler_channel(cfg)  # the folder's, or chosen when the learner answers
        self.wire: WeightClient | None = None
        if engine_traits(cfg.rollout.engine).weights_via == "folder":
            self.weights.attach(folder=self._engine_loads)
        else:
            self.weights.attach(self.worker.policy_model, then=self.worker.sync_rollout_weights)
        self.unseen_since: float | None = None  # since when published weights cannot be read
        self.said_unseen = False
        if a.partial_rollout and strategy_traits(cfg).multi_turn:  # between engine calls
            self.worker.rollout.turns.weights = self.weights
        elif a.partial_rollout:  # the worker's rollout: chunks with newer weights between them
            self.worker.rollout = PartialRollout(
                self.worker.engine,
                self.tokenizer,
                max_response_length=cfg.rollout.max_response_length,
                chunk_tokens=a.partial_chunk_tokens,
                weights=self.weights,
            )
        self.outbox = Outbox(state_root(cfg), self.sampler_id)
        if self.outbox.data_state is not None:
            self.data.load_state_dict(self.outbox.data_state)
        self.tracker = Tracker(self.outbox.dir, ["jsonl"], {}, self.sampler_id)
        self.incarnation: str | None = None
        self.learner_version = 0  # the learner's weight version, as last heard
        self.others_queued = 0  # other samplers' groups the learner holds, as last heard
        self.last_heard = time.monotonic()
        self.stopped = False
        self.exit_code = 0
        self.max_message = max_message_bytes(cfg)
        self.rejected = 0  # groups the learner rejected, or too large to send
        self.batches = 0
        self.idle_s = 0.0  # seconds spent waiting for acknowledgements or fresher weights
        self.socket: SamplerSocket | None = None

    # ---- producing groups ----------------------------------------------------------------

    def produce(self) -> tuple[list[Batch], dict[str, float]]:
        """Generate one batch of ``groups_per_batch`` prompts x ``rollout.n`` answers; return
        its groups (stamped with the sequence numbers they will get) and metrics."""
        timing: dict[str, float] = {}
        start = time.perf_counter()
        rows = [self.train_data[i] for i in next(self.data)]
        first = self.outbox.next_seq
        uids = [f"{self.sampler_id}:{first + k}" for k in range(len(rows))]
        seed = batch_seed(self.cfg.trainer.seed, self.index, first)
        prompts = prompt_batch(rows, self.tokenizer.pad_token_id, self.n, uids, seed)
        batch, future = self.pipeline.generation_half(prompts, self.batches, timing, seed=seed)
        metrics = self.pipeline.score(batch, future, timing, "reward")
        if self.with_ref:
            with Timer("ref", timing):
                batch = batch.union(
                    self.worker.compute_ref_log_prob(batch, sampled_temperature(batch, self.cfg))
                )
        if self.with_teacher:
            with Timer("teacher", timing):
                batch, rejected = self.pipeline.teacher_log_probs(batch)
            metrics["distill/rejected_teacher_prompts"] = float(rejected)
        del batch["sample_seed"]  # the learner never samples
        versions = group_versions(batch, self.n, self.version)
        groups = [
            group_of(
                trim_group(batch[k * self.n : (k + 1) * self.n]),
                self.sampler_id,
                first + k,
                versions[k],
            )
            for k in range(len(rows))
        ]
        timing["batch"] = time.perf_counter() - start
        tokens = float(batch["attention_mask"].sum())
        scores = batch["token_level_scores"].sum(-1)
        metrics.update(
            {
                **{f"timing_s/{k}": v for k, v in timing.items()},
                "sampler/weight_version": float(self.version),
                "sampler/weight_switches": float(
                    self.worker.rollout.last_stats.get("switches", 0.0)
                ),
                "sampler/response_tokens": float(batch["response_mask"].sum()),
                "sampler/tokens_per_s": tokens / max(timing["batch"], 1e-9),
                "sampler/score_mean": float(scores.mean()),
            }
        )
        if strategy_traits(self.cfg).multi_turn:
            from creditrl.agents.rollout import agent_metrics

            metrics.update(agent_metrics(batch) if "tool_calls" in batch else {})
        return groups, metrics

    @property
    def model(self) -> torch.nn.Module:
        """The behaviour policy's module (what published weights are loaded into)."""
        return self.worker.policy_model

    @property
    def version(self) -> int:
        """The weight version the engine samples with: the weight channel's."""
        return self.weights.version

    def _engine_loads(self, folder: Path) -> None:
        """The engine reads a published folder, its weights awake (the KV cache stays asleep)."""
        self.worker.engine.wake_up(tags=["weights"])
        self.worker.engine.load_weights_folder(folder)

    # ---- talking to the learner ----------------------------------------------------------

    def _send(self, frames: list[bytes]) -> None:
        while not self.socket.send(frames, timeout_s=self.cfg.asynchronous.ping_s):
            log.warning(
                "%s: learner queue full for %.0fs; still trying",
                self.sampler_id,
                self.cfg.asynchronous.ping_s,
            )
            self._drain(0.0)
            if self.stopped:
                return

    def _hello(self) -> None:
        self._send(
            encode(
                "hello",
                {
                    "sampler_id": self.sampler_id,
                    "started": self.started,
                    "pending": self.outbox.pending(),
                },
            )
        )

    def _send_group(self, seq: int, group: Batch) -> None:
        frames = episodes_message(self.sampler_id, seq, group)
        size = max(len(f) for f in frames)
        if size > self.max_message:
            self.rejected += 1
            log.error(
                "%s: group %d is %d bytes, above the %d the learner accepts; dropped (raise "
                "asynchronous.max_message_mb)", self.sampler_id, seq, size, self.max_message,
            )  # fmt: skip
            self.outbox.ack(seq, "too_large")
            return
        self._send(frames)

    def _resend_pending(self) -> None:
        for seq in self.outbox.pending():
            self._send_group(seq, self.outbox.load(seq))

    def _on_ack(self, entry: dict[str, Any]) -> None:
        seq, status = entry["seq"], entry["status"]
        if status == "rejected":
            self.rejected += 1
            log.warning(
                "%s: the learner rejected group %s (reason %s); dropped from the outbox",
                self.sampler_id, seq, entry.get("reason", "?"),
            )  # fmt: skip
        if seq is not None:
            self.outbox.ack(int(seq), status)

    def _on_message(self, message: Message) -> None:
        self.last_heard = time.monotonic()
        incarnation = message.header.get("incarnation")
        if message.kind == "stop":
            self.stopped = True
            return
        if message.kind == "disconnected":
            self.console.print(
                f"[red]sampler {self.sampler_id}:[/red]",
                as_text(
                    f"the learner disconnected this sampler: "
                    f"{message.header.get('reason', '?')!s:.200}; check that the sampler runs "
                    "the learner's code and config (rejected groups are logged by the learner)"
                ),
            )
            self.stopped = True
            self.exit_code = 1
            return
        version = message.header.get("weight_version")
        if isinstance(version, int) and not isinstance(version, bool):
            self.learner_version = version
        queued = message.header.get("queued")  # decode checked it: an int >= 0
        if isinstance(queued, int) and not isinstance(queued, bool):
            self.others_queued = queued
        next_seq = message.header.get("next_seq")  # decode checked it: an int >= 0
        if message.kind == "welcome" and next_seq is not None and self.outbox.skip_to(next_seq):
            log.warning(
                "%s: the learner holds groups of %s up to seq %d that this outbox never held "
                "(another process's); numbering new groups from %d",
                self.sampler_id, self.sampler_id, next_seq - 1, next_seq,
            )  # fmt: skip
        if incarnation is not None and incarnation != self.incarnation:
            restarted = self.incarnation is not None
            self.incarnation = incarnation
            if restarted:
                log.warning(
                    "%s: the learner restarted; resending unacknowledged groups", self.sampler_id
                )
                self._resend_pending()
        if message.kind == "ack":
            for entry in message.header["acks"]:
                self._on_ack(entry)

    def _drain(self, timeout_s: float) -> bool:
        """Handle every message that arrives within ``timeout_s``; True if any did."""
        got = False
        while True:
            try:
                message = self.socket.recv(timeout_s if not got else 0.0)
            except MessageError as e:
                log.warning("%s: bad message from the learner skipped: %s", self.sampler_id, e)
                continue
            if message is None:
                return got
            got = True
            self._on_message(message)

    def _fresh_enough(self) -> bool:
        """A batch sampled now can be trained: the learner's version as last heard, plus one
        step per ``data.train_batch_size`` groups ahead of it, exceeds the version held by at
        most ``asynchronous.max_staleness``. Otherwise the learner would drop it as stale, so
        the sampler waits for newer weights instead (at ``max_staleness=0`` it samples each
        batch with the weights of the step that trains on it, as ``creditrl train`` does).

        The learner trains in arrival order, so ahead of the batch are this sampler's
        unacknowledged groups (u) and the other samplers' groups: those the learner last said
        it holds (``queued``), or, while it has not received them yet (it reads messages only
        between steps), as many as this sampler has in flight for each of the other
        ``num_samplers - 1`` samplers: max(u + queued, u * num_samplers)."""
        own = len(self.outbox.pending())
        waiting = max(own + self.others_queued, own * self.cfg.asynchronous.num_samplers)
        ahead = waiting // self.cfg.data.train_batch_size
        staleness = max(self.learner_version, self.version) + ahead - self.version
        return staleness <= self.cfg.asynchronous.max_staleness

    def _refresh(self) -> bool:
        """Load newer published weights. When the learner has published a version newer than
        the one held and none can be read here, say so once, after ``ping_s`` (the folder and
        what is missing), and after ``data_timeout_s`` of it stop with exit code 1 (False)."""
        a = self.cfg.asynchronous
        ahead = self.learner_version >= a.publish_every and self.learner_version > self.version
        problem = self.weights.unreadable() if ahead else None
        if problem is not None and self.wire is not None:  # the weight port may answer now
            self.weights.refresh()
            problem = self.weights.unreadable()
        if problem is None:
            self.unseen_since = None
            self.weights.refresh()
            return True
        now = time.monotonic()
        self.unseen_since = self.unseen_since or now
        waited = now - self.unseen_since
        if waited > a.data_timeout_s:
            self.console.print(
                f"[red]sampler {self.sampler_id}:[/red]",
                as_text(
                    f"the learner's weights v{self.learner_version} still cannot be read after "
                    f"{waited:.0f}s: {problem}; exiting (asynchronous.weight_dir must name the "
                    "learner's folder as this machine sees it, or asynchronous.weight_channel="
                    "wire fetch them from its weight port; asynchronous.data_timeout_s)"
                ),
            )
            self.exit_code = 1
            return False
        if waited >= min(a.ping_s, a.data_timeout_s) and not self.said_unseen:
            self.said_unseen = True
            self.console.print(
                f"[yellow]sampler {self.sampler_id}:[/yellow]",
                as_text(
                    f"the learner published weights v{self.learner_version}, but they cannot be "
                    f"read here: {problem}; holding v{self.version} meanwhile, exiting if "
                    f"this lasts {a.data_timeout_s:.0f}s (asynchronous.weight_dir, "
                    "asynchronous.data_timeout_s)"
                ),
            )
        return True

    def step(self) -> None:
        """Produce one batch of groups, journal them, and send them."""
        if self.unseen_since is None:  # else ``_refresh`` found the weights unreadable
            self.weights.refresh()
        groups, metrics = self.produce()
        for group in groups:
            seq = self.outbox.put(group)
            if group["episode_id"][0] != f"{self.sampler_id}:{seq}:0":
                raise RuntimeError(f"group numbered {group['episode_id'][0]} saved as seq {seq}")
        self.outbox.save_state(self.data.state_dict())
        for group in groups:
            self._send_group(int(group["episode_id"][0].split(":")[1]), group)
        self.batches += 1
        metrics["sampler/inflight_groups"] = float(len(self.outbox.pending()))
        metrics["sampler/rejected_groups"] = float(self.rejected)
        metrics["sampler/idle_s"] = self.idle_s
        metrics.update(self._wire_metrics())
        self.tracker.log(metrics, step=self.batches)

    def run(self, max_batches: int | None = None) -> int:
        """Sample until the learner says stop (or ``max_batches``); returns the exit code."""
        a = self.cfg.asynchronous
        self.socket = SamplerSocket(a, self.sampler_id, port=self.port)
        self.console.print(
            as_text(
                f"sampler {self.sampler_id}: -> {self.socket.address}, weights v{self.version}, "
                f"{len(self.outbox.pending())} unacknowledged group(s) to resend"
            )
        )
        try:
            self._hello()
            self._resend_pending()
            last_ping = time.monotonic()
            while not self.stopped and (max_batches is None or self.batches < max_batches):
                self._drain(0.0)
                if self.stopped:
                    break
                answered = self.incarnation is not None  # the folder is this run's from now
                if answered and self.wire is None and isinstance(self.weights, ChosenLater):
                    self._choose_weights()
                if answered and not self._refresh():
                    break
                busy = len(self.outbox.pending()) >= self.max_inflight
                if not answered or busy or not self._fresh_enough():
                    silent = time.monotonic() - self.last_heard
                    if silent > a.data_timeout_s:
                        self.console.print(
                            f"[red]sampler {self.sampler_id}:[/red]",
                            as_text(
                                f"no word from the learner at {self.socket.address} for "
                                f"{silent:.0f}s with {len(self.outbox.pending())} group(s) "
                                "unacknowledged; exiting (they stay in the outbox; "
                                "asynchronous.data_timeout_s)"
                            ),
                        )
                        return 1
                    # an answer or an ack, or new weights
                    wait = min(a.ping_s, 1.0) if busy or not answered else 0.05
                    started = time.monotonic()
                    heard = self._drain(wait)
                    self.idle_s += time.monotonic() - started
                    if not heard and time.monotonic() - last_ping > a.ping_s:
                        self._hello()
                        last_ping = time.monotonic()
                    continue
                self.step()
        finally:
            self.close()
        self.console.print(f"sampler {self.sampler_id}: stopped after {self.batches} batch(es)")
        return self.exit_code

    def _choose_weights(self) -> None:
        """Once the learner has answered: the folder or the wire (said in one line)."""
        if self.weights.chosen is None:
            port = self.cfg.asynchronous.port if self.port is None else self.port
            self.wire = choose_channel(self.cfg, self.weights, self.sampler_id, port, self._say)

    def _say(self, line: str) -> None:
        self.console.print(as_text(line))

    def _wire_metrics(self) -> dict[str, float]:
        """``sampler/weights_*``: chunks fetched over the wire and answers refused."""
        channel = self.weights.chosen if isinstance(self.weights, ChosenLater) else None
        if self.wire is None or not isinstance(channel, WireChannel):
            return {}
        refused = sum(channel.rejected.values()) + sum(self.wire.rejected.values())
        return {"sampler/weights_chunks_fetched": float(channel.fetched),
                "sampler/weights_refused": float(refused)}  # fmt: skip

    def close(self) -> None:
        """Close the sockets, the reward workers and the metrics file."""
        if self.socket is not None:
            self.socket.close()
            self.socket = None
        if self.wire is not None:
            self.wire.close()
            self.wire = None
        self.reward.close()
        self.tracker.close()

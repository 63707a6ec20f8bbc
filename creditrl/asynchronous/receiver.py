"""Receiving, checking and acknowledging the samplers' groups: the learner's side of spec 003's
delivery, mixed into ``creditrl.asynchronous.learner.Learner`` (rank 0).

Every message is checked first (``validation``): one that fails (or that the learner fails on
before it joins a batch) is acknowledged ``rejected``, counted (``async/rejected``,
``async/rejected/<reason>``) and logged with its sender and seq, and a sender rejected
``asynchronous.max_rejects`` times is disconnected (every later message of it is answered
``disconnected`` and otherwise ignored); groups whose staleness (learner version - sampling
version) exceeds ``max_staleness`` are dropped, counted and acknowledged ``stale`` (with
``asynchronous.staleness_policy=drop``; ``keep`` trains them); a group
seen before is acknowledged ``duplicate``; a group that would take the buffered bytes past
``buffer_bound`` (``settings.max_buffered_bytes``, grown for samplers that joined past
``num_samplers``) is rejected ``buffer_full`` (counted like any rejection, but not toward
``max_rejects``: a flood from one peer never disconnects the others). Trained
groups are acknowledged ``trained`` after the update, journaled first. When no group passes
within ``asynchronous.data_timeout_s``, ``NoEpisodesError`` says in one line how many were
rejected meanwhile and why (or that none arrived).

The fleet (``creditrl.asynchronous.fleet``): every message marks its sampler heard, a new group
counts as delivered; a sampler that joins, restarts (a hello with a new ``started`` id) or
comes back is said in one line. A sampler is marked gone (one line) when an acknowledgement
finds it no longer connected: after each step every sampler heard from gets one, and when the
socket has reported a dropped connection (closed, or silent past the heartbeat timeout:
``transport``) and a step waits for groups, every sampler alive gets an empty one; the socket's
routing table tells exactly which are gone (``ROUTER_MANDATORY``). While no sampler is
connected and a step waits, the learner says so in one line; it stops after
``asynchronous.data_timeout_s`` as above.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from creditrl.asynchronous.delivery import AckJournal, DeliveryLedger
from creditrl.asynchronous.fleet import Fleet
from creditrl.asynchronous.messages import (
    Message,
    MessageError,
    ack_message,
    check_sampler_id,
    encode,
    reject_message,
)
from creditrl.asynchronous.settings import (
    inflight_groups,
    json_limits,
    max_buffered_bytes,
    max_message_bytes,
    needs_reference,
    teacher_on_sampler,
)
from creditrl.asynchronous.staleness import BufferedGroup, GroupBuffer, GroupStats
from creditrl.asynchronous.transport import HEARTBEAT_MISSES, LearnerSocket
from creditrl.asynchronous.validation import (
    AGENT_FIELDS,
    STRUCTURED_FIELDS,
    GroupLimits,
    max_group_bytes,
)
from creditrl.batch import Batch
from creditrl.config import Config
from creditrl.errors import DataError, UserError
from creditrl.plain_text import as_text
from creditrl.rollout import kept_sets_recorded
from creditrl.rollout.strategies import strategy_traits
from creditrl.tracking import RolloutDumper
from creditrl.weights import WeightChannel
from creditrl.workers.plan import structured_reward

__all__ = ["BUFFER_GROWTH", "AsyncRolloutDumper", "GroupReceiver", "NoEpisodesError"]

log = logging.getLogger(__name__)
_DRAIN = 256  # messages handled per receive call, so a flood never starves the step loop
BUFFER_GROWTH = 4  # the buffer's bound follows the samplers up to this x num_samplers of them


class NoEpisodesError(UserError):
    """No group passed the checks within ``asynchronous.data_timeout_s``: one line saying how
    many were rejected meanwhile, for which reasons, and the last one (or that none came)."""


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


class GroupReceiver:
    """The receiving side of the learner; it reads the learner's ``cfg``, ``step`` (the step
    acknowledgements are journaled under) and ``version`` (the weights it trains: those its
    weight channel ``weights`` holds, the one place the version lives)."""

    cfg: Config
    step: int
    weights: WeightChannel
    console: Any

    @property
    def version(self) -> int:
        return self.weights.version

    @version.setter
    def version(self, value: int) -> None:
        self.weights.version = int(value)

    def init_receiving(
        self, cfg: Config, vocab_size: int, out: Any, tokenizer: Any | None = None
    ) -> None:
        """The checks groups must pass, the buffer, the ledger, the journal and the counters;
        with ``tokenizer``, in a run whose step renders messages for its drift check, the
        check that the chat template renders each row's messages (``_check_rendering``)."""
        a = cfg.asynchronous
        self.chat = None
        if tokenizer is not None and strategy_traits(cfg).multi_turn and cfg.agent.drift_check_rows:
            from creditrl.agents.hooks import chat_format

            self.chat = chat_format(tokenizer, cfg.agent.tool_role)
        optional = {"ref_log_prob": needs_reference(cfg) and a.ref_on == "sampler",
                    "teacher_log_prob": teacher_on_sampler(cfg),
                    "rm_scores": cfg.reward.reward_model.enable,
                    "rollout_kept_counts": kept_sets_recorded(cfg),
                    "token_weight_version": a.partial_rollout,
                    **dict.fromkeys(AGENT_FIELDS, strategy_traits(cfg).multi_turn),
                    **dict.fromkeys(STRUCTURED_FIELDS, structured_reward(cfg))}  # fmt: skip
        self.limits = GroupLimits(
            n=cfg.rollout.n,
            vocab_size=vocab_size,
            max_prompt=cfg.data.max_prompt_length,
            max_response=cfg.rollout.max_response_length,
            optional=frozenset(name for name, sent in optional.items() if sent),
            temperature=cfg.rollout.temperature,
            kept_per_token=kept_sets_recorded(cfg) and not strategy_traits(cfg).multi_turn,
        )
        self.groups_per_step = cfg.data.train_batch_size
        self.ledger = DeliveryLedger()
        self.journal = AckJournal(out / "async" / "acks.jsonl")
        self.buffer = GroupBuffer(a.max_staleness, drop=a.staleness_policy == "drop")
        self.group_stats = GroupStats()
        self.json_limits = json_limits(cfg)
        self.buffer_limit = max_buffered_bytes(cfg)  # room for num_samplers samplers
        largest = max_group_bytes(cfg.rollout.n, cfg.data.max_prompt_length,
                                  cfg.rollout.max_response_length, self.json_limits)  # fmt: skip
        self.sampler_room = inflight_groups(cfg) * largest  # one sampler's unacknowledged groups
        self.counters: dict[str, int] = defaultdict(int)
        self.counters["rejected"] = 0
        self.last_rejection = ""  # "<sender>[:<seq>] (<reason>): <why>", for NoEpisodesError
        self.rejects: dict[str, int] = defaultdict(int)  # rejected messages per sender
        self.blocked: set[str] = set()  # senders disconnected after max_rejects rejections
        self.samplers: set[str] = set()
        self.fleet = Fleet()
        self.said_none_alive = False  # the line saying no sampler is connected, this wait
        self.probe_due = False  # a connection dropped since the samplers were last probed
        self.incarnation = uuid.uuid4().hex
        self.socket: LearnerSocket | None = None

    def restore_fleet(self, path: Path, state: dict[str, Any]) -> None:
        """The fleet saved in checkpoint ``path``'s ``state`` (``Fleet.load_state_dict``); none
        in a checkpoint written before fleets were saved (the counts start over); one that is
        not a fleet's state is a one-line DataError naming the checkpoint."""
        if "fleet" not in state:
            return
        try:
            self.fleet.load_state_dict(state["fleet"])
        except ValueError as e:
            raise DataError(f"checkpoint {path}: state.json's fleet: {e}") from None

    def open_socket(self, port: int | None) -> None:
        """Bind the learner's socket (``asynchronous.host`` and ``port``)."""
        self.socket = LearnerSocket(
            self.cfg.asynchronous,
            port=port,
            max_message_bytes=max_message_bytes(self.cfg),
            json_limits=self.json_limits,
        )

    def _ack(self, sampler_id: str, acks: list[tuple[int, str, int]], journal: bool = True) -> bool:
        """Journal (durably), mark consumed, then tell the sampler (with the learner's version
        and queue); False when it could not be reached."""
        if journal:
            self.journal.record(self.step, sampler_id, acks)
            for seq, _, _ in acks:
                self.ledger.add(sampler_id, seq)
        pairs = [(seq, status) for seq, status, _ in acks]
        queued = self.buffer.held_for_others(sampler_id)
        sent = self.socket.send(
            sampler_id, ack_message(self.incarnation, self.version, pairs, queued)
        )
        if not sent and self.socket.unreachable and self.fleet.mark_gone(sampler_id):
            self._say(f"sampler {sampler_id} disconnected; {self._alive_words()}")
        return sent

    def _say(self, line: str) -> None:
        self.console.print(as_text(f"learner: {line}"), soft_wrap=True)

    def _alive_words(self) -> str:
        """``2 sampler(s) connected (s0, s1)`` (the first 8 ids named)."""
        alive = self.fleet.alive()
        named = ", ".join(alive[:8]) + (", ..." if len(alive) > 8 else "")
        return f"{len(alive)} sampler(s) connected" + (f" ({named})" if alive else "")

    def _heard(self, sender: str, started: str | None = None) -> None:
        """Mark ``sender`` heard in the fleet; say a sampler that joined, restarted or came
        back in one line."""
        change = self.fleet.heard(sender, started)
        if change == "restarted":
            restarts = self.fleet.members[sender].restarts
            self._say(f"sampler {sender} restarted (restart {restarts} seen); "
                      f"{self._alive_words()}")  # fmt: skip
        elif change:
            self._say(f"sampler {sender} {'joined' if change == 'joined' else 'is back'}; "
                      f"{self._alive_words()}")  # fmt: skip
        if change:
            self.said_none_alive = False

    def _waiting(self, timeout: float) -> None:
        """A second without a group: after a dropped connection, an empty acknowledgement to
        every sampler alive (``_ack`` marks gone those no longer connected); then, when no
        sampler is connected, say so once for this wait."""
        if self.probe_due:
            self.probe_due = False
            for sampler_id in self.fleet.alive():
                if not self._ack(sampler_id, [], journal=False):
                    self.samplers.discard(sampler_id)
        if self.fleet.members and not self.fleet.alive() and not self.said_none_alive:
            self.said_none_alive = True
            self._say(
                f"no sampler connected ({self.fleet.describe_none_alive()}); waiting for one on "
                f"{self.socket.address} with {len(self.buffer)} of {self.groups_per_step} groups "
                f"buffered, for at most {timeout:.0f}s without a group "
                "(asynchronous.data_timeout_s)"
            )

    def _handle(self, sender: str, message: Message) -> int:
        """Act on one message that decoded; returns 1 for a group that passed every check."""
        if sender in self.blocked:
            self._refuse(sender)
            return 0
        self._heard(sender, message.header.get("started") if message.kind == "hello" else None)
        if message.kind == "hello":
            self.samplers.add(sender)
            header = {"incarnation": self.incarnation, "weight_version": self.version,
                      "queued": self.buffer.held_for_others(sender),
                      "next_seq": max(self.ledger.next_seq(sender),
                                      self.fleet.members[sender].next_seq)}  # fmt: skip
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
            self._check_rendering(batch, f"group {sender}:{seq}")
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
        if self.buffer.drop and self.buffer.is_stale(group, self.version):
            self.counters["received_groups"] += 1
            self.fleet.delivered(sender, seq)
            self._drop_stale([group])
            return 1
        needed = self.buffer.nbytes + group.nbytes
        if needed > self.buffer_limit and needed > (bound := self.buffer_bound(sender)):
            err = MessageError(
                f"group {sender}:{seq} of {group.nbytes} bytes would take the buffered groups "
                f"({self.buffer.nbytes} bytes) past {bound}",
                "buffer_full",
                seq,
            )
            self._reject(sender, err, strike=False)
            return 0
        self.counters["received_groups"] += 1
        self.fleet.delivered(sender, seq)
        self.buffer.add(group)
        return 1

    def buffer_bound(self, sender: str) -> int:
        """The most bytes the buffer holds with a group of ``sender``: ``buffer_limit`` (room
        for ``num_samplers`` samplers' unacknowledged groups at the largest size a group passes
        with), plus ``sampler_room`` (one sampler's) for each sampler past ``num_samplers``
        whose groups it holds, the sender included, counting at most ``BUFFER_GROWTH`` x
        ``num_samplers`` samplers: never more than ``BUFFER_GROWTH`` x ``buffer_limit``."""
        base = self.cfg.asynchronous.num_samplers
        holders = len(self.buffer.senders() | {sender})
        extra = min(holders, BUFFER_GROWTH * base) - base
        return self.buffer_limit + max(extra, 0) * self.sampler_room

    def _check_rendering(self, batch: Batch, where: str) -> None:
        """MessageError (non_tensor) when the chat template refuses a row's messages (a
        template's ``raise_exception``, e.g. on roles that do not alternate): the step's drift
        check renders them (``creditrl.agents.drift``), and would end the run there. Their
        shape is checked before (``validation``); this renders the text only."""
        if self.chat is None or "messages" not in batch:
            return
        for i, messages in enumerate(batch["messages"]):
            try:
                self.chat.render(messages, add_generation_prompt=False)
            except Exception as e:  # whatever the template raises: the row is refused
                raise MessageError(
                    f"{where}: messages[{i}]: the chat template refuses them: "
                    f"{type(e).__name__}: {e!s:.120}",
                    "non_tensor",
                ) from None

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
        why = " ".join(str(err).split())[:200]
        where = sender[:64] if err.seq is None else f"{sender[:64]}:{err.seq}"
        self.last_rejection = f"{where} ({err.reason}): {why}"
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
        if valid_sender:
            self._heard(sender)
        if seq is not None and valid_sender and not self.ledger.consumed(sender, seq):
            self.journal.record(self.step, sender, [(seq, "rejected", 0)])
            self.ledger.add(sender, seq)
        self.socket.send(sender, reject_message(self.incarnation, self.version, seq, err.reason))
        limit = self.cfg.asynchronous.max_rejects
        if strike and limit and self.rejects[sender] >= limit:
            self.blocked.add(sender)
            self.samplers.discard(sender)
            self.fleet.mark_gone(sender)
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
            self.group_stats.add("dropped", g.batch)
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
                "learner: %d sampler connection(s) closed (a sampler exiting, one silent for "
                "%d heartbeats: asynchronous.heartbeat_s, or one sending a frame over %d bytes: "
                "asynchronous.max_message_mb)",
                dropped, HEARTBEAT_MISSES, max_message_bytes(self.cfg),
            )  # fmt: skip
            self.probe_due = True
        return groups

    def collect(self) -> list[BufferedGroup]:
        """Block until ``data.train_batch_size`` fresh-enough groups are buffered; take them."""
        last_arrival = time.monotonic()
        rejected_then = self._rejected_by_reason()
        timeout = self.cfg.asynchronous.data_timeout_s
        while True:
            self._drop_stale(self.buffer.drop_stale(self.version))
            if len(self.buffer) >= self.groups_per_step:
                return self.buffer.take(self.groups_per_step)
            if self._receive(1.0):
                last_arrival = time.monotonic()
                rejected_then = self._rejected_by_reason()
            elif time.monotonic() - last_arrival > timeout:
                raise NoEpisodesError(self._no_episodes(timeout, rejected_then))
            else:
                self._waiting(timeout)

    def _rejected_by_reason(self) -> dict[str, int]:
        return {k[9:]: v for k, v in self.counters.items() if k.startswith("rejected/")}

    def _no_episodes(self, timeout: float, rejected_then: dict[str, int]) -> str:
        """The line of a learner that no group reached within ``timeout`` seconds: how many
        were rejected in that time, by reason, and the last one; or that none came."""
        waited = (f"learner: no usable group for {timeout:.0f}s on {self.socket.address} "
                  f"({len(self.buffer)} of {self.groups_per_step} groups buffered)")  # fmt: skip
        counts = {reason: count - rejected_then.get(reason, 0)
                  for reason, count in self._rejected_by_reason().items()}  # fmt: skip
        counts = {reason: count for reason, count in counts.items() if count > 0}
        if not counts and self.fleet.members and not self.fleet.alive():
            return (f"{waited}; no sampler connected ({self.fleet.describe_none_alive()}); "
                    "start one with `creditrl sampler` (asynchronous.data_timeout_s)")  # fmt: skip
        if not counts:
            return f"{waited}; are the samplers running? (asynchronous.data_timeout_s)"
        reasons = ", ".join(f"{reason} {count}" for reason, count in
                            sorted(counts.items(), key=lambda rc: (-rc[1], rc[0])))  # fmt: skip
        return (
            f"{waited}: {sum(counts.values())} rejected in that time ({reasons}), the last "
            f"{self.last_rejection}; check that the samplers run the learner's code and config "
            "(each rejection is logged; asynchronous.data_timeout_s)"
        )

    def acknowledge_trained(self, groups: list[BufferedGroup]) -> None:
        """Journal and acknowledge ``groups`` as ``trained``, per sampler; every other sampler
        heard from gets an empty acknowledgement: the learner's version and queue."""
        by_sampler: dict[str, list[tuple[int, str, int]]] = defaultdict(list)
        for g in groups:
            by_sampler[g.sampler_id].append((g.seq, "trained", len(g.batch)))
        for sampler_id, acks in by_sampler.items():
            self._ack(sampler_id, acks)
        self.counters["trained_groups"] += len(groups)
        for sampler_id in sorted(self.samplers - set(by_sampler)):
            if not self._ack(sampler_id, [], journal=False):
                self.samplers.discard(sampler_id)  # gone: heard of again at its next hello

    def receiving_metrics(self) -> dict[str, float]:
        """``async/<counter>`` for every counter, the learner's version, what it buffers, the
        samplers it acknowledges, and the fleet's ``fleet/*``."""
        metrics = {f"async/{k}": float(v) for k, v in self.counters.items()}
        metrics.update({"async/weight_version": float(self.version),
                        "async/buffered_groups": float(len(self.buffer)),
                        "async/buffered_bytes": float(self.buffer.nbytes),
                        "async/samplers": float(len(self.samplers))})  # fmt: skip
        metrics.update(self.fleet.metrics())
        return metrics

    def stop_samplers(self) -> None:
        """Tell every sampler heard from to stop, then close the socket."""
        if self.socket is None:
            return
        for sampler_id in sorted(self.samplers):
            self.socket.send(sampler_id, encode("stop", {"reason": "learner finished"}))
        time.sleep(0.2)  # let the io thread flush the stop messages (linger is 0)
        self.socket.close()
        self.socket = None

"""The learner's view of its samplers (``fleet/*`` metrics): who is connected, who came back,
when each was last heard and how many groups each delivered.

A sampler joins the fleet with its first message. Its ``hello`` carries ``started``, an id its
process draws once when it starts (``Sampler.started``): a ``hello`` with another ``started``
than the one last heard from that sampler id is a restart (of the process, under any launcher,
or by hand). A sampler is *alive* from any message until a send to it finds its connection
gone (``mark_gone``: the learner's socket answers that it routes to no such peer: it closed,
or left ``asynchronous.heartbeat_s``'s heartbeats unanswered, ``transport``); a sampler that
is busy sampling and silent stays alive, its silence shows in ``last_heard_s``.

Counts are since the run started: a learner saves them with its checkpoints (``state_dict``,
the ``MAX_SAVED`` samplers heard most recently) and a resumed one continues them, every sampler
known and none alive until it is heard again (a ``hello`` with another ``started`` than the one
saved is a restart). The clock is ``time.monotonic`` unless given; a resumed sampler's silence
continues from the one saved (the learner's downtime not counted).

The launchers' side (``SamplerRestarts``): ``creditrl async`` restarts a sampler that dies (a
process killed by a signal other than SIGINT/SIGTERM, a Ray actor lost), each at most
``asynchronous.max_sampler_restarts`` times, said in one line each time; one that dies once
more is left out while another sampler runs, and ends the run when it was the last.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from creditrl.asynchronous.messages import MessageError, check_sampler_id

__all__ = ["MAX_SAVED", "PER_SAMPLER_METRICS", "Fleet", "Member", "SamplerRestarts"]

PER_SAMPLER_METRICS = 64  # samplers (by id, sorted) whose own fleet/<id>/* metrics are logged
MAX_SAVED = 1 << 16  # samplers a checkpoint holds (those heard most recently)
_MAX_COUNT = 2**53  # a saved count or seq: JSON's exact integers
_MAX_SILENT_S = 1e9  # a saved silence, seconds
_SAVED_KEYS = frozenset({"id", "started", "restarts", "groups", "next_seq", "silent_s"})


@dataclass
class Member:
    """One sampler id as the learner knows it."""

    sampler_id: str
    last_heard: float
    started: str | None = None  # the ``started`` id of its process, as last heard
    alive: bool = True
    restarts: int = 0  # hellos with a new ``started`` id after the first one
    groups: int = 0  # groups delivered: new groups that passed every check
    next_seq: int = 0  # one past the highest seq of the groups delivered


class Fleet:
    """Every sampler heard from (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.members: dict[str, Member] = {}

    def heard(self, sampler_id: str, started: str | None = None) -> str:
        """A message from ``sampler_id`` (a ``hello`` gives its ``started`` id): it is alive
        and heard now. Returns what changed: ``"joined"`` (first message), ``"restarted"`` (a
        new ``started`` id), ``"back"`` (alive again, same process) or ``""``."""
        now = self.clock()
        member = self.members.get(sampler_id)
        if member is None:
            self.members[sampler_id] = Member(sampler_id, now, started)
            return "joined"
        change = "" if member.alive else "back"
        if started is not None and member.started is not None and started != member.started:
            member.restarts += 1
            change = "restarted"
        if started is not None:
            member.started = started
        member.alive, member.last_heard = True, now
        return change

    def delivered(self, sampler_id: str, seq: int = 0) -> None:
        """New group ``seq`` of ``sampler_id`` passed every check."""
        self.heard(sampler_id)
        member = self.members[sampler_id]
        member.groups += 1
        member.next_seq = max(member.next_seq, int(seq) + 1)

    def mark_gone(self, sampler_id: str) -> bool:
        """A send found ``sampler_id``'s connection gone; True if it was alive until now."""
        member = self.members.get(sampler_id)
        if member is None or not member.alive:
            return False
        member.alive = False
        return True

    def alive(self) -> list[str]:
        """The ids of the samplers alive, sorted."""
        return sorted(s for s, m in self.members.items() if m.alive)

    def silent_s(self, sampler_id: str) -> float:
        """Seconds since ``sampler_id`` was last heard."""
        return max(self.clock() - self.members[sampler_id].last_heard, 0.0)

    def last_heard_s(self) -> float:
        """The longest silence among the samplers alive (among all of them when none is; 0.0
        before any was heard)."""
        ids = self.alive() or list(self.members)
        return max((self.silent_s(s) for s in ids), default=0.0)

    def describe_none_alive(self) -> str:
        """``s0 last heard 12s ago, s1 ...`` (the five heard most recently) for a line saying
        that no sampler is connected."""
        recent = sorted(self.members, key=lambda s: -self.members[s].last_heard)[:5]
        more = len(self.members) - len(recent)
        words = ", ".join(f"{s} last heard {self.silent_s(s):.0f}s ago" for s in recent)
        return words + (f" and {more} more" if more > 0 else "")

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe ``{"members": [{"id", "started", "restarts", "groups", "next_seq",
        "silent_s"}, ...]}``: the ``MAX_SAVED`` samplers heard most recently."""
        recent = sorted(self.members.values(), key=lambda m: -m.last_heard)[:MAX_SAVED]
        return {"members": [{"id": m.sampler_id, "started": m.started, "restarts": m.restarts,
                             "groups": m.groups, "next_seq": m.next_seq,
                             "silent_s": self.silent_s(m.sampler_id)}
                            for m in sorted(recent, key=lambda m: m.sampler_id)]}  # fmt: skip

    def load_state_dict(self, state: Any) -> None:
        """Restore ``state_dict``'s samplers, none alive; ValueError (one line) for a state
        that is not one: a member's fields, types, ranges, or more than ``MAX_SAVED``."""
        members = state.get("members") if isinstance(state, dict) else None
        if not isinstance(members, list) or len(members) > MAX_SAVED:
            raise ValueError(f"'members' must be a list of at most {MAX_SAVED} samplers")
        now, restored = self.clock(), {}
        for i, saved in enumerate(members):
            if not isinstance(saved, dict) or saved.keys() != _SAVED_KEYS:
                raise ValueError(f"members[{i}] must hold exactly {sorted(_SAVED_KEYS)}")
            sampler_id, started = saved["id"], saved["started"]
            for key in ("id", "started") if started is not None else ("id",):
                try:
                    check_sampler_id(saved[key])
                except MessageError:
                    raise ValueError(
                        f"members[{i}].{key} must be 1-64 characters of [A-Za-z0-9_.-]"
                    ) from None
            if sampler_id in restored:
                raise ValueError(f"members[{i}]: sampler {sampler_id} appears twice")
            for key in ("restarts", "groups", "next_seq"):
                value = saved[key]
                if type(value) is not int or not 0 <= value <= _MAX_COUNT:
                    raise ValueError(f"members[{i}].{key} must be an int in [0, 2**53]")
            silent = saved["silent_s"]
            if type(silent) not in (int, float) or not 0 <= silent <= _MAX_SILENT_S:
                raise ValueError(f"members[{i}].silent_s must be a number in [0, 1e9]")
            restored[sampler_id] = Member(
                sampler_id, now - silent, started, alive=False, restarts=saved["restarts"],
                groups=saved["groups"], next_seq=saved["next_seq"],
            )  # fmt: skip
        self.members = restored

    def metrics(self) -> dict[str, float]:
        """``fleet/alive``, ``fleet/known`` (every sampler id heard from), ``fleet/restarts``,
        ``fleet/last_heard_s`` (``last_heard_s``), ``fleet/groups_delivered``; and per sampler
        (the first ``PER_SAMPLER_METRICS`` ids, sorted) ``fleet/<id>/alive``,
        ``fleet/<id>/restarts``, ``fleet/<id>/last_heard_s``, ``fleet/<id>/groups_delivered``."""
        members = self.members.values()
        out = {
            "fleet/alive": float(sum(m.alive for m in members)),
            "fleet/known": float(len(self.members)),
            "fleet/restarts": float(sum(m.restarts for m in members)),
            "fleet/last_heard_s": self.last_heard_s(),
            "fleet/groups_delivered": float(sum(m.groups for m in members)),
        }
        for sampler_id in sorted(self.members)[:PER_SAMPLER_METRICS]:
            m = self.members[sampler_id]
            out[f"fleet/{sampler_id}/alive"] = float(m.alive)
            out[f"fleet/{sampler_id}/restarts"] = float(m.restarts)
            out[f"fleet/{sampler_id}/last_heard_s"] = self.silent_s(sampler_id)
            out[f"fleet/{sampler_id}/groups_delivered"] = float(m.groups)
        return out


class SamplerRestarts:
    """A launcher's restarts of its samplers (module docstring): ``limit`` per sampler."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used: dict[int, int] = {}  # sampler index: restarts so far
        self.left_out: set[int] = set()  # died with no restart left, while others ran

    def decide(self, index: int, name: str, what: str, others: int) -> tuple[str, str]:
        """For sampler ``index`` (``name``) that ``what`` (``was killed by SIGKILL``, ``died
        (...)``) while ``others`` other samplers run: ``("restart", line)``, ``("leave",
        line)`` or ``("stop", "")`` (the caller reports it and ends the run)."""
        used = self.used.get(index, 0)
        key = "asynchronous.max_sampler_restarts"
        if used < self.limit:
            self.used[index] = used + 1
            return (
                "restart",
                f"async: {name} {what}; restarting it ({used + 1} of {self.limit}, {key})",
            )
        if others > 0:
            self.left_out.add(index)
            return "leave", (
                f"async: {name} {what}; its {self.limit} restart(s) are used ({key}): the run "
                f"goes on with {others} other sampler(s)"
            )
        return "stop", ""

    @property
    def total(self) -> int:
        """Restarts so far, over every sampler."""
        return sum(self.used.values())

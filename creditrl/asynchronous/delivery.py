"""At-most-once training of acknowledged groups, with nothing unacknowledged lost.

Sampler side (``Outbox``): every group is saved under ``<state_dir>/<sampler_id>/outbox/`` before
it is sent and removed only when the learner acknowledges it, so a killed sampler resends, on
restart, exactly what was never acknowledged. ``state.json`` keeps the next sequence number and
the data position; ``acks.jsonl`` logs each acknowledgement received.

Learner side: ``DeliveryLedger`` holds, per sampler, the sequence numbers already consumed
(trained, or dropped as stale/duplicate/rejected); a group arriving again is acknowledged as a
duplicate and never trained twice. The ledger is saved with each checkpoint; ``AckJournal``
appends every acknowledgement (fsync'd) before it is sent, so after a learner crash
``recover`` can rebuild the ledger and count the episodes whose updates were lost with the
steps after the checkpoint (the "in-flight episodes dropped" of the resume report).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from creditrl.batch import Batch

__all__ = ["AckJournal", "DeliveryLedger", "Outbox"]


class DeliveryLedger:
    """Per sampler: every seq < ``below`` is consumed, plus the seqs in ``extra``."""

    def __init__(self) -> None:
        self.below: dict[str, int] = {}
        self.extra: dict[str, set[int]] = {}

    def consumed(self, sampler_id: str, seq: int) -> bool:
        """True if group ``seq`` of ``sampler_id`` was consumed already."""
        return seq < self.below.get(sampler_id, 0) or seq in self.extra.get(sampler_id, ())

    def add(self, sampler_id: str, seq: int) -> None:
        """Mark group ``seq`` consumed (and advance ``below`` over a contiguous run)."""
        extra = self.extra.setdefault(sampler_id, set())
        extra.add(int(seq))
        below = self.below.get(sampler_id, 0)
        while below in extra:
            extra.remove(below)
            below += 1
        self.below[sampler_id] = below

    def next_seq(self, sampler_id: str) -> int:
        """One past the highest seq of ``sampler_id`` consumed (0: none)."""
        extra = self.extra.get(sampler_id, ())
        return max(self.below.get(sampler_id, 0), max(extra, default=-1) + 1)

    def count(self, sampler_id: str) -> int:
        """Number of groups of ``sampler_id`` consumed."""
        return self.below.get(sampler_id, 0) + len(self.extra.get(sampler_id, ()))

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe ``{sampler_id: {"below": int, "extra": [seq, ...]}}``."""
        return {
            s: {"below": self.below.get(s, 0), "extra": sorted(self.extra.get(s, ()))}
            for s in sorted(set(self.below) | set(self.extra))
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of ``state_dict``."""
        self.below = {s: int(v["below"]) for s, v in state.items()}
        self.extra = {s: {int(x) for x in v["extra"]} for s, v in state.items()}


def _append_lines(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))
        f.flush()
        os.fsync(f.fileno())


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a crash: its ack was never sent
    return rows


def _rewrite(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp, path)


class AckJournal:
    """The learner's fsync'd log of acknowledgements since the last checkpoint.

    Lines: ``{"step", "sampler_id", "seq", "status", "episodes"}``; ``step`` is the learner
    step whose update consumed the group (status ``trained``) or during which it was dropped.
    Groups whose updates a crash lost are also appended, for good, to ``dropped.jsonl``.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.dropped_path = self.path.with_name("dropped.jsonl")

    def record(self, step: int, sampler_id: str, acks: list[tuple[int, str, int]]) -> None:
        """Append ``[(seq, status, episodes), ...]`` of ``sampler_id`` durably."""
        rows = [
            {"step": step, "sampler_id": sampler_id, "seq": seq, "status": status, "episodes": n}
            for seq, status, n in acks
        ]
        _append_lines(self.path, rows)

    def checkpointed(self) -> None:
        """The ledger was just saved with a checkpoint: the journal starts over."""
        _rewrite(self.path, [])

    def recover(self, checkpoint_step: int, ledger: DeliveryLedger) -> dict[str, int]:
        """After resuming from ``checkpoint_step``: add every journaled group to ``ledger`` and
        mark the ones trained after the checkpoint ``dropped`` (their updates are lost).
        Returns ``{"groups": g, "episodes": e}`` dropped this way."""
        rows = _read_lines(self.path)
        dropped = {"groups": 0, "episodes": 0}
        lost = []
        for row in rows:
            ledger.add(row["sampler_id"], int(row["seq"]))
            if row["status"] == "trained" and int(row["step"]) > checkpoint_step:
                row["status"] = "dropped"
                dropped["groups"] += 1
                dropped["episodes"] += int(row.get("episodes", 0))
                lost.append({**row, "resumed_from": checkpoint_step})
        if lost:
            _append_lines(self.dropped_path, lost)
        _rewrite(self.path, rows)
        return dropped


class Outbox:
    """One sampler's durable queue of unacknowledged groups, sequence counter and data position."""

    def __init__(self, root: str | Path, sampler_id: str) -> None:
        self.dir = Path(root) / sampler_id
        self.groups = self.dir / "outbox"
        self.groups.mkdir(parents=True, exist_ok=True)
        self.state_path = self.dir / "state.json"
        self.acks_path = self.dir / "acks.jsonl"
        state = json.loads(self.state_path.read_text()) if self.state_path.is_file() else {}
        pending = self.pending()
        self.next_seq = max(int(state.get("next_seq", 0)), pending[-1] + 1 if pending else 0)
        self.data_state: dict[str, Any] | None = state.get("data")
        for stale in self.groups.glob(".*"):  # temp dirs of a save cut short by a kill
            shutil.rmtree(stale, ignore_errors=True)
        if pending:
            self._finish_acks_cut_short(pending)

    def _finish_acks_cut_short(self, pending: list[int]) -> None:
        """Drop the pending groups whose acknowledgement ``acks.jsonl`` already logs (a kill
        between ``ack``'s log line and its rename): the learner consumed them, so resending
        would only earn a second, ``duplicate`` line for the same seq."""
        acked = {row.get("seq") for row in self.acknowledged() if isinstance(row, dict)}
        for seq in pending:
            if seq in acked:
                self._drop(seq)

    def _drop(self, seq: int) -> None:
        """Take group ``seq`` out of ``pending`` by one atomic rename, then delete its files
        (a kill in between leaves a dot-folder, removed at the next opening)."""
        doomed = self.groups / f".acked-{seq:010d}"
        os.replace(self._path(seq), doomed)
        shutil.rmtree(doomed)

    def _path(self, seq: int) -> Path:
        return self.groups / f"{seq:010d}"

    def pending(self) -> list[int]:
        """Sequence numbers saved and not acknowledged, ascending."""
        return sorted(int(p.name) for p in self.groups.iterdir() if p.name.isdigit())

    def put(self, group: Batch) -> int:
        """Save ``group`` under the next sequence number (atomically); returns that number."""
        seq = self.next_seq
        group.save(self._path(seq))
        self.next_seq = seq + 1
        return seq

    def load(self, seq: int) -> Batch:
        """The saved group ``seq``."""
        return Batch.load(self._path(seq))

    def ack(self, seq: int, status: str) -> bool:
        """Drop group ``seq`` (acknowledged with ``status``); False if it was not pending.

        The acknowledgement is logged first, then the group leaves ``pending`` by one atomic
        rename, then its files are deleted: a kill at any point leaves the group either gone or
        whole, pending and logged, and reopening the outbox drops it then (never resent)."""
        path = self._path(seq)
        if not path.exists():
            return False
        _append_lines(self.acks_path, [{"seq": seq, "status": status}])
        self._drop(seq)
        return True

    def skip_to(self, seq: int) -> bool:
        """Number new groups from ``seq`` when that is past ``next_seq`` (the learner consumed
        groups of this sampler id that this outbox never held: another process's, whose outbox
        is gone); saved at once. True if it moved."""
        if seq <= self.next_seq:
            return False
        self.next_seq = int(seq)
        self.save_state(self.data_state)
        return True

    def acknowledged(self) -> list[dict[str, Any]]:
        """Every acknowledgement received so far (``acks.jsonl``)."""
        return _read_lines(self.acks_path)

    def save_state(self, data_state: dict[str, Any] | None) -> None:
        """Persist the sequence counter and the data sampler's position."""
        self.data_state = data_state
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".state.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"next_seq": self.next_seq, "data": data_state}, f)
        os.replace(tmp, self.state_path)

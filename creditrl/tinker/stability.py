"""Sampling-time records for ``stable_reinforce``, and the datums' provenance checked against them.

A sampling request with ``record_stability_info`` keeps, per returned sequence, what the sampler
saw and produced: the request's prompt, the sampled tokens and their log-probs under the
sampling distribution. The SDK names each sequence by the ``sequence_id`` the service gave it
when the request was submitted. As Tinker documents it, a record belongs to the session that
sampled it, can be trained on for one day after sampling, and each training request that uses
it restarts that day (``TTL_S``).

A training datum names those sequences through its provenance (``Datum.with_provenance``): runs
of positions that tile its input tokens and its targets, each a ``prompt`` run (positions
``[offset, offset + length)`` of the named request's prompt) or a ``sampled`` run (of the named
sequence's sampled tokens). ``StabilityRecords.resolve`` checks every run against the records
(the session, the bounds, the very tokens) and returns, per target position, the recorded
sampler log-prob (0 on prompt runs) and whether the target is a sampled token.

Bounded: at most ``max_tokens`` prompt and sampled tokens are held; past it the records used
least recently go first (a datum naming one gets a clear error).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from creditrl.tinker.messages import BadRequest, Datum, SampledSequence, Span

__all__ = ["TTL_S", "SequenceRecord", "StabilityRecords"]

TTL_S = 86_400.0  # a record can be trained on for one day after sampling or its last use


@dataclass
class SequenceRecord:
    """One sampled sequence as recorded: its session, the request's prompt, the sampled tokens
    and their log-probs, and when it was last sampled or trained on."""

    session_id: str
    prompt: np.ndarray  # int64, shared by the request's samples
    tokens: np.ndarray  # int64
    logprobs: np.ndarray  # float32
    used: float

    @property
    def size(self) -> int:
        return len(self.prompt) + len(self.tokens)


class StabilityRecords:
    """The recorded sequences of every session, by ``sequence_id``."""

    def __init__(self, max_tokens: int = 4_000_000, ttl_s: float = TTL_S) -> None:
        self.max_tokens = max_tokens
        self.ttl_s = ttl_s
        self.records: OrderedDict[str, SequenceRecord] = OrderedDict()  # least recently used first
        self.tokens = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.records)

    def add(
        self,
        session_id: str,
        ids: Sequence[str],
        prompt: Sequence[int],
        sequences: Sequence[SampledSequence],
        now: float | None = None,
    ) -> None:
        """Record the ``sequences`` one request sampled from ``prompt``, under ``ids``."""
        now = time.time() if now is None else now
        shared = np.asarray(prompt, dtype=np.int64)
        with self.lock:
            for sequence_id, seq in zip(ids, sequences, strict=True):
                self._drop(sequence_id)
                record = SequenceRecord(
                    session_id,
                    shared,
                    np.asarray(seq.tokens, dtype=np.int64),
                    np.asarray(seq.logprobs, dtype=np.float32),
                    now,
                )
                self.records[sequence_id] = record
                self.tokens += record.size
            while self.tokens > self.max_tokens and self.records:
                self._drop(next(iter(self.records)))

    def drop_session(self, session_id: str) -> None:
        """Forget every record of ``session_id`` (the session finished)."""
        with self.lock:
            for sequence_id in [k for k, r in self.records.items() if r.session_id == session_id]:
                self._drop(sequence_id)

    def _drop(self, sequence_id: str) -> None:
        record = self.records.pop(sequence_id, None)
        if record is not None:
            self.tokens -= record.size

    def _expire(self, now: float) -> None:
        while self.records:
            sequence_id, record = next(iter(self.records.items()))
            if now - record.used <= self.ttl_s:
                return
            self._drop(sequence_id)

    def _record(self, session_id: str, sequence_id: str, where: str) -> SequenceRecord:
        record = self.records.get(sequence_id)
        if record is None or record.session_id != session_id:
            raise BadRequest(
                f"{where} names sequence {sequence_id!r}, which this session has not sampled "
                "with record_stability_info=True (or whose record expired: a day after its "
                "sampling or last training use)"
            )
        return record

    def resolve(
        self, session_id: str, datums: Sequence[Datum], now: float | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per datum: the recorded sampler log-prob of each target (0 on prompt runs) and a
        bool mask of the targets that are sampled tokens. BadRequest for a datum without
        provenance, a run naming a sequence this session did not record, a run past the
        recorded tokens, or a token that is not the recorded one. Every record used restarts
        its day."""
        now = time.time() if now is None else now
        out = []
        with self.lock:
            self._expire(now)
            used: set[str] = set()
            for i, datum in enumerate(datums):
                if datum.input_spans is None or datum.target_spans is None:
                    raise BadRequest(
                        f"datum {i} has no provenance: stable_reinforce needs every datum to "
                        "name the sampled sequences behind its tokens (sample with "
                        "record_stability_info=True, then Datum.with_provenance)"
                    )
                tokens = np.asarray(datum.tokens, dtype=np.int64)
                targets = datum.inputs["target_tokens"].numpy().astype(np.int64)
                self._check(session_id, datum.input_spans, tokens, f"datum {i} model_input", used)
                recorded = np.zeros(len(targets), dtype=np.float32)
                sampled = np.zeros(len(targets), dtype=bool)
                self._check(
                    session_id,
                    datum.target_spans,
                    targets,
                    f"datum {i} loss_fn_inputs",
                    used,
                    recorded,
                    sampled,
                )
                out.append((torch.from_numpy(recorded), torch.from_numpy(sampled)))
            for sequence_id in used:
                self.records[sequence_id].used = now
                self.records.move_to_end(sequence_id)
        return out

    def attach(self, session_id: str, datums: Sequence[Datum], now: float | None = None) -> None:
        """``resolve`` the datums' provenance and set each ``Datum.recorded``; BadRequest as
        ``resolve`` does, and for an advantage on a target that is not a sampled token (only
        sampled tokens may be trained on)."""
        for i, (datum, (recorded, sampled)) in enumerate(
            zip(datums, self.resolve(session_id, datums, now), strict=True)
        ):
            advantages = datum.inputs.get("advantages")
            if advantages is not None and bool((advantages[~sampled] != 0).any()):
                at = int(((advantages != 0) & ~sampled).nonzero()[0])
                raise BadRequest(
                    f"datum {i}: position {at} has an advantage but its target is not a "
                    "sampled token (a prompt run); stable_reinforce trains sampled tokens only"
                )
            datum.recorded = recorded

    def _check(
        self,
        session_id: str,
        spans: Sequence[Span],
        tokens: np.ndarray,
        where: str,
        used: set[str],
        recorded: np.ndarray | None = None,
        sampled: np.ndarray | None = None,
    ) -> None:
        if sum(span.length for span in spans) != len(tokens):
            raise BadRequest(f"{where}: the provenance runs do not tile its {len(tokens)} tokens")
        position = 0
        for span in spans:
            record = self._record(session_id, span.sequence_id, where)
            source = record.tokens if span.kind == "sampled" else record.prompt
            end = span.offset + span.length
            if end > len(source):
                raise BadRequest(
                    f"{where}: a {span.kind} run of sequence {span.sequence_id!r} reaches "
                    f"position {end}, past its {len(source)} {span.kind} tokens"
                )
            here = slice(position, position + span.length)
            mismatch = np.flatnonzero(tokens[here] != source[span.offset : end])
            if len(mismatch):
                at = int(mismatch[0])
                raise BadRequest(
                    f"{where}: position {position + at} holds token {int(tokens[position + at])}"
                    f" but {span.kind} token {span.offset + at} of sequence "
                    f"{span.sequence_id!r} is {int(source[span.offset + at])}"
                )
            if span.kind == "sampled" and recorded is not None and sampled is not None:
                recorded[here] = record.logprobs[span.offset : end]
                sampled[here] = True
            used.add(span.sequence_id)
            position += span.length

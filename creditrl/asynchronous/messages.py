"""The sampler <-> learner wire format: a JSON header and, for episodes, a Batch as bytes.

A message is the ZeroMQ multipart ``[PROTOCOL, header JSON, payload?]``. The payload of an
``episodes`` message is ``Batch.to_bytes()`` (a JSON header and a safetensors payload); nothing
on the wire is ever pickled, and decoding checks every field before the learner trusts it
(``creditrl.asynchronous.validation``).

Kinds (sampler -> learner): ``hello`` {sampler_id, started?, pending}, ``episodes``
{sampler_id, seq, weight_version, episode_ids} + payload. (learner -> sampler): ``welcome``
{incarnation, weight_version, queued?}, ``ack`` {incarnation, weight_version, queued?, acks:
[{seq, status, reason?}]} (``acks`` may be empty: after each step every sampler hears the
learner's version and queue), ``stop`` {reason}, ``disconnected`` {reason, rejected}.
``queued`` counts the groups of other samplers waiting in the learner's buffer, to be trained
before any group the addressed sampler sends next. A sampler decodes what the learner sends
with the same care: ``weight_version`` and ``queued`` ints in [0, 2**53), ``incarnation`` a
short id; a message that fails is logged and skipped. ``seq`` numbers a sampler's groups 0, 1,
2, ...; the episode ids of group ``seq`` of sampler ``s`` are ``f"{s}:{seq}:{k}"`` for its k-th
answer. ``started`` is a short id the sampler's process draws when it starts (a new one tells
the learner the sampler restarted, ``creditrl.asynchronous.fleet``). A welcome may carry
``next_seq``, one past the highest seq of that sampler id the learner holds or consumed: a
sampler whose outbox is behind it (a new process without the old one's outbox) numbers its
new groups from there (``Outbox.skip_to``). A ``rejected``
acknowledgement names its ``reason`` (``validation.REASONS``) and has ``seq`` null when the
message carried no readable one. ``disconnected`` tells a sampler that the learner ignores it
from now on (too many rejected messages).

Weights over the wire (``asynchronous.weight_channel``; a second socket, to the learner's
weight port, served while the learner trains: ``creditrl.asynchronous.weight_server``): a
sampler asks ``manifest_request`` {rid, version} and ``chunk_request`` {rid, version, index};
the learner answers ``manifest`` {rid, newest, manifest} (``newest`` null before the first
publication; ``manifest`` the asked version's ``creditrl.weights.wire.Manifest`` fields,
checked by the sampler against its ``WireLimits``, or null when the request's version was
null: asking only for the newest version's number), ``chunk`` {rid, version, index} + the
chunk's bytes, or ``weights_refused`` {rid, reason, detail} (a version it does not hold, a
chunk it does not have). ``rid`` numbers a sampler's requests, so a late answer to an earlier
one is told apart; every int is in [0, 2**53), ``detail`` at most 200 characters, no header
field is unknown, and only a chunk has a third frame.

The fields a group carries, their dtypes, widths and which samplers send them, are the field
catalogue's (``creditrl.batch.FIELDS``: ``weight_version``, ``staleness``, ``episode_id`` and
``sampler_id`` among them), which ``validation`` checks every group against.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch

from creditrl.asynchronous.validation import (
    DEFAULT_JSON_LIMITS,
    EPISODE_FIELDS,
    REASONS,
    MessageError,
    check_payload,
)
from creditrl.batch import Batch
from creditrl.bounded_json import JsonLimitError, JsonLimits, loads_bounded

__all__ = [
    "ACK_STATUSES",
    "EPISODE_FIELDS",
    "KINDS",
    "MAX_INT",
    "PROTOCOL",
    "WEIGHT_REPLIES",
    "WEIGHT_REQUESTS",
    "Message",
    "MessageError",
    "ack_message",
    "decode",
    "encode",
    "episode_ids",
    "episodes_message",
    "group_of",
    "reject_message",
    "weight_message",
]

PROTOCOL = b"creditrl.async/1"
KINDS = ("hello", "episodes", "welcome", "ack", "stop", "disconnected",
         "manifest_request", "chunk_request", "manifest", "chunk", "weights_refused")  # fmt: skip
WEIGHT_REQUESTS = ("manifest_request", "chunk_request")
WEIGHT_REPLIES = ("manifest", "chunk", "weights_refused")
_WEIGHT_FIELDS = {
    "manifest_request": {"rid": "int", "version": "int?"},
    "chunk_request": {"rid": "int", "version": "int", "index": "int"},
    "manifest": {"rid": "int", "newest": "int?", "manifest": "dict?"},
    "chunk": {"rid": "int", "version": "int", "index": "int"},
    "weights_refused": {"rid": "int", "reason": "str", "detail": "str"},
}
ACK_STATUSES = ("trained", "stale", "duplicate", "rejected")
MAX_INT = 2**53  # header integers stay below this (exact in JSON everywhere)
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# the JSON header of any message: an episodes header holds rollout.n episode ids, an ack one
# entry (3 keys) per acknowledged group, so 65536 items leave room for any honest one
_HEADER_LIMITS = JsonLimits(max_bytes=1 << 20, max_depth=8, max_items=1 << 16)
_EPISODES_HEADER = {"kind", "sampler_id", "seq", "weight_version", "episode_ids"}


@dataclass
class Message:
    """One decoded message: its kind, JSON header and (episodes only) the group as a Batch and
    the bytes it holds in memory (``validation.check_payload``); a weight chunk's bytes."""

    kind: str
    header: dict[str, Any]
    batch: Batch | None = None
    nbytes: int = 0
    payload: bytes | None = None  # a weight chunk's bytes


def episode_ids(sampler_id: str, seq: int, n: int) -> list[str]:
    """The ids of the ``n`` episodes of group ``seq`` of ``sampler_id``."""
    return [f"{sampler_id}:{seq}:{k}" for k in range(n)]


def check_sampler_id(sampler_id: Any) -> str:
    """``sampler_id`` if it is 1-64 characters of [A-Za-z0-9_.-]; MessageError otherwise."""
    if not isinstance(sampler_id, str) or not _ID.match(sampler_id):
        raise MessageError(
            f"sampler_id {sampler_id!r:.80} must be 1-64 characters of [A-Za-z0-9_.-]", "header"
        )
    return sampler_id


def encode(
    kind: str, header: dict[str, Any], payload: bytes | memoryview | None = None
) -> list[bytes]:
    """The frames of a message: ``[PROTOCOL, JSON header with "kind", payload?]``."""
    if kind not in KINDS:
        raise ValueError(f"unknown message kind {kind!r}; kinds: {KINDS}")
    frames = [PROTOCOL, json.dumps({**header, "kind": kind}, allow_nan=False).encode()]
    if payload is not None:
        frames.append(payload)
    return frames


def episodes_message(sampler_id: str, seq: int, group: Batch) -> list[bytes]:
    """Frames of one whole group (all answers to one prompt) produced by ``sampler_id``."""
    versions = group["weight_version"].unique().tolist()
    if len(versions) != 1:
        raise ValueError(f"group {seq} mixes weight versions {versions}")
    header = {
        "sampler_id": check_sampler_id(sampler_id),
        "seq": int(seq),
        "weight_version": int(versions[0]),
        "episode_ids": list(group["episode_id"]),
    }
    return encode("episodes", header, group.to_bytes())


def ack_message(
    incarnation: str, weight_version: int, acks: list[tuple[int, str]], queued: int = 0
) -> list[bytes]:
    """Frames acknowledging groups ``[(seq, status), ...]`` of one sampler (none: only the
    learner's version and ``queued``, the other samplers' groups it holds)."""
    for seq, status in acks:
        if status not in ACK_STATUSES:
            raise ValueError(f"ack status {status!r} for group {seq} not in {ACK_STATUSES}")
    body = [{"seq": int(seq), "status": status} for seq, status in acks]
    header = {"incarnation": incarnation, "weight_version": weight_version, "queued": queued}
    return encode("ack", {**header, "acks": body})


def reject_message(
    incarnation: str, weight_version: int, seq: int | None, reason: str
) -> list[bytes]:
    """Frames acknowledging one message ``rejected`` for ``reason`` (``seq`` None: unknown)."""
    if reason not in REASONS:
        raise ValueError(f"unknown rejection reason {reason!r}")
    body = [{"seq": None if seq is None else int(seq), "status": "rejected", "reason": reason}]
    return encode(
        "ack", {"incarnation": incarnation, "weight_version": weight_version, "acks": body}
    )


def _is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value < MAX_INT


def _int(header: dict[str, Any], key: str) -> int:
    value = header.get(key)
    if not _is_int(value):
        raise MessageError(
            f"header field {key!r} must be an int in [0, 2**53), got {value!r:.80}", "header"
        )
    return value


def _check_episodes(
    header: dict[str, Any], payload: bytes, json_limits: JsonLimits
) -> tuple[Batch, int]:
    unknown = sorted(set(header) - _EPISODES_HEADER)
    if unknown:
        raise MessageError(f"episodes header has unknown fields {unknown}", "header")
    sampler_id = check_sampler_id(header.get("sampler_id"))
    seq = _int(header, "seq")
    version = _int(header, "weight_version")
    ids = header.get("episode_ids")
    if not isinstance(ids, list) or not ids:
        raise MessageError("header field 'episode_ids' must be a non-empty list", "header")
    if ids != episode_ids(sampler_id, seq, len(ids)):
        raise MessageError(
            f"episode_ids of group {sampler_id}:{seq} are not '<sampler>:<seq>:<k>'", "header"
        )
    return check_payload(payload, sampler_id, seq, version, ids, json_limits)


def _ack_ok(entry: Any) -> bool:
    if not isinstance(entry, dict) or entry.get("status") not in ACK_STATUSES:
        return False
    seq = entry.get("seq")
    seq_ok = _is_int(seq) or (seq is None and entry["status"] == "rejected")
    return seq_ok and isinstance(entry.get("reason", ""), str)


def _check_ack(header: dict[str, Any]) -> None:
    acks = header.get("acks")
    if not isinstance(acks, list) or not all(_ack_ok(a) for a in acks):
        raise MessageError("ack header needs 'acks': [{seq: int, status: str, reason?: str}]")


def _check_learner_header(header: dict[str, Any]) -> None:
    """The fields of a welcome or ack a sampler paces itself by: ``weight_version``,
    ``queued`` and ``next_seq`` ints in [0, 2**53), ``incarnation`` a short id. MessageError (reason
    ``protocol``: a learner's kind, which a learner receiving it refuses as such) otherwise."""
    for key in ("weight_version", "queued", "next_seq"):
        if (key in header or key == "weight_version") and not _is_int(header.get(key)):
            raise MessageError(
                f"header field {key!r} must be an int in [0, 2**53), got {header.get(key)!r:.80}"
            )
    incarnation = header.get("incarnation")
    if not (isinstance(incarnation, str) and _ID.match(incarnation)):
        raise MessageError(
            "header field 'incarnation' must be 1-64 characters of [A-Za-z0-9_.-], "
            f"got {incarnation!r:.80}"
        )


def weight_message(
    kind: str, payload: bytes | memoryview | None = None, **fields: Any
) -> list[bytes]:
    """Frames of a weight request or answer (module docstring), checked as ``decode`` checks
    them (a ValueError for a field it would refuse)."""
    frames = encode(kind, fields, payload)
    if kind not in _WEIGHT_FIELDS:
        raise ValueError(f"{kind!r} is not a weight message kind")
    _check_weight(kind, {**fields, "kind": kind}, len(frames))
    return frames


def _check_weight(kind: str, header: dict[str, Any], frames: int) -> None:
    """A weight request's or answer's header: exactly its fields, each of its type (ints in
    [0, 2**53), a dict, a string of at most 200 characters; ``?``: or null), and a payload
    frame for a chunk only."""
    spec = _WEIGHT_FIELDS[kind]
    unknown = sorted(set(header) - set(spec) - {"kind"})
    if unknown:
        raise MessageError(f"{kind} header has unknown fields {unknown!s:.200}", "header")
    for key, what in spec.items():
        value = header.get(key)
        if what.endswith("?") and value is None:
            continue
        ok = {"int": _is_int(value), "dict": isinstance(value, dict),
              "str": isinstance(value, str) and len(value) <= 200}[what.rstrip("?")]  # fmt: skip
        if not ok:
            raise MessageError(
                f"{kind} header field {key!r} must be {what.rstrip('?')}"
                f"{' or null' if what.endswith('?') else ''}, got {value!r:.80}",
                "header",
            )
    if frames != (3 if kind == "chunk" else 2):
        raise MessageError(f"a {kind} message has {3 if kind == 'chunk' else 2} frames, got "
                           f"{frames}")  # fmt: skip


def _header(frames: list[bytes]) -> dict[str, Any]:
    if len(frames) < 2 or bytes(frames[0]) != PROTOCOL:
        raise MessageError(f"not a {PROTOCOL.decode()} message ({len(frames)} frames)")
    try:
        header = loads_bounded(frames[1], _HEADER_LIMITS, allow_nan=False)
    except JsonLimitError as e:
        raise MessageError(f"header: {e}", "header") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise MessageError(f"header is not JSON: {e!s:.200}", "header") from None
    if not isinstance(header, dict) or header.get("kind") not in KINDS:
        raise MessageError(f"header has no known 'kind' (kinds: {KINDS})")
    return header


def decode(frames: list[bytes], json_limits: JsonLimits = DEFAULT_JSON_LIMITS) -> Message:
    """Check and decode frames from the wire (an episodes group's JSON within ``json_limits``,
    ``settings.json_limits`` for a run); MessageError names what is wrong (its ``reason`` and,
    when the header gave one, the group's ``seq``)."""
    header = _header(frames)
    kind = header["kind"]
    seq = header.get("seq") if _is_int(header.get("seq")) else None
    try:
        if kind == "episodes":
            if len(frames) != 3:
                raise MessageError(f"an episodes message has 3 frames, got {len(frames)}")
            return Message(kind, header, *_check_episodes(header, bytes(frames[2]), json_limits))
        if kind in _WEIGHT_FIELDS:
            _check_weight(kind, header, len(frames))
            payload = bytes(frames[2]) if kind == "chunk" else None
            return Message(kind, header, nbytes=0 if payload is None else len(payload),
                           payload=payload)  # fmt: skip
        if len(frames) != 2:
            raise MessageError(f"a {kind} message has 2 frames, got {len(frames)}")
        if kind == "hello":
            check_sampler_id(header.get("sampler_id"))
            started = header.get("started")
            if started is not None and not (isinstance(started, str) and _ID.match(started)):
                raise MessageError(
                    "hello field 'started' must be 1-64 characters of [A-Za-z0-9_.-], "
                    f"got {started!r:.80}",
                    "header",
                )
        if kind == "ack":
            _check_ack(header)
        if kind in ("welcome", "ack"):
            _check_learner_header(header)
        return Message(kind, header)
    except MessageError as e:
        e.seq = seq
        raise


def group_of(batch: Batch, sampler_id: str, seq: int, weight_version: int) -> Batch:
    """Stamp one group's rows with their episode ids, sampler id and weight version."""
    batch["episode_id"] = episode_ids(sampler_id, seq, len(batch))
    batch["sampler_id"] = [sampler_id] * len(batch)
    batch["weight_version"] = torch.full((len(batch),), int(weight_version), dtype=torch.long)
    return batch

"""The sampler <-> learner wire format: a JSON header and, for episodes, a Batch as bytes.

A message is the ZeroMQ multipart ``[PROTOCOL, header JSON, payload?]``. The payload of an
``episodes`` message is ``Batch.to_bytes()`` (a JSON header and a safetensors payload); nothing
on the wire is ever pickled, and decoding checks every field before the learner trusts it.

Kinds (sampler -> learner): ``hello`` {sampler_id, pending}, ``episodes`` {sampler_id, seq,
weight_version, episode_ids} + payload. (learner -> sampler): ``welcome`` {incarnation,
weight_version}, ``ack`` {incarnation, weight_version, acks: [{seq, status}]}, ``stop``
{reason}. ``seq`` numbers a sampler's groups 0, 1, 2, ...; the episode ids of group ``seq`` of
sampler ``s`` are ``f"{s}:{seq}:{k}"`` for its k-th answer.

Fields a group carries beyond the catalogue (``creditrl.batch.FIELDS``), documented here:

- ``weight_version`` (B,) int64: the policy version that sampled the episode;
- ``staleness`` (B,) int64: learner version at training time minus ``weight_version``
  (written by the learner);
- ``episode_id`` (B,) object[str], ``sampler_id`` (B,) object[str].
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch

from creditrl.batch import Batch

__all__ = [
    "ACK_STATUSES",
    "EPISODE_FIELDS",
    "KINDS",
    "PROTOCOL",
    "Message",
    "MessageError",
    "ack_message",
    "decode",
    "encode",
    "episode_ids",
    "episodes_message",
    "group_of",
]

PROTOCOL = b"creditrl.async/1"
KINDS = ("hello", "episodes", "welcome", "ack", "stop")
ACK_STATUSES = ("trained", "stale", "duplicate", "rejected")
# Tensors every episode group must hold (shapes checked against ``responses``).
EPISODE_FIELDS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "prompts",
    "responses",
    "response_mask",
    "rollout_log_probs",
    "token_level_scores",
    "weight_version",
)
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_MAX_HEADER = 1 << 20


class MessageError(ValueError):
    """A message that does not follow the protocol (the learner counts and skips it)."""


@dataclass
class Message:
    """One decoded message: its kind, JSON header and (episodes only) the group as a Batch."""

    kind: str
    header: dict[str, Any]
    batch: Batch | None = None


def episode_ids(sampler_id: str, seq: int, n: int) -> list[str]:
    """The ids of the ``n`` episodes of group ``seq`` of ``sampler_id``."""
    return [f"{sampler_id}:{seq}:{k}" for k in range(n)]


def check_sampler_id(sampler_id: Any) -> str:
    """``sampler_id`` if it is 1-64 characters of [A-Za-z0-9_.-]; MessageError otherwise."""
    if not isinstance(sampler_id, str) or not _ID.match(sampler_id):
        raise MessageError(f"sampler_id {sampler_id!r} must be 1-64 characters of [A-Za-z0-9_.-]")
    return sampler_id


def encode(kind: str, header: dict[str, Any], payload: bytes | None = None) -> list[bytes]:
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


def ack_message(incarnation: str, weight_version: int, acks: list[tuple[int, str]]) -> list[bytes]:
    """Frames acknowledging groups ``[(seq, status), ...]`` of one sampler."""
    for seq, status in acks:
        if status not in ACK_STATUSES:
            raise ValueError(f"ack status {status!r} for group {seq} not in {ACK_STATUSES}")
    body = [{"seq": int(seq), "status": status} for seq, status in acks]
    return encode(
        "ack", {"incarnation": incarnation, "weight_version": weight_version, "acks": body}
    )


def _int(header: dict[str, Any], key: str, minimum: int = 0) -> int:
    value = header.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise MessageError(f"header field {key!r} must be an int >= {minimum}, got {value!r}")
    return value


def _check_episodes(header: dict[str, Any], payload: bytes) -> Batch:
    sampler_id = check_sampler_id(header.get("sampler_id"))
    seq = _int(header, "seq")
    version = _int(header, "weight_version")
    ids = header.get("episode_ids")
    if not isinstance(ids, list) or not ids:
        raise MessageError("header field 'episode_ids' must be a non-empty list")
    if ids != episode_ids(sampler_id, seq, len(ids)):
        raise MessageError(f"episode_ids of group {sampler_id}:{seq} are not '<sampler>:<seq>:<k>'")
    try:
        group = Batch.from_bytes(payload)
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise MessageError(f"group {sampler_id}:{seq}: payload is not a creditrl batch: {e}") from e
    if len(group) != len(ids):
        raise MessageError(f"group {sampler_id}:{seq} has {len(group)} rows for {len(ids)} ids")
    missing = [name for name in EPISODE_FIELDS if name not in group.tensors]
    if missing:
        raise MessageError(f"group {sampler_id}:{seq} lacks tensor fields {missing}")
    for name in ("uid", "episode_id"):
        if name not in group.non_tensors:
            raise MessageError(f"group {sampler_id}:{seq} lacks non-tensor field {name!r}")
    if list(group["episode_id"]) != ids:
        raise MessageError(f"group {sampler_id}:{seq}: episode_id field differs from the header")
    if len(set(group["uid"].tolist())) != 1:
        raise MessageError(f"group {sampler_id}:{seq} is not one prompt group (several uids)")
    if not bool((group["weight_version"] == version).all()):
        raise MessageError(f"group {sampler_id}:{seq}: weight_version differs from the header")
    t = group["responses"].shape
    for name in ("response_mask", "rollout_log_probs", "token_level_scores", "ref_log_prob"):
        if name in group.tensors and group[name].shape != t:
            raise MessageError(
                f"group {sampler_id}:{seq}: {name} {tuple(group[name].shape)} != {t}"
            )
    width = group["prompts"].shape[1] + t[1]
    for name in ("input_ids", "attention_mask", "position_ids"):
        if group[name].shape != (len(group), width):
            raise MessageError(
                f"group {sampler_id}:{seq}: {name} is not (B, P+T) = ({len(group)}, {width})"
            )
    for name in ("rollout_log_probs", "token_level_scores"):
        if not torch.isfinite(group[name]).all():
            raise MessageError(f"group {sampler_id}:{seq}: {name} holds non-finite values")
    return group


def decode(frames: list[bytes]) -> Message:
    """Check and decode frames from the wire; MessageError names what is wrong."""
    if len(frames) < 2 or bytes(frames[0]) != PROTOCOL:
        raise MessageError(f"not a {PROTOCOL.decode()} message ({len(frames)} frames)")
    raw = bytes(frames[1])
    if len(raw) > _MAX_HEADER:
        raise MessageError(f"header of {len(raw)} bytes exceeds {_MAX_HEADER}")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MessageError(f"header is not JSON: {e}") from e
    if not isinstance(header, dict) or header.get("kind") not in KINDS:
        raise MessageError(f"header has no known 'kind' (kinds: {KINDS})")
    kind = header["kind"]
    if kind == "episodes":
        if len(frames) != 3:
            raise MessageError(f"an episodes message has 3 frames, got {len(frames)}")
        return Message(kind, header, _check_episodes(header, bytes(frames[2])))
    if len(frames) != 2:
        raise MessageError(f"a {kind} message has 2 frames, got {len(frames)}")
    if kind == "hello":
        check_sampler_id(header.get("sampler_id"))
    if kind == "ack":
        acks = header.get("acks")
        if not isinstance(acks, list) or not all(
            isinstance(a, dict)
            and isinstance(a.get("seq"), int)
            and a.get("status") in ACK_STATUSES
            for a in acks
        ):
            raise MessageError("ack header needs 'acks': [{seq: int, status: str}]")
    return Message(kind, header)


def group_of(batch: Batch, sampler_id: str, seq: int, weight_version: int) -> Batch:
    """Stamp one group's rows with their episode ids, sampler id and weight version."""
    batch["episode_id"] = episode_ids(sampler_id, seq, len(batch))
    batch["sampler_id"] = [sampler_id] * len(batch)
    batch["weight_version"] = torch.full((len(batch),), int(weight_version), dtype=torch.long)
    return batch

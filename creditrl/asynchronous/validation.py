"""Checks on an episodes group before the learner trusts it: everything a sampler sends is
untrusted input. A failed check raises ``MessageError`` with a ``reason`` (one of ``REASONS``);
the learner acknowledges the group ``rejected``, counts it as ``async/rejected`` and
``async/rejected/<reason>`` and carries on.

Two layers: ``check_payload`` (``messages.decode`` calls it) needs only the JSON limits: the
JSON of the non-tensor columns and meta is within its byte, depth and item limits before it is
decoded (``bounded_json``), the payload parses as a creditrl batch, every field is known and
has its catalogue dtype and a consistent shape, ids are >= 0, masks are 0/1, floats are finite,
non-tensors and meta have their types, the agent columns hold what the learner's step
metrics read (tool calls with a known status, short stop reasons, numeric rewards) and the
``messages`` its drift check renders (dicts with a short-name role and string content, at most
one per id of the row); it also tells the bytes the group holds, which the learner's buffer is
bounded by (``max_group_bytes`` is the most an accepted group holds).
``GroupLimits.check`` needs the learner's config and state: group size ``rollout.n``, widths
within ``data.max_prompt_length`` / ``rollout.max_response_length``, token ids below the
model's vocabulary, kept-set sizes (sampling replay) at most the vocabulary and, in
single-turn runs, at least 1 for every sampled token, the optional
fields this run sends, a weight version not in the future.

Unknown fields are refused (``fields``), never dropped: a sampler that writes fields this
learner does not know runs other code or another config, and its groups would not
concatenate with the others.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from creditrl.batch import Batch, fields
from creditrl.batch import io as batch_io
from creditrl.bounded_json import JsonLimitError, JsonLimits, held_bytes
from creditrl.tools.base import TOOL_STATUSES

__all__ = [
    "AGENT_FIELDS",
    "DEFAULT_JSON_LIMITS",
    "EPISODE_FIELDS",
    "GROUP_OVERHEAD",
    "REASONS",
    "STRUCTURED_FIELDS",
    "GroupLimits",
    "MessageError",
    "check_payload",
    "max_group_bytes",
]

REASONS = {
    "protocol": "not a creditrl.async/1 message, a wrong frame count, or a kind a sampler may "
    "not send",
    "header": "the JSON header is malformed: a field missing, of the wrong type, out of range "
    "or unknown; episode ids or the sender's identity inconsistent",
    "payload": "the payload is not a creditrl batch (garbage, truncated, bad declared sizes)",
    "json_limit": "the JSON of the non-tensor columns and meta exceeds its byte, nesting depth "
    "or item limit (checked before it is decoded), or is not UTF-8",
    "fields": "a required field is missing, or a field this learner does not know is present",
    "dtype": "a tensor does not have its catalogue dtype (int64 ids and masks, float32 floats)",
    "shape": "tensor shapes disagree (rows, prompt width P, response width T, P + T)",
    "length": "the prompt or response width exceeds max_prompt_length / max_response_length",
    "group_size": "the group does not hold rollout.n answers",
    "token_id": "a token id is negative or not below the model's vocabulary size",
    "mask": "a mask holds values other than 0 and 1",
    "non_finite": "a float is NaN or infinite",
    "value": "values are inconsistent or out of range (uids, episode ids, log-probs > 0, ...)",
    "non_tensor": "a non-tensor column or meta entry has the wrong type",
    "version": "the group claims a weight version the learner has not published yet",
    "error": "the learner failed on the group before it joined a batch (logged with traceback)",
    "temperature": "the group was sampled at another temperature than the learner's "
    "rollout.temperature (its log-probs would be of another distribution)",
    "buffer_full": "the group would take the learner's buffered groups past their byte limit "
    "(not counted toward asynchronous.max_rejects)",
}

# What a sampler may send is the field catalogue's (``creditrl.batch.FIELDS``): a field's
# ``wire`` says which groups carry it, its ``dtype`` and ``width`` what it is, a tensor's
# ``kind`` its value check, a column's ``json_types`` its values' types.


def _group(wire: str, tensor: bool = True) -> tuple[str, ...]:
    """The catalogue's fields (tensors, or non-tensor columns) that ``wire`` groups carry."""
    return tuple(n for n, s in fields.FIELDS.items() if s.wire == wire and s.is_tensor == tensor)


# Tensors every group holds; ref_log_prob (ref_on=sampler), teacher_log_prob
# (distill.teacher_on=sampler) and rm_scores (a reward model) are added by some runs
# (``GroupLimits.optional``).
EPISODE_FIELDS = _group("episode")
# tensors an agent run's groups carry (GroupLimits.optional)
AGENT_FIELDS = _group("agent")
STRUCTURED_FIELDS = _group("structured")
_REQUIRED_COLUMNS = _group("episode", tensor=False)


def _tensors() -> dict[str, fields.FieldSpec]:
    """Tensor -> its catalogue entry, for every tensor a sampler may send (read at each check,
    so the catalogue is the one table)."""
    return {n: s for n, s in fields.FIELDS.items() if s.wire and s.is_tensor}


def _columns() -> dict[str, tuple[type, ...] | None]:
    """Non-tensor column -> allowed JSON types of each value (None: any JSON value)."""
    return {n: s.json_types for n, s in fields.FIELDS.items() if s.wire and not s.is_tensor}


def _dtype(spec: fields.FieldSpec) -> torch.dtype:
    """The torch dtype of a catalogued tensor."""
    return getattr(torch, spec.base_dtype)


_MAX_COUNT = 1 << 20  # turn numbers and counts: small non-negative integers
_MAX_LOG_PROB = 1e-3  # log-probs are <= 0; a little slack for rounding
# and no sampled token is that unlikely; float32 sums of -3e38 overflow (every update skipped)
_MIN_LOG_PROB = -1e4
_MAX_SCORE = 1e9  # larger rewards overflow float32 statistics (squares in the group std)
# memory of a decoded group beyond its tensors' and its JSON's bytes: the Batch, its TensorDict,
# the tensor and numpy objects (measured: about 8 KiB; tests/test_async_hardening.py)
GROUP_OVERHEAD = 16 * 1024
# JSON limits of a group when no config gives them (``messages.decode`` without limits): the
# size of the smallest frame limit (settings.max_message_bytes), 1 item per 32 bytes
DEFAULT_JSON_LIMITS = JsonLimits(max_bytes=8 << 20, max_depth=64, max_items=(8 << 20) // 32)
_META: dict[str, tuple[type, ...]] = {
    "temperature": (int, float),
    "max_response_length": (int,),
    "eos_token_id": (int, list, type(None)),
    "reward_extra_keys": (list,),
    "step": (int,),
    "endpoint": (dict,),  # an endpoint rollout's counts (creditrl.agents.program): name -> number
}


class MessageError(ValueError):
    """A message that does not follow the protocol or fails a check: the learner rejects it.

    ``reason`` is one of ``REASONS``; ``seq`` the group's number when the header gave one;
    ``sender`` the routing identity it came from (set by the socket)."""

    def __init__(self, message: str, reason: str = "protocol", seq: int | None = None) -> None:
        super().__init__(message)
        if reason not in REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        self.reason = reason
        self.seq = seq
        self.sender: str | None = None


def _non_finite_path(value: Any, path: str) -> str | None:
    """Where a JSON value holds a NaN or infinite float (None if nowhere); iterative, so any
    nesting the JSON parser accepted is walked without recursion."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return where
        if isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
        elif isinstance(item, dict):
            stack.extend((v, f"{where}[{k!r}]") for k, v in item.items())
    return None


def _parse(payload: bytes, where: str, json_limits: JsonLimits) -> tuple[Batch, int]:
    """The group in ``payload`` (its JSON checked against ``json_limits`` before it is decoded)
    and the bytes it holds: tensors, JSON as ``bounded_json.held_bytes`` charges it, overhead."""
    try:
        head, _ = batch_io.split(payload)
        items = json_limits.check(head)
        group = Batch.from_bytes(payload)
    except JsonLimitError as e:
        raise MessageError(f"{where}: non-tensor columns and meta: {e}", "json_limit") from None
    except Exception as e:  # any failure to parse untrusted bytes is a rejection
        raise MessageError(f"{where}: payload is not a creditrl batch: {e}", "payload") from None
    tensors = sum(x.nbytes for x in group.tensors.values())
    return group, tensors + held_bytes(len(head), items) + GROUP_OVERHEAD


def max_group_bytes(n: int, max_prompt: int, max_response: int, json_limits: JsonLimits) -> int:
    """The most bytes a group ``check_payload`` accepts holds: ``n`` rows of every catalogue
    tensor at the widest widths, its JSON at ``json_limits``, and ``GROUP_OVERHEAD``."""
    widths = {"P": max_prompt, "T": max_response, "P+T": max_prompt + max_response, None: 1}
    tensors = sum(n * widths[s.width] * _dtype(s).itemsize for s in _tensors().values())
    return tensors + json_limits.held_bound() + GROUP_OVERHEAD


def _check_fields(group: Batch, where: str) -> None:
    missing = [n for n in EPISODE_FIELDS if n not in group.tensors]
    missing += [n for n in _REQUIRED_COLUMNS if n not in group.non_tensors]
    if missing:
        raise MessageError(f"{where} lacks fields {missing}", "fields")
    tensors = list(group.tensors.keys())
    known, columns = _tensors(), _columns()
    unknown = [n for n in tensors if n not in known]
    unknown += [n for n in group.non_tensors if n not in columns]
    unknown += [f"meta[{k!r}]" for k in group.meta if k not in _META]
    if unknown:
        raise MessageError(f"{where} holds fields this learner does not know: {unknown}", "fields")


def _check_tensors(group: Batch, where: str) -> None:
    specs = _tensors()
    for name, x in group.tensors.items():
        want = _dtype(specs[name])
        if x.dtype != want:
            raise MessageError(f"{where}: {name} is {x.dtype}, not {want}", "dtype")
    b = len(group)
    p, t = group["prompts"].shape[-1], group["responses"].shape[-1]
    widths = {"P": p, "T": t, "P+T": p + t}
    for name, x in group.tensors.items():
        width = specs[name].width
        expected = (b,) if width is None else (b, widths[width])
        if tuple(x.shape) != expected or (width is not None and widths[width] < 1):
            raise MessageError(
                f"{where}: {name} has shape {tuple(x.shape)}, expected {expected} "
                f"(B={b}, P={p}, T={t})",
                "shape",
            )
    for name, x in group.tensors.items():
        kind = specs[name].kind
        if kind == "ids" and bool((x < 0).any()):
            raise MessageError(f"{where}: {name} holds negative token ids", "token_id")
        if kind == "mask" and not bool(((x == 0) | (x == 1)).all()):
            raise MessageError(f"{where}: {name} holds values other than 0 and 1", "mask")
        if kind in ("log_prob", "score") and not bool(torch.isfinite(x).all()):
            raise MessageError(f"{where}: {name} holds non-finite values", "non_finite")
        if kind == "log_prob" and bool((x > _MAX_LOG_PROB).any()):
            raise MessageError(f"{where}: {name} holds log-probs above 0", "value")
        if kind == "log_prob" and bool((x < _MIN_LOG_PROB).any()):
            raise MessageError(f"{where}: {name} holds log-probs below {_MIN_LOG_PROB:g}", "value")
        if kind == "score" and bool((x.abs() > _MAX_SCORE).any()):
            raise MessageError(f"{where}: {name} holds values beyond +-{_MAX_SCORE:g}", "value")
        if kind == "count" and not bool(((x >= 0) & (x <= _MAX_COUNT)).all()):
            raise MessageError(f"{where}: {name} holds counts outside [0, {_MAX_COUNT}]", "value")
        if kind == "version" and bool((x < 0).any()):
            raise MessageError(f"{where}: {name} holds negative versions", "value")
        if kind == "position" and not bool(((x >= 0) & (x < p + t)).all()):
            raise MessageError(f"{where}: {name} holds positions outside [0, P+T)", "value")
    if not torch.equal(group["input_ids"], torch.cat([group["prompts"], group["responses"]], 1)):
        raise MessageError(f"{where}: input_ids is not prompts | responses", "value")
    if bool((group["response_mask"] > group["attention_mask"][:, p:]).any()):
        raise MessageError(f"{where}: response_mask is 1 where attention_mask is 0", "value")


def _check_non_tensors(group: Batch, where: str) -> None:
    columns = _columns()
    for name, column in group.non_tensors.items():
        allowed = columns[name]
        for i, value in enumerate(column):
            bad_type = allowed is not None and (
                not isinstance(value, allowed) or isinstance(value, bool)
            )
            if bad_type:
                names = "/".join(a.__name__ for a in allowed)
                raise MessageError(
                    f"{where}: non-tensor {name}[{i}] is {type(value).__name__}, not {names}",
                    "non_tensor",
                )
            if _non_finite_path(value, f"{name}[{i}]"):
                raise MessageError(f"{where}: {name}[{i}] holds a non-finite float", "non_finite")
    _check_agent_columns(group, where)
    for key, value in group.meta.items():
        allowed = _META[key]
        ok = isinstance(value, allowed) and not isinstance(value, bool)
        if key == "eos_token_id" and isinstance(value, list):
            ok = all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        if key == "reward_extra_keys":
            ok = ok and all(isinstance(v, str) for v in value)
        if key == "endpoint":
            ok = ok and all(
                isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
                for k, v in value.items()
            )
        if not ok or _non_finite_path(value, key):
            raise MessageError(
                f"{where}: meta[{key!r}] = {value!r:.80}: wrong type or not finite",
                "non_tensor",
            )


_NAME = re.compile(r"[a-z_]{1,32}")  # a stop reason or episode status: a metric key's end


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _agent_value_problem(name: str, value: Any) -> str | None:
    """What is wrong with one value of an agent column the learner's step metrics read
    (``creditrl.agents.rollout.agent_metrics``, ``tool_use_metrics``), or None."""
    if name == "tool_calls":
        if not all(isinstance(c, dict) and c.get("status") in TOOL_STATUSES for c in value):
            return f"a call that is not a dict with a status in {TOOL_STATUSES}"
    elif name == "agent_info" and value is not None:
        if not isinstance(value, dict):
            return "not a dict"
        for key in ("stop_reason", "episode"):
            name_value = value.get(key)
            if name_value is not None and not (
                isinstance(name_value, str) and _NAME.fullmatch(name_value)
            ):
                return f"{key} is not a short lower-case name"
        tokens = value.get("observation_tokens", 0)
        if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0):
            return "observation_tokens is not an int >= 0"
    elif name == "structured_rewards":
        for key in ("global_rewards", "turn_rewards"):
            part = value.get(key, {})
            if not (isinstance(part, dict) and all(_number(v) for v in part.values())):
                return f"{key} is not a mapping of numbers"
    return None


_ROLE = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]{0,63}")  # a chat role: a short name


def _messages_problem(value: list[Any], most: int) -> str | None:
    """What is wrong with one row's ``messages`` before the learner's drift check renders them
    with the chat template (``creditrl.agents.drift.template_check``), or None: at most
    ``most`` messages, each a dict with a short-name ``role`` and a string ``content``, any
    other key (``name``, ``tool_call_id``, ...) a string, number, bool or null. Their bytes,
    depth and items are bounded by the group's JSON limits, checked before decoding."""
    if len(value) > most:
        return f"{len(value)} messages, more than the {most} ids of the row (P+T)"
    for k, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {k} is {type(message).__name__}, not a dict"
        role = message.get("role")
        if not (isinstance(role, str) and _ROLE.fullmatch(role)):
            return f"message {k}: role is not a short name"
        if not isinstance(message.get("content"), str):
            return f"message {k}: content is not a string"
        odd = [key for key, v in message.items() if not isinstance(v, str | int | float | None)]
        if odd:
            return f"message {k}: {odd[0]!r:.40} is not a string, number, bool or null"
    return None


def _check_agent_columns(group: Batch, where: str) -> None:
    """The agent columns' contents, as the learner's step metrics and drift check read them."""
    for name in ("tool_calls", "agent_info", "structured_rewards"):
        for i, value in enumerate(group.non_tensors.get(name, ())):
            problem = _agent_value_problem(name, value)
            if problem is not None:
                raise MessageError(f"{where}: {name}[{i}]: {problem}", "non_tensor")
    most = group["input_ids"].shape[-1]
    for i, value in enumerate(group.non_tensors.get("messages", ())):
        problem = _messages_problem(value, most)
        if problem is not None:
            raise MessageError(f"{where}: messages[{i}]: {problem}", "non_tensor")


def check_payload(
    payload: bytes,
    sampler_id: str,
    seq: int,
    version: int,
    ids: list[str],
    json_limits: JsonLimits = DEFAULT_JSON_LIMITS,
) -> tuple[Batch, int]:
    """The group in ``payload`` and the bytes it holds, if it passes the first layer of checks
    (module docstring) and matches its header (``sampler_id``, ``seq``, ``version``, episode
    ``ids``)."""
    where = f"group {sampler_id}:{seq}"
    group, nbytes = _parse(payload, where, json_limits)
    if len(group) != len(ids):
        raise MessageError(f"{where} has {len(group)} rows for {len(ids)} ids", "shape")
    _check_fields(group, where)
    _check_tensors(group, where)
    _check_non_tensors(group, where)
    if list(group["episode_id"]) != ids:
        raise MessageError(f"{where}: episode_id field differs from the header", "value")
    if set(group["sampler_id"].tolist()) != {sampler_id}:
        raise MessageError(f"{where}: sampler_id field differs from the header", "value")
    uids = set(group["uid"].tolist())
    if len(uids) != 1:
        raise MessageError(f"{where} is not one prompt group (several uids)", "value")
    if uids != {f"{sampler_id}:{seq}"}:
        raise MessageError(f"{where}: uid {uids.pop()!r:.80} is not '{sampler_id}:{seq}'", "value")
    if not bool((group["weight_version"] == version).all()):
        raise MessageError(f"{where}: weight_version differs from the header", "value")
    return group, nbytes


@dataclass(frozen=True)
class GroupLimits:
    """What this learner accepts: ``n`` answers per group, widths up to ``max_prompt`` and
    ``max_response``, token ids below ``vocab_size``, exactly the ``optional`` tensors, and
    (when given) groups sampled at ``temperature``."""

    n: int
    vocab_size: int
    max_prompt: int
    max_response: int
    optional: frozenset[str] = frozenset()
    temperature: float | None = None
    # every response token was sampled under a kept set of >= 1 tokens (single-turn replay:
    # no observation tokens, whose size is 0, and no empty-episode placeholder)
    kept_per_token: bool = False

    def check(self, group: Batch, sampler_id: str, seq: int, version: int, current: int) -> None:
        """MessageError unless group ``seq`` (sampled by weight ``version``; the learner is at
        ``current``) fits these limits."""
        where = f"group {sampler_id}:{seq}"
        if len(group) != self.n:
            raise MessageError(
                f"{where} has {len(group)} answers; rollout.n is {self.n}", "group_size"
            )
        expected = set(EPISODE_FIELDS) | self.optional
        odd = sorted(set(group.tensors.keys()) ^ expected)
        if odd:
            raise MessageError(
                f"{where}: tensors {odd} differ from what this run sends (optional fields "
                f"here: {sorted(self.optional) or 'none'})",
                "fields",
            )
        p, t = group["prompts"].shape[1], group["responses"].shape[1]
        if p > self.max_prompt or t > self.max_response:
            raise MessageError(
                f"{where}: prompt width {p} / response width {t} exceed "
                f"data.max_prompt_length={self.max_prompt} / "
                f"rollout.max_response_length={self.max_response}",
                "length",
            )
        for name in ("input_ids", "prompts", "responses"):
            top = int(group[name].max())
            if top >= self.vocab_size:
                raise MessageError(
                    f"{where}: {name} holds token id {top} >= vocabulary size {self.vocab_size}",
                    "token_id",
                )
        kept = group.tensors.get("rollout_kept_counts", None)
        if kept is not None and int(kept.max()) > self.vocab_size:
            raise MessageError(
                f"{where}: rollout_kept_counts holds a kept set of {int(kept.max())} tokens, "
                f"more than the vocabulary's {self.vocab_size}",
                "value",
            )
        sampled = group["response_mask"].bool()
        if kept is not None and self.kept_per_token and bool((kept[sampled] < 1).any()):
            # a size of 0 replays the whole vocabulary: log-probs of another distribution
            raise MessageError(
                f"{where}: rollout_kept_counts is 0 for a sampled token (its kept set holds "
                "at least that token)",
                "value",
            )
        if version > current:
            raise MessageError(
                f"{where} claims weight version {version} > the learner's {current}", "version"
            )
        if "token_weight_version" in group.tensors:
            _check_token_versions(group, where, version, current)
        sampled = group.meta.get("temperature")
        if self.temperature is not None and sampled is not None and sampled != self.temperature:
            raise MessageError(
                f"{where} was sampled at temperature {sampled}; this learner trains at "
                f"rollout.temperature={self.temperature}",
                "temperature",
            )


def _check_token_versions(group: Batch, where: str, version: int, current: int) -> None:
    """MessageError unless ``token_weight_version`` is 0 on padding and, over each row's
    response tokens, never decreases and lies in [``version``, ``current``], the lowest of the
    group's being ``version`` (its weight_version is its oldest token's)."""
    tokens, mask = group["token_weight_version"], group["response_mask"].bool()
    p = group["prompts"].shape[1]
    padding = group["attention_mask"][:, p:] == 0
    if bool((tokens[padding] != 0).any()):
        raise MessageError(f"{where}: token_weight_version is not 0 on padding", "value")
    real = tokens[mask]
    if len(real) and (int(real.min()) < version or int(real.max()) > current):
        raise MessageError(
            f"{where}: token_weight_version outside [{version}, {current}] (the group's "
            "weight_version and the learner's)",
            "version",
        )
    if len(real) and int(real.min()) != version:
        raise MessageError(
            f"{where}: the oldest token_weight_version {int(real.min())} is not the group's "
            f"weight_version {version}",
            "value",
        )
    for i in range(len(group)):
        row = tokens[i][mask[i]]
        if bool((row[1:] < row[:-1]).any()):
            raise MessageError(f"{where}: token_weight_version of row {i} decreases", "value")

"""The learner's buffer of whole groups, bounded staleness, and batches of groups.

Staleness of an episode trained at learner version v (the version before this step's update)
is ``v - weight_version``, where ``weight_version`` is the version that sampled it (with
partial rollout, its oldest token's; ``token_weight_version`` holds each token's): 0 means
on-policy. With ``asynchronous.staleness_policy=drop`` a group whose staleness exceeds
``max_staleness`` is dropped (counted, and acknowledged as ``stale``); with ``keep`` it is
trained like the rest. Stale rows are corrected by the rollout importance weights
(``creditrl.core.compute_rollout_importance_weights``, per token: pi_old over the log-prob of
the version that sampled the token, truncated by ``algorithm.rollout_is``) when the learner
recomputes their ``old_log_probs``. ``GroupStats`` reports the length and score of dropped
and late groups against trained ones, so a policy's bias toward short answers shows.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from creditrl.batch import Batch, position_ids_from_mask

__all__ = [
    "BufferedGroup",
    "GroupBuffer",
    "GroupStats",
    "StalenessProgress",
    "concat_groups",
    "staleness_metrics",
    "version_metrics",
]

_PROMPT_ALIGNED = ("input_ids", "attention_mask", "position_ids")


@dataclass
class BufferedGroup:
    """One received group waiting to be trained on (``nbytes``: the memory it holds)."""

    sampler_id: str
    seq: int
    version: int
    batch: Batch
    received: float = field(default_factory=time.monotonic)
    nbytes: int = 0


class GroupBuffer:
    """Groups in arrival order, keyed by (sampler_id, seq); ``nbytes`` is the sum of theirs.
    ``drop``: groups past ``max_staleness`` are dropped (``drop_stale``); else all are kept."""

    def __init__(self, max_staleness: int, *, drop: bool = True) -> None:
        if max_staleness < 0:
            raise ValueError(f"asynchronous.max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness, self.drop = max_staleness, drop
        self._groups: OrderedDict[tuple[str, int], BufferedGroup] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._groups)

    def held_for_others(self, sampler_id: str) -> int:
        """How many waiting groups come from samplers other than ``sampler_id``."""
        return sum(1 for sender, _ in self._groups if sender != sampler_id)

    def senders(self) -> set[str]:
        """The sampler ids whose groups are waiting here."""
        return {sender for sender, _ in self._groups}

    def holds(self, sampler_id: str, seq: int) -> bool:
        """True if group ``seq`` of ``sampler_id`` is waiting here."""
        return (sampler_id, seq) in self._groups

    def add(self, group: BufferedGroup) -> None:
        """Queue ``group`` (ValueError if the same group is already queued)."""
        key = (group.sampler_id, group.seq)
        if key in self._groups:
            raise ValueError(f"group {group.sampler_id}:{group.seq} is already buffered")
        self._groups[key] = group
        self.nbytes += group.nbytes

    def is_stale(self, group: BufferedGroup, version: int) -> bool:
        """True if ``version - group.version > max_staleness``."""
        return version - group.version > self.max_staleness

    def drop_stale(self, version: int) -> list[BufferedGroup]:
        """Remove and return the groups too stale to train at learner ``version`` (none when
        this buffer keeps stale groups)."""
        stale = [g for g in self._groups.values() if self.drop and self.is_stale(g, version)]
        for g in stale:
            del self._groups[(g.sampler_id, g.seq)]
            self.nbytes -= g.nbytes
        return stale

    def take(self, count: int) -> list[BufferedGroup]:
        """Remove and return the ``count`` oldest groups (fewer if fewer are waiting)."""
        taken = [self._groups.pop(k) for k in list(self._groups)[:count]]
        self.nbytes -= sum(g.nbytes for g in taken)
        return taken


def _pad(x: torch.Tensor, left: int, right: int, value: float) -> torch.Tensor:
    if left == 0 and right == 0:
        return x
    return torch.nn.functional.pad(x, (left, right), value=value)


def concat_groups(groups: list[Batch], pad_token_id: int) -> Batch:
    """Concatenate groups of different prompt width P and response width T into one Batch.

    Prompts are left-padded to the widest P (``pad_token_id``, attention 0), responses and
    every (B, T) field right-padded to the widest T (responses with ``pad_token_id``, other
    fields with 0); ``input_ids``/``attention_mask`` are rebuilt as prompt | response and
    ``position_ids`` = clamp(cumsum(attention_mask) - 1, 0), which leaves every real token's
    position unchanged. (B,) fields and non-tensors are concatenated as they are.
    """
    if not groups:
        raise ValueError("concat_groups needs at least one group")
    width_p = max(g["prompts"].shape[1] for g in groups)
    width_t = max(g["responses"].shape[1] for g in groups)
    padded = []
    for g in groups:
        p, t = g["prompts"].shape[1], g["responses"].shape[1]
        left, right = width_p - p, width_t - t
        tensors: dict[str, torch.Tensor] = {}
        for name, x in g.tensors.items():
            if name in _PROMPT_ALIGNED:
                continue
            if name == "prompts":
                tensors[name] = _pad(x, left, 0, pad_token_id)
            elif x.ndim == 1:
                tensors[name] = x
            elif x.ndim == 2 and x.shape[1] == t:
                tensors[name] = _pad(x, 0, right, pad_token_id if name == "responses" else 0)
            else:
                raise ValueError(
                    f"cannot align field {name!r} of shape {tuple(x.shape)}: neither (B,), "
                    f"(B, P+T) nor (B, T) with T = {t}"
                )
        attention = g["attention_mask"]
        tensors["attention_mask"] = torch.cat(
            [_pad(attention[:, :p], left, 0, 0), _pad(attention[:, p:], 0, right, 0)], dim=1
        )
        tensors["input_ids"] = torch.cat([tensors["prompts"], tensors["responses"]], dim=1)
        tensors["position_ids"] = position_ids_from_mask(tensors["attention_mask"])
        padded.append(Batch(tensors, g.non_tensors, g.meta))
    return Batch.concat(padded)


def staleness_metrics(staleness: torch.Tensor) -> dict[str, float]:
    """``async/staleness/{mean,max,min}`` over the samples of a step, and the fraction fresh."""
    s = staleness.to(torch.float64)
    return {
        "async/staleness/mean": float(s.mean()),
        "async/staleness/max": float(s.max()),
        "async/staleness/min": float(s.min()),
        "async/on_policy_fraction": float((s == 0).to(torch.float64).mean()),
    }


class GroupStats:
    """Run totals of the episodes a staleness policy dropped, trained late (past
    ``max_staleness``, ``staleness_policy=keep``) and trained in time: their count, response
    length and score (``token_level_scores`` summed); and the latest step's per-token
    staleness (``partial.version_metrics``) when its rows carry ``token_weight_version``."""

    KINDS = ("trained", "late", "dropped")

    def __init__(self) -> None:
        self.totals = {k: [0, 0.0, 0.0] for k in self.KINDS}  # episodes, length sum, score sum
        self.tokens: dict[str, float] = {}

    def add(self, kind: str, batch: Batch) -> None:
        """Count the episodes of ``batch`` under ``kind``."""
        total = self.totals[kind]
        total[0] += len(batch)
        total[1] += float(batch["response_mask"].sum())
        if "token_level_scores" in batch:
            total[2] += float(batch["token_level_scores"].sum())

    def add_trained(self, batch: Batch, max_staleness: int, version: int | None = None) -> None:
        """Count a step's rows, trained at learner ``version``: ``late`` where ``staleness`` >
        ``max_staleness``, else ``trained``."""
        if version is not None and "token_weight_version" in batch:
            self.tokens = version_metrics(batch, version)
        late = batch["staleness"] > max_staleness
        if bool(late.any()):
            self.add("late", batch[late])
        if not bool(late.all()):
            self.add("trained", batch[~late] if bool(late.any()) else batch)

    def metrics(self) -> dict[str, float]:
        """``async/{kind}/episodes``, and for kinds seen, ``async/{kind}/response_length`` and
        ``async/{kind}/score``: means over the run's episodes of that kind so far."""
        out: dict[str, float] = dict(self.tokens)
        for kind, (count, length, score) in self.totals.items():
            out[f"async/{kind}/episodes"] = float(count)
            if count:
                out[f"async/{kind}/response_length"] = length / count
                out[f"async/{kind}/score"] = score / count
        return out


def version_metrics(batch: Batch, version: int) -> dict[str, float]:
    """Per-token staleness at learner ``version``: ``async/token_staleness/{mean,max}`` of
    ``version - token_weight_version`` over ``response_mask``, and
    ``async/partial/switched_fraction``: the share of rows sampled by more than one version."""
    mask = batch["response_mask"].bool()
    tokens = batch["token_weight_version"]
    staleness = (version - tokens)[mask].to(torch.float64)
    big = torch.iinfo(torch.long).max
    lowest = torch.where(mask, tokens, big).min(-1).values
    highest = torch.where(mask, tokens, -1).max(-1).values
    return {
        "async/token_staleness/mean": float(staleness.mean()) if len(staleness) else 0.0,
        "async/token_staleness/max": float(staleness.max()) if len(staleness) else 0.0,
        "async/partial/switched_fraction": float((highest > lowest).to(torch.float64).mean()),
    }


class StalenessProgress:
    """The learner's progress: one line per step with its score, staleness and seconds."""

    def __init__(self, total: int, console: Any) -> None:
        self.total, self.console = total, console

    def update(self, step: int, metrics: dict[str, float]) -> None:
        self.console.print(
            f"learner step {step}/{self.total}: "
            f"score {metrics.get('critic/score/mean', float('nan')):.3f}, "
            f"staleness {metrics['async/staleness/mean']:.2f}, "
            f"{metrics['perf/time_per_step']:.1f}s"
        )

    def close(self) -> None:
        """Nothing to close."""

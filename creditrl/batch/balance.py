"""Balance a batch's tokens over data-parallel ranks (verl's ``_balance_batch``).

Rank r of ``world_size`` receives the r-th contiguous equal chunk (``Batch.chunk(world_size)``).
``balance_batch`` reorders the samples so that every chunk holds about the same number of
tokens, sum_i attention_mask[i].sum() over the chunk's samples, with the Karmarkar-Karp largest
differencing method restricted to partitions of equal size. Samples are independent here:
GRPO groups travel by their ``uid`` field, never by adjacency.

The partitioner is written here (about 50 lines of heapq) rather than taken from PyPI: the
packages that implement Karmarkar-Karp (e.g. ``numberpartitioning``) are small, rarely
released, and do not offer the equal-cardinality variant that data-parallel chunks need.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

import torch

from creditrl.batch.batch import Batch

__all__ = [
    "BalancedBatch",
    "balance_batch",
    "invert_permutation",
    "karmarkar_karp",
    "seqlen_balance_metrics",
]

_Partition = tuple[int, list[int]]  # (sum of weights, item indices)


def _spread(state: list[_Partition]) -> int:
    return state[0][0] - state[-1][0]


def karmarkar_karp(weights: Sequence[int], k: int, equal_size: bool = True) -> list[list[int]]:
    """Partition item indices ``0..n-1`` into ``k`` sets of near-equal weight sums.

    Largest differencing method for k-way partitioning: every state is a k-tuple of partial
    sets sorted by sum (descending); its spread is max sum - min sum. Repeatedly pop the two
    states of largest spread and merge them, joining the heaviest set of one with the lightest
    of the other (set i of A with set k-1-i of B), until one state is left. With
    ``equal_size`` the initial states are the sorted weights taken k at a time, one item per
    set, so each final set holds exactly n / k items (n must be divisible by k). Otherwise each
    item starts as its own state (one set holding it, k-1 empty sets). Each returned set lists
    its indices in ascending order; sets are ordered by their smallest index.
    """
    n = len(weights)
    if k < 1:
        raise ValueError(f"number of partitions must be >= 1, got {k}")
    if equal_size and n % k:
        raise ValueError(f"{n} items cannot be split into {k} partitions of equal size")
    order = sorted(range(n), key=lambda i: (weights[i], i))
    if equal_size:
        starts = [[(int(weights[i]), [i]) for i in order[g : g + k]] for g in range(0, n, k)]
    else:
        starts = [[(int(weights[i]), [i])] + [(0, [])] * (k - 1) for i in order]
    heap: list[tuple[int, int, list[_Partition]]] = []
    for tick, state in enumerate(starts):
        state.sort(key=lambda part: part[0], reverse=True)
        heapq.heappush(heap, (-_spread(state), tick, state))
    tick = len(starts)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b), strict=True)]
        merged.sort(key=lambda part: part[0], reverse=True)
        heapq.heappush(heap, (-_spread(merged), tick, merged))
        tick += 1
    final = heap[0][2] if heap else [(0, [])] * k
    sets = [sorted(items) for _, items in final]
    return sorted(sets, key=lambda s: (s[0] if s else n, len(s)))


def seqlen_balance_metrics(
    seqlens: Sequence[int], partitions: Sequence[Sequence[int]], prefix: str = "global_seqlen"
) -> dict[str, float]:
    """verl's ``log_seqlen_unbalance``: token sums per rank before and after balancing.

    Before: the contiguous equal chunks of the given order (``{prefix}/min``, ``/max``,
    ``/minmax_diff``); after: the sums of ``partitions`` (``/balanced_min``,
    ``/balanced_max``); ``/mean`` = total tokens / number of ranks (the same for both).
    """
    k = len(partitions)
    size = len(seqlens) // k
    before = [sum(seqlens[r * size : (r + 1) * size]) for r in range(k)]
    after = [sum(seqlens[i] for i in part) for part in partitions]
    return {
        f"{prefix}/min": float(min(before)),
        f"{prefix}/max": float(max(before)),
        f"{prefix}/minmax_diff": float(max(before) - min(before)),
        f"{prefix}/balanced_min": float(min(after)),
        f"{prefix}/balanced_max": float(max(after)),
        f"{prefix}/mean": float(sum(before)) / k,
    }


class BalancedBatch(NamedTuple):
    """The reordered batch, ``batch = original[permutation]``, and verl-named metrics."""

    batch: Batch
    permutation: torch.Tensor
    metrics: dict[str, float]


def invert_permutation(permutation: torch.Tensor) -> torch.Tensor:
    """``inverse`` with ``reordered[inverse] == original`` for ``reordered = original[perm]``."""
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(len(permutation), device=permutation.device)
    return inverse


def balance_batch(batch: Batch, world_size: int, prefix: str = "global_seqlen") -> BalancedBatch:
    """Reorder ``batch`` so each of ``world_size`` contiguous equal chunks has about the same
    number of tokens (``attention_mask`` sums: prompt + response tokens of each sample).

    Returns ``BalancedBatch(batch, permutation, metrics)``: ``batch`` = the input's samples in
    the order ``permutation`` (a LongTensor permutation of ``range(len(batch))``), rank r's
    samples at ``[r * n/world_size, (r+1) * n/world_size)``; undo with
    ``balanced.batch[invert_permutation(balanced.permutation)]``. The given order is kept
    (identity permutation) when Karmarkar-Karp does not lower the spread (max - min token
    sum), so the spread after is never larger than before. ``len(batch)`` must be divisible by
    ``world_size`` (see ``pad_to_divisor``).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if len(batch) % world_size:
        raise ValueError(
            f"balance_batch: {len(batch)} samples are not divisible by world_size {world_size}; "
            f"pad first with pad_to_divisor(batch, {world_size})"
        )
    if "attention_mask" not in batch:
        raise KeyError("balance_batch needs the 'attention_mask' field to count tokens")
    seqlens = [int(s) for s in batch["attention_mask"].sum(-1).tolist()]
    size = len(seqlens) // world_size
    identity = [list(range(r * size, (r + 1) * size)) for r in range(world_size)]
    partitions = karmarkar_karp(seqlens, world_size, equal_size=True)
    metrics = seqlen_balance_metrics(seqlens, partitions, prefix)
    if (
        metrics[f"{prefix}/balanced_max"] - metrics[f"{prefix}/balanced_min"]
        >= metrics[f"{prefix}/minmax_diff"]
    ):
        partitions = identity
        metrics = seqlen_balance_metrics(seqlens, partitions, prefix)
    permutation = torch.tensor([i for part in partitions for i in part], dtype=torch.long)
    return BalancedBatch(batch[permutation], permutation, metrics)

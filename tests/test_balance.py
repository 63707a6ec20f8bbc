"""balance_batch: Karmarkar-Karp over data-parallel ranks, with equal-size chunks."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from creditrl import Batch
from creditrl.batch import balance_batch, invert_permutation
from creditrl.batch.balance import karmarkar_karp


def batch_of(lengths: list[int], width: int | None = None) -> Batch:
    """Samples whose attention_mask sums to ``lengths``; ``uid`` and ``row`` identify them."""
    width = width or max([*lengths, 1])
    attention = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return Batch.from_dict(
        {"attention_mask": attention, "row": torch.arange(len(lengths))},
        {"uid": [f"g{i // 2}" for i in range(len(lengths))]},
    )


def spread(lengths: list[int], partitions) -> int:
    sums = [sum(lengths[i] for i in part) for part in partitions]
    return max(sums) - min(sums)


def optimum(lengths: list[int], k: int) -> int:
    """Brute force: the smallest spread over all splits into k sets of len/k items."""
    size = len(lengths) // k
    best = None
    for perm in itertools.permutations(range(len(lengths))):
        parts = [perm[r * size : (r + 1) * size] for r in range(k)]
        value = spread(lengths, parts)
        best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize(
    ("lengths", "k", "best"),
    [
        ([1, 2, 3, 4], 2, 0),
        ([5, 5, 4, 3, 3, 1], 3, 2),
        ([10, 1, 9, 2, 8, 3], 2, 3),
        ([7, 7, 1, 1, 4, 4], 3, 0),
        ([100, 1, 1, 1], 2, 99),
        ([3, 3, 3, 3, 3, 3], 3, 0),
    ],
)
def test_karmarkar_karp_finds_the_optimum_on_small_cases(lengths, k, best) -> None:
    assert optimum(lengths, k) == best
    parts = karmarkar_karp(lengths, k)
    assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
    assert all(len(part) == len(lengths) // k for part in parts)
    assert spread(lengths, parts) == best


def test_balance_batch_hand_case_metrics_and_undo() -> None:
    lengths = [10, 9, 1, 2, 8, 3]  # as given: [10, 9, 1] = 20, [2, 8, 3] = 13; best 15 / 18
    batch = batch_of(lengths)
    out = balance_batch(batch, 2)
    assert out.metrics == {
        "global_seqlen/min": 13.0,
        "global_seqlen/max": 20.0,
        "global_seqlen/minmax_diff": 7.0,
        "global_seqlen/balanced_min": 15.0,
        "global_seqlen/balanced_max": 18.0,
        "global_seqlen/mean": 16.5,
    }
    ranks = out.batch.chunk(2)
    assert sorted(int(r["attention_mask"].sum()) for r in ranks) == [15, 18]
    assert out.batch["row"].tolist() == out.permutation.tolist()
    assert list(out.batch["uid"]) == [batch["uid"][i] for i in out.permutation.tolist()]
    assert out.batch[invert_permutation(out.permutation)].equals(batch)


def test_balance_batch_errors() -> None:
    with pytest.raises(ValueError, match="5 samples are not divisible by world_size 2"):
        balance_batch(batch_of([1, 2, 3, 4, 5]), 2)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        balance_batch(batch_of([1, 2]), 0)
    with pytest.raises(KeyError, match="attention_mask"):
        balance_batch(Batch.from_dict({"x": torch.zeros(2)}), 1)
    with pytest.raises(ValueError, match="equal size"):
        karmarkar_karp([1, 2, 3], 2)


@settings(max_examples=60, deadline=None)
@given(
    world_size=st.integers(1, 5),
    per_rank=st.integers(1, 6),
    data=st.data(),
)
def test_balance_batch_properties(world_size: int, per_rank: int, data) -> None:
    n = world_size * per_rank
    lengths = data.draw(st.lists(st.integers(0, 64), min_size=n, max_size=n))
    batch = batch_of(lengths)
    out = balance_batch(batch, world_size)
    perm = out.permutation
    assert sorted(perm.tolist()) == list(range(n))  # every sample exactly once
    assert out.batch["row"].tolist() == perm.tolist()
    ranks = out.batch.chunk(world_size)
    assert [len(r) for r in ranks] == [per_rank] * world_size
    sums = [int(r["attention_mask"].sum()) for r in ranks]
    m = out.metrics
    assert (min(sums), max(sums)) == (
        m["global_seqlen/balanced_min"],
        m["global_seqlen/balanced_max"],
    )
    assert max(sums) - min(sums) <= m["global_seqlen/minmax_diff"]
    if max(sums) - min(sums) == m["global_seqlen/minmax_diff"]:  # no gain: order kept
        assert perm.tolist() == list(range(n))
    assert m["global_seqlen/mean"] == pytest.approx(sum(lengths) / world_size)
    assert out.batch[invert_permutation(perm)].equals(batch)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=4, max_size=6).filter(lambda x: len(x) % 2 == 0))
def test_two_way_karmarkar_karp_is_near_optimal(lengths: list[int]) -> None:
    parts = karmarkar_karp(lengths, 2)
    assert spread(lengths, parts) <= optimum(lengths, 2) + max(lengths)

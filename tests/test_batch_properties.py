"""Property tests: sharding, repeating and reordering random ragged batches are lossless."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from creditrl.batch import Batch, require, unpad

PAD = 0


@st.composite
def ragged_batches(draw: st.DrawFn, min_size: int = 1) -> Batch:
    """Left-padded prompts, right-padded responses with observation tokens, random lengths."""
    b = draw(st.integers(min_size, 12))
    p = draw(st.integers(1, 5))
    t = draw(st.integers(1, 6))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    prompt_len = torch.randint(1, p + 1, (b,), generator=gen)
    resp_len = torch.randint(0, t + 1, (b,), generator=gen)
    prompt_mask = torch.arange(p) >= (p - prompt_len)[:, None]
    in_response = torch.arange(t) < resp_len[:, None]
    observation = torch.rand(b, t, generator=gen) < 0.3
    prompts = torch.randint(1, 50, (b, p), generator=gen) * prompt_mask
    responses = torch.randint(1, 50, (b, t), generator=gen) * in_response
    group = torch.randint(0, 3, (b,), generator=gen)
    return Batch.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, in_response], dim=1).long(),
            "response_mask": (in_response & ~observation).long(),
            "old_log_probs": -torch.rand(b, t, generator=gen) * in_response,
            "advantages": torch.randn(b, t, generator=gen).to(torch.bfloat16),
        },
        {
            "uid": [f"prompt-{i}-{int(g)}" for i, g in enumerate(group)],
            "extra_info": [
                {"len": int(n), "obs": bool(o.any())}
                for n, o in zip(resp_len, observation, strict=True)
            ],
        },
        {"step": draw(st.integers(0, 100))},
    )


def check_consistent(batch: Batch) -> None:
    """Shapes agree with the catalogue and masks are still masks of the right rows."""
    require(batch, "responses", "response_mask", "attention_mask", "input_ids", "old_log_probs")
    assert set(batch["response_mask"].unique().tolist()) <= {0, 1}
    assert bool((batch["response_mask"] <= (batch["responses"] != PAD)).all())
    assert [e["len"] for e in batch["extra_info"]] == (batch["responses"] != PAD).sum(1).tolist()


FAST = settings(max_examples=40, deadline=None)


@FAST
@given(ragged_batches(), st.integers(1, 4))
def test_chunk_concat_is_identity(batch: Batch, per_shard: int) -> None:
    n = len(batch)
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    shards = batch.chunk(divisors[per_shard % len(divisors)])
    for shard in shards:
        check_consistent(shard)
    assert Batch.concat(shards).equals(batch)


@FAST
@given(ragged_batches(), st.integers(1, 15))
def test_padded_chunk_concat_unpad_is_identity(batch: Batch, n: int) -> None:
    shards = batch.chunk(n, pad=True)
    assert len(shards) == n and len({len(s) for s in shards}) == 1
    merged = Batch.concat(shards)
    assert len(merged) % n == 0
    restored = unpad(merged, -len(batch) % n)
    check_consistent(restored)
    assert restored.equals(batch)


@FAST
@given(ragged_batches(), st.integers(1, 4))
def test_repeat_layouts(batch: Batch, n: int) -> None:
    b = len(batch)
    inter = batch.repeat(n, interleave=True)
    tiled = batch.repeat(n, interleave=False)
    for r in (inter, tiled):
        check_consistent(r)
        assert r["responses"].shape == (b * n, batch["responses"].shape[1])
    for i in range(b):
        group = inter[i * n : (i + 1) * n]
        assert set(group["uid"].tolist()) == {batch["uid"][i]}
        assert Batch.concat([batch[i]] * n).equals(group)
    for j in range(b * n):
        assert tiled["uid"][j] == batch["uid"][j % b]
    assert Batch.concat([batch] * n).equals(tiled)


@FAST
@given(ragged_batches(), st.randoms(use_true_random=False))
def test_reorder_then_inverse_is_identity(batch: Batch, rnd) -> None:
    perm = list(range(len(batch)))
    rnd.shuffle(perm)
    inverse = torch.argsort(torch.tensor(perm))
    shuffled = batch[perm]
    shuffled.reorder(inverse)
    assert shuffled.equals(batch)
    original = batch[:]
    batch.reorder(perm)
    check_consistent(batch)
    assert batch["uid"].tolist() == [original["uid"][k] for k in perm]
    assert torch.equal(batch["response_mask"], original["response_mask"][perm])
    batch.reorder(inverse)
    assert batch.equals(original)


@FAST
@given(ragged_batches(min_size=0))
def test_bytes_round_trip(batch: Batch) -> None:
    assert Batch.from_bytes(batch.to_bytes()).equals(batch)

"""Property tests on random ragged batches: masks and shapes hold for every estimator."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from creditrl.core import ADV_ESTIMATORS, agg_loss, compute_advantage, compute_gae_advantage_return
from creditrl.core.reference import gae_reverse_loop


@st.composite
def ragged_batches(draw):
    """rewards, values, mask with random lengths and random observation holes; group uids."""
    b = draw(st.integers(2, 8))
    t = draw(st.integers(2, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).double()
    if draw(st.booleans()):
        mask *= (torch.rand(b, t, generator=g) > 0.25).double()
    mask[:, 0] = 1.0
    mask[0, :2] = 1.0  # at least two valid tokens, so whitening is defined
    rewards = torch.randn(b, t, generator=g, dtype=torch.float64) * mask
    values = torch.randn(b, t, generator=g, dtype=torch.float64)
    uids = np.array([f"p{i % draw(st.integers(1, b))}" for i in range(b)], dtype=object)
    return rewards, values, mask, uids


@settings(max_examples=40, deadline=None)
@given(ragged_batches(), st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_gae_matches_the_loop_on_ragged_batches(batch, gamma, lam) -> None:
    rewards, values, mask, _ = batch
    fast = compute_gae_advantage_return(rewards, values, mask, gamma, lam, whiten=False)
    slow = gae_reverse_loop(rewards, values, mask, gamma, lam, whiten=False)
    torch.testing.assert_close(fast, slow, atol=1e-9, rtol=1e-9)


@settings(max_examples=25, deadline=None)
@given(ragged_batches())
def test_every_estimator_keeps_shape_mask_and_finiteness(batch) -> None:
    rewards, values, mask, uids = batch
    baselines = torch.randn(len(uids), dtype=torch.float64)
    for name in ADV_ESTIMATORS.names():
        adv, ret = compute_advantage(
            name, rewards, mask, uids, values=values, reward_baselines=baselines, gamma=0.9, lam=0.9
        )
        assert adv.shape == ret.shape == mask.shape, name
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name
        assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all(), name


@settings(max_examples=25, deadline=None)
@given(ragged_batches(), st.sampled_from(["token-mean", "seq-mean-token-mean", "token-sum"]))
def test_padding_columns_never_change_the_loss(batch, mode) -> None:
    rewards, _, mask, _ = batch
    loss = agg_loss(rewards, mask, mode)
    padded = torch.nn.functional.pad(rewards, (0, 5), value=123.0)
    padded_mask = torch.nn.functional.pad(mask, (0, 5))
    torch.testing.assert_close(agg_loss(padded, padded_mask, mode), loss)

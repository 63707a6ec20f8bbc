"""Masked statistics, loss aggregation modes, and micro-batch gradient invariance."""

from __future__ import annotations

import pytest
import torch

from creditrl.core.aggregation import LOSS_AGG_MODES, agg_loss, global_normalisers
from creditrl.core.masked import masked_mean, masked_sum, masked_var, masked_whiten
from creditrl.core.policy_losses import POLICY_LOSSES, get_policy_loss

DTYPE = torch.float64


def test_masked_statistics_by_hand() -> None:
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]], dtype=DTYPE)
    m = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    assert masked_sum(x, m).item() == 10.0
    assert masked_mean(x, m).item() == 2.5
    torch.testing.assert_close(masked_mean(x, m, dim=-1), torch.tensor([1.5, 3.5], dtype=DTYPE))
    assert masked_var(x, m).item() == pytest.approx(5.0 / 3.0)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(1.25)
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0


def test_masked_whiten_zero_mean_unit_unbiased_variance() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g, dtype=DTYPE) * 3.0 + 2.0
    m = (torch.rand(5, 7, generator=g) > 0.3).to(DTYPE)
    w = masked_whiten(x, m)
    assert masked_mean(w, m).item() == pytest.approx(0.0, abs=1e-10)
    assert masked_var(w, m).item() == pytest.approx(1.0, abs=1e-6)
    kept = masked_whiten(x, m, shift_mean=False)
    assert masked_mean(kept, m).item() == pytest.approx(masked_mean(x, m).item())


def test_masked_whiten_with_one_valid_token_is_centred_only() -> None:
    """Pins the defined result for n = 1 (it used to raise inside a training step): the one
    valid entry becomes x - mean = 0, others are x - mean too (callers multiply by the mask);
    shift_mean=False returns the values unchanged."""
    x = torch.tensor([[0.5, 2.0, -1.0], [3.0, 4.0, 5.0]], dtype=DTYPE)
    m = torch.zeros(2, 3, dtype=DTYPE)
    m[0, 1] = 1.0
    torch.testing.assert_close(masked_whiten(x, m), x - 2.0)
    torch.testing.assert_close(masked_whiten(x, m, shift_mean=False), x)


def test_masked_whiten_with_no_valid_token_returns_the_values() -> None:
    """n = 0: nothing to centre by; the values come back unchanged (a copy unless inplace)."""
    x = torch.randn(2, 3, dtype=DTYPE)
    out = masked_whiten(x, torch.zeros(2, 3, dtype=DTYPE))
    torch.testing.assert_close(out, x)
    assert out is not x


def test_reinforce_plus_plus_trains_on_one_token_responses() -> None:
    """A batch whose only policy token is one EOS used to raise in masked_whiten; now the
    advantage there is 0 (centred only) and the return is the reward."""
    from creditrl.core import compute_advantage

    rewards = torch.tensor([[1.0, 0.0]], dtype=DTYPE)
    mask = torch.tensor([[1.0, 0.0]], dtype=DTYPE)
    adv, ret = compute_advantage("reinforce_plus_plus", rewards, mask, ["u"])
    torch.testing.assert_close(adv, torch.zeros_like(adv))
    torch.testing.assert_close(ret, rewards)


LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=DTYPE)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=DTYPE)
HAND = {
    "token-mean": (1 + 2 + 4) / 3,
    "token-sum": 7.0,
    "seq-mean-token-sum": (3 + 4) / 2,
    "seq-mean-token-mean": (1.5 + 4) / 2,
    "seq-mean-token-sum-norm": 7 / (2 * 3),
}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_modes_by_hand(mode: str) -> None:
    assert set(HAND) == set(LOSS_AGG_MODES)
    assert agg_loss(LOSS_MAT, MASK, mode).item() == pytest.approx(HAND[mode])


def test_agg_loss_global_normalisers_and_scale_factor() -> None:
    assert global_normalisers(MASK) == {"global_num_tokens": 3.0, "global_num_seqs": 2.0}
    assert agg_loss(LOSS_MAT, MASK, "token-mean", global_num_tokens=14).item() == 0.5
    assert agg_loss(LOSS_MAT, MASK, "seq-mean-token-sum", global_num_seqs=7).item() == 1.0
    norm = agg_loss(LOSS_MAT, MASK, "seq-mean-token-sum-norm", loss_scale_factor=7)
    assert norm.item() == pytest.approx(0.5)


def test_unknown_agg_mode_raises() -> None:
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'seq-sum'"):
        agg_loss(LOSS_MAT, MASK, "seq-sum")
    old = torch.zeros(2, 3, dtype=DTYPE)
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        get_policy_loss("ppo")(old, old, old, torch.ones_like(old), "mean")


def _batch(seed: int = 0, b: int = 8, t: int = 5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=DTYPE) * 2.0 - 0.1
    logp = old + 0.3 * torch.randn(b, t, generator=g, dtype=DTYPE)
    adv = torch.randn(b, t, generator=g, dtype=DTYPE)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[3] = 0
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(DTYPE)
    weights = torch.rand(b, t, generator=g, dtype=DTYPE) + 0.5
    return old, logp, adv, mask, weights


@pytest.mark.parametrize("name", ["plain", *POLICY_LOSSES.names()])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_accumulate_full_batch_gradient(mode: str, name: str) -> None:
    old, logp, adv, mask, weights = _batch()

    def loss_fn(sl: slice, param: torch.Tensor, **norms: float) -> torch.Tensor:
        if name == "plain":
            return agg_loss(-adv[sl] * param[sl], mask[sl], mode, **norms)
        fn = get_policy_loss(name)
        args = (old[sl], param[sl], adv[sl], mask[sl], mode)
        # fields a loss declares it reads (distill: the teacher's log-probs)
        extra = {k: old[sl] - 0.5 for k in POLICY_LOSSES.info(name).get("requires", ())}
        return fn(*args, rollout_is_weights=weights[sl], **norms, **extra)[0]

    full = logp.clone().requires_grad_(True)
    full_loss = loss_fn(slice(None), full)
    full_loss.backward()
    assert torch.any(full.grad != 0)

    norms = global_normalisers(mask)
    b = logp.shape[0]
    for n_micro in (1, 2, 4):
        param = logp.clone().requires_grad_(True)
        size = b // n_micro
        total = torch.zeros((), dtype=DTYPE)
        for k in range(n_micro):
            micro = loss_fn(slice(k * size, (k + 1) * size), param, **norms)
            micro.backward()
            total = total + micro.detach()
        torch.testing.assert_close(param.grad, full.grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(total, full_loss.detach(), rtol=0, atol=1e-6)

"""Policy losses: gradients at ratio 1, clipping, dual clip, metrics, IS weights, hand values."""

from __future__ import annotations

import math

import pytest
import torch

from creditrl.core.aggregation import LOSS_AGG_MODES, agg_loss
from creditrl.core.policy_losses import (
    POLICY_LOSSES,
    PolicyLossConfig,
    get_policy_loss,
)

LOSS_NAMES = ["ppo", "vanilla", "gspo", "cispo", "gpg", "sapo"]
DTYPE = torch.float64


def make_batch(seed: int = 0, b: int = 4, t: int = 6, spread: float = 0.0):
    """Random (old_log_prob, log_prob, advantages, response_mask); log ratio ~ spread * N(0,1)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=DTYPE) * 3.0 - 0.05
    logp = old + spread * torch.randn(b, t, generator=g, dtype=DTYPE)
    adv = torch.randn(b, t, generator=g, dtype=DTYPE)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(DTYPE)
    return old, logp, adv, mask


def test_registry_names_and_unknown_name() -> None:
    assert set(POLICY_LOSSES.names()) == {*LOSS_NAMES, "distill"}  # distill: test_distill_core
    assert get_policy_loss("vanilla") is get_policy_loss("ppo")
    with pytest.raises(KeyError, match=r"unknown policy loss 'nope'.*'cispo'.*'ppo'"):
        get_policy_loss("nope")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_gradient_at_ratio_one_is_policy_gradient(name: str, mode: str) -> None:
    old, _, adv, mask = make_batch(seed=1)
    logp = old.clone().requires_grad_(True)
    loss, metrics = get_policy_loss(name)(old, logp, adv, mask, mode)
    loss.backward()

    ref = old.clone().requires_grad_(True)
    agg_loss(-adv * ref, mask, mode).backward()

    assert loss.shape == ()
    torch.testing.assert_close(logp.grad, ref.grad, rtol=1e-10, atol=1e-12)
    assert set(metrics) == {"pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    assert all(not v.requires_grad and v.shape == () for v in metrics.values())
    assert metrics["ppo_kl"].item() == 0.0
    assert metrics["pg_clipfrac"].item() == 0.0


def test_ppo_clipped_tokens_get_zero_gradient_and_clipfracs() -> None:
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    ratios = torch.tensor([0.5, 0.75, 0.9, 1.1, 1.25, 1.4, 2.5, 4.0], dtype=DTYPE)
    old, _, _, _ = make_batch(seed=2, b=2, t=8)
    r = ratios.repeat(2, 1)
    adv = torch.tensor([[1.0] * 8, [-1.5] * 8], dtype=DTYPE)
    mask = torch.ones(2, 8, dtype=DTYPE)
    mask[1, 2] = 0.0
    logp = (old + r.log()).requires_grad_(True)

    loss, metrics = get_policy_loss("ppo")(old, logp, adv, mask, "token-sum", cfg)
    loss.backward()

    pos, neg = adv > 0, adv < 0
    clipped = (pos & (r > 1.28)) | (neg & (r < 0.8))
    dual = neg & (r > 3.0)
    flat = clipped | dual | (mask == 0)
    assert torch.all(logp.grad[flat] == 0.0)
    torch.testing.assert_close(logp.grad[~flat], (-adv * r)[~flat])
    assert torch.all(logp.grad[~flat] != 0.0)

    valid = mask.bool()
    n = valid.sum()
    assert metrics["pg_clipfrac"].item() == pytest.approx(((clipped & valid).sum() / n).item())
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(((dual & valid).sum() / n).item())
    assert metrics["pg_clipfrac"].item() == pytest.approx(5 / 15)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 15)
    assert metrics["ppo_kl"].item() == pytest.approx(-(r.log() * mask).sum().item() / 15)


def test_ppo_dual_clip_caps_negative_advantage_loss() -> None:
    old = torch.zeros(1, 1, dtype=DTYPE)
    adv = torch.tensor([[-1.5]], dtype=DTYPE)
    mask = torch.ones(1, 1, dtype=DTYPE)
    logp = torch.tensor([[math.log(10.0)]], dtype=DTYPE, requires_grad=True)
    loss, metrics = get_policy_loss("ppo")(old, logp, adv, mask, config=PolicyLossConfig())
    loss.backward()
    assert loss.item() == pytest.approx(1.5 * 3.0)
    assert logp.grad.item() == 0.0
    assert metrics["pg_clipfrac_lower"].item() == 1.0

    for c in (1.0, 0.5):
        with pytest.raises(ValueError, match="clip_ratio_c > 1"):
            get_policy_loss("ppo")(old, logp, adv, mask, config=PolicyLossConfig(clip_ratio_c=c))


def test_ppo_hand_computed_values() -> None:
    r = torch.tensor([[1.5, 1.1], [0.5, 4.0]], dtype=DTYPE)
    old = torch.zeros(2, 2, dtype=DTYPE)
    logp = r.log()
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=DTYPE)
    mask = torch.ones(2, 2, dtype=DTYPE)
    loss, metrics = get_policy_loss("ppo")(old, logp, adv, mask, "token-mean")
    # per-token: max(-1.5, -1.2) = -1.2; -1.1; max(0.5, 0.8) = 0.8; min(max(4, 1.2), 3) = 3
    assert loss.item() == pytest.approx((-1.2 - 1.1 + 0.8 + 3.0) / 4)
    assert metrics["pg_loss"].item() == pytest.approx(loss.item())
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(0.25)
    kl = -(math.log(1.5) + math.log(1.1) + math.log(0.5) + math.log(4.0)) / 4
    assert metrics["ppo_kl"].item() == pytest.approx(kl)


def test_gspo_hand_computed_values_and_gradient() -> None:
    r = torch.tensor([[1.5, 1.1], [0.9, 5.0]], dtype=DTYPE)
    old = torch.full((2, 2), -1.0, dtype=DTYPE)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=DTYPE)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=DTYPE)
    logp = (old + r.log()).requires_grad_(True)
    fn = get_policy_loss("gspo")

    # s_0 = sqrt(1.5 * 1.1) = 1.284 > 1.2 -> both tokens -1.2; s_1 = 0.9 (masked token ignored)
    loss, metrics = fn(old, logp, adv, mask, "seq-mean-token-mean")
    assert loss.item() == pytest.approx((-1.2 + 0.9) / 2)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 3)
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    kl = -(math.log(1.5) + math.log(1.1) + math.log(0.9)) / 3
    assert metrics["ppo_kl"].item() == pytest.approx(kl)
    loss.backward()
    expected = torch.tensor([[0.0, 0.0], [0.9 / 2, 0.0]], dtype=DTYPE)
    torch.testing.assert_close(logp.grad, expected)

    token_mean, _ = fn(old, logp.detach(), adv, mask, "token-mean")
    assert token_mean.item() == pytest.approx((-2.4 + 0.9) / 3)


def test_cispo_clips_weight_but_keeps_gradient() -> None:
    r = torch.tensor([[2.0, 0.5, 1.1]], dtype=DTYPE)
    old = torch.full((1, 3), -2.0, dtype=DTYPE)
    adv = torch.tensor([[1.0, -2.0, 0.5]], dtype=DTYPE)
    mask = torch.ones(1, 3, dtype=DTYPE)
    logp = (old + r.log()).requires_grad_(True)
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss, metrics = get_policy_loss("cispo")(old, logp, adv, mask, "token-sum", cfg)
    loss.backward()
    w = torch.tensor([[1.28, 0.8, 1.1]], dtype=DTYPE)
    assert loss.item() == pytest.approx((-w * adv * logp.detach()).sum().item())
    torch.testing.assert_close(logp.grad, -w * adv)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 3)


def test_sapo_value_and_gate_temperatures() -> None:
    r = torch.tensor([[1.5, 0.6]], dtype=DTYPE)
    old = torch.zeros(1, 2, dtype=DTYPE)
    adv = torch.tensor([[2.0, -1.0]], dtype=DTYPE)
    mask = torch.ones(1, 2, dtype=DTYPE)
    cfg = PolicyLossConfig(tau_pos=1.0, tau_neg=1.05)
    loss, _ = get_policy_loss("sapo")(old, r.log(), adv, mask, "token-sum", cfg)

    def gate(x: float, tau: float) -> float:
        return 4.0 / tau / (1.0 + math.exp(-tau * (x - 1.0)))

    expected = -gate(1.5, 1.0) * 2.0 + gate(0.6, 1.05) * 1.0
    assert loss.item() == pytest.approx(expected)
    with pytest.raises(ValueError, match="tau_pos"):
        get_policy_loss("sapo")(old, r.log(), adv, mask, config=PolicyLossConfig(tau_neg=0.0))


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_rollout_is_weights_scale_per_token_loss(name: str) -> None:
    old, logp, adv, mask = make_batch(seed=3, b=2, t=4, spread=0.4)
    fn = get_policy_loss(name)
    per_token = torch.zeros_like(old)
    for i in range(old.shape[0]):
        for j in range(old.shape[1]):
            onehot = torch.zeros_like(old)
            onehot[i, j] = 1.0
            per_token[i, j] = fn(old, logp, adv, mask, "token-sum", rollout_is_weights=onehot)[0]

    w = torch.rand(old.shape, dtype=DTYPE, generator=torch.Generator().manual_seed(4)) + 0.5
    w.requires_grad_(True)
    for mode in LOSS_AGG_MODES:
        weighted, _ = fn(old, logp, adv, mask, mode, rollout_is_weights=w)
        torch.testing.assert_close(weighted, agg_loss(w.detach() * per_token, mask, mode))
    unweighted, _ = fn(old, logp, adv, mask, "token-sum")
    torch.testing.assert_close(unweighted, per_token.sum())

    logp_grad = logp.clone().requires_grad_(True)
    fn(old, logp_grad, adv, mask, rollout_is_weights=w)[0].backward()
    assert w.grad is None

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from creditrl.core.rollout_correction import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_IS_MODES,
    compute_mismatch_metrics,
    compute_rollout_importance_weights,
)

E = math.exp
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# delta = old - rollout = [[0.5, -1.0, 0.0], [0.0, -1.0, pad]]; padding holds garbage.
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, float("nan")]], dtype=torch.float64)
ROLL = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -0.2, float("-inf")]], dtype=torch.float64)


def _close(a: torch.Tensor, b: list[list[float]]) -> None:
    torch.testing.assert_close(a, torch.tensor(b, dtype=a.dtype), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("level", ROLLOUT_IS_LEVELS)
@pytest.mark.parametrize("mode", ROLLOUT_IS_MODES)
def test_identical_log_probs_give_unit_weights(level: str, mode: str) -> None:
    lp = torch.tensor([[-0.7, -1.3, -2.0], [-0.1, -4.0, -9.0]])
    w, mask, met = compute_rollout_importance_weights(lp, lp.clone(), MASK, level, mode)
    assert torch.equal(w, MASK)
    assert torch.equal(mask, MASK)
    assert met["mismatch/mismatch_kl"] == 0.0
    assert met["mismatch/mismatch_k3_kl"] == 0.0
    assert met["mismatch/mismatch_ppl_ratio"] == 1.0
    assert met["mismatch/mismatch_log_ppl_abs_diff"] == 0.0
    assert met["mismatch/rollout_is_eff_sample_size"] == 1.0
    assert met["mismatch/rollout_is_std"] == 0.0
    assert met["mismatch/rollout_is_mean"] == 1.0
    assert met["mismatch/rollout_is_veto_fraction"] == 0.0


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        ("token", [[E(0.5), E(-1.0), 1.0], [1.0, E(-1.0), 0.0]]),
        ("sequence", [[E(-0.5)] * 3, [E(-1.0), E(-1.0), 0.0]]),
        ("geometric", [[E(-0.5 / 3)] * 3, [E(-0.5), E(-0.5), 0.0]]),
    ],
)
def test_hand_computed_weights_on_ragged_batch(level: str, expected: list[list[float]]) -> None:
    w, mask, met = compute_rollout_importance_weights(
        OLD, ROLL, MASK, level, "truncate", rollout_is_threshold=10.0
    )
    _close(w, expected)
    assert torch.equal(mask, MASK)
    assert met["mismatch/rollout_is_clipped_fraction"] == 0.0
    assert all(math.isfinite(v) for v in met.values())


def test_mismatch_metrics_hand_computed() -> None:
    met = compute_mismatch_metrics(OLD, ROLL, MASK)
    # k1 = mean(rollout - old) over 5 valid tokens = -(0.5 - 1 + 0 + 0 - 1) / 5
    assert met["mismatch_kl"] == pytest.approx(1.5 / 5)
    k3 = (E(0.5) - 0.5 - 1) + (E(-1) + 1 - 1) * 2
    assert met["mismatch_k3_kl"] == pytest.approx(k3 / 5)
    train_ppl = (E(3.5 / 3) + E(1.5 / 2)) / 2
    roll_ppl = (E(3.0 / 3) + E(0.5 / 2)) / 2
    assert met["mismatch_training_ppl"] == pytest.approx(train_ppl)
    assert met["mismatch_rollout_ppl"] == pytest.approx(roll_ppl)
    # per-sequence D_i = lbar_roll - lbar_train = [0.5/3, 0.5]
    assert met["mismatch_ppl_ratio"] == pytest.approx((E(0.5 / 3) + E(0.5)) / 2)
    assert met["mismatch_log_ppl_diff_max"] == pytest.approx(0.5)
    assert met["mismatch_log_ppl_diff_min"] == pytest.approx(0.5 / 3)


def test_truncate_clamps_upper_only_and_counts() -> None:
    old = torch.tensor([[2.0, 0.1, -3.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    roll = torch.zeros_like(old)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    w, new_mask, met = compute_rollout_importance_weights(old, roll, mask, "token", "truncate")
    _close(w, [[2.0, E(0.1), E(-3.0), 0.0], [1.0, 1.0, 0.0, 0.0]])
    assert torch.equal(new_mask, mask) and new_mask.dtype == mask.dtype
    assert met["mismatch/rollout_is_clipped_fraction"] == pytest.approx(1 / 5)
    assert met["mismatch/rollout_is_seq_clipped_fraction"] == pytest.approx(1 / 2)
    assert met["mismatch/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    assert met["mismatch/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 5)
    assert met["mismatch/rollout_is_max"] == pytest.approx(E(2.0))
    assert met["mismatch/rollout_is_min"] == pytest.approx(E(-3.0))
    # ESS on rho clamped to [0.5, 2]: w~ = [2, e^0.1, 0.5, 1, 1]
    wt = [2.0, E(0.1), 0.5, 1.0, 1.0]
    ess = sum(wt) ** 2 / (5 * sum(x * x for x in wt))
    assert met["mismatch/rollout_is_eff_sample_size"] == pytest.approx(ess)
    assert "mismatch/rollout_is_masked_fraction" not in met


def test_mask_mode_rejects_tokens_outside_bounds() -> None:
    old = torch.tensor([[2.0, 0.1, -3.0], [0.2, -0.2, 9.0]], dtype=torch.float64)
    roll = torch.zeros_like(old)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    w, new_mask, met = compute_rollout_importance_weights(
        old, roll, mask, "token", "mask", rollout_is_threshold=3.0, rollout_is_threshold_lower=0.4
    )
    # true ratios are kept (not truncated, not zeroed) on valid tokens
    _close(w, [[E(2.0), E(0.1), E(-3.0)], [E(0.2), E(-0.2), 0.0]])
    assert new_mask.dtype == torch.bool
    assert new_mask.tolist() == [[False, True, False], [True, True, False]]
    assert met["mismatch/rollout_is_masked_fraction"] == pytest.approx(2 / 5)
    assert met["mismatch/rollout_is_seq_masked_fraction"] == pytest.approx(1 / 2)


def test_mask_mode_sequence_level_rejects_whole_sequences() -> None:
    old = torch.tensor([[0.5, 0.5, 0.0], [0.1, 0.1, 0.0]], dtype=torch.float64)
    roll = torch.zeros_like(old)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    w, new_mask, met = compute_rollout_importance_weights(old, roll, mask, "sequence", "mask")
    # row 0: exp(1.0) > 2 rejected; row 1: exp(0.2) kept
    assert new_mask.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    _close(w, [[E(1.0), E(1.0), 0.0], [E(0.2)] * 3])
    assert met["mismatch/rollout_is_seq_masked_fraction"] == pytest.approx(1 / 2)
    assert met["mismatch/rollout_is_masked_fraction"] == pytest.approx(2 / 5)
    assert met["mismatch/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 2)


@pytest.mark.parametrize("mode", ROLLOUT_IS_MODES)
def test_veto_rejects_whole_sequence(mode: str) -> None:
    old = torch.tensor([[0.0, -10.0, 0.0], [0.1, 0.0, 0.0]], dtype=torch.float64)
    roll = torch.zeros_like(old)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w, new_mask, met = compute_rollout_importance_weights(
        old, roll, mask, "token", mode, rollout_is_veto_threshold=1e-3
    )
    assert new_mask.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    assert met["mismatch/rollout_is_veto_fraction"] == pytest.approx(0.5)
    assert met["mismatch/rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 5)
    assert w[0, 0].item() == 1.0 and w[0, 1].item() == pytest.approx(E(-10.0))


def test_veto_ignores_padding() -> None:
    old = torch.tensor([[0.0, -50.0]])
    roll = torch.zeros_like(old)
    mask = torch.tensor([[1.0, 0.0]])
    _, new_mask, met = compute_rollout_importance_weights(
        old, roll, mask, rollout_is_veto_threshold=1e-4
    )
    assert new_mask.tolist() == [[1.0, 0.0]]
    assert met["mismatch/rollout_is_veto_fraction"] == 0.0


def test_geometric_is_exp_of_mean_log_ratio() -> None:
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 3
    roll = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 3
    lengths = [7, 1, 4, 5]
    mask = torch.tensor([[float(j < n) for j in range(7)] for n in lengths])
    w, _, _ = compute_rollout_importance_weights(
        old, roll, mask, "geometric", rollout_is_threshold=100.0
    )
    for i, n in enumerate(lengths):
        expected = math.exp(sum((old[i, j] - roll[i, j]).item() for j in range(n)) / n)
        assert torch.allclose(w[i, :n], torch.full((n,), expected, dtype=w.dtype))
        assert torch.all(w[i, n:] == 0)


def test_safety_bound_keeps_sequence_weights_finite() -> None:
    old = torch.zeros(1, 50)
    roll = torch.full((1, 50), -5.0)
    w, _, met = compute_rollout_importance_weights(
        old, roll, torch.ones(1, 50), "sequence", "mask", rollout_is_threshold=1e10
    )
    assert torch.allclose(w, torch.full_like(w, E(20.0)))
    assert met["mismatch/rollout_is_max"] == pytest.approx(E(20.0), rel=1e-5)


def test_weights_carry_no_gradient() -> None:
    old = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    roll = torch.tensor([[-1.1, -1.5]], requires_grad=True)
    for level in ROLLOUT_IS_LEVELS:
        w, mask, _ = compute_rollout_importance_weights(old, roll, torch.ones(1, 2), level)
        assert not w.requires_grad and w.grad_fn is None
        assert not mask.requires_grad


def test_invalid_names_raise_naming_choices() -> None:
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"token.*sequence.*geometric"):
        compute_rollout_importance_weights(lp, lp, torch.ones(1, 2), rollout_is_level="seq")
    with pytest.raises(ValueError, match=r"truncate.*mask"):
        compute_rollout_importance_weights(lp, lp, torch.ones(1, 2), rollout_is_mode="clip")
    with pytest.raises(ValueError, match="threshold"):
        compute_rollout_importance_weights(lp, lp, torch.ones(1, 2), rollout_is_threshold=0.0)
    with pytest.raises(ValueError, match="no valid token"):
        compute_mismatch_metrics(lp, lp, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="shape"):
        compute_mismatch_metrics(lp, lp, torch.ones(1, 3))


@st.composite
def ragged_batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b = draw(st.integers(1, 4))
    t = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
    if max(lengths) == 0:
        lengths[0] = 1
    lp = st.floats(-30.0, 0.0, allow_nan=False, width=32)
    old = draw(st.lists(st.lists(lp, min_size=t, max_size=t), min_size=b, max_size=b))
    roll = draw(st.lists(st.lists(lp, min_size=t, max_size=t), min_size=b, max_size=b))
    mask = torch.tensor([[float(j < n) for j in range(t)] for n in lengths])
    return torch.tensor(old), torch.tensor(roll), mask


@settings(max_examples=80, deadline=None)
@given(
    batch=ragged_batches(),
    level=st.sampled_from(ROLLOUT_IS_LEVELS),
    mode=st.sampled_from(ROLLOUT_IS_MODES),
    threshold=st.floats(1.01, 10.0),
    veto=st.sampled_from([None, 1e-4, 0.5]),
)
def test_property_weights_finite_nonnegative_zero_on_padding(
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    level: str,
    mode: str,
    threshold: float,
    veto: float | None,
) -> None:
    old, roll, mask = batch
    w, new_mask, met = compute_rollout_importance_weights(
        old, roll, mask, level, mode, threshold, rollout_is_veto_threshold=veto
    )
    assert w.shape == mask.shape
    assert torch.isfinite(w).all() and (w >= 0).all()
    assert torch.all(w[mask == 0] == 0)
    if mode == "truncate":
        assert (w <= threshold).all()
    assert torch.all(new_mask <= mask)
    ess = met["mismatch/rollout_is_eff_sample_size"]
    assert 0.0 < ess <= 1.0
    assert all(math.isfinite(v) for k, v in met.items() if "ppl" not in k)

"""The spec 000 worked example (ARCHITECTURE.md): scores -> rewards -> GAE, to 1e-5."""

import pytest
import torch

from creditrl.core import (
    apply_kl_penalty,
    compute_gae_advantage_return,
    kl_penalty,
    place_sequence_scores,
)
from creditrl.inspect.example import spec000_example

OLD = [-0.40, -0.30, -0.60, -0.80, -0.20, -0.25]
REF = [-0.50, -0.35, -0.55, -0.90, -0.40, -0.30]
VALUES = [0.20, 0.25, 0.30, 0.35, 0.45, 0.60]
REWARDS = [-0.01, -0.005, 0.005, -0.01, -0.02, 0.995]
RAW_ADV = [0.621081, 0.611664, 0.596488, 0.569987, 0.505250, 0.395000]
RETURNS = [0.821081, 0.861664, 0.896488, 0.919987, 0.955250, 0.995000]


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_scores_to_rewards_with_k1_penalty() -> None:
    mask = torch.ones(1, 6)
    scores = place_sequence_scores(torch.tensor([1.0], dtype=torch.float64), mask)
    assert scores.tolist() == [[0, 0, 0, 0, 0, 1]]
    rewards, metrics = apply_kl_penalty(scores, _t([OLD]), _t([REF]), mask, 0.1, "k1")
    torch.testing.assert_close(rewards, _t([REWARDS]), atol=1e-9, rtol=0)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(
        sum(o - r for o, r in zip(OLD, REF, strict=True)) / 6
    )
    torch.testing.assert_close(kl_penalty(_t([OLD]), _t([REF]), "kl"), _t([OLD]) - _t([REF]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gae_worked_example(dtype: torch.dtype) -> None:
    rewards, values = torch.tensor([REWARDS], dtype=dtype), torch.tensor([VALUES], dtype=dtype)
    adv, ret = compute_gae_advantage_return(
        rewards, values, torch.ones(1, 6), 1.0, 0.95, whiten=False
    )
    torch.testing.assert_close(adv, torch.tensor([RAW_ADV], dtype=dtype), atol=1e-5, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([RETURNS], dtype=dtype), atol=1e-5, rtol=0)


def test_gae_worked_example_padded_beside_a_longer_response() -> None:
    rewards = torch.zeros(2, 9)
    values = torch.zeros(2, 9)
    mask = torch.zeros(2, 9)
    rewards[0, :6], values[0, :6], mask[0, :6] = torch.tensor(REWARDS), torch.tensor(VALUES), 1
    values[0, 6:] = 7.0  # garbage in the padding must not leak in
    rewards[1] = torch.linspace(-0.1, 0.3, 9)
    values[1] = torch.linspace(0.5, 0.1, 9)
    mask[1] = 1
    adv, ret = compute_gae_advantage_return(rewards, values, mask, 1.0, 0.95, whiten=False)
    torch.testing.assert_close(adv[0, :6], torch.tensor(RAW_ADV), atol=1e-5, rtol=0)
    torch.testing.assert_close(ret[0, :6], torch.tensor(RETURNS), atol=1e-5, rtol=0)
    assert adv[0, 6:].abs().max() == 0 and ret[0, 6:].abs().max() == 0
    whitened, _ = compute_gae_advantage_return(rewards, values, mask, 1.0, 0.95)
    valid = whitened[mask.bool()]
    assert valid.mean().abs() < 1e-6 and (valid.var() - 1).abs() < 1e-4


def test_example_table_matches_spec() -> None:
    table = spec000_example()
    torch.testing.assert_close(table["reward"], _t([REWARDS])[0], atol=1e-9, rtol=0)
    assert [f"{a:.6f}" for a in table["advantage_raw"].tolist()] == [f"{a:.6f}" for a in RAW_ADV]
    assert [f"{r:.6f}" for r in table["return"].tolist()] == [f"{r:.6f}" for r in RETURNS]
    assert table["token"] == ["是", "的", "，", "等于", "2", "！"]

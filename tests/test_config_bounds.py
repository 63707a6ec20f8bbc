"""Numbers a config may hold beyond the ranges of their meaning: what float32 tensors carry, and
counts whose work grows with them. Each refusal is one line naming the key, at config load."""

from __future__ import annotations

import pytest
from helpers import refused

from creditrl.config import load_config


@pytest.mark.parametrize("key", ["data.few_shot", "distill.teacher_few_shot"])
def test_few_shot_counts_are_bounded_at_config_load(capsys, key: str) -> None:
    """Before, 100000 generated 800,000 candidate examples and rendered 200,000-message
    prompts (3.8 GB after 240 s) before anything said no."""
    line = refused(capsys, f"{key}=100000")
    assert f"{key}=100000 must be in [" in line
    assert load_config(overrides=[f"{key}=64"]) is not None


@pytest.mark.parametrize(
    "key",
    [
        "distill.coef",
        "algorithm.kl_ctrl.kl_coef",
        "actor.kl_loss_coef",
        "actor.entropy_coeff",
        "algorithm.overlong_buffer.penalty_factor",
        "reward.fallback_score",
    ],
)
def test_coefficients_are_bounded_to_what_float32_carries(capsys, key: str) -> None:
    """Before, 1e39 passed (finite in float64) and became inf in the float32 reward tensors:
    a traceback at step 1; 1e30 is finite in float32 but its products with per-token terms
    are not."""
    for value in ("1e39", "-1e39"):
        assert refused(capsys, f"{key}={value}").startswith(f"error: {key}=")
    assert f"{key}=1e+30 must be in [" in refused(capsys, f"{key}=1e30")


@pytest.mark.parametrize("key", ["actor.optim.lr", "rollout.temperature", "actor.clip_ratio"])
def test_every_float_setting_fits_float32(capsys, key: str) -> None:
    line = refused(capsys, f"{key}=1e39")
    assert f"{key}=1e+39 is beyond what float32 carries" in line


def test_the_loss_divisor_is_bounded_to_what_float32_carries(capsys) -> None:
    """actor.loss_scale_factor divides the summed per-token losses (seq-mean-token-sum-norm):
    1e-40 passed (> 0) and made the float32 loss inf, 1e39 is inf in float32 itself; the
    critic has no such key."""
    import torch

    from creditrl.core.aggregation import agg_loss

    mode = "actor.loss_agg_mode=seq-mean-token-sum-norm"
    loss = agg_loss(torch.ones(2, 3), torch.ones(2, 3), mode.split("=")[1], loss_scale_factor=1e-40)
    assert torch.isinf(loss)  # what a value below the range did
    for value in ("1e-40", "0.0001", "1e8", "1e39"):
        line = refused(capsys, mode, f"actor.loss_scale_factor={value}")
        assert line.startswith("error: actor.loss_scale_factor=")
        assert "must be in [0.001, 10000000]" in line or "beyond what float32 carries" in line
    for value in ("0.001", "4096", "1e7"):
        cfg = load_config(overrides=[mode, f"actor.loss_scale_factor={value}"])
        assert cfg.actor.loss_scale_factor == float(value)
    assert not hasattr(load_config().critic, "loss_scale_factor")

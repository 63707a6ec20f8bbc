"""AdamW: the fused CPU kernel gives the foreach kernel's update; the schedule's factors."""

import pytest
import torch

from creditrl.config import OptimConfig
from creditrl.workers.optim import build_optimizer, implementation, lr_factor


def test_fused_cpu_adamw_equals_foreach() -> None:
    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32)]
    grads = [[torch.randn_like(t) for t in start] for _ in range(4)]
    results = []
    for kernel in ({"fused": True}, {"foreach": True}):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **kernel)
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            opt.step()
        results.append([p.detach() for p in params])
    for fused, foreach, before in zip(*results, start, strict=True):
        assert (fused - before).abs().max() > 1e-3  # the steps moved the parameters
        torch.testing.assert_close(fused, foreach, atol=1e-6, rtol=1e-6)


def test_build_optimizer_picks_fused_for_plain_cpu_parameters() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert implementation(params) == {"fused": True}
    optimizer, _ = build_optimizer(params, OptimConfig(lr=1e-3), total_steps=2)
    assert optimizer.defaults["fused"] is True
    assert implementation([torch.nn.Parameter(torch.zeros(2, dtype=torch.long), False)]) == {
        "foreach": True
    }


def test_lr_factor_warmup_then_cosine() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=2, lr_scheduler="cosine", min_lr_ratio=0.1)
    factors = [lr_factor(step, 6, cfg) for step in range(7)]
    assert factors[:2] == [0.5, 1.0]
    assert factors[2] == pytest.approx(1.0) and factors[6] == pytest.approx(0.1)
    assert factors[4] == pytest.approx(0.55)  # halfway: 0.1 + 0.9 * (1 + cos(pi / 2)) / 2

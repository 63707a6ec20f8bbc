"""AdamW: the fused kernel gives the foreach kernel's update (CPU; CUDA when marked gpu);
the kernel choice; the schedule's factors."""

from types import SimpleNamespace

import pytest
import torch

from creditrl.config import OptimConfig
from creditrl.workers.optim import build_optimizer, implementation, lr_factor


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible"),
            ],
        ),
    ],
)
def test_fused_adamw_equals_foreach(device: str) -> None:
    torch.manual_seed(0)
    start = [torch.randn(64, 32, device=device), torch.randn(32, device=device)]
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


def test_fused_adamw_on_cuda_and_foreach_for_mixed_devices() -> None:
    """The choice reads each parameter's device, dtype and sharding (stand-ins: no GPU here)."""

    def param(device: str) -> SimpleNamespace:
        return SimpleNamespace(
            device=torch.device(device), data=torch.zeros(1), dtype=torch.bfloat16
        )

    assert implementation([param("cuda"), param("cuda")]) == {"fused": True}
    assert implementation([param("cuda"), param("cpu")]) == {"foreach": True}
    assert implementation([param("meta")]) == {"foreach": True}


def test_lr_factor_warmup_then_cosine() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=2, lr_scheduler="cosine", min_lr_ratio=0.1)
    factors = [lr_factor(step, 6, cfg) for step in range(7)]
    assert factors[:2] == [0.5, 1.0]
    assert factors[2] == pytest.approx(1.0) and factors[6] == pytest.approx(0.1)
    assert factors[4] == pytest.approx(0.55)  # halfway: 0.1 + 0.9 * (1 + cos(pi / 2)) / 2

"""The critic under the update's autocast (``CriticModel(autocast=...)``): bf16 products in the
backbone, the value head in float32, values within bf16 rounding of the float32 ones."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama_config
from transformers import AutoModel

from creditrl.models.critic import CriticModel


def critic(autocast: str) -> CriticModel:
    torch.manual_seed(0)
    model = CriticModel(AutoModel.from_config(tiny_llama_config()), autocast=autocast)
    torch.nn.init.normal_(model.value_head.weight, std=0.5)
    return model


def test_bf16_autocast_runs_the_backbone_in_bf16_and_the_head_in_float32():
    fp32, bf16 = critic("none"), critic("bf16")
    dtypes = {}
    for name, model in (("none", fp32), ("bf16", bf16)):

        def hook(module, args, out, name=name) -> None:
            dtypes[name] = out.dtype

        handle = model.backbone.layers[0].self_attn.q_proj.register_forward_hook(hook)
        ids = torch.tensor([[1, 520, 9, 33, 4001, 77]])
        values = model(ids, torch.ones_like(ids))
        handle.remove()
        assert values.dtype == torch.float32 and values.shape == (1, 6)
        if name == "none":
            reference = values
    assert dtypes == {"none": torch.float32, "bf16": torch.bfloat16}
    # bf16 keeps 8 bits of mantissa: hidden states within ~1% of the float32 ones
    torch.testing.assert_close(values, reference, atol=0.05, rtol=0.05)
    values.sum().backward()
    assert bf16.value_head.weight.grad.dtype == torch.float32


def test_autocast_is_checked():
    with pytest.raises(ValueError, match="autocast must be 'bf16' or 'none', got 'fp8'"):
        critic("fp8")

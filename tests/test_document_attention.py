"""Document attention for packed micro-batches: no N x N mask, the same numbers as the padded
forward, under activation checkpointing too."""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import pytest
import torch
from helpers import padded_batch, small_llama_config, tiny_lm_with_attn
from transformers import LlamaModel, MistralConfig, MistralForCausalLM

from creditrl.models.critic import CriticModel
from creditrl.models.document_attention import (
    DOCUMENT_ATTENTION,
    attends_by_document,
    document_attention,
    document_attention_kernel,
)
from creditrl.models.loading import enable_checkpointing
from creditrl.workers import packing, policy_forward, value_forward
from creditrl.workers.packing import pack, packed_policy_forward, packed_value_forward

PROMPTS = [6, 2, 4, 5, 1, 3]
RESPONSES = [5, 1, 3, 4, 2, 0]
LENGTHS = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]  # 11 3 7 9 3 3: N = 36


class SdpaSpy:
    """Records (query length, key length, mask given) of every sdpa call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, bool]] = []
        self._sdpa = torch.nn.functional.scaled_dot_product_attention

    def __call__(self, query, key, value, attn_mask=None, *args, **kwargs):
        self.calls.append((query.shape[-2], key.shape[-2], attn_mask is not None))
        return self._sdpa(query, key, value, attn_mask, *args, **kwargs)

    def patch(self):
        return mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", self)


def dense(model, lengths):
    """packing without document attention: transformers' own packed mask."""
    return nullcontext()


def test_packed_forward_attends_document_by_document_without_a_mask() -> None:
    model = tiny_lm_with_attn().eval()
    batch = padded_batch(PROMPTS, RESPONSES)
    assert pack(batch).lengths == tuple(LENGTHS)
    spy = SdpaSpy()
    with torch.no_grad(), spy.patch():
        got, _ = packed_policy_forward(model, batch)
    layers = model.config.num_hidden_layers
    assert len(spy.calls) == layers * len(LENGTHS)
    assert sorted(spy.calls) == sorted((n, n, False) for n in LENGTHS for _ in range(layers))
    with torch.no_grad(), mock.patch.object(packing, "document_attention", dense):
        spy.calls.clear()
        with spy.patch():
            before, _ = packed_policy_forward(model, batch)
    assert spy.calls == [(36, 36, True)] * layers  # the dense path: one N x N masked call
    want, _ = policy_forward(model, batch)
    valid = batch["attention_mask"][:, -5:].bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, before, atol=1e-6, rtol=1e-6)
    assert model.config._attn_implementation == "sdpa"


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _policy_grads(model: torch.nn.Module, batch, forward) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    log_probs, _ = forward(model, batch, 0.7)
    (log_probs * torch.linspace(-1, 1, log_probs.shape[1])).sum().backward()
    return _grads(model)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gradients_equal_the_padded_forward(checkpointing: bool) -> None:
    model = tiny_lm_with_attn(seed=2).train()
    if checkpointing:
        enable_checkpointing(model)
    batch = padded_batch(PROMPTS, RESPONSES, seed=4)
    want = _policy_grads(model, batch, policy_forward)
    spy = SdpaSpy()
    with spy.patch():
        got = _policy_grads(model, batch, packed_policy_forward)
    assert max(k for _, k, _ in spy.calls) == max(LENGTHS)  # the recomputation's calls too
    assert not any(mask for _, _, mask in spy.calls)
    layers = model.config.num_hidden_layers
    assert len(spy.calls) == layers * len(LENGTHS) * (2 if checkpointing else 1)
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-5 * scale


def test_critic_values_and_gradients_attend_by_document() -> None:
    torch.manual_seed(1)
    critic = CriticModel(LlamaModel(small_llama_config()).float(), torch.nn.Linear(32, 1))
    critic.backbone.set_attn_implementation("sdpa")
    batch = padded_batch(PROMPTS, RESPONSES, seed=5)
    valid = batch["attention_mask"][:, -5:].bool()
    want = value_forward(critic, batch)
    (want[valid] * 0.3).sum().backward()
    want_grad = _grads(critic)
    critic.zero_grad(set_to_none=True)
    spy = SdpaSpy()
    with spy.patch():
        got = packed_value_forward(critic, batch)
        (got[valid] * 0.3).sum().backward()
    assert max(k for _, k, _ in spy.calls) == max(LENGTHS)
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)
    assert (_grads(critic) - want_grad).abs().max() <= 1e-5 * want_grad.abs().max()


def test_models_that_do_not_qualify_keep_transformers_masks() -> None:
    assert attends_by_document(tiny_lm_with_attn())
    assert not attends_by_document(tiny_lm_with_attn(attn="eager"))
    config = MistralConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    windowed = MistralForCausalLM(config).float().eval()
    assert not attends_by_document(windowed)
    batch = padded_batch(PROMPTS, RESPONSES)
    valid = batch["attention_mask"][:, -5:].bool()
    with torch.no_grad():
        want, _ = policy_forward(windowed, batch)
        got, _ = packed_policy_forward(windowed, batch)
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)


def test_the_kernel_refuses_what_it_does_not_compute() -> None:
    model = tiny_lm_with_attn()
    attention = model.model.layers[0].self_attn
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    with pytest.raises(RuntimeError, match="only inside document_attention"):
        document_attention_kernel(attention, q, k, k, None)
    with document_attention(model, [2, 4]):
        assert model.config._attn_implementation == DOCUMENT_ATTENTION
        out, _ = document_attention_kernel(attention, q, k, k, None)
        assert out.shape == (1, 6, 4, 8)
        with pytest.raises(ValueError, match="no mask"):
            document_attention_kernel(attention, q, k, k, torch.ones(1, 1, 6, 6, dtype=torch.bool))
        with pytest.raises(ValueError, match="sum to 6, the row has 5"):
            document_attention_kernel(attention, q[:, :, :5], k[:, :, :5], k[:, :, :5], None)
        with pytest.raises(ValueError, match="sliding-window"):
            document_attention_kernel(attention, q, k, k, None, sliding_window=3)
    with pytest.raises(KeyError), document_attention(model, [6]):
        raise KeyError("inside")
    assert model.config._attn_implementation == "sdpa"


def test_each_document_is_its_own_causal_attention() -> None:
    """The kernel's output for documents [2, 4] is two separate causal attentions."""
    model = tiny_lm_with_attn()
    attention = model.model.layers[0].self_attn
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    with document_attention(model, [2, 4]):
        out, _ = document_attention_kernel(attention, q, k, v, None, scaling=0.5)
    for start, end in [(0, 2), (2, 6)]:
        keys = k[:, :, start:end].repeat_interleave(2, dim=1)
        values = v[:, :, start:end].repeat_interleave(2, dim=1)
        scores = q[:, :, start:end] @ keys.transpose(-1, -2) * 0.5
        causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        want = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ values
        torch.testing.assert_close(out[:, start:end], want.transpose(1, 2), atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
def test_on_cuda_under_bf16_it_matches_the_dense_mask_and_holds_less() -> None:
    """CUDA, bf16 autocast, 16 documents of 512 tokens: document attention's log-probs and
    gradients are the dense packed mask's to bf16 rounding, and its peak memory is lower."""
    model = tiny_lm_with_attn(seed=5).cuda().train()
    lengths = [256] * 16
    batch = padded_batch(lengths, lengths, p=256, t=256, seed=6).to("cuda")
    results = {}
    for arm, patch in (("dense", mock.patch.object(packing, "document_attention", dense)),
                       ("documents", nullcontext())):  # fmt: skip
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with patch, torch.autocast("cuda", dtype=torch.bfloat16):
            log_probs, _ = packed_policy_forward(model, batch)
            log_probs.float().sum().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        results[arm] = (log_probs.detach().float(), _grads(model), peak)
    (lp_dense, g_dense, mem_dense), (lp_docs, g_docs, mem_docs) = results.values()
    assert (lp_docs - lp_dense).abs().max() <= 0.05
    assert (g_docs - g_dense).abs().max() <= 0.02 * g_dense.abs().max()
    assert mem_docs < mem_dense

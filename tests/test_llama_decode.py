"""The plain-Llama decode step (``rollout.llama_decode``): its rotary table, its LM head's
layout, and its fused weights after the actor's weights change."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import PROMPTS, prompt_batch, tiny_hf_engine
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from creditrl.rollout import llama_decode
from creditrl.rollout.llama_decode import LlamaDecoder


def test_rotate_is_transformers_rotary_embedding_bit_for_bit(model):
    """``_rotate`` with the signed sine gives ``apply_rotary_pos_emb``'s values exactly."""
    decoder = LlamaDecoder(model)
    torch.manual_seed(0)
    x = torch.randn(5, 6, decoder.head_dim)
    positions = torch.tensor([0, 3, 17, 4, 99])
    cos, sin = model.model.rotary_emb(x, positions[:, None])  # (5, 1, dim)
    expected, _ = apply_rotary_pos_emb(x[:, :, None], x[:, :, None], cos, sin, unsqueeze_dim=2)
    table_cos, signed_sin = decoder._rotation(x, positions)
    assert torch.equal(table_cos, cos.view(5, 1, -1))
    assert torch.equal(llama_decode._rotate(x, table_cos, signed_sin), expected.squeeze(2))


def test_rotary_table_grows_past_its_end(model):
    """The table is built at the first step for twice the positions it needs, and rebuilt when
    a position passes its end; its values stay the rotary module's."""
    decoder = LlamaDecoder(model)
    assert decoder.static_rope and decoder._table is None
    decoder._rotation(torch.zeros(1, model.config.hidden_size), torch.tensor([1]))
    assert len(decoder._table[0]) == 4
    x = torch.zeros(3, model.config.hidden_size)
    positions = torch.tensor([3, 9, 200])
    cos, signed_sin = decoder._rotation(x, positions)
    assert len(decoder._table[0]) > 200
    expected_cos, sin = model.model.rotary_emb(x, positions[:, None])
    half = sin.shape[-1] // 2
    assert torch.equal(cos, expected_cos)
    assert torch.equal(signed_sin, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1))


def test_a_position_dependent_rotary_type_is_computed_every_step(model, tokenizer):
    """A dynamic rotary embedding (its frequencies depend on the longest position) keeps no
    table, and the decoder still samples what the model's forward samples."""
    config = copy.deepcopy(model.config)
    config.rope_parameters = {**config.rope_parameters, "rope_type": "dynamic", "factor": 2.0}
    torch.manual_seed(1)
    dynamic = LlamaForCausalLM(config).float().eval()
    assert not LlamaDecoder(dynamic).static_rope
    outs = {
        fast: tiny_hf_engine(dynamic, tokenizer, eos_token_ids=[], fast_decode=fast).generate(
            prompt_batch(PROMPTS, repeat=2), seed=5
        )
        for fast in (True, False)
    }
    assert torch.equal(outs[True]["responses"], outs[False]["responses"])
    torch.testing.assert_close(
        outs[True]["rollout_log_probs"], outs[False]["rollout_log_probs"], atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("rows", [1, 16, 80])
def test_the_lm_head_gives_row_major_logits(rows):
    """The LM head's logits are row-major (the sampler reads strided ones ~4x slower)."""
    weight, x = torch.randn(3000, 16), torch.randn(rows, 16)
    out = llama_decode._project_head(weight, x)
    assert out.is_contiguous() and out.shape == (rows, 3000)
    torch.testing.assert_close(out, x @ weight.t(), atol=1e-5, rtol=1e-5)


def test_fused_weights_follow_an_optimizer_step_that_keeps_version_counters(model, tokenizer):
    """The q/k/v product runs on a concatenated copy of the weights: after a fused
    AdamW step (which writes the parameters without bumping their version counters) the next
    generate samples from the new weights, as the model's own forward does, not from a stale
    concatenation."""
    actor = copy.deepcopy(model).train()
    fast = tiny_hf_engine(actor, tokenizer, eos_token_ids=[])
    slow = tiny_hf_engine(actor, tokenizer, eos_token_ids=[], fast_decode=False)
    prompts = prompt_batch(PROMPTS, repeat=2)
    before = fast.generate(prompts, seed=7)
    optimizer = torch.optim.AdamW(actor.parameters(), lr=0.05, fused=True)
    actor(input_ids=prompts["input_ids"], labels=prompts["input_ids"]).loss.backward()
    versions = [p._version for p in actor.parameters()]
    optimizer.step()
    assert [p._version for p in actor.parameters()] == versions  # no counter moved
    after, reference = fast.generate(prompts, seed=7), slow.generate(prompts, seed=7)
    assert not torch.equal(after["rollout_log_probs"], before["rollout_log_probs"])
    assert torch.equal(after["responses"], reference["responses"])
    torch.testing.assert_close(
        after["rollout_log_probs"], reference["rollout_log_probs"], atol=1e-5, rtol=0
    )

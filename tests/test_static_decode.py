"""Decode from a static KV cache (``creditrl.rollout.cuda_graph``): the buckets, the row
handling, the in-place weight update, and the same samples as the dynamic path. On the CPU the
static step runs eagerly; the cases marked gpu capture it as a CUDA graph (``make test-gpu``)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_rollout import PAD, PROMPTS, engine, prompt_batch

from creditrl import Batch
from creditrl.rollout.cuda_graph import (
    CAPACITY_STEP,
    StaticDecoder,
    capacity_bucket,
    parameter_pointers,
    row_bucket,
    static_decode_unsupported,
)

STOP_IDS = list(range(0, 49152, 7))  # many stop ids: rows finish at different steps
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")


def static_engine(model, tokenizer, mode: str = "static", **overrides):
    return engine(
        model, tokenizer, eos_token_ids=STOP_IDS, engine_kwargs={"decode_cache": mode}, **overrides
    )


def decode_inputs(model) -> tuple[list[torch.Tensor], torch.utils.hooks.RemovableHandle]:
    """The ``input_ids`` of every forward of ``model`` with one column (the decode steps)."""
    seen: list[torch.Tensor] = []

    def hook(_module, _args, kwargs):
        ids = kwargs["input_ids"]
        if ids.shape[1] == 1:
            seen.append(ids[:, 0].clone())

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


def test_row_and_capacity_buckets():
    assert [row_bucket(m, 64) for m in (1, 2, 3, 5, 9, 33, 64)] == [1, 2, 4, 8, 16, 64, 64]
    assert [row_bucket(m, 48) for m in (17, 33, 48)] == [32, 48, 48]
    assert [capacity_bucket(n) for n in (1, CAPACITY_STEP, CAPACITY_STEP + 1)] == [
        CAPACITY_STEP,
        CAPACITY_STEP,
        2 * CAPACITY_STEP,
    ]
    with pytest.raises(ValueError, match=r"rows must be in \[1, 8\], got 9"):
        row_bucket(9, 8)
    with pytest.raises(ValueError, match="positions must be >= 1"):
        capacity_bucket(0)


@pytest.mark.parametrize("greedy", [False, True])
def test_static_cache_samples_what_the_dynamic_path_samples(model, tokenizer, greedy):
    """Same tokens; log-probs within 1e-5 (measured: <= 4e-6) of the engine's dynamic-cache
    path (rows leaving the batch), rows finishing at different steps."""
    prompts = prompt_batch(PROMPTS, repeat=3)
    outs, stats = {}, {}
    for mode in ("dynamic", "static"):
        rollout = static_engine(model, tokenizer, mode)
        outs[mode] = rollout.generate(prompts, seed=3, greedy=greedy)
        stats[mode] = rollout.last_stats
    assert (stats["static"]["static_decode"], stats["dynamic"]["static_decode"]) == (1.0, 0.0)
    assert stats["static"]["graph_decode"] == 0.0  # the CPU: eager
    assert torch.equal(outs["static"]["responses"], outs["dynamic"]["responses"])
    assert torch.equal(outs["static"]["response_mask"], outs["dynamic"]["response_mask"])
    torch.testing.assert_close(
        outs["static"]["rollout_log_probs"], outs["dynamic"]["rollout_log_probs"], atol=1e-5, rtol=0
    )
    lengths = outs["static"]["response_mask"].sum(1)
    assert lengths.min() < lengths.max()


def test_finished_rows_stay_in_the_bucket_fed_the_pad_id(model, tokenizer):
    """9 rows in micro-batches of 4: buckets of 4, 4 and 1 rows, every decode step the same
    shape; a row that finished is fed the pad id from the next step on."""
    prompts = prompt_batch(PROMPTS, repeat=3)
    rollout = static_engine(model, tokenizer, micro_batch_size=4, max_response_length=8)
    seen, handle = decode_inputs(model)
    try:
        out = rollout.generate(prompts, seed=5)
    finally:
        handle.remove()
    steps = seen[1:]  # on the CPU one warm-up forward per built step, before its first step
    assert {len(ids) for ids in seen} == {4, 1}
    decoder = rollout._static[0]
    assert sorted(decoder.steps) == [(1, CAPACITY_STEP), (4, CAPACITY_STEP)]
    lengths = out["response_mask"].sum(1)
    first = lengths[:4]
    fed = [ids for ids in steps if len(ids) == 4][: int(first.max()) - 1]
    for step, ids in enumerate(fed, start=1):  # step s feeds the token sampled at s - 1
        finished = first <= step  # its last token was sampled at step - 1 or before
        assert torch.all(ids[finished] == PAD), (step, ids, first)
        assert torch.equal(ids[~finished], out["responses"][:4][~finished, step - 1])


def test_in_place_weight_update_keeps_the_steps(model, tokenizer):
    """update_weights copies into the parameters' storage: the pointers and the built steps
    stay, and the samples follow the new weights (those of the dynamic path on them); a
    replaced parameter rebuilds the steps."""
    model = copy.deepcopy(model)
    prompts = prompt_batch(PROMPTS, repeat=2)
    rollout = static_engine(model, tokenizer)
    rollout.generate(prompts, seed=1)
    decoder = rollout._static[0]
    pointers, built, steps = parameter_pointers(model), decoder.built, dict(decoder.steps)
    torch.manual_seed(7)
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    assert rollout.update_weights(state.items()) == len(state)
    out = rollout.generate(prompts, seed=1)
    assert parameter_pointers(model) == pointers
    assert decoder.built == built and dict(decoder.steps) == steps
    reference = static_engine(model, tokenizer, "dynamic").generate(prompts, seed=1)
    assert torch.equal(out["responses"], reference["responses"])
    torch.testing.assert_close(
        out["rollout_log_probs"], reference["rollout_log_probs"], atol=1e-5, rtol=0
    )
    model.lm_head.weight.data = model.lm_head.weight.data.clone()
    rollout.generate(prompts, seed=1)
    assert decoder.built == built + 1 and parameter_pointers(model) == decoder.pointers


def test_auto_leaves_the_cpu_engine_as_it_was(model, tokenizer):
    """'auto' (the default) decodes CPU models as before: the dynamic path, the Llama decoder."""
    rollout = engine(model, tokenizer)
    assert rollout.decode_cache == "auto"
    rollout.generate(prompt_batch(PROMPTS), seed=0)
    assert rollout.last_stats["static_decode"] == 0.0 and not rollout._static
    assert rollout.keeps_turn_kv()
    assert not static_engine(model, tokenizer).keeps_turn_kv()


def test_static_cache_refuses_what_it_cannot_take(model, tokenizer, monkeypatch):
    with pytest.raises(
        Exception, match=r"decode_cache='sometimes' is not one of auto, static, dynamic"
    ):
        static_engine(model, tokenizer, "sometimes")
    assert static_decode_unsupported(model) is None
    flash = copy.deepcopy(model)
    monkeypatch.setattr(flash.config, "_attn_implementation_internal", "flash_attention_2")
    assert "flash_attention_2" in static_decode_unsupported(flash)
    with pytest.raises(
        ValueError, match="decode_cache=static cannot take this model: its attention"
    ):
        static_engine(flash, tokenizer).generate(prompt_batch(PROMPTS))
    step = StaticDecoder(model, 4, "cache", PAD, graph=False).step_for(2, 10)
    with pytest.raises(ValueError, match="does not fit a static step of 2 rows x 128"):
        step.load(None, torch.ones(3, 5, dtype=torch.long))


def test_config_refuses_static_cache_with_kept_agent_kv(capsys):
    from helpers import refused

    line = refused(capsys, "agent.enable=true", "rollout.engine_kwargs.decode_cache=static")
    assert "decode_cache=static" in line and "agent.keep_kv_cache=false" in line
    refused(capsys, "rollout.engine_kwargs.decode_cache=always")


# ---- on CUDA: the captured graph ------------------------------------------------------------


def agreeing_prefix(a: Batch, b: Batch) -> torch.Tensor:
    """(B, T) bool: the positions of each row up to its first differing token."""
    return (a["responses"] == b["responses"]).long().cumprod(1).bool()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("greedy", [False, True])
def test_cuda_graph_samples_what_the_eager_path_samples(model, tokenizer, dtype, greedy):
    """On CUDA 'auto' captures the step and replays it: in float32 the tokens of the same
    static step run eagerly (log-probs within 1e-5) and of the dynamic path (1e-4); in bf16
    log-probs within 5e-2 up to each row's first differing token. The graph survives an
    in-place AdamW step (not re-captured) and then follows the new weights."""
    cuda = copy.deepcopy(model).to("cuda", dtype)
    prompts = prompt_batch(PROMPTS, repeat=3)
    graphed = static_engine(cuda, tokenizer, "auto")
    eager = static_engine(cuda, tokenizer, "static")
    eager._static = [StaticDecoder(cuda, 64, graphed._cache_keyword, PAD, graph=False)]
    for update in (False, True):
        if update:
            optimizer = torch.optim.AdamW(cuda.parameters(), lr=1e-2, fused=True)
            cuda(input_ids=prompts["input_ids"].cuda()).logits.float().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        built = graphed._static[0].built if graphed._static else 0
        out = graphed.generate(prompts, seed=2, greedy=greedy)
        assert graphed.last_stats["graph_decode"] == 1.0
        if update:
            assert graphed._static[0].built == built
        same_step = eager.generate(prompts, seed=2, greedy=greedy)
        assert eager.last_stats["graph_decode"] == 0.0
        dynamic = static_engine(cuda, tokenizer, "dynamic").generate(prompts, seed=2, greedy=greedy)
        for reference, tol in ((same_step, 1e-5), (dynamic, 1e-4)):
            same = agreeing_prefix(out, reference)
            if dtype == torch.float32:
                assert same.all()
            else:  # bf16 rounding may flip a near-tie; up to there the log-probs agree
                assert same[:, :2].all() and same.float().mean() > 0.5
                tol = 5e-2
            gap = (out["rollout_log_probs"] - reference["rollout_log_probs"]).abs()[same]
            assert gap.max() < tol


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_decodes_a_few_kv_head_qwen2(tokenizer):
    """A Qwen2 shape (q/k/v biases, 1 KV head, tied embeddings) under the graph: the tokens
    and log-probs of the eager path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(config).to("cuda").eval()
    prompts = prompt_batch(PROMPTS, repeat=2)
    out = static_engine(qwen, tokenizer, "auto").generate(prompts, seed=4)
    reference = static_engine(qwen, tokenizer, "dynamic").generate(prompts, seed=4)
    assert torch.equal(out["responses"], reference["responses"])
    torch.testing.assert_close(
        out["rollout_log_probs"], reference["rollout_log_probs"], atol=1e-4, rtol=0
    )

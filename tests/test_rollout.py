"""HFRolloutEngine and the sampling functions, with a tiny random Llama (float32)."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
from helpers import PAD, PROMPTS, prompt_batch, tiny_hf_engine

from creditrl import Batch
from creditrl.rollout import (
    cpu_kernels,
    eos_token_ids_of,
    filter_logits,
    hf_engine,
    llama_decode,
    sample_next_tokens,
)
from creditrl.rollout.cpu_kernels import weight_major_linears
from creditrl.rollout.kv_cache import PreallocatedLayer, cache_keyword, preallocated_cache
from creditrl.rollout.llama_decode import LlamaDecoder
from creditrl.rollout.sampling import inverse_cdf_sample

FIELDS = {
    "prompts": torch.int64,
    "responses": torch.int64,
    "response_mask": torch.int64,
    "input_ids": torch.int64,
    "attention_mask": torch.int64,
    "position_ids": torch.int64,
    "rollout_log_probs": torch.float32,
}


def teacher_forced_log_probs(model, out: Batch, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits[:, -T-1:-1] / temperature)[responses] from one full forward."""
    width = out["responses"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"],
            attention_mask=out["attention_mask"],
            position_ids=out["position_ids"],
        ).logits[:, -width - 1 : -1]
    log_probs = (logits.float() / temperature).log_softmax(-1)
    return log_probs.gather(-1, out["responses"][..., None]).squeeze(-1)


def count_forward_rows(model) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    sizes: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda _m, _args, kwargs: sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    return sizes, handle


# ---- output fields ---------------------------------------------------------------------------


def test_output_fields_shapes_dtypes_and_layout(model, tokenizer):
    prompts = prompt_batch(PROMPTS, repeat=2)
    out = tiny_hf_engine(model, tokenizer).generate(prompts)
    b, p = prompts["input_ids"].shape
    t = out["responses"].shape[1]
    assert t == int(out["response_mask"].sum(1).max()) and 1 <= t <= 12
    shapes = {"prompts": (b, p), "input_ids": (b, p + t), "attention_mask": (b, p + t)}
    shapes["position_ids"] = (b, p + t)
    for name, dtype in FIELDS.items():
        assert out[name].dtype == dtype, name
        assert tuple(out[name].shape) == shapes.get(name, (b, t)), name
    assert torch.equal(out["prompts"], prompts["input_ids"])
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], 1))
    mask = torch.cat([prompts["attention_mask"], out["response_mask"]], 1)
    assert torch.equal(out["attention_mask"], mask)
    assert torch.equal(out["position_ids"], (mask.cumsum(1) - 1).clamp(min=0))
    assert out["ground_truth"].tolist() == [str(i) for i in range(b)]
    assert out.meta == {"step": 3}
    assert prompts["input_ids"].shape == (b, p)  # the input batch is not modified


def test_eos_masks_padding_and_zero_log_probs(model, tokenizer):
    stop_ids = list(range(0, 49152, 6))  # about 1 in 6 tokens ends a response
    rollout = tiny_hf_engine(
        model, tokenizer, eos_token_ids=stop_ids, max_response_length=10, seed=1
    )
    out = rollout.generate(prompt_batch(PROMPTS, repeat=4))
    responses, mask, log_probs = out["responses"], out["response_mask"], out["rollout_log_probs"]
    lengths = mask.sum(1)
    assert lengths.min() < lengths.max() <= 10  # some rows stop early
    stops = torch.isin(responses, torch.tensor(stop_ids))
    for row, n in enumerate(lengths.tolist()):
        assert mask[row, :n].eq(1).all() and mask[row, n:].eq(0).all(), row
        assert not stops[row, : n - 1].any(), row  # no EOS before the last valid token
        assert bool(stops[row, n - 1]) or n == 10, row  # ends with EOS, or hit the limit
        assert responses[row, n:].eq(PAD).all(), row
        assert log_probs[row, n:].eq(0).all(), row
        assert torch.isfinite(log_probs[row, :n]).all() and log_probs[row, :n].le(0).all(), row


def test_default_eos_ids_come_from_tokenizer_and_generation_config(model, tokenizer):
    assert tokenizer.eos_token_id == 2
    model.generation_config.eos_token_id = [2, 7]
    try:
        assert eos_token_ids_of(model, tokenizer) == [2, 7]
        assert tiny_hf_engine(model, tokenizer).eos_token_ids.tolist() == [2, 7]
    finally:
        model.generation_config.eos_token_id = 2


# ---- determinism and padding invariance -----------------------------------------------------


def test_greedy_is_deterministic_and_temperature_zero_is_greedy(model, tokenizer):
    prompts = prompt_batch(PROMPTS, repeat=2)
    rollout = tiny_hf_engine(model, tokenizer)
    first = rollout.generate(prompts, greedy=True)
    assert first.equals(rollout.generate(prompts, greedy=True))
    assert first.equals(rollout.generate(prompts, temperature=0.0))
    assert torch.equal(first["responses"][0], first["responses"][1])  # same prompt, same output


def test_same_seed_same_samples(model, tokenizer):
    prompts = prompt_batch(PROMPTS, repeat=2)
    a = tiny_hf_engine(model, tokenizer, seed=5).generate(prompts)
    b = tiny_hf_engine(model, tokenizer, seed=5).generate(prompts)
    c = tiny_hf_engine(model, tokenizer, seed=6).generate(prompts)
    assert a.equals(b)
    assert not torch.equal(a["responses"], c["responses"])
    rollout = tiny_hf_engine(model, tokenizer, seed=0)
    assert rollout.generate(prompts, seed=5).equals(a)


def test_sample_seeds_make_samples_independent_of_batching(model, tokenizer):
    prompts = prompt_batch(PROMPTS, repeat=4)
    prompts["sample_seed"] = torch.arange(len(prompts), dtype=torch.int64) * 7919 + 11
    whole = tiny_hf_engine(model, tokenizer, seed=1, temperature=1.0).generate(prompts)
    small = tiny_hf_engine(model, tokenizer, seed=2, temperature=1.0, micro_batch_size=3)
    halves = [small.generate(part) for part in prompts.chunk(2)]
    for name in ("responses", "response_mask"):
        rejoined = torch.cat([h[name] for h in halves])[:, : whole[name].shape[1]]
        assert torch.equal(rejoined, whole[name][:, : rejoined.shape[1]])
    reversed_rows = small.generate(prompts[torch.arange(len(prompts) - 1, -1, -1)])
    width = whole["responses"].shape[1]
    assert torch.equal(reversed_rows["responses"].flip(0)[:, :width], whole["responses"])
    assert len({tuple(r) for r in whole["responses"].tolist()}) > len(PROMPTS)


def test_counter_uniforms_are_splitmix64():
    from creditrl.rollout.sampling import counter_uniforms

    def reference(seed: int, step: int) -> float:
        m = (1 << 64) - 1
        x = (seed + (step + 1) * 0x9E3779B97F4A7C15) & m
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        return ((x ^ (x >> 31)) >> 11) / 2**53

    seeds = torch.tensor([0, 5, 2**62 - 1, 123456789])
    for step in (0, 1, 95):
        expected = [reference(int(s), step) for s in seeds]
        assert counter_uniforms(seeds, step).tolist() == expected
    u = counter_uniforms(torch.arange(20000), 0)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01


def test_left_padded_prompt_generates_what_it_generates_alone(model, tokenizer):
    short, long = PROMPTS[1], PROMPTS[2]
    rollout = tiny_hf_engine(model, tokenizer)
    alone = rollout.generate(prompt_batch([short]), greedy=True)
    beside = rollout.generate(prompt_batch([long, short]), greedy=True)
    assert torch.equal(beside["responses"][1], alone["responses"][0])
    torch.testing.assert_close(
        beside["rollout_log_probs"][1], alone["rollout_log_probs"][0], atol=1e-5, rtol=0
    )


def test_micro_batches_give_the_same_greedy_output(model, tokenizer):
    prompts = prompt_batch(PROMPTS, repeat=2)
    whole = tiny_hf_engine(model, tokenizer).generate(prompts, greedy=True)
    split = tiny_hf_engine(model, tokenizer, micro_batch_size=4).generate(prompts, greedy=True)
    assert torch.equal(whole["responses"], split["responses"])
    torch.testing.assert_close(
        whole["rollout_log_probs"], split["rollout_log_probs"], atol=1e-5, rtol=0
    )


# ---- log-prob alignment (acceptance) ---------------------------------------------------------


def test_rollout_log_probs_match_teacher_forced_forward(model, tokenizer):
    rollout = tiny_hf_engine(model, tokenizer, eos_token_ids=list(range(0, 49152, 8)), seed=3)
    out = rollout.generate(prompt_batch(PROMPTS, repeat=3), temperature=1.0)
    valid = out["response_mask"].bool()
    assert valid.sum() > len(valid)  # more than one token per row on average
    expected = teacher_forced_log_probs(model, out)
    diff = (out["rollout_log_probs"] - expected).abs()[valid]
    assert diff.max() < 1e-4


def test_log_probs_use_the_temperature(model, tokenizer):
    out = tiny_hf_engine(model, tokenizer, seed=4).generate(prompt_batch(PROMPTS), temperature=0.7)
    expected = teacher_forced_log_probs(model, out, temperature=0.7) * out["response_mask"]
    torch.testing.assert_close(out["rollout_log_probs"], expected, atol=1e-4, rtol=0)


def test_greedy_log_probs_are_of_the_unscaled_distribution(model, tokenizer):
    out = tiny_hf_engine(model, tokenizer).generate(prompt_batch(PROMPTS), greedy=True)
    expected = teacher_forced_log_probs(model, out) * out["response_mask"]
    torch.testing.assert_close(out["rollout_log_probs"], expected, atol=1e-4, rtol=0)


# ---- top-k / top-p ---------------------------------------------------------------------------


def test_top_k_one_equals_greedy(model, tokenizer):
    prompts = prompt_batch(PROMPTS, repeat=2)
    greedy = tiny_hf_engine(model, tokenizer).generate(prompts, greedy=True)
    top1 = tiny_hf_engine(model, tokenizer, top_k=1, seed=9).generate(prompts, temperature=1.3)
    assert torch.equal(top1["responses"], greedy["responses"])
    assert top1["rollout_log_probs"].eq(0).all()  # one token left: probability 1


def test_top_p_never_samples_a_filtered_token(model, tokenizer):
    rollout = tiny_hf_engine(model, tokenizer, top_p=0.3, top_k=50, seed=2)
    out = rollout.generate(prompt_batch(PROMPTS, repeat=4), temperature=0.5)
    valid = out["response_mask"].bool()
    assert torch.isfinite(out["rollout_log_probs"][valid]).all()
    width = out["responses"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"],
            attention_mask=out["attention_mask"],
            position_ids=out["position_ids"],
        ).logits[:, -width - 1 : -1]
    kept = filter_logits(logits / 0.5, top_k=50, top_p=0.3)
    chosen = kept.gather(-1, out["responses"][..., None]).squeeze(-1)
    assert torch.isfinite(chosen[valid]).all()


def test_filter_logits_on_a_known_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    assert torch.isinf(filter_logits(logits, top_p=0.5)).tolist() == [[False, True, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.81)).tolist() == [[False, False, False, True]]
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True]]
    assert torch.equal(filter_logits(logits), logits)
    with pytest.raises(ValueError, match="top_p"):
        filter_logits(logits, top_p=0.0)


def test_sample_next_tokens_log_probs_are_renormalised():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    tokens, log_probs = sample_next_tokens(logits, temperature=2.0, top_k=2, generator=gen)
    assert set(tokens.tolist()) == {0, 1}
    expected = torch.tensor([1.0, 0.5]).log_softmax(-1)
    torch.testing.assert_close(log_probs, expected[tokens])
    assert abs(tokens.eq(0).float().mean().item() - expected.exp()[0].item()) < 0.05


def test_inverse_cdf_sample_never_picks_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(5, 1)
    uniforms = torch.tensor([0.0, 0.49, 0.5, 0.999, 1.0 - 2.0**-53], dtype=torch.float64)
    assert inverse_cdf_sample(probs, uniforms).tolist() == [1, 1, 3, 3, 3]
    unnormalised = torch.tensor([[2.0, 0.0, 6.0]])
    assert inverse_cdf_sample(unnormalised, torch.tensor([0.2])).tolist() == [0]
    assert inverse_cdf_sample(unnormalised, torch.tensor([0.3])).tolist() == [2]


def test_inverse_cdf_sample_across_blocks_matches_the_full_cdf():
    """Two-level search (blocks of 256 tokens) against the one-level float64 CDF, on a vocab
    of 700 (padded to 768) whose second block has no mass; uniforms at block boundaries."""
    probs = torch.zeros(1, 700)
    probs[0, 3], probs[0, 255], probs[0, 600], probs[0, 699] = 0.25, 0.25, 0.3, 0.2
    uniforms = torch.tensor([0.0, 0.2499, 0.25, 0.4999, 0.5, 0.7999, 0.8, 1.0 - 2.0**-53])
    rows = probs.repeat(len(uniforms), 1)
    tokens, totals = inverse_cdf_sample(rows, uniforms, with_totals=True)
    assert tokens.tolist() == [3, 3, 255, 255, 600, 600, 699, 699]
    torch.testing.assert_close(totals, torch.ones(len(uniforms), dtype=torch.float64))
    torch.manual_seed(0)
    weights = torch.rand(64, 49152) ** 8
    u = torch.rand(64, dtype=torch.float64)
    cdf = weights.double().cumsum(-1)
    full = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(-1)
    assert torch.equal(inverse_cdf_sample(weights, u), full)


# ---- CPU measures: preallocated KV cache, weight-major small-batch linears -------------------


def test_preallocated_layer_matches_concatenation_through_growth_and_selection():
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randn(3, 2, n, 4, generator=gen) for n in (5, 1, 1, 4)]
    layer = PreallocatedLayer(capacity=6)  # the third update outgrows it
    for i, chunk in enumerate(chunks):
        keys, values = layer.update(chunk, -chunk)
        expected = torch.cat(chunks[: i + 1], dim=2)
        assert torch.equal(keys, expected) and torch.equal(values, -expected)
    assert layer.get_seq_length() == 11
    layer.batch_select_indices(torch.tensor([2, 0, 0]))
    assert torch.equal(layer.keys, torch.cat(chunks, dim=2)[[2, 0, 0]])
    keys, _ = layer.update(chunks[1][:, :, :1], chunks[1][:, :, :1])
    assert keys.shape == (3, 2, 12, 4)


def test_preallocated_cache_replaces_the_full_attention_layers(model):
    cache = preallocated_cache(model, capacity=16)
    assert len(cache.layers) == 2
    assert all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)


@pytest.mark.parametrize("rows", [1, 2, 8, 9, 64, 65])
@pytest.mark.parametrize("out_features", [48, 8192])
def test_weight_major_linears_give_the_linear_values(rows, out_features):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, out_features), torch.nn.Linear(out_features, 3))
    x = torch.randn(rows, 1, 512)
    expected = net(x)
    with torch.no_grad(), weight_major_linears(net) as patched:
        assert patched == 2
        torch.testing.assert_close(net(x), expected, atol=1e-5, rtol=1e-5)
    assert "forward" not in net[0].__dict__  # restored


# ---- no forward passes on finished rows ------------------------------------------------------


def test_finished_rows_leave_the_running_batch(model, tokenizer):
    prompts = prompt_batch(PROMPTS, repeat=4)
    stop_ids = list(range(0, 49152, 5))
    outs, sizes = {}, {}
    for remove in (True, False):
        rollout = tiny_hf_engine(  # fast_decode=False: count rows through model.forward
            model,
            tokenizer,
            eos_token_ids=stop_ids,
            remove_finished=remove,
            max_response_length=8,
            fast_decode=False,
        )
        sizes[remove], handle = count_forward_rows(model)
        try:
            outs[remove] = rollout.generate(prompts, seed=11)
        finally:
            handle.remove()
    assert torch.equal(outs[True]["responses"], outs[False]["responses"])
    assert torch.equal(outs[True]["response_mask"], outs[False]["response_mask"])
    torch.testing.assert_close(
        outs[True]["rollout_log_probs"], outs[False]["rollout_log_probs"], atol=1e-5, rtol=0
    )
    lengths = outs[True]["response_mask"].sum(1)
    assert lengths.min() < 8
    # one prefill forward: the distinct prompts as one token trie (they share BOS); decode
    # step s runs the rows still unfinished
    assert sizes[True][0] == sizes[False][0] == 1
    expected = [int((lengths > s).sum()) for s in range(1, int(lengths.max()))]
    assert sizes[True][1:] == expected
    assert sizes[False][1:] == [len(prompts)] * len(expected)


@pytest.mark.parametrize("greedy", [False, True])
def test_llama_decoder_equals_the_model_forward(model, tokenizer, greedy):
    """The plain-Llama decode step samples the same tokens with log-probs within 1e-5 of the
    model's own forward, finished rows leaving the batch as before."""
    prompts = prompt_batch(PROMPTS, repeat=3)
    outs, stats = {}, {}
    for fast in (True, False):
        rollout = tiny_hf_engine(
            model, tokenizer, eos_token_ids=list(range(0, 49152, 7)), fast_decode=fast
        )
        outs[fast] = rollout.generate(prompts, seed=3, greedy=greedy)
        stats[fast] = rollout.last_stats
    assert LlamaDecoder.for_model(model) is not None
    assert torch.equal(outs[True]["responses"], outs[False]["responses"])
    torch.testing.assert_close(
        outs[True]["rollout_log_probs"], outs[False]["rollout_log_probs"], atol=1e-5, rtol=0
    )
    assert stats[True]["decode_rows"] == stats[False]["decode_rows"]
    assert outs[True]["response_mask"].sum(1).min() < outs[True]["responses"].shape[1]


def test_llama_decoder_attends_with_the_fused_kernel(model, tokenizer):
    """Every decode step's attention runs SDPA's fused CPU kernel: a query with a strided last
    dimension (the weight-major product's layout) would send it to the math kernel."""
    prompts = prompt_batch(PROMPTS, repeat=2)
    rollout = tiny_hf_engine(model, tokenizer, eos_token_ids=[])
    with torch.profiler.profile() as profile:
        rollout.generate(prompts, seed=0)
    names = [event.name for event in profile.events()]
    layers = model.config.num_hidden_layers
    steps = int(rollout.last_stats["decode_steps"])
    assert steps > 0
    assert names.count("aten::_scaled_dot_product_flash_attention_for_cpu") >= layers * steps
    assert names.count("aten::_scaled_dot_product_attention_math") <= layers  # the prefill


@pytest.mark.parametrize("fast_decode", [False, True])
def test_generation_passes_the_cache_by_its_current_name(model, tokenizer, fast_decode):
    """The engine hands the KV cache to the model under the keyword its forward names
    (transformers 5.2x renamed ``past_key_values`` to ``cache`` and warns on the old one), so a
    run prints no deprecation warning: padded and trie prefill, decode through the model and
    through the Llama decoder."""
    assert cache_keyword(model) in inspect.signature(type(model).forward).parameters
    rollout = tiny_hf_engine(model, tokenizer, eos_token_ids=[], fast_decode=fast_decode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rollout.generate(prompt_batch(PROMPTS, repeat=2), seed=0)
        rollout.generate(prompt_batch(PROMPTS[:1]), seed=0)
    assert [str(w.message) for w in caught if "deprecated" in str(w.message)] == []


def test_a_lora_model_gets_the_cache_by_its_base_models_name(model, tokenizer) -> None:
    """A peft model's forward takes **kwargs and hands them to the base model, so the base
    model's forward names the keyword (before: `past_key_values`, which warned on every call);
    applying LoRA itself warns of nothing either."""
    from creditrl.models.loading import apply_lora

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lora = apply_lora(copy.deepcopy(model), rank=4, alpha=8, target_modules="q_proj,v_proj")
        assert cache_keyword(lora) == cache_keyword(model)
        tiny_hf_engine(lora, tokenizer, eos_token_ids=[]).generate(
            prompt_batch(PROMPTS[:1]), seed=0
        )
    assert [str(w.message) for w in caught if "deprecated" in str(w.message)] == []


@pytest.mark.parametrize("rows", [1, 16, 80])
def test_llama_decoder_lm_head_in_blocks(monkeypatch, rows):
    """The LM head's product in blocks of weight rows (the last one short) gives x @ W^T."""
    monkeypatch.setattr(llama_decode, "HEAD_CHUNK_ROWS", 7)
    weight, x = torch.randn(30, 16), torch.randn(rows, 16)
    out = llama_decode._project_head(weight, x)
    assert out.shape == (rows, 30)
    torch.testing.assert_close(out, x @ weight.t(), atol=1e-5, rtol=1e-5)


def test_llama_decoder_only_takes_plain_llamas(model):
    class Subclass(type(model)):
        pass

    assert LlamaDecoder.for_model(Subclass(model.config)) is None
    biased = copy.deepcopy(model.config)
    biased.attention_bias = True
    assert LlamaDecoder.for_model(type(model)(biased)) is None
    assert LlamaDecoder.for_model(copy.deepcopy(model).to(torch.float64)) is None


def test_trie_prefill_equals_the_padded_prefill(model, tokenizer):
    """Prompts sharing a 4-token head: the trie prefill runs each shared prefix once and gives
    the padded prefill's samples and log-probs."""
    head = [1, 520, 9, 33]
    rows = [[*head, 7, 8, 9], [*head, 70], [*head, 700, 701], [5, 6]]
    prompts = prompt_batch(rows, repeat=3)
    outs, stats = {}, {}
    for tree in (True, False):
        rollout = tiny_hf_engine(model, tokenizer, max_response_length=6, tree_prefill=tree)
        outs[tree] = rollout.generate(prompts, seed=5)
        stats[tree] = rollout.last_stats
    assert torch.equal(outs[True]["responses"], outs[False]["responses"])
    torch.testing.assert_close(
        outs[True]["rollout_log_probs"], outs[False]["rollout_log_probs"], atol=1e-5, rtol=0
    )
    assert stats[False]["prefill_tokens"] == 7 + 5 + 6 + 2
    assert stats[True]["prefill_tokens"] == 4 + 3 + 1 + 2 + 2  # head, tails, [5, 6]
    assert stats[True]["prefill_rows"] == stats[False]["prefill_rows"] == 4


def test_engine_toggles_are_per_engine_with_module_defaults(model, tokenizer, monkeypatch):
    """The speed toggles are constructor arguments: two engines in one process can differ and
    sample the same tokens; left out, the module-level defaults are read when it is built."""
    prompts = prompt_batch(PROMPTS, repeat=2)
    plain = tiny_hf_engine(
        model, tokenizer, fast_decode=False, tree_prefill=False, small_batch_rows=0
    )
    fast = tiny_hf_engine(model, tokenizer)
    assert (plain.fast_decode, plain.tree_prefill, plain.small_batch_rows) == (False, False, 0)
    assert (fast.fast_decode, fast.tree_prefill) == (True, True)
    assert fast.small_batch_rows == cpu_kernels.SMALL_BATCH_ROWS > 0
    outs = [rollout.generate(prompts, seed=4) for rollout in (plain, fast)]
    assert torch.equal(outs[0]["responses"], outs[1]["responses"])
    torch.testing.assert_close(
        outs[0]["rollout_log_probs"], outs[1]["rollout_log_probs"], atol=1e-5, rtol=0
    )
    monkeypatch.setattr(hf_engine, "FAST_DECODE", False)
    monkeypatch.setattr(hf_engine, "TREE_PREFILL", False)
    monkeypatch.setattr(cpu_kernels, "SMALL_BATCH_ROWS", 3)
    later = tiny_hf_engine(model, tokenizer)
    assert (later.fast_decode, later.tree_prefill, later.small_batch_rows) == (False, False, 3)
    assert fast.fast_decode and fast.tree_prefill  # built before: unchanged


# ---- input checks and model state ------------------------------------------------------------


def test_bad_prompt_batches_are_rejected(model, tokenizer):
    rollout = tiny_hf_engine(model, tokenizer)
    prompts = prompt_batch(PROMPTS)
    right_padded = prompts["attention_mask"].flip(1)
    bad = Batch({"input_ids": prompts["input_ids"], "attention_mask": right_padded})
    with pytest.raises(ValueError, match=r"prompt rows \[0, 1\]"):
        rollout.generate(bad)
    with pytest.raises(KeyError, match="attention_mask"):
        rollout.generate(Batch({"input_ids": prompts["input_ids"]}))
    with pytest.raises(ValueError, match="temperature"):
        rollout.generate(prompts, temperature=-1.0)
    with pytest.raises(ValueError, match="max_response_length"):
        tiny_hf_engine(model, tokenizer, max_response_length=0)


def test_training_mode_is_restored(model, tokenizer):
    model.train()
    try:
        tiny_hf_engine(model, tokenizer, max_response_length=2).generate(prompt_batch(PROMPTS))
        assert model.training
    finally:
        model.eval()

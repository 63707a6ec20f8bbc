"""Decode from a static KV cache (``creditrl.rollout.cuda_graph``, ``rollout.static_loop``,
``rollout.decode_attention``): the buckets, the row handling, the in-place weight update, the
same samples as the dynamic path, attention without ``repeat_kv``, no host sync per step,
memory handed back, and failed captures. On the CPU the static step runs eagerly; the cases
marked gpu capture it as a CUDA graph (``make test-gpu``)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from helpers import PAD, PROMPTS, prompt_batch, tiny_hf_engine

from creditrl import Batch
from creditrl.rollout import cuda_graph, hf_engine, static_loop
from creditrl.rollout.cuda_graph import (
    CAPACITY_STEP,
    GraphCapture,
    StaticDecoder,
    capacity_bucket,
    kv_bucket,
    parameter_pointers,
    row_bucket,
    static_decode_unsupported,
)
from creditrl.rollout.decode_attention import decode_attention, static_decode_attention
from creditrl.rollout.kv_cache import cache_keyword

STOP_IDS = list(range(0, 49152, 7))  # many stop ids: rows finish at different steps
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")


def static_engine(model, tokenizer, mode: str = "static", **overrides):
    return tiny_hf_engine(
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
    assert [kv_bucket(n, 384) for n in (1, 128, 129, 384)] == [128, 128, 256, 384]
    assert kv_bucket(300, 300) == 300


@pytest.mark.parametrize(
    "greedy,micro_batch_size,truncated",
    [(False, 64, False), (True, 64, False), (False, 4, False), (False, 64, True)],
)
def test_static_cache_samples_what_the_dynamic_path_samples(
    model, tokenizer, greedy, micro_batch_size, truncated
):
    """Same tokens; log-probs within 1e-5 (measured: <= 4e-6) of the engine's dynamic-cache
    path (rows leaving the batch), rows finishing at different steps. In micro-batches of 4
    the generator's draws of the steps run past the last row's end are taken back, so the
    next micro-batch draws what the dynamic path's does; with top-k/top-p the kept-set
    sizes and with per-row ``max_new_tokens`` the lengths are the dynamic path's too."""
    prompts = prompt_batch(PROMPTS, repeat=3)
    settings = {"top_k": 40, "top_p": 0.9} if truncated else {}
    if truncated:
        prompts["max_new_tokens"] = torch.tensor([3, 12, 5, 1, 12, 7, 12, 2, 9])
    outs, stats = {}, {}
    for mode in ("dynamic", "static"):
        rollout = static_engine(
            model, tokenizer, mode, micro_batch_size=micro_batch_size, **settings
        )
        outs[mode] = rollout.generate(prompts, seed=3, greedy=greedy)
        stats[mode] = rollout.last_stats
    if truncated:
        assert torch.equal(
            outs["static"]["rollout_kept_counts"], outs["dynamic"]["rollout_kept_counts"]
        )
        assert (outs["static"]["response_mask"].sum(1) <= prompts["max_new_tokens"]).all()
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
    rollout = tiny_hf_engine(model, tokenizer)
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
    step = StaticDecoder(model, 4, cache_keyword(model), PAD, graph=False).step_for(2, 10)
    with pytest.raises(ValueError, match="does not fit a static step of 2 rows x 128"):
        step.load(None, torch.ones(3, 5, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    for rope in ("dynamic", "longrope"):
        scaled = copy.deepcopy(model)
        scaled.config.rope_parameters = {"rope_type": rope, "factor": 2.0, "rope_theta": 1e4}
        assert f"RoPE type {rope!r}" in static_decode_unsupported(scaled)
        with pytest.raises(ValueError, match="reads the positions on the host"):
            static_engine(scaled, tokenizer).generate(prompt_batch(PROMPTS))


def test_config_refuses_static_cache_with_kept_agent_kv(capsys):
    from helpers import refused

    line = refused(capsys, "agent.enable=true", "rollout.engine_kwargs.decode_cache=static")
    assert "decode_cache=static" in line and "agent.keep_kv_cache=false" in line
    refused(capsys, "rollout.engine_kwargs.decode_cache=always")


def test_grouped_query_attention_without_repeat_kv():
    """The query regrouped onto the key/value heads gives sdpa's output over repeated
    key/value heads (float32 rounding of the same sums), the mask broadcast over the group
    and the columns beyond ``kv_width`` cut off (they are closed in the mask)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    torch.manual_seed(0)
    batch, heads, kv_heads, dim, columns = 3, 8, 2, 16, 40
    module = torch.nn.Module()
    query = torch.randn(batch, heads, 1, dim)
    key, value = torch.randn(2, batch, kv_heads, columns, dim).unbind(0)
    mask = torch.zeros(batch, 1, 1, columns)
    mask[:, :, :, 20:] = torch.finfo(torch.float32).min
    mask[1, :, :, :3] = torch.finfo(torch.float32).min
    n_rep = heads // kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, n_rep), repeat_kv(value, n_rep), attn_mask=mask, scale=0.25
    ).transpose(1, 2)
    for width in (None, 24):
        with decode_attention(module, width):
            out, _ = static_decode_attention(module, query, key, value, mask, scaling=0.25)
        assert out.shape == (batch, 1, heads, dim)
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="one query token"):
        static_decode_attention(module, query.expand(-1, -1, 2, -1), key, value, None)


@pytest.mark.parametrize("greedy", [False, True])
def test_gqa_packing_and_kv_buckets_keep_tokens_and_log_probs(
    model, tokenizer, monkeypatch, greedy
):
    """The static step with ``rollout.decode_attention`` (query regrouped, no repeat_kv;
    kv-length buckets of 16 columns, so 40 new tokens after 9 prompt positions read 16, 32
    then 48 columns) samples the tokens of the model's own attention over all 128 columns,
    log-probs within 1e-5 (float32 rounding of the same sums; measured ~1e-6)."""
    monkeypatch.setattr(cuda_graph, "KV_STEP", 16)
    widths = []
    real = cuda_graph.decode_attention

    def spy(module, kv_width):
        widths.append(kv_width)
        return real(module, kv_width)

    monkeypatch.setattr(cuda_graph, "decode_attention", spy)
    assert model.config.num_attention_heads // model.config.num_key_value_heads == 2
    prompts = prompt_batch(PROMPTS, repeat=3)
    outs = {}
    for pack in (False, True):
        rollout = tiny_hf_engine(
            model, tokenizer, eos_token_ids=[], max_response_length=40,
            engine_kwargs={"decode_cache": "static"},
        )  # fmt: skip
        keyword = cache_keyword(model)
        rollout._static = [StaticDecoder(model, 64, keyword, PAD, graph=False, pack_gqa=pack)]
        outs[pack] = rollout.generate(prompts, seed=8, greedy=greedy)
    assert sorted(set(widths)) == [16, 32, 48, 128]  # 128: the step's first (allocating) run
    assert torch.equal(outs[True]["responses"], outs[False]["responses"])
    torch.testing.assert_close(
        outs[True]["rollout_log_probs"], outs[False]["rollout_log_probs"], atol=1e-5, rtol=0
    )


class _HostSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops that wait for the device: a value read on the host (``reads``)
    and boolean indexing (``boolean_indexing``: nonzero, masked_select, a bool index)."""

    READS = ("aten.is_nonzero", "aten.item", "aten._local_scalar_dense")
    BOOLEAN = ("aten.nonzero", "aten.masked_select")

    def __init__(self) -> None:
        super().__init__()
        self.reads = self.boolean_indexing = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.reads += name in self.READS
        indices = args[1] if name == "aten.index" else ()
        bool_index = any(getattr(i, "dtype", None) == torch.bool for i in indices)
        self.boolean_indexing += name in self.BOOLEAN or bool_index
        return func(*args, **(kwargs or {}))


def test_the_static_decode_loop_has_no_host_sync_per_step(model, tokenizer, monkeypatch):
    """40 steps of the static loop (the model's forward and the sampler included) read the
    device on the host only every CHECK_EVERY steps (2 checks) and once at the end; no
    boolean indexing."""
    modes = []
    real = static_loop.static_decode

    def counted(*args, **kwargs):
        with _HostSyncs() as mode:
            out = real(*args, **kwargs)
        modes.append(mode)
        return out

    monkeypatch.setattr(hf_engine, "static_decode", counted)
    rollout = tiny_hf_engine(
        model, tokenizer, eos_token_ids=[], max_response_length=40,
        engine_kwargs={"decode_cache": "static"},
    )  # fmt: skip
    out = rollout.generate(prompt_batch(PROMPTS, repeat=2), seed=1)
    assert out["response_mask"].sum(1).tolist() == [40] * 6
    assert rollout.last_stats["decode_steps"] == 39
    assert [(m.reads, m.boolean_indexing) for m in modes] == [(40 // 16 + 1, 0)]


def test_sampling_inside_the_step_samples_what_sampling_outside_does(model, tokenizer):
    """The sampler run inside the static step (captured with it on CUDA) and the same
    sampler run on the step's logits outside give the same tokens and log-probs, bit for
    bit, step after step (top-k and top-p on, kept-set sizes too)."""
    from creditrl.rollout.sampling import SamplingParams

    params = SamplingParams(0.9, 50, 0.95, 8, greedy=False)
    sampler = static_loop.StepSampler.of(params, with_kept=True)

    def logits_only(logits, uniforms):
        return (logits,)

    keyword = cache_keyword(model)
    ids = torch.tensor([[1, 520, 9, 33], [1, 12, 13, 14]])
    with torch.inference_mode():
        prefill = model(input_ids=ids, use_cache=True)
        steps = [
            StaticDecoder(model, 2, keyword, PAD, graph=False).step_for(2, 12) for _ in range(2)
        ]
        for step in steps:
            step.load(prefill.past_key_values, torch.ones_like(ids), torch.tensor([4, 4]))
        tokens = prefill.logits[:, -1].argmax(-1)
        generator = torch.Generator().manual_seed(0)
        for _ in range(6):
            uniforms = torch.rand(2, generator=generator, dtype=torch.float64)
            inside = steps[0].step(tokens, uniforms, sampler)
            (logits,) = steps[1].step(tokens, uniforms, logits_only)
            outside = sampler(logits, uniforms)
            for a, b in zip(inside, outside, strict=True):
                assert torch.equal(a, b)
            tokens = inside[0]


def test_sleep_frees_the_static_caches(model, tokenizer):
    """sleep() drops every static step (caches, buffers, graphs); the next call rebuilds
    them and samples the same."""
    rollout = static_engine(model, tokenizer)
    prompts = prompt_batch(PROMPTS, repeat=2)
    first = rollout.generate(prompts, seed=4)
    decoder = rollout._static[0]
    assert decoder.steps and decoder.built == 1
    rollout.sleep()
    assert not decoder.steps
    again = rollout.generate(prompts, seed=4)
    assert decoder.built == 2 and torch.equal(first["responses"], again["responses"])


def test_the_kept_steps_are_bounded_by_bytes(model):
    """A decoder keeps the most recently used steps whose caches fit max_cache_bytes: one
    step's worth keeps only the latest (two buckets alternating rebuild each time)."""
    keyword = cache_keyword(model)
    probe = StaticDecoder(model, 8, keyword, PAD, graph=False).step_for(8, 256)
    decoder = StaticDecoder(model, 8, keyword, PAD, graph=False, max_cache_bytes=probe.nbytes)
    for rows in (8, 2, 8):
        decoder.step_for(rows, 200)
    assert list(decoder.steps) == [(8, 256)] and decoder.built == 3
    roomy = StaticDecoder(model, 8, keyword, PAD, graph=False, max_cache_bytes=2 * probe.nbytes)
    for rows in (8, 2, 8):
        roomy.step_for(rows, 200)
    assert list(roomy.steps) == [(2, 256), (8, 256)] and roomy.built == 2


class _FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name

    def wait_stream(self, other) -> None:
        pass


class _FakeCuda:
    """Enough of ``torch.cuda`` for ``GraphCapture.capture`` on the CPU: streams, a capture
    that makes its stream current and then raises ``error``, and the current stream."""

    def __init__(self, error: BaseException) -> None:
        self.error, self.current, self.pools = error, _FakeStream("default"), 0

    def Stream(self) -> _FakeStream:
        return _FakeStream("side")

    def CUDAGraph(self) -> object:
        return object()

    @contextlib.contextmanager
    def graph(self, graph, pool=None):
        self.current = _FakeStream("capture")
        raise self.error
        yield

    def current_stream(self) -> _FakeStream:
        return self.current

    def set_stream(self, stream) -> None:
        self.current = stream

    def stream(self, stream):
        return contextlib.nullcontext()

    def graph_pool_handle(self) -> int:
        self.pools += 1
        return self.pools


@pytest.mark.parametrize("oom", [False, True])
def test_a_failed_capture_restores_the_stream_and_is_counted(monkeypatch, oom):
    """A capture that fails leaves the stream that was current, a new memory pool and one
    more fallback; out of memory is raised again (the stage turns it into one line),
    anything else leaves the decoder eager."""
    error = torch.OutOfMemoryError("CUDA out of memory") if oom else RuntimeError("bad op")
    fake = _FakeCuda(error)
    for name in ("Stream", "CUDAGraph", "graph", "current_stream", "set_stream", "stream",
                 "graph_pool_handle"):  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    capture = GraphCapture(True)
    runs = []
    if oom:
        with pytest.raises(torch.OutOfMemoryError):
            capture.capture(lambda: runs.append(1))
    else:
        assert capture.capture(lambda: runs.append(1)) is None
    assert fake.current.name == "default" and capture.fallbacks == 1
    assert capture.pool == 2 and len(runs) == 2  # the warm-up ran; a fresh pool
    assert capture.enabled is oom


def test_the_transformers_floor_has_what_the_static_path_reads():
    """pyproject admits torch 2.11 (the GPU image's) and asks for transformers 5.4, the first
    whose StaticLayer keeps a device-side cumulative_length (5.3's takes cache_position)."""
    import tomllib
    from pathlib import Path

    from transformers.cache_utils import StaticLayer

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    deps = project["project"]["dependencies"]
    assert "torch>=2.11" in deps and "transformers>=5.4" in deps
    assert hasattr(StaticLayer(max_cache_len=4), "cumulative_length")


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
        assert graphed.last_stats["graph_fallbacks"] == 0.0
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


@pytest.mark.gpu
@needs_cuda
def test_bf16_sampler_copy_is_captured_and_refreshed_in_place(model, tokenizer):
    """On CUDA a float32 master sampled through its bf16 copy (sample_dtype=bfloat16): the
    graphs are captured over the copy, survive an in-place update of the master (refreshed
    by copy_, not re-captured), and its samples are those of the master rounded to bf16."""
    master = copy.deepcopy(model).to("cuda")
    prompts = prompt_batch(PROMPTS, repeat=3)
    rollout = tiny_hf_engine(
        master, tokenizer, eos_token_ids=STOP_IDS,
        engine_kwargs={"decode_cache": "auto", "sample_dtype": "bfloat16"},
    )  # fmt: skip
    rollout.generate(prompts, seed=2)
    assert rollout.last_stats["graph_decode"] == 1.0
    decoder = rollout._static[0]
    built = decoder.built
    with torch.no_grad():
        for param in master.parameters():
            param.add_(0.01 * torch.randn_like(param))
    out = rollout.generate(prompts, seed=2)
    assert decoder.built == built and rollout.last_stats["graph_fallbacks"] == 0.0
    rounded = copy.deepcopy(master).to(torch.bfloat16)
    reference = static_engine(rounded, tokenizer, "dynamic").generate(prompts, seed=2)
    same = agreeing_prefix(out, reference)
    assert same[:, :2].all() and same.float().mean() > 0.5

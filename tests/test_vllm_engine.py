"""VLLMRolloutEngine: request building and response assembly on CPU with a stand-in for
vllm.LLM (replaying HFRolloutEngine's samples), and, on a CUDA machine with vLLM installed,
vLLM's rollout log-probs against the trainer's."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from types import ModuleType, SimpleNamespace
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaForCausalLM

from creditrl import Batch
from creditrl.config.schema import ActorConfig, RolloutConfig
from creditrl.core import compute_rollout_importance_weights, kl_penalty, masked_mean
from creditrl.errors import ConfigError
from creditrl.models.tiny import tiny_model_dir
from creditrl.rollout import EngineArgs, HFRolloutEngine, SamplingParams, build_rollout_engine
from creditrl.rollout import vllm_engine as engine_module
from creditrl.rollout.vllm_engine import (
    LOGPROBS_MODE,
    WORKER_EXTENSION,
    VLLMRolloutEngine,
    WeightLoaderExtension,
    assemble_rollout,
    completions_from_outputs,
    engine_core_in_process,
    eos_token_ids_from_dir,
    external_launcher_env,
    llm_engine_kwargs,
    prompt_token_lists,
    request_seeds,
    sampling_param_dicts,
    vllm_unavailable_reason,
)
from creditrl.workers import ActorWorker

PAD = 2
EOS = list(range(3, 49152, 9))  # ~1 id in 9 ends a response: rows of varied lengths
UNAVAILABLE = vllm_unavailable_reason()


def prompt_batch(rows: list[list[int]], repeat: int = 1) -> Batch:
    """Left-padded prompts (pad id 2), each row ``repeat`` times, with a uid column."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows]).repeat_interleave(repeat, 0)
    lengths = torch.tensor([len(r) for r in rows]).repeat_interleave(repeat)
    mask = (torch.arange(width)[None] >= width - lengths[:, None]).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    uids = [f"u{i}" for i in range(len(ids))]
    tensors = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    return Batch(tensors, {"uid": uids}, {"step": 3})


ROWS = [[5, 17, 99, 1000], [7], [12, 13, 14, 15, 16, 17, 18]]


def completions_of(out: Batch) -> list[tuple[list[int], list[float]]]:
    """Per-row (ids, log-probs) of a rollout Batch: what vLLM would have returned."""
    lengths = out["response_mask"].sum(-1).tolist()
    return [
        (out["responses"][i, :n].tolist(), out["rollout_log_probs"][i, :n].tolist())
        for i, n in enumerate(lengths)
    ]


def request_output(ids: list[int], log_probs: list[float], reason: str = "stop"):
    logprobs = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(ids, log_probs, strict=True)]
    completion = SimpleNamespace(token_ids=ids, logprobs=logprobs, finish_reason=reason)
    return SimpleNamespace(outputs=[completion])


class FakeWorker(WeightLoaderExtension):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model_runner = SimpleNamespace(model=model)


class LoadableModel(torch.nn.Module):
    """A stand-in for vLLM's model: ``load_weights`` copies named tensors in place."""

    def __init__(self, reference: torch.nn.Module) -> None:
        super().__init__()
        self.params = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}

    def load_weights(self, weights):
        for name, tensor in weights:
            self.params[name].copy_(tensor)


class FakeLLM:
    """Replays scripted completions per prompt; records everything the engine asks of it."""

    def __init__(self, completions=None, worker_model=None) -> None:
        self.completions = completions or {}
        self.worker = FakeWorker(worker_model) if worker_model is not None else None
        self.generate_calls: list[tuple[list, list]] = []
        self.events: list[tuple] = []
        self.reset_result: bool | None = True  # vLLM 0.10 returned None, later releases a bool

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.generate_calls.append((prompts, sampling_params))
        outputs = []
        for prompt, params in zip(prompts, sampling_params, strict=True):
            ids, lps = self.completions[(tuple(prompt["prompt_token_ids"]), params["seed"])]
            outputs.append(request_output(ids, lps))
        return outputs

    def collective_rpc(self, method, args=()):
        self.events.append(("rpc", method, len(args[0])))
        return [getattr(self.worker, method)(*args)]

    def reset_prefix_cache(self):
        self.events.append(("reset_prefix_cache",))
        return self.reset_result

    def sleep(self, level=1):
        self.events.append(("sleep", level))

    def wake_up(self, tags=None):
        self.events.append(("wake_up", tags))


def fake_engine(tokenizer, cfg, llm, **kwargs) -> VLLMRolloutEngine:
    return VLLMRolloutEngine(
        tiny_model_dir(), tokenizer, cfg, llm=llm, sampling_params_cls=dict, **kwargs
    )


# ---- engine construction -------------------------------------------------------------------


def test_llm_engine_kwargs_are_vllm_llm_arguments():
    """``vllm.LLM`` keywords: the settings as given, processed log-probs, vLLM's own sampling
    defaults and the weight-loading worker extension; extras are added but may not override."""
    kwargs = llm_engine_kwargs(
        "/models/tiny",
        seed=7,
        gpu_memory_utilization=0.3,
        enable_sleep_mode=True,
        dtype="bfloat16",
        tensor_parallel_size=1,
        max_model_len=512,
        enforce_eager=False,
        extra={"distributed_executor_backend": "external_launcher"},
    )
    assert kwargs == {
        "model": "/models/tiny",
        "dtype": "bfloat16",
        "seed": 7,
        "gpu_memory_utilization": 0.3,
        "enable_sleep_mode": True,
        "tensor_parallel_size": 1,
        "max_model_len": 512,
        "enforce_eager": False,
        "logprobs_mode": "processed_logprobs",
        "generation_config": "vllm",
        "worker_extension_cls": "creditrl.rollout.vllm_engine.WeightLoaderExtension",
        "distributed_executor_backend": "external_launcher",
    }
    module, name = WORKER_EXTENSION.rsplit(".", 1)
    assert getattr(sys.modules[module], name) is WeightLoaderExtension
    with pytest.raises(ValueError, match=r"\['logprobs_mode'\] are set by VLLMRolloutEngine"):
        llm_engine_kwargs(
            "m",
            seed=0,
            gpu_memory_utilization=0.5,
            enable_sleep_mode=False,
            dtype="auto",
            tensor_parallel_size=1,
            max_model_len=None,
            enforce_eager=True,
            extra={"logprobs_mode": "raw_logprobs"},
        )


@pytest.mark.parametrize(
    ("in_process", "tp", "backend", "expected"),
    [
        (True, 1, None, True),
        (True, 1, "uni", True),
        (True, 1, "mp", False),  # the worker runs in a child process even on one GPU
        (True, 1, "ray", False),
        (True, 2, None, False),
        (False, 1, None, False),
        (False, 1, "external_launcher", True),  # one in-process worker per rank, always
        (True, 2, "external_launcher", True),
    ],
)
def test_engine_core_in_process(in_process, tp, backend, expected):
    assert engine_core_in_process(in_process, tp, backend) is expected


def test_external_launcher_env_values_and_checks():
    assert external_launcher_env(3, 4, 1) == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}
    with pytest.raises(ValueError, match=r"rank 4 is not in \[0, 4\)"):
        external_launcher_env(4, 4, 0)
    with pytest.raises(ValueError, match="local_rank must be >= 0"):
        external_launcher_env(0, 1, -1)


def test_external_launcher_env_is_exported_from_the_process_group(monkeypatch):
    """A rank of a torch.distributed job started without torchrun gets RANK / LOCAL_RANK /
    WORLD_SIZE, which vLLM's external_launcher executor reads; a contradicting RANK is an
    error; without a process group nothing is set."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(key, "unset")  # recorded, so the teardown restores the original
        monkeypatch.delenv(key)
    engine_module._export_external_launcher_env()
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        engine_module._export_external_launcher_env()
        local = str(torch.cuda.current_device()) if torch.cuda.is_available() else "0"
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "1")
        assert os.environ["LOCAL_RANK"] == local
        monkeypatch.setenv("RANK", "3")
        with pytest.raises(
            RuntimeError, match="RANK=3 in the environment but this process is rank 0"
        ):
            engine_module._export_external_launcher_env()
    finally:
        dist.destroy_process_group()


class RecordingLLM:
    """Stands in for ``vllm.LLM`` in a fake ``vllm`` module: records its keywords and the
    multiprocessing switch it was built under."""

    built: ClassVar[list[tuple[dict, str | None]]] = []

    def __init__(self, **kwargs) -> None:
        RecordingLLM.built.append((kwargs, os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")))


def test_engine_builds_vllm_llm_in_process(tokenizer, monkeypatch):
    """Without a stand-in ``llm`` the engine builds ``vllm.LLM(**llm_engine_kwargs(...))`` and
    ``vllm.SamplingParams``, with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` set before (vLLM reads
    it when the engine is built); a multi-process executor is not in-process."""
    fake = ModuleType("vllm")
    fake.LLM = RecordingLLM
    fake.SamplingParams = dict
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(engine_module, "vllm_unavailable_reason", lambda: None)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    RecordingLLM.built.clear()
    cfg = RolloutConfig(max_response_length=8)
    engine = VLLMRolloutEngine(
        tiny_model_dir(), tokenizer, cfg, seed=5, gpu_memory_utilization=0.25, dtype="half"
    )
    ((kwargs, multiprocessing),) = RecordingLLM.built
    assert multiprocessing == "0" and engine.in_process
    assert kwargs == engine.llm_kwargs
    assert kwargs["model"] == str(tiny_model_dir()) and kwargs["seed"] == 5
    assert (kwargs["gpu_memory_utilization"], kwargs["dtype"]) == (0.25, "half")
    assert kwargs["logprobs_mode"] == LOGPROBS_MODE and kwargs["enable_sleep_mode"] is True
    assert isinstance(engine.llm, RecordingLLM) and engine.sampling_params_cls is dict
    mp = VLLMRolloutEngine(
        tiny_model_dir(), tokenizer, cfg, llm_kwargs={"distributed_executor_backend": "mp"}
    )
    assert not mp.in_process and RecordingLLM.built[-1][0]["distributed_executor_backend"] == "mp"
    with pytest.raises(RuntimeError, match="in-place update_weights needs"):
        mp.update_weights([("w", torch.zeros(1))])


# ---- request building ----------------------------------------------------------------------


def test_prompt_token_lists_strips_left_padding():
    batch = prompt_batch(ROWS)
    assert prompt_token_lists(batch["input_ids"], batch["attention_mask"]) == ROWS
    lists = prompt_token_lists(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    assert lists == ROWS


@pytest.mark.parametrize(
    ("mask_row", "message"),
    [([1, 1, 0, 1], r"rows \[1\] are not left-padded"), ([0, 0, 0, 0], r"rows \[1\]")],
)
def test_prompt_token_lists_rejects_holes_and_empty_rows(mask_row, message):
    ids = torch.arange(8).view(2, 4)
    mask = torch.tensor([[0, 1, 1, 1], mask_row])
    with pytest.raises(ValueError, match=message):
        prompt_token_lists(ids, mask)


def test_prompt_token_lists_rejects_shifted_positions_and_bad_shapes():
    batch = prompt_batch(ROWS)
    positions = batch["position_ids"].clone()
    positions[2] += 1
    with pytest.raises(ValueError, match=r"rows \[2\] have position_ids"):
        prompt_token_lists(batch["input_ids"], batch["attention_mask"], positions)
    with pytest.raises(ValueError, match="same"):
        prompt_token_lists(batch["input_ids"], batch["attention_mask"][:, 1:])


def test_request_seeds_from_sample_seed_or_generator():
    batch = prompt_batch(ROWS)
    draws = [request_seeds(batch, torch.Generator().manual_seed(s)) for s in (4, 4, 5)]
    assert draws[0] == draws[1] != draws[2]
    assert len(draws[0]) == 3 and all(0 <= s < 1 << 62 for s in draws[0])
    batch["sample_seed"] = torch.tensor([7, -1, (1 << 62) - 1])
    assert request_seeds(batch, torch.Generator()) == [7, (1 << 63) - 1, (1 << 62) - 1]


def test_sampling_param_dicts_sampled_and_greedy():
    sampled = SamplingParams(temperature=0.7, top_k=-1, top_p=0.9, max_new_tokens=12, greedy=False)
    dicts = sampling_param_dicts(sampled, 2, [11, 12], [2, 5])
    assert [d["seed"] for d in dicts] == [11, 12]
    assert dicts[0] == {
        "n": 1,
        "max_tokens": 12,
        "min_tokens": 0,
        "logprobs": 0,
        "stop_token_ids": [2, 5],
        "ignore_eos": True,
        "detokenize": False,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_p": 0.0,
        "temperature": 0.7,
        "top_k": 0,
        "top_p": 0.9,
        "seed": 11,
    }
    greedy = sampling_param_dicts(replace(sampled, greedy=True, top_k=5), 3, None, [2])
    assert len(greedy) == 3
    assert all(d["temperature"] == 0.0 and d["seed"] is None and d["top_k"] == 0 for d in greedy)
    with pytest.raises(ValueError, match="one seed per row: 2 rows, 1 seeds"):
        sampling_param_dicts(sampled, 2, [1], [2])


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "message"),
    [
        (2.5, 0, 1.0, r"temperatures in \[1e-05, 2\].*got 2.5"),
        (1e-6, 0, 1.0, "below 1e-05 it decodes greedily"),
        (1.0, 0, 0.0, r"top_p must be in \(0, 1\], got 0.0"),
    ],
)
def test_sampling_param_dicts_rejects_what_vllm_would(temperature, top_k, top_p, message):
    """vLLM's SamplingParams refuses temperature > 2 (current releases) and decodes greedily
    (unscaled log-probs) below 1e-5: both are refused here, before any request is sent."""
    params = SamplingParams(temperature, top_k, top_p, max_new_tokens=4, greedy=False)
    with pytest.raises(ValueError, match=message):
        sampling_param_dicts(params, 1, [0], [2])


def test_sampling_param_dicts_top_k_and_types():
    """top-k off is 0 (vLLM's value; -1 is mapped to it), on is k; numbers are plain Python
    ints and floats (vLLM's msgspec struct checks types), at the bounds vLLM accepts."""
    on = SamplingParams(temperature=2, top_k=5, top_p=1, max_new_tokens=3, greedy=False)
    (d,) = sampling_param_dicts(on, 1, [torch.tensor(9).item()], [])
    assert (d["top_k"], d["temperature"], d["top_p"], d["seed"]) == (5, 2.0, 1.0, 9)
    assert type(d["temperature"]) is float and type(d["top_p"]) is float
    assert type(d["top_k"]) is int and type(d["max_tokens"]) is int
    assert d["stop_token_ids"] == [] and d["ignore_eos"] is True
    off = replace(on, top_k=-1, temperature=1e-5)
    assert sampling_param_dicts(off, 1, [1], [])[0]["top_k"] == 0


# ---- response assembly ---------------------------------------------------------------------


def test_assemble_rollout_fields_shapes_and_eos_cut():
    batch = prompt_batch(ROWS)
    batch["sample_seed"] = torch.tensor([1, 2, 3])
    completions = [([8, 9, 2], [-0.1, -0.2, -0.3]), ([4], [-1.5]), ([6, 2, 7, 7], [-1, -2, -3, -4])]
    out = assemble_rollout(
        batch, completions, pad_token_id=PAD, eos_token_ids=[2], max_response_length=4
    )
    assert out["responses"].tolist() == [[8, 9, 2], [4, PAD, PAD], [6, 2, PAD]]
    assert out["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert out["rollout_log_probs"].dtype == torch.float32
    assert out["rollout_log_probs"][2].tolist() == [-1.0, -2.0, 0.0]
    assert torch.equal(out["prompts"], batch["input_ids"])
    assert torch.equal(out["input_ids"], torch.cat([batch["input_ids"], out["responses"]], 1))
    assert out["attention_mask"][1].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 0, 0]
    assert out["position_ids"][1].tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert out["sample_seed"].tolist() == [1, 2, 3]
    assert list(out["uid"]) == ["u0", "u1", "u2"] and out.meta == {"step": 3}
    with pytest.raises(ValueError, match="row 0: 3 response tokens exceed max_response_length=2"):
        assemble_rollout(
            batch, completions, pad_token_id=PAD, eos_token_ids=[], max_response_length=2
        )
    with pytest.raises(ValueError, match="2 completions for 3 prompt rows"):
        assemble_rollout(
            batch, completions[:2], pad_token_id=PAD, eos_token_ids=[2], max_response_length=4
        )


def test_completions_from_outputs_reads_sampled_log_probs_and_rejects_gaps():
    outputs = [request_output([5, 6], [-0.5, -0.25]), request_output([9], [-2.0])]
    assert completions_from_outputs(outputs) == [([5, 6], [-0.5, -0.25]), ([9], [-2.0])]
    missing = request_output([5, 6], [-0.5, -0.25])
    missing.outputs[0].logprobs[1] = {7: SimpleNamespace(logprob=-1.0)}
    with pytest.raises(ValueError, match="row 1, token 1: no log-prob for the sampled id 6"):
        completions_from_outputs([outputs[0], missing])
    no_logprobs = request_output([5], [-0.5])
    no_logprobs.outputs[0].logprobs = None
    with pytest.raises(ValueError, match="row 0: vLLM returned no log-prob"):
        completions_from_outputs([no_logprobs])
    with pytest.raises(ValueError, match="finish_reason='abort'"):
        completions_from_outputs([request_output([], [], reason="abort")])


class FlatLogprobsLike(Sequence):
    """vLLM's ``FlatLogprobs`` (vllm/logprobs.py) in miniature: flat columns that read as a
    sequence of ``{token_id: Logprob}`` positions."""

    def __init__(self, ids, values) -> None:
        self.token_ids, self.logprobs = list(ids), list(values)

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, i):
        return {self.token_ids[i]: SimpleNamespace(logprob=self.logprobs[i], rank=1)}


def test_completions_from_outputs_accepts_vllm_output_forms():
    """token_ids as any int sequence (vLLM may hand an array), log-probs as a list of dicts or
    a FlatLogprobs-like sequence, finish reasons stop and length."""
    flat = SimpleNamespace(
        token_ids=(7, 8, 2),
        logprobs=FlatLogprobsLike([7, 8, 2], [-0.5, -1.5, -0.25]),
        finish_reason="stop",
    )
    capped = request_output([4, 4], [-2.0, -3.0], reason="length")
    assert completions_from_outputs([SimpleNamespace(outputs=[flat]), capped]) == [
        ([7, 8, 2], [-0.5, -1.5, -0.25]),
        ([4, 4], [-2.0, -3.0]),
    ]


@pytest.mark.parametrize("bad", [-math.inf, math.nan])
def test_completions_from_outputs_rejects_non_finite_log_probs(bad):
    with pytest.raises(ValueError, match=r"row 0, token 1: vLLM returned log-prob"):
        completions_from_outputs([request_output([5, 6], [-0.5, bad])])


def test_completions_from_outputs_rejects_several_completions():
    two = SimpleNamespace(outputs=request_output([1], [-1.0]).outputs * 2)
    with pytest.raises(ValueError, match="row 0: expected one completion per request, got 2"):
        completions_from_outputs([two])


def test_eos_token_ids_from_dir_reads_tokenizer_and_generation_config(tokenizer, tmp_path):
    assert eos_token_ids_from_dir(tiny_model_dir(), tokenizer) == [2]
    assert eos_token_ids_from_dir(tmp_path, tokenizer) == [tokenizer.eos_token_id]


# ---- the engine against a stand-in vllm.LLM ----------------------------------------------


@pytest.mark.parametrize("with_seeds", [True, False])
def test_generate_matches_hf_engine_field_for_field(model, tokenizer, with_seeds):
    """The HF engine's samples, replayed by the stand-in, come out as the same Batch."""
    cfg = RolloutConfig(temperature=0.9, max_response_length=10, micro_batch_size=4)
    prompts = prompt_batch(ROWS, repeat=2)
    if with_seeds:
        prompts["sample_seed"] = torch.arange(100, 106)
    hf_out = HFRolloutEngine(model, tokenizer, cfg, eos_token_ids=EOS).generate(prompts)
    lengths = hf_out["response_mask"].sum(-1)
    assert len(set(lengths.tolist())) > 1  # responses of several lengths, some ended by EOS
    engine = fake_engine(tokenizer, cfg, FakeLLM(), eos_token_ids=EOS, seed=3)
    seeds = request_seeds(prompts, torch.Generator().manual_seed(3))
    token_lists = prompt_token_lists(prompts["input_ids"], prompts["attention_mask"])
    engine.llm.completions = {
        (tuple(ids), seed): completion
        for ids, seed, completion in zip(token_lists, seeds, completions_of(hf_out), strict=True)
    }
    out = engine.generate(prompts)
    assert out.equals(hf_out)
    requests, params = engine.llm.generate_calls[0]
    assert [r["prompt_token_ids"] for r in requests] == [r for r in ROWS for _ in range(2)]
    assert [p["seed"] for p in params] == seeds
    assert all(p["temperature"] == 0.9 and p["stop_token_ids"] == EOS for p in params)
    assert engine.last_stats["response_tokens"] == float(lengths.sum())
    assert engine.last_stats["requests"] == 6.0 and engine.last_stats["decode_s"] >= 0


def test_generate_greedy_and_reseeding(tokenizer):
    cfg = RolloutConfig(temperature=0.7, max_response_length=4)
    llm = FakeLLM()
    engine = fake_engine(tokenizer, cfg, llm)
    prompts = prompt_batch(ROWS)
    token_lists = prompt_token_lists(prompts["input_ids"], prompts["attention_mask"])
    llm.completions = {(tuple(ids), None): ([2], [-0.1]) for ids in token_lists}
    out = engine.generate(prompts, temperature=0.0)
    assert out["responses"].tolist() == [[2], [2], [2]]
    assert all(p["temperature"] == 0.0 and p["seed"] is None for p in llm.generate_calls[0][1])
    seeds = [request_seeds(prompts, torch.Generator().manual_seed(9)) for _ in range(2)]
    llm.completions = {
        (tuple(ids), s): ([4, 2], [-1.0, -0.5])
        for ids, s in zip(token_lists, seeds[0], strict=True)
    }
    for _ in range(2):  # seed= re-seeds the generator: the same request seeds each time
        engine.generate(prompts, seed=9, temperature=1.3)
        assert [p["seed"] for p in llm.generate_calls[-1][1]] == seeds[0]
        assert all(p["temperature"] == 1.3 for p in llm.generate_calls[-1][1])
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        engine.generate(prompts, temperature=-1.0)


def test_update_weights_in_place_in_chunks(model, tokenizer):
    target = LoadableModel(model)
    llm = FakeLLM(worker_model=target)
    engine = fake_engine(tokenizer, RolloutConfig(), llm)
    count = engine.update_weights(model.named_parameters(), chunk_bytes=1 << 20)
    names = [n for n, _ in model.named_parameters()]
    assert count == len(names)
    assert all(torch.equal(target.params[n], p) for n, p in model.named_parameters())
    rpcs = [e for e in llm.events if e[0] == "rpc"]
    assert len(rpcs) > 1 and sum(e[2] for e in rpcs) == len(names)
    assert llm.events[-1] == ("reset_prefix_cache",)
    with pytest.raises(TypeError, match="weight 'w' is a list"):
        engine.update_weights([("w", [1.0])])
    with pytest.raises(ValueError, match="no tensors"):
        engine.update_weights([])
    remote = fake_engine(tokenizer, RolloutConfig(), llm, in_process=False)
    with pytest.raises(RuntimeError, match="WeightTransferConfig"):
        remote.update_weights(model.named_parameters())


class GraphWrapper:
    """vLLM's CUDA-graph wrapper around the model: no ``load_weights`` of its own."""

    def __init__(self, inner) -> None:
        self.inner = inner


class WrappingRunner:
    """A GPUModelRunner whose ``model`` is wrapped and whose ``get_model()`` unwraps it."""

    def __init__(self, model) -> None:
        self.model = GraphWrapper(model)

    def get_model(self):
        return self.model.inner


def test_weight_loader_extension_loads_into_the_unwrapped_model(model):
    """The worker extension loads through ``model_runner.get_model()`` (the unwrapped model),
    and returns how many tensors it loaded; the engine's call path ends with a prefix-cache
    reset, whose False answer (blocks still in use) is an error, and whose None (vLLM 0.10)
    is not."""
    target = LoadableModel(model)
    worker = WeightLoaderExtension()
    worker.model_runner = WrappingRunner(target)
    weights = [(n, p.detach()) for n, p in model.named_parameters()][:3]
    assert worker.creditrl_load_weights(weights) == 3
    assert all(torch.equal(target.params[n], p) for n, p in weights)
    assert not any(target.params[n].abs().sum() > 0 for n, _ in list(model.named_parameters())[3:])


def test_update_weights_checks_the_prefix_cache_reset(model, tokenizer):
    llm = FakeLLM(worker_model=LoadableModel(model))
    engine = fake_engine(tokenizer, RolloutConfig(), llm)
    llm.reset_result = None
    assert engine.update_weights(model.named_parameters()) == len(list(model.parameters()))
    llm.reset_result = False
    with pytest.raises(RuntimeError, match="could not reset its prefix cache after update_weights"):
        engine.update_weights(model.named_parameters())
    engine.sleep()
    with pytest.raises(RuntimeError, match="weights are asleep"):
        engine.update_weights(model.named_parameters())
    with pytest.raises(RuntimeError, match="could not reset its prefix cache after wake_up"):
        engine.wake_up()
    assert [e[0] for e in llm.events][-3:] == ["sleep", "wake_up", "reset_prefix_cache"]


def test_sleep_wake_and_level_two_needs_new_weights(model, tokenizer):
    llm = FakeLLM(worker_model=LoadableModel(model))
    engine = fake_engine(tokenizer, RolloutConfig(max_response_length=2), llm)
    prompts = prompt_batch([[5]])
    llm.completions = {((5,), None): ([2], [-0.1])}
    engine.sleep()
    engine.sleep()  # no-op when asleep
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, greedy=True)
    engine.wake_up()
    engine.generate(prompts, greedy=True)
    engine.sleep(level=2)
    engine.wake_up(tags=["weights"])
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, greedy=True)
    engine.wake_up(tags=["kv_cache"])
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(prompts, greedy=True)
    engine.update_weights(model.named_parameters())
    assert engine.generate(prompts, greedy=True)["responses"].tolist() == [[2]]
    calls = [e for e in llm.events if e[0] in ("sleep", "wake_up")]
    assert calls == [
        ("sleep", 1),
        ("wake_up", None),
        ("sleep", 2),
        ("wake_up", ["weights"]),
        ("wake_up", ["kv_cache"]),
    ]
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        engine.wake_up(tags=["cache"])
    quiet = fake_engine(tokenizer, RolloutConfig(), FakeLLM(), enable_sleep_mode=False)
    quiet.sleep()
    assert quiet.asleep == set() and quiet.llm.events == []


def test_build_rollout_engine_choices(model, tokenizer):
    """The registry builds ``hf`` over the given module, refuses an unknown name with a
    ConfigError listing the choices, ``hf`` without a module, and ``vllm`` where it cannot run
    (a one-line ConfigError naming vllm and suggesting rollout.engine=hf)."""
    cfg = RolloutConfig()
    built = build_rollout_engine(EngineArgs(cfg, tokenizer, "unused", model))
    assert isinstance(built, HFRolloutEngine) and built.model is model
    unknown = r"rollout\.engine: unknown rollout engine 'sglang'; choose one of \[.*'hf'.*'vllm'"
    with pytest.raises(ConfigError, match=unknown):
        build_rollout_engine(EngineArgs(replace(cfg, engine="sglang"), tokenizer, "unused", model))
    with pytest.raises(ValueError, match="pass it"):
        build_rollout_engine(EngineArgs(cfg, tokenizer, "unused"))
    if UNAVAILABLE is not None:
        vllm_cfg = replace(cfg, engine="vllm")
        with pytest.raises(
            ConfigError, match=r"^rollout\.engine=vllm: .*use rollout\.engine=hf"
        ) as e:
            build_rollout_engine(EngineArgs(vllm_cfg, tokenizer, tiny_model_dir()))
        assert UNAVAILABLE in str(e.value) and "\n" not in str(e.value)


def test_vllm_engine_refuses_lora_and_launches_externally_on_ranks(tokenizer, monkeypatch):
    """``VLLMRolloutEngine.from_args``: LoRA policies are refused (ConfigError), and on the
    ranks of a distributed job vLLM gets the external_launcher executor with the rollout.*
    vLLM settings."""
    cfg = replace(RolloutConfig(), engine="vllm", gpu_memory_utilization=0.3, vllm_dtype="half")
    with pytest.raises(ConfigError, match=r"model\.lora_rank > 0"):
        VLLMRolloutEngine.from_args(EngineArgs(cfg, tokenizer, "dir", lora=True))
    seen = {}
    monkeypatch.setattr(VLLMRolloutEngine, "__init__", lambda self, *a, **kw: seen.update(kw))
    VLLMRolloutEngine.from_args(EngineArgs(cfg, tokenizer, "dir", seed=4, world_size=2))
    assert seen["llm_kwargs"] == {"distributed_executor_backend": "external_launcher"}
    assert (seen["seed"], seen["gpu_memory_utilization"], seen["dtype"]) == (4, 0.3, "half")
    VLLMRolloutEngine.from_args(EngineArgs(cfg, tokenizer, "dir"))
    assert seen["llm_kwargs"] is None
    assert seen["tensor_parallel_size"] == 1 and seen["enable_sleep_mode"] is True


def test_vllm_engine_refuses_tensor_parallel(tokenizer):
    """In-place weight pushes need one GPU per engine, and external_launcher tensor
    parallelism would need the same prompts on every rank of a group: a ConfigError."""
    cfg = replace(RolloutConfig(), engine="vllm", tensor_parallel_size=2)
    for world_size in (1, 2):
        with pytest.raises(ConfigError, match=r"rollout\.tensor_parallel_size=2: .* needs one GPU"):
            VLLMRolloutEngine.from_args(EngineArgs(cfg, tokenizer, "dir", world_size=world_size))


# ---- real vLLM on a GPU --------------------------------------------------------------------


def trainer_log_probs(model_dir, batch: Batch, temperature: float) -> torch.Tensor:
    policy = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda().eval()
    worker = ActorWorker(policy, ActorConfig(log_prob_micro_batch_size=8), trainable=False)
    log_probs, _ = worker.compute_log_prob(batch.to("cuda"), temperature, with_entropy=False)
    return log_probs.cpu()


def k3_mean(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> float:
    """mean over valid tokens of k3 = exp(old - rollout) - (old - rollout) - 1."""
    return float(masked_mean(kl_penalty(rollout, old, "low_var_kl"), mask.float()))


def same_samples(a: Batch, b: Batch) -> bool:
    """The same tokens, and log-probs equal up to kernel rounding (a prefix-cache hit computes
    the prompt's last position apart from the rest)."""
    return torch.equal(a["responses"], b["responses"]) and torch.allclose(
        a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-3
    )


@pytest.fixture(scope="module")
def vllm_engine(tokenizer):
    if UNAVAILABLE is not None:
        pytest.skip(UNAVAILABLE)
    cfg = RolloutConfig(temperature=0.8, max_response_length=24)
    return VLLMRolloutEngine(
        tiny_model_dir(), tokenizer, cfg, seed=0, gpu_memory_utilization=0.2, enforce_eager=True
    )


@pytest.mark.slow
@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"needs vLLM on a CUDA GPU: {UNAVAILABLE}")
def test_vllm_rollout_log_probs_match_trainer(vllm_engine):
    prompts = prompt_batch(ROWS, repeat=4)
    prompts["sample_seed"] = torch.arange(12)
    out = vllm_engine.generate(prompts)
    assert same_samples(out, vllm_engine.generate(prompts))  # seeded: the same samples again
    old = trainer_log_probs(tiny_model_dir(), out, temperature=0.8)
    mask = out["response_mask"]
    assert k3_mean(old, out["rollout_log_probs"], mask) < 1e-3
    _, _, metrics = compute_rollout_importance_weights(old, out["rollout_log_probs"], mask)
    assert abs(metrics["mismatch/rollout_is_mean"] - 1.0) < 0.05
    greedy = vllm_engine.generate(prompts, greedy=True)  # log-probs of the unscaled logits
    old = trainer_log_probs(tiny_model_dir(), greedy, temperature=1.0)
    assert k3_mean(old, greedy["rollout_log_probs"], greedy["response_mask"]) < 1e-3


@pytest.mark.slow
@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"needs vLLM on a CUDA GPU: {UNAVAILABLE}")
def test_vllm_update_weights_sleep_and_wake(vllm_engine):
    prompts = prompt_batch(ROWS, repeat=4)
    prompts["sample_seed"] = torch.arange(12)
    other = tiny_model_dir(seed=1)
    weights = LlamaForCausalLM.from_pretrained(str(other), dtype=torch.float32).cuda()
    vllm_engine.update_weights(weights.named_parameters())
    out = vllm_engine.generate(prompts)
    mask = out["response_mask"]
    new = k3_mean(trainer_log_probs(other, out, 0.8), out["rollout_log_probs"], mask)
    stale = k3_mean(trainer_log_probs(tiny_model_dir(), out, 0.8), out["rollout_log_probs"], mask)
    assert new < 1e-3 < stale
    vllm_engine.sleep(level=1)
    vllm_engine.wake_up()
    assert same_samples(vllm_engine.generate(prompts), out)  # level 1 kept the new weights
    original = LlamaForCausalLM.from_pretrained(str(tiny_model_dir()), dtype=torch.float32).cuda()
    vllm_engine.sleep(level=2)
    vllm_engine.wake_up(tags=["weights"])
    vllm_engine.update_weights(original.named_parameters())
    vllm_engine.wake_up(tags=["kv_cache"])
    back = vllm_engine.generate(prompts)
    old = trainer_log_probs(tiny_model_dir(), back, 0.8)
    assert k3_mean(old, back["rollout_log_probs"], back["response_mask"]) < 1e-3

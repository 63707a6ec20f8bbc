"""A LoRA actor is sampled from its merged weights (``creditrl.rollout.merged_copy``): a plain
copy whose adapted linears hold W + s B A, refreshed in place once per weight version, so the
fast decode path applies; its log-probs are the adapter model's to float32 rounding. Covered
here: the engine, ``creditrl train``, the async sampler (``lora_sync=adapter`` and ``merged``),
the Tinker service's sampling, and the benchmark's tiny setting."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, prompt_batch, tiny_hf_engine, tiny_learner_config, tiny_trainer_config
from transformers import LlamaForCausalLM

from creditrl.config import ActorConfig
from creditrl.config.loader import load_config
from creditrl.models import apply_lora, load_causal_lm
from creditrl.models.tiny import tiny_model_dir
from creditrl.rollout.cuda_graph import parameter_pointers
from creditrl.rollout.llama_decode import LlamaDecoder
from creditrl.rollout.merged_copy import MergedCopy, merge_unsupported
from creditrl.weights.tensors import merged_state_dict
from creditrl.workers import ActorWorker
from creditrl.workers.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[1]

# The merged copy computes W' x with W' = W + s B A (rounded once per weight); the adapter model
# computes W x + s B (A x). In float32 (unit roundoff u = 2^-24 ~ 6e-8) a logit of the tiny
# model (|logit| <= 6 here) sums ~100 products along its path, so the two differ by at most
# ~100 u |logit| ~ 4e-5, and a log-softmax moves by at most twice its largest logit's change:
# 1e-4. Measured on these batches: max 5.7e-6 merged, 3.8e-6 through peft, 2.9e-6 for the full
# model's engine (its KV-cache decode rounds differently from the teacher-forced forward too).
LOG_PROB_ATOL = 1e-4
# peft's notice when the LoRA head is tied to the embeddings (the copy unties it: tested here)
TIED_HEAD = "ignore:Model has `tie_word_embeddings=True`:UserWarning"


def lora_of(model: torch.nn.Module, seed: int = 0, **kwargs) -> torch.nn.Module:
    """``model`` (copied) with rank-4 adapters whose B is random (B starts at 0: the adapters
    would change nothing)."""
    torch.manual_seed(seed)
    lora = apply_lora(copy.deepcopy(model), rank=4, alpha=8, **kwargs)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return lora.eval()


def teacher_forced(model: torch.nn.Module, out, temperature: float) -> torch.Tensor:
    worker = ActorWorker(model, ActorConfig(autocast="none"), trainable=False)
    return worker.compute_log_prob(out, temperature)[0]


def gap(model: torch.nn.Module, out, temperature: float) -> float:
    valid = out["response_mask"].bool()
    diff = teacher_forced(model, out, temperature) - out["rollout_log_probs"]
    return float(diff.abs()[valid].max())


def assert_merged(copy_: torch.nn.Module, lora: torch.nn.Module) -> None:
    """The copy holds exactly the weights the async channel publishes as 'merged'."""
    state = copy_.state_dict()
    for name, value in merged_state_dict(lora).items():
        assert torch.equal(state[name], value.to(state[name].dtype)), name


# ---- the engine -----------------------------------------------------------------------------


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_a_lora_model_is_sampled_from_its_merged_copy(model, tokenizer, targets):
    lora = lora_of(model, target_modules=targets)
    engine = tiny_hf_engine(lora, tokenizer, seed=1, eos_token_ids=[])
    out = engine.generate(prompt_batch(PROMPTS, repeat=2), seed=3)
    sampler = engine.merged_copy.module
    assert type(sampler) is LlamaForCausalLM and LlamaDecoder.for_model(sampler) is not None
    assert engine.model is lora and not any(p.requires_grad for p in sampler.parameters())
    assert_merged(sampler, lora)
    assert gap(lora, out, engine.cfg.temperature) < LOG_PROB_ATOL


def test_sampled_ids_are_the_peft_models(model, tokenizer):
    """Greedy: the same ids as sampling through peft; sampled with a seed too (the draws are
    the same and the distributions differ by rounding only)."""
    lora = lora_of(model)
    prompts = prompt_batch(PROMPTS, repeat=2)
    merged = tiny_hf_engine(lora, tokenizer, seed=1)
    through_peft = tiny_hf_engine(lora, tokenizer, seed=1, merge_lora=False)
    assert through_peft.merged_copy is None and through_peft.sampling_module() is lora
    for kwargs in ({"greedy": True}, {"seed": 5}):
        ours, theirs = merged.generate(prompts, **kwargs), through_peft.generate(prompts, **kwargs)
        assert torch.equal(ours["responses"], theirs["responses"]), kwargs
        torch.testing.assert_close(
            ours["rollout_log_probs"], theirs["rollout_log_probs"], atol=LOG_PROB_ATOL, rtol=0
        )


def test_the_merge_happens_once_per_weight_version(model, tokenizer):
    """Two calls without an update merge once; an optimizer step (fused AdamW, which does not
    bump the parameters' version counters) and a load each make one more merge; the copy's
    storage never moves."""
    lora = lora_of(model)
    prompts = prompt_batch(PROMPTS)
    engine = tiny_hf_engine(lora, tokenizer, seed=1)
    engine.generate(prompts, seed=0)
    engine.generate(prompts, seed=1)
    merged = engine.merged_copy
    assert merged.merges == 1
    pointers = parameter_pointers(merged.module)

    params = [p for p in lora.parameters() if p.requires_grad]
    optimizer, _ = build_optimizer(params, ActorConfig().optim, 1)
    versions = [p._version for p in params]
    lora.train()
    out = lora(input_ids=torch.tensor([PROMPTS[0]]))
    out.logits.logsumexp(-1).mean().backward()
    optimizer.step()
    lora.eval()
    engine.generate(prompts, seed=2)
    assert merged.merges == 2 and parameter_pointers(merged.module) == pointers
    assert_merged(merged.module, lora)
    if optimizer.defaults.get("fused"):  # why values are compared, not only versions
        assert [p._version for p in params] == versions
    engine.generate(prompts, seed=3)
    assert merged.merges == 2

    engine.update_weights(copy.deepcopy(lora_of(model, seed=1).state_dict()).items())
    out = engine.generate(prompts, seed=4)
    assert merged.merges == 3 and parameter_pointers(merged.module) == pointers
    assert_merged(merged.module, lora)
    assert gap(lora, out, engine.cfg.temperature) < LOG_PROB_ATOL


def test_engines_that_share_a_merged_copy_merge_once(model, tokenizer):
    """An engine built per call (the Tinker service's) over one model and one MergedCopy."""
    lora, shared = lora_of(model), MergedCopy()
    for seed in range(3):
        engine = tiny_hf_engine(lora, tokenizer)
        engine.merged_copy = shared
        engine.generate(prompt_batch(PROMPTS), seed=seed)
    assert shared.merges == 1


def test_bf16_sampling_of_a_lora_model_merges_then_rounds(model, tokenizer, monkeypatch):
    """sample_dtype=bfloat16 with LoRA: the merged weights (float32) rounded once to bf16; the
    engine samples what an engine over those rounded weights samples, and the config loads
    where bf16 is native (faked here) with rollout IS on (old_log_probs recomputed by the
    actor, as for any bf16 copy: tests/test_sampler_copy_policy.py)."""
    lora = lora_of(model)
    prompts = prompt_batch(PROMPTS, repeat=2)
    engine = tiny_hf_engine(lora, tokenizer, engine_kwargs={"sample_dtype": "bfloat16"})
    out = engine.generate(prompts, seed=3)
    sampler = engine.merged_copy.module
    assert sampler.dtype == torch.bfloat16 and type(sampler) is LlamaForCausalLM
    assert_merged(sampler, lora)
    rounded = copy.deepcopy(model)
    rounded.load_state_dict(merged_state_dict(lora))
    reference = tiny_hf_engine(rounded.to(torch.bfloat16), tokenizer).generate(prompts, seed=3)
    assert torch.equal(out["responses"], reference["responses"])
    assert torch.equal(out["rollout_log_probs"], reference["rollout_log_probs"])
    monkeypatch.setattr("creditrl.workers.precision.cpu_has_native_bf16", lambda: True)
    cfg = load_config(
        overrides=["model.lora_rank=8", "rollout.engine_kwargs.sample_dtype=bfloat16",
                   "algorithm.rollout_is.enable=true"]
    )  # fmt: skip
    assert cfg.model.lora_rank == 8


@pytest.mark.filterwarnings(TIED_HEAD)
def test_a_lora_head_tied_to_the_embeddings_is_untied_in_the_copy(tokenizer):
    base = load_causal_lm(tiny_model_dir())
    assert base.lm_head.weight is base.model.embed_tokens.weight
    lora = lora_of(base, target_modules="q_proj,lm_head")
    engine = tiny_hf_engine(lora, tokenizer, seed=1, eos_token_ids=[])
    out = engine.generate(prompt_batch(PROMPTS), seed=3)
    sampler = engine.merged_copy.module
    embeddings = lora.get_base_model().model.embed_tokens.weight
    assert torch.equal(sampler.model.embed_tokens.weight, embeddings)
    assert not torch.equal(sampler.lm_head.weight, embeddings)
    assert_merged(sampler, lora)
    assert gap(lora, out, engine.cfg.temperature) < LOG_PROB_ATOL


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_what_cannot_be_merged_exactly_is_sampled_through_peft(model, tokenizer):
    """Adapters disabled (the peft model is then the base model) and DoRA (not W + s B A)."""
    from peft import LoraConfig, get_peft_model

    lora = lora_of(model)
    prompts = prompt_batch(PROMPTS)
    engine = tiny_hf_engine(lora, tokenizer)
    with lora.disable_adapter():
        assert "disabled" in merge_unsupported(lora)
        assert engine.sampling_module() is lora
        out = engine.generate(prompts, greedy=True)
    base = tiny_hf_engine(model, tokenizer).generate(prompts, greedy=True)
    assert torch.equal(out["responses"], base["responses"])
    assert engine.merged_copy.module is None  # never built

    dora = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=2, use_dora=True, target_modules=["q_proj"])
    )
    assert "variant" in merge_unsupported(dora)
    assert tiny_hf_engine(dora, tokenizer).sampling_module() is dora
    assert merge_unsupported(model) == "it is not a peft model"


def _nudge_adapters(lora: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.mul_(1.5)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
            ],
        ),
    ],
)
def test_static_decode_keeps_its_steps_across_merges(model, tokenizer, device):
    """The static decoder (a CUDA graph on CUDA, eager on the CPU) is built over the merged
    copy and kept across a merge (written in place: no pointer moves, nothing rebuilt); its
    samples follow the new adapters, those of the dynamic path through peft."""
    lora = lora_of(model).to(device)
    prompts = prompt_batch(PROMPTS, repeat=2)
    engine = tiny_hf_engine(lora, tokenizer, engine_kwargs={"decode_cache": "static"})
    engine.generate(prompts, seed=1)
    decoder = engine._static[0]
    assert decoder.model is engine.merged_copy.module
    built, steps = decoder.built, dict(decoder.steps)
    _nudge_adapters(lora)
    out = engine.generate(prompts, seed=1)
    assert engine.merged_copy.merges == 2
    assert decoder.built == built and dict(decoder.steps) == steps
    assert engine.last_stats["graph_decode"] == float(device == "cuda")
    peft = tiny_hf_engine(
        lora, tokenizer, merge_lora=False, engine_kwargs={"decode_cache": "dynamic"}
    )
    reference = peft.generate(prompts, seed=1)
    assert torch.equal(out["responses"], reference["responses"])
    torch.testing.assert_close(
        out["rollout_log_probs"], reference["rollout_log_probs"], atol=LOG_PROB_ATOL, rtol=0
    )


# ---- creditrl train --------------------------------------------------------------------------


def test_a_lora_train_run_samples_merged_and_reuses_its_log_probs(tmp_path):
    """Two steps of `creditrl train` with model.lora_rank=4 (float32; an entropy bonus, so the
    tiny run's all-zero scores still move the adapters): one merge per weight version (step 1
    samples version 0, step 2 version 1), the rollout's log-probs reused as old_log_probs
    (they are the actor's to rounding) and the first mini-batch's ratio 1 to ~1e-5, as for a
    full model."""
    from creditrl.pipeline.step import rollout_log_probs_reusable
    from creditrl.trainers.rl_trainer import RLTrainer

    cfg = tiny_trainer_config(
        tmp_path, "model.lora_rank=4", "model.lora_alpha=8", "actor.use_rollout_log_probs=true",
        "actor.optim.lr=5e-2", "actor.entropy_coeff=0.01", "trainer.save_freq=0",
        "trainer.test_freq=0", "trainer.val_before_train=false", "reward.num_workers=0",
    )  # fmt: skip
    assert rollout_log_probs_reusable(cfg)
    trainer = RLTrainer(cfg)
    trainer.fit()
    worker = trainer.workers.worker
    merged = worker.engine.merged_copy
    assert merged is not None and merged.merges == 2
    worker.engine.sampling_module()  # the next rollout's: the second update's weights
    assert merged.merges == 3
    assert_merged(merged.module, worker.actor.model)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    for line in lines:
        metrics = json.loads(line)
        assert metrics["actor/grad_norm"] > 0
        assert metrics["health/first_minibatch_clipfrac"] == 0.0
        assert abs(metrics["health/first_minibatch_ppo_kl"]) < 1e-5
    dump = json.loads((tmp_path / "rollouts" / "step_000001.jsonl").read_text().splitlines()[0])
    per_token = dump["per_token"]
    assert per_token["old_log_probs"] == per_token["rollout_log_probs"]


# ---- the async sampler ------------------------------------------------------------------------


def _published_lora() -> torch.nn.Module:
    """A LoRA actor of the tiny model as a learner would publish it."""
    return lora_of(load_causal_lm(tiny_model_dir()))


@pytest.mark.parametrize("lora_sync", ["adapter", "merged"])
def test_async_samplers_sample_merged_weights(tmp_path, tokenizer, lora_sync):
    """lora_sync=adapter: the sampler's policy is a peft model, its engine merges once per
    loaded version; lora_sync=merged: it loads merged weights into a plain model. Both sample
    the same ids with the same log-probs, bit for bit (the same merged weights, the same
    decode)."""
    from creditrl.asynchronous.sampler import Sampler
    from creditrl.asynchronous.settings import weight_root
    from creditrl.weights.folder import WeightPublisher

    results = {}
    prompts = prompt_batch(PROMPTS, repeat=2)
    for sync in ("adapter", "merged"):
        out = tmp_path / sync
        cfg = tiny_learner_config(
            out, "model.lora_rank=4", "model.lora_alpha=8", f"asynchronous.lora_sync={sync}",
            "data.train_size=8", "rollout.max_response_length=8",
            "asynchronous.weight_channel=folder",  # the folder this test publishes into
        )  # fmt: skip
        sampler = Sampler(cfg, 0)
        try:
            engine = sampler.worker.engine
            learner = _published_lora()
            publisher = WeightPublisher(weight_root(cfg), 2, sync)
            publisher.publish(learner, 1)
            assert sampler.weights.refresh() and sampler.version == 1
            first = engine.generate(prompts, seed=3)
            engine.generate(prompts, seed=4)
            if sync == "adapter":
                assert engine.merged_copy.merges == 1
                assert_merged(engine.merged_copy.module, learner)
            else:
                assert engine.merged_copy is None and engine.sampling_module() is engine.model
            assert LlamaDecoder.for_model(engine.sampling_module()) is not None
            assert gap(learner, first, engine.cfg.temperature) < LOG_PROB_ATOL
            with torch.no_grad():  # the learner's next version
                for name, param in learner.named_parameters():
                    if "lora_A" in name:
                        param.mul_(1.5)
            publisher.publish(learner, 2)
            assert sampler.weights.refresh() and sampler.version == 2
            second = engine.generate(prompts, seed=3)
            if sync == "adapter":
                assert engine.merged_copy.merges == 2
            assert gap(learner, second, engine.cfg.temperature) < LOG_PROB_ATOL
            results[sync] = first
        finally:
            sampler.close()
    if lora_sync == "merged":  # once is enough: both runs are compared here
        for key in ("responses", "rollout_log_probs"):
            assert torch.equal(results["adapter"][key], results["merged"][key]), key


# ---- the Tinker service ----------------------------------------------------------------------


@pytest.mark.filterwarnings(TIED_HEAD)
def test_the_tinker_policy_samples_merged_once_per_weight_change(tokenizer):
    """A LoRA training client's sampling: one engine per call over one kept MergedCopy that
    merges once per weight change (an optim_step, a sampler's saved weights swapped in and
    out); a sampled token's log-prob is the training forward's (``prompt_logprobs``) to
    rounding, the greedy ids those of sampling through peft."""
    from creditrl.tinker.messages import Datum
    from creditrl.tinker.policy import AdamStep, LoraSpec, Policy, SampleParams

    directory = str(tiny_model_dir())
    policy = Policy(directory, directory, LoraSpec(rank=4, seed=0))
    prompt = [1, 520, 9, 33, 4001, 77]
    params = SampleParams(max_tokens=6, temperature=1.0)

    def sample(seed: int) -> None:
        for seq in policy.sample([(prompt, 2, seed)], params)[0]:
            full = policy.prompt_logprobs(prompt + seq.tokens)[len(prompt) :]
            torch.testing.assert_close(
                torch.tensor(seq.logprobs), torch.tensor(full), atol=LOG_PROB_ATOL, rtol=0
            )

    sample(0)
    sample(1)
    assert policy.merged.merges == 1
    saved, version = policy.adapter_state(), policy.version
    datum = Datum(prompt[:-1], {"target_tokens": torch.tensor(prompt[1:]),
                                "weights": torch.ones(len(prompt) - 1)})  # fmt: skip
    policy.forward_backward([datum], "cross_entropy", {}, forward_only=False)
    policy.optim_step(AdamStep(learning_rate=5e-2))
    sample(0)
    assert policy.merged.merges == 2
    assert_merged(policy.merged.module, policy.module)
    with policy.using(saved, version):  # a sampler saved before the step
        sample(2)
        assert policy.merged.merges == 3
    sample(3)
    assert policy.merged.merges == 4
    greedy = policy.sample([(prompt, 1, 0)], SampleParams(max_tokens=6, temperature=0.0))
    through_peft = tiny_hf_engine(
        policy.module, tokenizer, eos_token_ids=[], max_response_length=6, merge_lora=False
    ).generate(prompt_batch([prompt]), greedy=True)
    assert greedy[0][0].tokens == through_peft["responses"][0].tolist()


# ---- the benchmark --------------------------------------------------------------------------


def test_the_lora_rollout_benchmark_runs_on_a_tiny_setting(capsys, tmp_path, monkeypatch):
    # a CPU without native bf16: actor.autocast=auto resolves to none, as on this dev box
    monkeypatch.setattr("creditrl.workers.precision.cpu_has_native_bf16", lambda: False)
    spec = importlib.util.spec_from_file_location(
        "lora_rollout", ROOT / "benchmarks/lora_rollout.py"
    )
    bench = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("lora_rollout", bench)
    spec.loader.exec_module(bench)
    results = tmp_path / "lora_rollout.md"
    bench.main(["--tiny", "--repeats", "1", "--threads", "1", "--write", str(results)])
    out = capsys.readouterr().out
    for variant in ("full", "lora-merged", "lora-peft"):
        assert f"\n{variant} " in out or out.startswith(f"{variant} "), variant
    assert "old log-probs" in out and "merge" in out
    # both acceptance ratios, each with its target; a float32 run here reuses the sampled
    # log-probs with LoRA as without, so the stage is the same copy for both
    assert "sampling tokens/s, LoRA (merged) / full: " in out and "(target >= 0.9: " in out
    assert "old-log-prob stage, LoRA / full seconds: 1.00 (target <= 1.2: met)" in out
    written = results.read_text()
    assert "--tiny" in written and "CPU: " in written and "(target >= 0.9: " in written

"""Sampling from a bf16 copy of float32 master weights (``rollout.engine_kwargs.sample_dtype=
bfloat16``, ``rollout.sampler_copy``): the copy is refreshed in place (same storage, so
captured graphs stay valid) and samples what an engine over the master rounded to bf16 samples.
When the config allows it (native bf16, rollout IS on): tests/test_sampler_copy_policy.py."""

from __future__ import annotations

import copy

import torch
from helpers import PROMPTS, prompt_batch, tiny_hf_engine

from creditrl.rollout.cuda_graph import parameter_pointers


def bf16_engine(model, tokenizer, **overrides):
    return tiny_hf_engine(model, tokenizer, engine_kwargs={"sample_dtype": "bfloat16"}, **overrides)


def test_the_bf16_copy_samples_what_the_rounded_master_samples(model, tokenizer):
    master = copy.deepcopy(model)
    prompts = prompt_batch(PROMPTS, repeat=2)
    rollout = bf16_engine(master, tokenizer)
    out = rollout.generate(prompts, seed=3)
    sampler = rollout._copy.module
    assert rollout.model is master and master.dtype == torch.float32
    assert sampler.dtype == torch.bfloat16 and not any(
        p.requires_grad for p in sampler.parameters()
    )
    rounded = copy.deepcopy(master).to(torch.bfloat16)
    reference = tiny_hf_engine(rounded, tokenizer).generate(prompts, seed=3)
    assert torch.equal(out["responses"], reference["responses"])
    assert torch.equal(out["rollout_log_probs"], reference["rollout_log_probs"])
    # an in-place update of the master reaches the copy in place
    pointers = parameter_pointers(sampler)
    with torch.no_grad():
        for param in master.parameters():
            param.add_(0.01 * torch.randn_like(param))
    rollout.generate(prompts, seed=3)
    assert rollout._copy.module is sampler and parameter_pointers(sampler) == pointers
    for name, tensor in master.state_dict().items():
        assert torch.equal(sampler.state_dict()[name], tensor.to(torch.bfloat16)), name


def test_bf16_sampling_takes_a_float32_update(monkeypatch):
    """The update need not run in bf16: with rollout IS on, old_log_probs are recomputed by the
    actor in whatever precision it updates in (before, actor.autocast=none was refused)."""
    from creditrl.config.loader import load_config
    from creditrl.pipeline.step import rollout_log_probs_reusable

    monkeypatch.setattr("creditrl.workers.precision.cpu_has_native_bf16", lambda: True)
    for autocast in ("none", "bf16"):
        cfg = load_config(
            overrides=["rollout.engine_kwargs.sample_dtype=bfloat16",
                       "algorithm.rollout_is.enable=true", f"actor.autocast={autocast}"]
        )  # fmt: skip
        assert not rollout_log_probs_reusable(cfg)

"""bf16 sampling (``rollout.engine_kwargs.sample_dtype=bfloat16``) is opt-in and only where the
CPU multiplies bf16 natively (avx512_bf16 or amx_bf16; the probe ``cpu_has_native_bf16`` is
faked here both ways): on a CPU without them the config is refused in one line naming the key,
no fallback. It needs rollout IS on, so the update's ``old_log_probs`` are recomputed by the
actor (float32 here: ``actor.autocast=none``), the first mini-batch's ratio is 1, the sampler's
gap is reported by ``rollout_corr/*`` and weighed by the rollout IS weights. The start-up line
says which dtype the engine samples in and why."""

from __future__ import annotations

import json

import pytest
from helpers import refused, tiny_trainer_config

from creditrl.config.loader import load_config
from creditrl.pipeline.step import rollout_log_probs_reusable
from creditrl.workers.precision import sampling_choice

BF16 = "rollout.engine_kwargs.sample_dtype=bfloat16"
IS_ON = "algorithm.rollout_is.enable=true"


def native_bf16(monkeypatch, native: bool) -> None:
    monkeypatch.setattr("creditrl.workers.precision.cpu_has_native_bf16", lambda: native)


def test_bf16_sampling_is_refused_on_a_cpu_without_native_bf16(monkeypatch, capsys):
    native_bf16(monkeypatch, False)
    line = refused(capsys, BF16, IS_ON, "actor.autocast=none")
    assert "rollout.engine_kwargs.sample_dtype=bfloat16" in line
    assert "avx512_bf16 and amx_bf16" in line and "sample_dtype=model" in line
    refused(capsys, BF16, IS_ON, "actor.autocast=bf16")  # the update's autocast changes nothing
    cfg = load_config(overrides=["actor.autocast=none"])
    line = sampling_choice(cfg, "cpu")
    assert line.startswith("rollout.engine_kwargs.sample_dtype=model: sampling with the actor's")
    assert "bf16 sampling is refused here: this CPU lacks avx512_bf16 and amx_bf16" in line


def test_bf16_sampling_needs_rollout_is(monkeypatch, capsys):
    native_bf16(monkeypatch, True)
    line = refused(capsys, BF16, "actor.autocast=none")
    assert "sample_dtype=bfloat16" in line and "algorithm.rollout_is.enable=true" in line
    refused(capsys, "rollout.engine_kwargs.sample_dtype=float16")


def test_the_start_up_line_says_the_sampling_dtype_and_why(monkeypatch):
    native_bf16(monkeypatch, True)
    line = sampling_choice(load_config(overrides=[]), "cpu")
    assert line.startswith("rollout.engine_kwargs.sample_dtype=model: ")
    assert "opt-in here (this CPU has avx512_bf16 or amx_bf16)" in line
    cfg = load_config(overrides=[BF16, IS_ON, "actor.autocast=none"])
    line = sampling_choice(cfg, "cpu")
    assert line.startswith("rollout.engine_kwargs.sample_dtype=bfloat16: sampling from a bf16 ")
    assert "this CPU has avx512_bf16 or amx_bf16" in line and "recomputed by the actor" in line
    # an engine without the option (vLLM) says nothing about it
    assert sampling_choice(load_config(overrides=["rollout.engine=vllm"]), "cpu") is None


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_bf16_sampled_run_recomputes_old_log_probs_with_the_float32_actor(
    monkeypatch, tmp_path, capsys
):
    """One step of `creditrl train` sampling from the bf16 copy with a float32 update: the
    rollout's log-probs are not reused (old_log_probs recomputed by the actor), so the first
    mini-batch's ratio is 1 (ppo_kl to float32 rounding, nothing clipped), while rollout_corr/*
    shows the bf16 sampler's gap (far above float32 rounding) and the IS weights differ from 1."""
    from creditrl.trainers.rl_trainer import RLTrainer

    native_bf16(monkeypatch, True)
    cfg = tiny_trainer_config(
        tmp_path, BF16, IS_ON, "actor.autocast=none", "actor.use_rollout_log_probs=true",
        "trainer.total_steps=1", "trainer.save_freq=0", "trainer.test_freq=0",
        "trainer.val_before_train=false", "reward.num_workers=0",
    )  # fmt: skip
    assert not rollout_log_probs_reusable(cfg)
    trainer = RLTrainer(cfg)
    trainer.fit()
    assert "sample_dtype=bfloat16: sampling from a bf16 copy" in capsys.readouterr().out
    assert trainer.workers.worker.engine._copy is not None
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["health/first_minibatch_clipfrac"] == 0.0
    # float32 recompute against the float32 training forward: rounding only (~1e-7)
    assert abs(row["health/first_minibatch_ppo_kl"]) < 1e-5
    # bf16 weights move a log-prob by ~1e-2 (8 mantissa bits): the gap is seen, not rounding
    assert row["rollout_corr/max_abs_logp_diff"] > 1e-3
    # the IS weights exp(old - rollout) correct it: not all 1
    assert row["mismatch/rollout_is_std"] > 0 and row["mismatch/rollout_is_max"] > 1
    dump = json.loads((tmp_path / "rollouts" / "step_000001.jsonl").read_text().splitlines()[0])
    per_token = dump["per_token"]
    assert per_token["old_log_probs"] != per_token["rollout_log_probs"]

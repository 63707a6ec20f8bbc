"""actor.autocast=auto picks bf16 only where bfloat16 matmuls are native."""

import pytest

from creditrl.config.loader import load_config
from creditrl.workers import precision
from creditrl.workers.precision import autocast_choice, cpu_has_native_bf16, resolve_autocast


def _cpuinfo(tmp_path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\n")
    return str(path)


def test_cpu_flags_decide(tmp_path):
    assert cpu_has_native_bf16.__wrapped__(_cpuinfo(tmp_path, "avx2 avx512f avx512_bf16"))
    assert cpu_has_native_bf16.__wrapped__(_cpuinfo(tmp_path, "avx2 amx_bf16 amx_tile"))
    assert not cpu_has_native_bf16.__wrapped__(_cpuinfo(tmp_path, "avx2 fma avx512f"))
    assert not cpu_has_native_bf16.__wrapped__(str(tmp_path / "missing"))


@pytest.mark.parametrize("native", [True, False])
def test_auto_resolves_on_cpu(monkeypatch, native):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    assert resolve_autocast("auto", "cpu") == ("bf16" if native else "none")
    assert resolve_autocast("bf16", "cpu") == "bf16" and resolve_autocast("none", "cpu") == "none"


def test_default_is_auto_and_bad_values_refused():
    assert load_config().actor.autocast == "auto"
    with pytest.raises(ValueError, match=r"actor\.autocast"):
        resolve_autocast("fp16", "cpu")


@pytest.mark.parametrize("native", [True, False])
def test_the_choice_and_the_flags_behind_it_are_said(monkeypatch, native):
    """The start-up line names what ``auto`` chose on this CPU and the flags that decided."""
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    line = autocast_choice("auto", "cpu")
    assert line.startswith(
        f"actor.autocast=auto: the update runs in {'bf16' if native else 'none'}"
    )
    assert "avx512_bf16" in line and "amx_bf16" in line
    assert autocast_choice("none", "cpu") == "actor.autocast=none: the update runs in none on cpu"


def test_under_bf16_autocast_old_log_probs_are_the_updates_and_rollout_ones_are_not_reused(
    tmp_path,
):
    """actor.autocast=bf16: the log-prob pass runs under the update's autocast, so the first
    mini-batch's ratio is 1 (ppo_kl ~0 and nothing clipped; before, float32 old log-probs
    against a bf16 update gave ppo_kl 0.11 and 11% clipped on the main job), and the float32
    engine's log-probs are not taken as old_log_probs."""
    import json

    from helpers import tiny_trainer_config

    from creditrl.pipeline.step import rollout_log_probs_reusable
    from creditrl.trainers.rl_trainer import RLTrainer

    cfg = tiny_trainer_config(tmp_path, "actor.autocast=bf16", "actor.use_rollout_log_probs=true",
                              "trainer.total_steps=1", "trainer.test_freq=0")  # fmt: skip
    assert not rollout_log_probs_reusable(cfg)
    fp32 = tiny_trainer_config(tmp_path, "actor.autocast=none", "actor.use_rollout_log_probs=true")
    assert rollout_log_probs_reusable(fp32)
    RLTrainer(cfg).fit()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["health/first_minibatch_clipfrac"] == 0.0
    assert abs(row["health/first_minibatch_ppo_kl"]) < 1e-2

"""The config checks that need the workers' placement: registered with
``creditrl.config.checks``, read without torch unless a setting needs the device resolved."""

from __future__ import annotations

from creditrl.config.checks import register_config_check
from creditrl.config.schema import Config
from creditrl.errors import ConfigError


@register_config_check("sample_dtype_bf16")
def _check_sample_dtype(cfg: Config) -> None:
    """A bf16 sampling copy (opt-in) only where bf16 is multiplied natively, and with rollout
    importance sampling on: its log-probs are the copy's, so the update's ``old_log_probs``
    are recomputed by the actor (rollout IS on: ``rollout_log_probs_reusable``), ``rollout_corr/*``
    reports the sampler-trainer gap and the IS weights correct it. Refused on a CPU without
    avx512_bf16 or amx_bf16, where bf16 products are many times slower than float32
    (benchmarks/results/precision.md): no fallback, the key is named (the placement, which
    imports torch, is resolved only when the bf16 copy is asked for)."""
    if cfg.rollout.engine_kwargs.get("sample_dtype") != "bfloat16":
        return
    from creditrl.workers.placement import device_type
    from creditrl.workers.precision import BF16_FLAGS, cpu_has_native_bf16

    if device_type(cfg) == "cpu" and not cpu_has_native_bf16():
        raise ConfigError(
            "rollout.engine_kwargs.sample_dtype=bfloat16: this CPU lacks "
            f"{' and '.join(BF16_FLAGS)}, where bf16 products are slower than float32 "
            "(benchmarks/results/precision.md): set rollout.engine_kwargs.sample_dtype=model"
        )
    if not cfg.algorithm.rollout_is.enable:
        raise ConfigError(
            "rollout.engine_kwargs.sample_dtype=bfloat16 samples from a bf16 copy whose "
            "log-probs are not the actor's: set algorithm.rollout_is.enable=true (old_log_probs "
            "recomputed by the actor, the gap corrected by the rollout IS weights) or "
            "sample_dtype=model"
        )

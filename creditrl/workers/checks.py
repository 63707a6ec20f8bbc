"""The config checks that need the workers' placement: registered with
``creditrl.config.checks``, read without torch unless a setting needs the autocast resolved."""

from __future__ import annotations

from creditrl.config.checks import register_config_check
from creditrl.config.schema import Config
from creditrl.errors import ConfigError


@register_config_check("sample_dtype_autocast")
def _check_sample_dtype(cfg: Config) -> None:
    """A bf16 sampling copy only where the update runs in bf16 too (the autocast is resolved
    by the placement, which imports torch: only when the bf16 copy is asked for)."""
    if cfg.rollout.engine_kwargs.get("sample_dtype") != "bfloat16":
        return
    from creditrl.workers.placement import update_autocast

    if update_autocast(cfg) != "bf16":
        raise ConfigError(
            "rollout.engine_kwargs.sample_dtype=bfloat16 samples from a bf16 copy whose "
            "log-probs are not the update's, and actor.autocast resolves to none here (the "
            "update would reuse them as old_log_probs): set actor.autocast=bf16 or "
            "sample_dtype=model"
        )

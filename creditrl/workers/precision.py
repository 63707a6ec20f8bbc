"""Which precision the actor's update runs in: ``actor.autocast`` = auto | bf16 | none.

bfloat16 autocast pays only where the hardware multiplies bfloat16 natively: CUDA GPUs, and
CPUs with AVX512-BF16 or AMX. Elsewhere PyTorch's CPU bfloat16 matmul falls back to a generic
kernel, many times slower than float32 (figures: benchmarks/results/precision.md). ``auto``
therefore picks bf16 only where it is native.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "AUTOCAST_CHOICES",
    "BF16_FLAGS",
    "autocast_choice",
    "cpu_has_native_bf16",
    "resolve_autocast",
    "sampling_choice",
]

AUTOCAST_CHOICES = ("auto", "bf16", "none")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@lru_cache(maxsize=1)
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU flags (Linux ``/proc/cpuinfo``) include avx512_bf16 or amx_bf16;
    False where they do not or cannot be read."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    flags = {f for line in text.splitlines() if line.startswith("flags") for f in line.split()}
    return any(flag in flags for flag in BF16_FLAGS)


def resolve_autocast(setting: str, device: str) -> str:
    """'bf16' or 'none' for ``setting`` on ``device`` ('cpu', 'cuda', ...): 'auto' is 'bf16'
    on CUDA (with bf16 support) and on CPUs with native bf16, else 'none'."""
    if setting not in AUTOCAST_CHOICES:
        raise ValueError(f"actor.autocast must be one of {AUTOCAST_CHOICES}, got {setting!r}")
    if setting != "auto":
        return setting
    if device == "cuda":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "none"
    return "bf16" if device == "cpu" and cpu_has_native_bf16() else "none"


def autocast_choice(setting: str, device: str) -> str:
    """One line saying what ``actor.autocast`` resolved to on ``device`` and, for 'auto' on a
    CPU, which flags decided it (printed at start-up: a speed choice made by CPU flags)."""
    chosen = resolve_autocast(setting, device)
    if setting != "auto" or device != "cpu":
        return f"actor.autocast={setting}: the update runs in {chosen} on {device}"
    why = (
        f"this CPU multiplies bf16 natively ({' or '.join(BF16_FLAGS)})"
        if chosen == "bf16"
        else f"this CPU lacks {' and '.join(BF16_FLAGS)}, where bf16 is slower than float32"
    )
    return f"actor.autocast=auto: the update runs in {chosen} on cpu, as {why}"


def sampling_choice(cfg: Any, device: str) -> str | None:
    """One line saying which dtype the rollout engine samples in on ``device`` and why (printed
    at start-up beside ``autocast_choice``); None for an engine without ``rollout.engine_kwargs.
    sample_dtype``. bf16 sampling is opt-in; the config refuses it on a CPU without native
    bf16 (``creditrl.workers.checks``)."""
    from creditrl.rollout.registries import SAMPLE_DTYPE, engine_traits

    if SAMPLE_DTYPE not in engine_traits(cfg.rollout.engine).options:
        return None
    chosen = cfg.rollout.engine_kwargs.get(SAMPLE_DTYPE.name, SAMPLE_DTYPE.default)
    native = device != "cpu" or cpu_has_native_bf16()
    where = f"this CPU has {' or '.join(BF16_FLAGS)}" if device == "cpu" else f"on {device}"
    if chosen == "bfloat16":
        return (
            f"rollout.engine_kwargs.sample_dtype=bfloat16: sampling from a bf16 copy, as {where}; "
            "old_log_probs recomputed by the actor, the gap in rollout_corr/*, corrected by "
            "rollout IS"
        )
    offer = (
        f"opt-in here ({where}): rollout.engine_kwargs.sample_dtype=bfloat16"
        if native
        else f"refused here: this CPU lacks {' and '.join(BF16_FLAGS)}"
    )
    return (
        f"rollout.engine_kwargs.sample_dtype={chosen}: sampling with the actor's weights "
        f"(model.dtype={cfg.model.dtype}); bf16 sampling is {offer}"
    )

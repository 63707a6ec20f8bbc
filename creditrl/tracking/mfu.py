"""``perf/mfu``: the update's model FLOP utilisation, from a device's peak dense bf16 FLOP/s.

A forward and backward pass over T tokens of a dense transformer does about 2 N T
floating-point operations forward, 2 N T for the gradients of the activations and 2 N_t T for
the gradients of the N_t trained weights (attention's own products and the non-matrix ops left
out, as in Kaplan et al. 2020 and PaLM's MFU): 6 N T when every weight is trained, and
(4 N + 2 N_t) T when most are frozen (LoRA: only the adapters get weight gradients; the frozen
base weights still pass gradients through). So

    perf/mfu = (4 N + 2 N_t) T / (update seconds * peak FLOP/s)

with N = every parameter of the actor (a tied embedding counted once: its product is the LM
head's), N_t those with ``requires_grad``, T = the real tokens (prompt + response, padding not
counted) the update passed through forward and backward (each PPO epoch counts again), and
the update's seconds wall time on this rank. The peak is the device's dense bf16 tensor-core
rate (``PEAK_TFLOPS``, matched on the words of ``torch.cuda.get_device_name``: "NVIDIA L40"
is not an L4), or ``trainer.device_peak_tflops``; where neither is known (the CPU, an
unlisted GPU) there is no ``perf/mfu``.
"""

from __future__ import annotations

import re

import torch

__all__ = [
    "PEAK_TFLOPS",
    "device_peak_flops",
    "mfu_metrics",
    "parameter_counts",
    "update_flops",
]

PEAK_TFLOPS: tuple[tuple[str, str | None, float], ...] = (
    ("H200", None, 989.4),
    ("H100", "PCIE", 756.0),
    ("H100", "NVL", 835.5),
    ("H100", None, 989.4),  # SXM (HBM3)
    ("GH200", None, 989.4),
    ("A100", None, 312.0),
    ("L40S", None, 362.1),
    ("L40", None, 181.0),
    ("L4", None, 121.0),
    ("A10G", None, 70.0),
)
"""(model word, variant word or None, dense bf16 TFLOP/s) from NVIDIA's data sheets; the first
entry whose words are both among the device name's words (split on spaces and dashes, upper
case) applies, so variants come before their model's plain entry."""


def device_peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of ``device``: ``override_tflops`` x 1e12 when given, else the
    first ``PEAK_TFLOPS`` entry matching the CUDA device's name word for word; None on the
    CPU and for an unlisted GPU."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    words = set(re.split(r"[\s\-_]+", torch.cuda.get_device_name(device).upper()))
    for model, variant, tflops in PEAK_TFLOPS:
        if model in words and (variant is None or variant in words):
            return tflops * 1e12
    return None


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(every parameter, those with ``requires_grad``) of ``model``, shared ones once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def update_flops(params: int, tokens: int, trained: int | None = None) -> float:
    """(4 x ``params`` + 2 x ``trained``) x ``tokens``: the forward and backward FLOPs of a
    dense transformer whose ``trained`` parameters (default: all) get weight gradients."""
    trained = params if trained is None else trained
    return (4.0 * params + 2.0 * trained) * tokens


def mfu_metrics(
    params: int,
    tokens: int,
    seconds: float,
    peak_flops: float | None,
    trained: int | None = None,
) -> dict:
    """``perf/mfu`` = ``update_flops(params, tokens, trained)`` / (``seconds`` x
    ``peak_flops``), and ``perf/update_tokens_per_s``; only the latter without a peak (none:
    both absent when no time was measured)."""
    if seconds <= 0 or tokens <= 0:
        return {}
    out = {"perf/update_tokens_per_s": tokens / seconds}
    if peak_flops is not None and peak_flops > 0:
        out["perf/mfu"] = update_flops(params, tokens, trained) / (seconds * peak_flops)
    return out

"""``perf/mfu``: the update's model FLOP utilisation, from a device's peak dense bf16 FLOP/s.

A forward and backward pass over T tokens of a dense transformer of N parameters does about
6 N T floating-point operations (2 N T forward, 4 N T backward; attention's own products and
the non-matrix ops are left out, as in Kaplan et al. 2020 and PaLM's MFU). So

    perf/mfu = 6 * N * T / (update seconds * peak FLOP/s)

with N = every parameter of the actor (a tied embedding counted once: its product is the LM
head's), T = the real tokens (prompt + response, padding not counted) the update passed
through forward and backward (each PPO epoch counts again), and the update's seconds wall
time on this rank. The peak is the device's dense bf16 tensor-core rate (``PEAK_TFLOPS``,
matched on ``torch.cuda.get_device_name``), or ``trainer.device_peak_tflops``; where neither is
known (the CPU, an unlisted GPU) there is no ``perf/mfu``.
"""

from __future__ import annotations

import torch

__all__ = ["PEAK_TFLOPS", "device_peak_flops", "mfu_metrics", "update_flops"]

PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.5),
    ("H100", 989.4),  # SXM (HBM3)
    ("GH200", 989.4),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("L4", 121.0),
    ("A10G", 70.0),
)
"""(name fragment, dense bf16 TFLOP/s) from NVIDIA's data sheets, most specific name first."""


def device_peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of ``device``: ``override_tflops`` x 1e12 when given, else the
    first ``PEAK_TFLOPS`` entry whose name fragment is in the CUDA device's name; None on
    the CPU and for an unlisted GPU."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, tflops in PEAK_TFLOPS:
        if fragment in name:
            return tflops * 1e12
    return None


def update_flops(params: int, tokens: int) -> float:
    """6 x ``params`` x ``tokens``: the forward and backward FLOPs of a dense transformer."""
    return 6.0 * params * tokens


def mfu_metrics(params: int, tokens: int, seconds: float, peak_flops: float | None) -> dict:
    """``perf/mfu`` = ``update_flops(params, tokens)`` / (``seconds`` x ``peak_flops``), and
    ``perf/update_tokens_per_s``; only the latter without a peak (none: both absent when no
    time was measured)."""
    if seconds <= 0 or tokens <= 0:
        return {}
    out = {"perf/update_tokens_per_s": tokens / seconds}
    if peak_flops is not None and peak_flops > 0:
        out["perf/mfu"] = update_flops(params, tokens) / (seconds * peak_flops)
    return out

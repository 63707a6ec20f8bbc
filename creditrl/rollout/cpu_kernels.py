"""The weight-major product for few-row float32 CPU matrix products.

For ``x`` (m, in) and a weight ``W`` (out, in), ``x @ W^T`` is computed as ``(W @ x^T)^T``
when m is small: MKL streams the weight far faster in that layout for few rows (figures:
``benchmarks/results/rollout_kernels.md``). The values are the same to float rounding.
``weight_major_product`` is the one product, used by the Llama decode step
(``rollout.llama_decode``) and by ``weight_major_linears``, which patches a model's
``nn.Linear`` modules for the HF engine. Measured in ``benchmarks/bench_rollout.py``
("linear-as-is" switches the patch off).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "SMALL_BATCH_ROWS",
    "WEIGHT_MAJOR_ROWS",
    "weight_major_linears",
    "weight_major_product",
]

# Rows up to which (W @ x^T)^T is used: every weight of the Llama decode step, and weights of
# _LARGE_WEIGHT elements or more (the LM head) in patched nn.Linear modules.
WEIGHT_MAJOR_ROWS = 64
# Default row limit of patched nn.Linear modules with smaller weights; 0: no patch.
SMALL_BATCH_ROWS = 8
_LARGE_WEIGHT = 1 << 22  # elements (16 MiB in float32)


def weight_major_product(
    weight: torch.Tensor, x: torch.Tensor, max_rows: int = WEIGHT_MAJOR_ROWS
) -> torch.Tensor:
    """``x @ weight^T`` for ``x`` (m, in): ``(W @ x^T)^T`` for m <= ``max_rows`` (a row-strided
    (m, out) view), else ``F.linear``."""
    if x.shape[0] <= max_rows:
        return torch.mm(weight, x.t()).t()
    return F.linear(x, weight)


def _weight_major_linear(module: nn.Linear, small_batch_rows: int, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` through ``weight_major_product`` for 2..``small_batch_rows`` rows, and up
    to WEIGHT_MAJOR_ROWS rows for large weights (the LM head). One row uses the matrix-vector
    product, except for large weights, where the row is doubled: MKL's one-row path reads them
    ~3x slower than its two-row one."""
    rows = x.numel() // x.shape[-1]
    large = module.weight.numel() >= _LARGE_WEIGHT
    limit = WEIGHT_MAJOR_ROWS if large else small_batch_rows
    if rows > limit or rows == 0 or (rows == 1 and not large):
        return F.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = torch.cat([flat, flat])
    out = weight_major_product(module.weight, flat, limit)[:rows].contiguous()
    if module.bias is not None:
        out += module.bias
    return out.view(*x.shape[:-1], out.shape[-1])


@contextmanager
def weight_major_linears(model: nn.Module, small_batch_rows: int | None = None) -> Iterator[int]:
    """Within the block, float32 CPU ``nn.Linear`` modules of ``model`` compute few-row inputs
    as ``(W @ x^T)^T`` (same values to float rounding); ``small_batch_rows`` (default
    ``SMALL_BATCH_ROWS``; 0: patch nothing) bounds the rows for all but large weights. Modules
    whose ``forward`` is already replaced (e.g. by accelerate hooks) are left alone. Yields the
    number of modules patched."""
    if small_batch_rows is None:
        small_batch_rows = SMALL_BATCH_ROWS
    patched = []
    if small_batch_rows > 0:
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if (
                type(module) is nn.Linear
                and "forward" not in module.__dict__
                and weight is not None
                and weight.device.type == "cpu"
                and weight.dtype == torch.float32
            ):
                module.forward = partial(_weight_major_linear, module, small_batch_rows)
                patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward

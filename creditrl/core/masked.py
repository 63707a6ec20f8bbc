"""Masked statistics over (batch, T) tensors.

Every function here reduces over the positions where ``mask`` is 1 (mask may be bool or
float; it is cast to the values' dtype). Index convention: column j of a response tensor is
time step t = j + 1 (see docs/architecture.md); masks say which steps exist.
"""

from __future__ import annotations

import math

import torch

__all__ = ["masked_mean", "masked_sum", "masked_var", "masked_whiten", "row_blocks"]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum_i values_i * mask_i, over ``dim`` (all dims when None)."""
    masked = values * mask.to(values.dtype)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum_i values_i m_i / sum_i m_i over ``dim``; 0 where there is no valid entry."""
    m = mask.to(values.dtype)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(values, m, dim) / count.clamp(min=1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all valid entries: sum m (x - mean)^2 / (n - 1) (or / n if not unbiased).

    Raises ValueError when unbiased and fewer than two entries are valid (n - 1 would be 0).
    """
    m = mask.to(values.dtype)
    n = m.sum()
    if unbiased and n < 2:
        raise ValueError(
            "masked_var needs at least 2 valid entries for an unbiased variance, "
            f"got {int(n.item())}"
        )
    mean = masked_sum(values, m) / n.clamp(min=1.0)
    sq = masked_sum((values - mean) ** 2, m)
    return sq / (n - 1) if unbiased else sq / n.clamp(min=1.0)


def row_blocks(n_rows: int, n_cols: int, elements: int = 262144) -> list[slice]:
    """Row slices of about ``elements`` entries each. Processing a (512, 2048) tensor in such
    blocks keeps temporaries small and cache-resident; on this machine a fresh full-size
    buffer costs more than the arithmetic on it (measured by benchmarks/bench_core.py)."""
    rows = max(1, elements // max(n_cols, 1))
    return [slice(i, i + rows) for i in range(0, n_rows, rows)]


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    *,
    inplace: bool = False,
) -> torch.Tensor:
    """Whiten over valid entries: (x - mean) / sqrt(var + eps), var unbiased.

    mean and var are taken over entries with mask 1 only (two passes, block sums in float64). With
    ``shift_mean=False`` the mean is added back: (x - mean) * rsqrt(var + eps) + mean.
    Entries where mask is 0 are returned as computed (callers multiply by the mask).
    ``inplace=True`` overwrites ``values``.

    With fewer than two valid entries there is no spread to divide by, and the result is
    defined as centred only: n = 1 gives x - mean (0 at the one valid entry; with
    ``shift_mean=False`` the entries are returned unchanged), n = 0 returns the values
    unchanged. So a batch whose responses hold a single policy token between them trains with
    advantage 0 there instead of failing.
    """
    x2, m2 = values.reshape(-1, values.shape[-1]), mask.reshape(-1, values.shape[-1])
    blocks = [
        (x2[b].reshape(-1), m2[b].reshape(-1).to(values.dtype)) for b in row_blocks(*x2.shape)
    ]
    n = sum(float(m.sum()) for _, m in blocks)
    out = values if inplace else values.clone()
    if n < 1:
        return out
    mean = sum(float(torch.dot(x, m)) for x, m in blocks) / n
    if n < 2:
        return out.sub_(mean) if shift_mean else out
    sq = 0.0
    for x, m in blocks:
        centred = x - mean
        sq += float(torch.dot(centred * m, centred))
    rstd = 1.0 / math.sqrt(sq / (n - 1) + eps)
    out.sub_(mean).mul_(rstd)
    return out if shift_mean else out.add_(mean)

"""Masked statistics over (batch, T) tensors.

Every function here reduces over the positions where ``mask`` is 1 (mask may be bool or
float; it is cast to the values' dtype). Index convention: column j of a response tensor is
time step t = j + 1 (see ARCHITECTURE.md); masks say which steps exist.
"""

from __future__ import annotations

import torch

__all__ = ["masked_mean", "masked_sum", "masked_var", "masked_whiten"]


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


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten over valid entries: (x - mean) / sqrt(var + eps), var unbiased.

    With ``shift_mean=False`` the mean is added back: x' = (x - mean) * rsqrt(var + eps) + mean
    (the scale changes, the centre does not). Entries where mask is 0 are returned as computed
    (callers multiply by the mask). Raises ValueError with fewer than two valid entries.
    """
    m = mask.to(values.dtype).reshape(-1)
    n = m.sum()
    if n < 2:
        raise ValueError(
            f"masked_whiten needs at least 2 valid tokens, got {int(n.item())}: "
            "a single token has no spread to normalise by"
        )
    # Dot products instead of masked temporaries: fewer large buffers (bench_core.py).
    mean = torch.dot(values.reshape(-1), m) / n
    centred = values - mean
    flat = centred.reshape(-1)
    var = torch.dot(flat * m, flat) / (n - 1)
    whitened = centred.mul_(torch.rsqrt(var + eps))
    return whitened if shift_mean else whitened.add_(mean)

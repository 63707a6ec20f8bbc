"""Per-token entropy and selected-token log-probabilities from logits, chunked over tokens.

``logits`` is (..., V): (B, T, V) or (N, V). Both functions flatten the leading dimensions to
N token rows and process ``chunk_size`` rows at a time, computing in at least float32, so peak
extra memory is O(chunk_size * V) rather than O(N * V). Both stay differentiable. For
response tensors, pass ``logits[:, -T-1:-1]`` so that column j is step t = j + 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["DEFAULT_CHUNK_SIZE", "entropy_from_logits", "log_probs_from_logits"]

DEFAULT_CHUNK_SIZE = 2048


def _shifted(logits: torch.Tensor) -> torch.Tensor:
    """z - max_v z in at least float32 (the shift changes neither quantity computed here)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return z - z.amax(dim=-1, keepdim=True).detach()


def _entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    z = _shifted(logits)
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def _log_prob_rows(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    z = _shifted(logits)
    return z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def _chunked(
    fn: Callable[..., torch.Tensor], chunk_size: int, logits: torch.Tensor, *rest: torch.Tensor
) -> torch.Tensor:
    """Apply ``fn`` to ``chunk_size`` rows of (N, V) ``logits`` at a time; checkpoint each chunk
    when a gradient is needed, so backward too holds one chunk's intermediates at a time."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    parts = []
    for start in range(0, logits.shape[0], chunk_size):
        args = [t[start : start + chunk_size] for t in (logits, *rest)]
        if needs_grad:
            parts.append(checkpoint(fn, *args, use_reentrant=False))
        else:
            parts.append(fn(*args))
    if not parts:
        return logits.new_empty(0, dtype=torch.promote_types(logits.dtype, torch.float32))
    return torch.cat(parts)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Entropy of the categorical distribution at each position: shape ``logits.shape[:-1]``.

    H_n = logsumexp_v(z_{n,v}) - sum_v p_{n,v} z_{n,v}, p_n = softmax(z_n), computed with z
    shifted by its row max (same value; no overflow or cancellation at |z| ~ 1e4).
    """
    rows = logits.reshape(-1, logits.shape[-1])
    return _chunked(_entropy_rows, chunk_size, rows).reshape(logits.shape[:-1])


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """log softmax(z_n)[y_n] = z_{n,y_n} - logsumexp_v z_{n,v}: shape ``labels.shape``.

    ``labels`` (token ids) has shape ``logits.shape[:-1]``. z is shifted by its row max (same
    value, full precision at |z| ~ 1e4); the full log-softmax is never materialised.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab "
            f"dimension {tuple(logits.shape[:-1])}"
        )
    rows = logits.reshape(-1, logits.shape[-1])
    ids = labels.reshape(-1).long()
    return _chunked(_log_prob_rows, chunk_size, rows, ids).reshape(labels.shape)

"""Selected-token log-probabilities and entropies of token rows, chunked over tokens.

One defining function, ``token_log_probs``: N token rows are either logits (N, V) or final
hidden states (N, D) with the output ``head`` that maps them to logits, so the float32 logits
of at most ``chunk_tokens`` rows exist at a time, in the forward and, through
``torch.utils.checkpoint`` (the backward recomputes a chunk's logits), in the backward.
``log_probs_from_logits`` and ``entropy_from_logits`` are that function on logits. For response
tensors, pass the rows at positions ``[-T-1:-1]`` so that row j is step t = j + 1 (spec 000).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "entropy_from_logits",
    "log_probs_from_logits",
    "token_log_probs",
]

DEFAULT_CHUNK_SIZE = 2048

Head = Callable[[torch.Tensor], torch.Tensor]


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


def _chunk(
    rows: torch.Tensor,
    labels: torch.Tensor,
    head: Head | None,
    temperature: float,
    entropy: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and (``entropy``: 'grad' | 'nograd' | 'none') entropies of a few rows."""
    logits = rows if head is None else head(rows)
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = _log_prob_rows(logits, labels)
    if entropy == "grad":
        return log_probs, _entropy_rows(logits)
    if entropy == "nograd":
        with torch.no_grad():
            return log_probs, _entropy_rows(logits.detach())
    return log_probs, None


def token_log_probs(
    rows: torch.Tensor,
    labels: torch.Tensor,
    *,
    head: Head | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = 0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_n | s_n) (N,) of ``labels`` (N,) and, when ``with_entropy``, H(pi(. | s_n)) (N,)
    (no gradient when ``entropy_grad`` is False: a metric only).

    z_n = head(rows_n) / temperature (``rows`` (N, V) are the logits when ``head`` is None),
    in the head's dtype, then in at least float32 and shifted by its row max (same values, no
    overflow or cancellation at |z| ~ 1e4):
    log pi(y_n | s_n) = z_{n,y_n} - logsumexp_v z_{n,v};
    H_n = logsumexp_v z_{n,v} - sum_v p_{n,v} z_{n,v}, p_n = softmax(z_n).
    ``chunk_tokens`` > 0 and N > ``chunk_tokens``: rows are taken ``chunk_tokens`` at a time,
    each chunk under ``torch.utils.checkpoint`` when a gradient is needed, so at most one
    chunk's (chunk_tokens, V) logits exist at once; otherwise all rows in one pass.
    """
    if rows.dim() != 2 or labels.shape != rows.shape[:1]:
        raise ValueError(
            f"token_log_probs needs rows (N, D) and labels (N,), got {tuple(rows.shape)} and "
            f"{tuple(labels.shape)}"
        )
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be >= 0, got {chunk_tokens}")
    entropy = ("grad" if entropy_grad else "nograd") if with_entropy else "none"
    labels = labels.long()
    n = rows.shape[0]
    if chunk_tokens == 0 or n <= chunk_tokens:
        return _chunk(rows, labels, head, temperature, entropy)
    params = head.parameters() if isinstance(head, torch.nn.Module) else ()
    needs_grad = torch.is_grad_enabled() and (
        rows.requires_grad or any(p.requires_grad for p in params)
    )
    parts = []
    for start in range(0, n, chunk_tokens):
        args = (rows[start : start + chunk_tokens], labels[start : start + chunk_tokens])
        if needs_grad:
            parts.append(checkpoint(_chunk, *args, head, temperature, entropy, use_reentrant=False))
        else:
            parts.append(_chunk(*args, head, temperature, entropy))
    log_probs = torch.cat([p[0] for p in parts])
    return log_probs, torch.cat([p[1] for p in parts]) if with_entropy else None


def _flat(logits: torch.Tensor, chunk_size: int) -> torch.Tensor:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return logits.reshape(-1, logits.shape[-1])


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """``token_log_probs``' entropy of each row of ``logits`` (..., V): shape ``logits.shape[:-1]``,
    ``chunk_size`` rows at a time."""
    rows = _flat(logits, chunk_size)
    labels = torch.zeros(rows.shape[0], dtype=torch.long, device=rows.device)
    _, entropy = token_log_probs(rows, labels, chunk_tokens=chunk_size, with_entropy=True)
    return entropy.reshape(logits.shape[:-1])


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """``token_log_probs`` of ``labels`` (token ids, shape ``logits.shape[:-1]``) under
    ``logits`` (..., V), ``chunk_size`` rows at a time: shape ``labels.shape``."""
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab "
            f"dimension {tuple(logits.shape[:-1])}"
        )
    rows = _flat(logits, chunk_size)
    log_probs, _ = token_log_probs(rows, labels.reshape(-1), chunk_tokens=chunk_size)
    return log_probs.reshape(labels.shape)

"""Selected-token log-probabilities and entropies of token rows, chunked over tokens.

One defining function, ``token_log_probs``: N token rows are either logits (N, V) or final
hidden states (N, D) with the output ``head`` that maps them to logits, so the float32 logits
of at most ``chunk_tokens`` rows exist at a time, in the forward and, through
``torch.utils.checkpoint`` (the backward recomputes a chunk's logits), in the backward.
``log_probs_from_logits`` and ``entropy_from_logits`` are that function on logits. For response
tensors, pass the rows at positions ``[-T-1:-1]`` so that row j is step t = j + 1 (spec 000).
With ``kept`` (the sampler's kept-set sizes, ``rollout_kept_counts``) both are over the kept
set K_n (``kept_set_mask``), renormalised: the distribution top-k/top-p/min-p sampled from.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "entropy_from_logits",
    "kept_set_mask",
    "log_probs_from_logits",
    "token_log_probs",
]

DEFAULT_CHUNK_SIZE = 2048
_SELECT_ROWS = 64  # rows whose kept-set threshold one top-k finds (bounds its k x rows buffer)

Head = Callable[[torch.Tensor], torch.Tensor]


def _shifted(logits: torch.Tensor) -> torch.Tensor:
    """z - max_v z in at least float32 (the shift changes neither quantity computed here)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return z - z.amax(dim=-1, keepdim=True).detach()


def kept_set_mask(z: torch.Tensor, kept: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    """K_n (N, V) bool: each row's kept set rebuilt from its size (None: every row keeps the
    whole vocabulary).

    For row n with logits z_n (V,) (temperature-scaled, compared in at least float32), size
    k_n = ``kept[n]`` and sampled token y_n = ``labels[n]``: c_n = the k_n-th largest z_{n,v}
    (counted with multiplicity), K_n = {v : z_{n,v} >= c_n} ∪ {y_n}; k_n <= 0 or >= V: the
    whole vocabulary. On the logits the sampler cut (``creditrl.rollout.sampling.
    filter_logits``, whose cuts keep boundary ties, so its set is {v : z_v >= c}) this is
    exactly its set; on logits equal up to float noise it differs only where two logits at the
    boundary are within that noise of each other, and the sampled token is always in it.
    Cost: one top-k per block of ``_SELECT_ROWS`` rows of similar k_n (a sort of the row when
    k_n nears V), so about sum_n k_n log k_n, in buffers of at most 64 x V."""
    vocab = z.shape[-1]
    size = kept.to(device=z.device, dtype=torch.long)
    cut = (size > 0) & (size < vocab)
    if not bool(cut.any()):
        return None
    z = z.detach().to(torch.promote_types(z.dtype, torch.float32))
    threshold = z.new_full((len(z), 1), float("-inf"))
    rows = cut.nonzero().squeeze(1)
    rows = rows[torch.argsort(size[rows])]  # blocks of similar sizes: top-k of about each's k
    for block in torch.split(rows, _SELECT_ROWS):
        k = size[block]
        largest = torch.topk(z[block], int(k.max()), dim=-1).values
        threshold[block] = largest.gather(-1, (k - 1).unsqueeze(-1))
    return (z >= threshold).scatter(-1, labels.unsqueeze(-1), True)


def _entropy_rows(z: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    if keep is None:
        return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    masked = z.masked_fill(~keep, float("-inf"))
    return torch.logsumexp(masked, dim=-1) - (
        torch.softmax(masked, dim=-1) * z.masked_fill(~keep, 0.0)
    ).sum(dim=-1)


def _log_prob_rows(
    z: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor | None
) -> torch.Tensor:
    masked = z if keep is None else z.masked_fill(~keep, float("-inf"))
    return z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(masked, dim=-1)


def _chunk(
    rows: torch.Tensor,
    labels: torch.Tensor,
    kept: torch.Tensor | None,
    head: Head | None,
    temperature: float,
    entropy: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and (``entropy``: 'grad' | 'nograd' | 'none') entropies of a few rows."""
    logits = rows if head is None else head(rows)
    if temperature != 1.0:
        logits = logits / temperature
    keep = None if kept is None else kept_set_mask(logits, kept, labels)
    z = _shifted(logits)
    log_probs = _log_prob_rows(z, labels, keep)
    if entropy == "grad":
        return log_probs, _entropy_rows(z, keep)
    if entropy == "nograd":
        with torch.no_grad():
            return log_probs, _entropy_rows(z.detach(), keep)
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
    kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_n | s_n) (N,) of ``labels`` (N,) and, when ``with_entropy``, H(pi(. | s_n)) (N,)
    (no gradient when ``entropy_grad`` is False: a metric only).

    z_n = head(rows_n) / temperature (``rows`` (N, V) are the logits when ``head`` is None),
    in the head's dtype, then in at least float32 and shifted by its row max (same values, no
    overflow or cancellation at |z| ~ 1e4):
    log pi(y_n | s_n) = z_{n,y_n} - logsumexp_v z_{n,v};
    H_n = logsumexp_v z_{n,v} - sum_v p_{n,v} z_{n,v}, p_n = softmax(z_n).
    With ``kept`` (N,) (kept-set sizes; sampling replay) every sum over v runs over K_n =
    ``kept_set_mask(z, kept, labels)`` instead of the vocabulary: the log-prob and entropy of
    the renormalised truncated distribution pi_K(v) = exp(z_v) / sum_{u in K_n} exp(z_u), v in
    K_n (the set is chosen without a gradient; the log-prob is differentiable in z as usual).
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
    if kept is not None and kept.shape != labels.shape:
        raise ValueError(
            f"kept {tuple(kept.shape)} must be shaped like labels {tuple(labels.shape)}"
        )
    entropy = ("grad" if entropy_grad else "nograd") if with_entropy else "none"
    labels = labels.long()
    n = rows.shape[0]
    if chunk_tokens == 0 or n <= chunk_tokens:
        return _chunk(rows, labels, kept, head, temperature, entropy)
    params = head.parameters() if isinstance(head, torch.nn.Module) else ()
    needs_grad = torch.is_grad_enabled() and (
        rows.requires_grad or any(p.requires_grad for p in params)
    )
    parts = []
    for start in range(0, n, chunk_tokens):
        part = slice(start, start + chunk_tokens)
        args = (rows[part], labels[part], None if kept is None else kept[part])
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

"""Loss aggregation: from a per-token loss matrix (B, T) to one scalar.

Normalisers can be given globally. Pass the counts of the *whole* mini-batch (all
micro-batches, all data-parallel ranks) as ``global_num_tokens`` / ``global_num_seqs`` and
*sum* the micro-batch losses: the accumulated gradient then equals the full-batch gradient
for every mode. Under data-parallel training where the gradient is averaged over ranks, scale
each rank's loss by the world size (as verl does). ``global_normalisers`` computes the counts.
"""

from __future__ import annotations

import torch

__all__ = ["LOSS_AGG_MODES", "agg_loss", "global_normalisers"]

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def global_normalisers(loss_mask: torch.Tensor) -> dict[str, float]:
    """Counts that ``agg_loss`` divides by, taken over the whole (mini-)batch given.

    ``global_num_tokens`` = sum of the mask; ``global_num_seqs`` = sequences with at least one
    valid token (sequences with none contribute nothing and are not counted).
    """
    m = loss_mask.to(torch.float32)
    return {
        "global_num_tokens": float(m.sum().item()),
        "global_num_seqs": float((m.sum(-1) > 0).sum().item()),
    }


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` (B, T) over the valid positions of ``loss_mask`` (B, T).

    With m the mask, N the number of valid tokens and S the number of sequences with at least
    one valid token (both local unless given globally):

    - ``token-mean``:              sum_{i,t} l_it m_it / N
    - ``token-sum``:               sum_{i,t} l_it m_it
    - ``seq-mean-token-sum``:      sum_i (sum_t l_it m_it) / S
    - ``seq-mean-token-mean``:     sum_i (sum_t l_it m_it / sum_t m_it) / S
    - ``seq-mean-token-sum-norm``: sum_i (sum_t l_it m_it) / (S * C), C = ``loss_scale_factor``
      (Dr. GRPO's constant; default T = loss_mat.shape[-1]; give the configured maximum
      response length when micro-batches may be padded to different lengths).
    """
    m = loss_mask.to(loss_mat.dtype)
    token_sums = (loss_mat * m).sum(-1)
    if loss_agg_mode == "token-sum":
        return token_sums.sum()
    if loss_agg_mode == "token-mean":
        n = m.sum() if global_num_tokens is None else global_num_tokens
        return token_sums.sum() / max(float(n), 1.0)
    seqs = (m.sum(-1) > 0).sum() if global_num_seqs is None else global_num_seqs
    seqs = max(float(seqs), 1.0)
    if loss_agg_mode == "seq-mean-token-sum":
        return token_sums.sum() / seqs
    if loss_agg_mode == "seq-mean-token-mean":
        return (token_sums / m.sum(-1).clamp(min=1.0)).sum() / seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        scale = loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return token_sums.sum() / (seqs * float(scale))
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {LOSS_AGG_MODES}")

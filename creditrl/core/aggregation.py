"""Loss aggregation: from a per-token loss matrix (B, T) to one scalar.

Normalisers can be given globally. Pass the counts of the *whole* mini-batch (all
micro-batches, all data-parallel ranks) as ``global_num_tokens`` / ``global_num_seqs`` and
*sum* the micro-batch losses: the accumulated gradient then equals the full-batch gradient
for every mode. Under data-parallel training where the gradient is averaged over ranks, scale
each rank's loss by the world size (as verl does). ``global_normalisers`` computes the counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from creditrl.core.registries import LOSS_AGG_MODES, register_loss_agg

__all__ = ["LOSS_AGG_MODES", "agg_loss", "global_normalisers", "register_loss_agg"]

AggFn = Callable[..., torch.Tensor]


def _token_mean(sums: torch.Tensor, m: torch.Tensor, tokens: Any, seqs: Any, scale: Any) -> Any:
    return sums.sum() / max(float(m.sum() if tokens is None else tokens), 1.0)


def _token_sum(sums: torch.Tensor, m: torch.Tensor, tokens: Any, seqs: Any, scale: Any) -> Any:
    return sums.sum()


def _seqs(m: torch.Tensor, seqs: Any) -> float:
    """S: sequences with at least one valid token (or the global count given), at least 1."""
    return max(float((m.sum(-1) > 0).sum() if seqs is None else seqs), 1.0)


def _seq_mean_token_sum(
    sums: torch.Tensor, m: torch.Tensor, tokens: Any, seqs: Any, scale: Any
) -> Any:
    return sums.sum() / _seqs(m, seqs)


def _seq_mean_token_mean(
    sums: torch.Tensor, m: torch.Tensor, tokens: Any, seqs: Any, scale: Any
) -> Any:
    return (sums / m.sum(-1).clamp(min=1.0)).sum() / _seqs(m, seqs)


def _seq_mean_token_sum_norm(
    sums: torch.Tensor, m: torch.Tensor, tokens: Any, seqs: Any, scale: Any
) -> Any:
    return sums.sum() / (_seqs(m, seqs) * float(m.shape[-1] if scale is None else scale))


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
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {tuple(LOSS_AGG_MODES)}"
        )
    m = loss_mask.to(loss_mat.dtype)
    token_sums = (loss_mat * m).sum(-1)
    aggregate = LOSS_AGG_MODES.get(loss_agg_mode)
    return aggregate(token_sums, m, global_num_tokens, global_num_seqs, loss_scale_factor)

"""One forward pass over (prompt + response) tokens, aligned to the response (spec 000).

For responses of length T, the model's outputs at positions ``[-T-1:-1]`` of the full sequence
predict tokens y_1..y_T: ``log_probs[:, j]`` = log pi(y_{j+1} | s_{j+1}) and ``values[:, j]`` =
V(s_{j+1}). Each micro-batch is trimmed to the columns some row uses (left prompt padding,
right response padding), and logits are computed only at the response positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from creditrl.batch import Batch
from creditrl.core import entropy_from_logits, log_probs_from_logits

__all__ = ["SequenceSlice", "policy_forward", "split_indices", "trim"]


@dataclass
class SequenceSlice:
    """The trimmed columns of one micro-batch: model inputs and where the response sits."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    responses: torch.Tensor  # (b, t) the response ids inside the trimmed window
    width: int  # t: response columns kept (the rest of T is padding for every row)


def trim(batch: Batch) -> SequenceSlice:
    """Drop columns that are padding in every row: leading prompt columns and trailing
    response columns. Requires ``input_ids``, ``attention_mask``, ``position_ids``,
    ``responses`` (B, T)."""
    responses = batch["responses"]
    total_t = responses.shape[1]
    attention = batch["attention_mask"]
    prompt_len = attention.shape[1] - total_t
    used = attention.bool().any(dim=0)
    first = int(used[:prompt_len].nonzero()[0]) if used[:prompt_len].any() else prompt_len
    resp_used = used[prompt_len:].nonzero()
    width = int(resp_used[-1]) + 1 if len(resp_used) else 1
    end = prompt_len + width
    return SequenceSlice(
        input_ids=batch["input_ids"][:, first:end],
        attention_mask=attention[:, first:end],
        position_ids=batch["position_ids"][:, first:end],
        responses=responses[:, :width],
        width=width,
    )


def policy_forward(
    model: torch.nn.Module,
    batch: Batch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log pi(y_t | s_t) (B, T) of the responses under ``model`` at ``temperature``,
    and the entropy of pi(. | s_t) when asked (without a gradient when ``entropy_grad`` is
    False: a metric only); 0 beyond each micro-batch's last response column.
    """
    window = trim(batch)
    t = window.width
    out = model(
        input_ids=window.input_ids,
        attention_mask=window.attention_mask,
        position_ids=window.position_ids,
        use_cache=False,
        logits_to_keep=t + 1,
    )
    logits = out.logits[:, :-1, :]
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = log_probs_from_logits(logits, window.responses)
    entropy = None
    if with_entropy and entropy_grad:
        entropy = entropy_from_logits(logits)
    elif with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())
    full_t = batch["responses"].shape[1]
    if t < full_t:
        pad = (0, full_t - t)
        log_probs = torch.nn.functional.pad(log_probs, pad)
        entropy = None if entropy is None else torch.nn.functional.pad(entropy, pad)
    return log_probs, entropy


def split_indices(order: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Consecutive chunks of ``order`` of at most ``size`` (the last may be shorter)."""
    return list(torch.split(order, max(int(size), 1)))

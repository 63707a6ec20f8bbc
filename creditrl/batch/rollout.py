"""The rollout's Batch, assembled in one place for every engine and the agent loop, and the
one formula for ``position_ids``."""

from __future__ import annotations

import torch

from creditrl.batch.batch import Batch

__all__ = ["assemble_rollout_batch", "position_ids_from_mask"]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``position_ids = clamp(cumsum(attention_mask, -1) - 1, min=0)`` (int64): the first real
    token of a left-padded row is position 0; padding positions are 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def assemble_rollout_batch(
    prompts: Batch,
    responses: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    real_mask: torch.Tensor,
    *,
    response_mask: torch.Tensor | None = None,
    extra: dict[str, torch.Tensor] | None = None,
) -> Batch:
    """``prompts`` (left-padded ``input_ids`` (B, P), ``attention_mask``) plus right-padded
    ``responses`` (B, T): the Batch every rollout returns, on the prompts' device.

    Fields: ``prompts`` (B, P), ``responses``, ``response_mask`` (``real_mask`` unless given:
    the agent loop passes the policy-token mask, 0 on observations), ``input_ids`` = prompts |
    responses, ``attention_mask`` = prompt mask | ``real_mask`` (every real response token,
    observations included), ``position_ids`` (``position_ids_from_mask``),
    ``rollout_log_probs``, and ``extra``. The prompts' other fields, non-tensors and meta are
    kept.
    """
    ids = prompts["input_ids"].long().to(responses.device)
    mask = prompts["attention_mask"].long().to(responses.device)
    attention_mask = torch.cat([mask, real_mask.long()], dim=1)
    fields = {
        "prompts": ids,
        "responses": responses,
        "response_mask": (real_mask if response_mask is None else response_mask).long(),
        "input_ids": torch.cat([ids, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "rollout_log_probs": rollout_log_probs,
        **(extra or {}),
    }
    device = prompts["input_ids"].device
    tensors = {k: v for k, v in prompts.tensors.items() if k not in fields}
    tensors.update({k: v.to(device) for k, v in fields.items()})
    return Batch(tensors, dict(prompts.non_tensors), prompts.meta)

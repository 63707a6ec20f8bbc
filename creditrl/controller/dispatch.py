"""How a worker-group call reaches its ranks and how their answers come back.

- ``ALL``: every rank gets the same arguments; the answer is rank 0's (the others computed
  the same, or took part in a collective such as a checkpoint gather);
- ``DP``: the Batch is cut into ``world`` contiguous equal chunks, rank r gets chunk r, and
  the answers are concatenated in rank order, so samples come back in the order they were
  sent. A Batch that does not divide evenly is padded with copies of its first rows, whose
  answers are dropped (``strict`` calls, the updates, refuse to pad instead: copies would
  change the gradient).
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from creditrl.batch import Batch, pad_to_divisor, unpad

__all__ = ["Dispatch", "collect", "right_pad", "split"]


class Dispatch(enum.Enum):
    """Dispatch modes of a worker-group method."""

    ALL = "all"
    DP = "dp"


def split(batch: Batch, world: int, *, strict: bool = False, what: str = "") -> tuple[list, int]:
    """(one chunk per rank, number of padding rows added)."""
    if strict and len(batch) % world:
        raise ValueError(
            f"{what}: {len(batch)} samples do not divide evenly over {world} workers; choose "
            "data.train_batch_size x rollout.n divisible by trainer.workers"
        )
    padded, pad = pad_to_divisor(batch, world)
    return padded.chunk(world), pad


# Right-padded (B, T) fields whose padding value is not 0; ``position_ids`` repeat their last
# column (a right-padded row's positions stop growing after its last real token).
EDGE_PADDED = ("position_ids",)
PAD_ID_FIELDS = ("responses", "input_ids")


def right_pad(batches: list[Batch], pad_token_id: int) -> list[Batch]:
    """Widen every 2-D tensor field to its widest version across ``batches`` (ranks' responses
    end at different lengths): token ids with ``pad_token_id``, ``position_ids`` with their
    last column, everything else (masks, log-probs, scores) with 0."""
    widths: dict[str, int] = {}
    for batch in batches:
        for key, value in batch.tensors.items():
            if value.ndim >= 2:
                widths[key] = max(widths.get(key, 0), value.shape[1])
    out = []
    for batch in batches:
        batch = batch[:]
        for key, width in widths.items():
            value = batch[key]
            missing = width - value.shape[1]
            if missing <= 0:
                continue
            if key in EDGE_PADDED:
                fill = value[:, -1:].expand(-1, missing, *value.shape[2:])
            else:
                pad_value = pad_token_id if key in PAD_ID_FIELDS else 0
                fill = value.new_full((value.shape[0], missing, *value.shape[2:]), pad_value)
            batch[key] = torch.cat([value, fill], dim=1)
        out.append(batch)
    return out


def collect(results: list[Any], mode: Dispatch, pad: int = 0, pad_token_id: int = 0) -> Any:
    """Combine per-rank answers: concatenation for DP Batches (right-padded to a common
    width), rank 0's answer otherwise."""
    if mode is Dispatch.DP and isinstance(results[0], Batch):
        return unpad(Batch.concat(right_pad(results, pad_token_id)), pad)
    return results[0]

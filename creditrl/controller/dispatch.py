"""How a worker-group call reaches its ranks and how their answers come back.

- ``ALL``: every rank gets the same arguments; the answer is rank 0's (the others computed
  the same, or took part in a collective such as a checkpoint gather);
- ``DP``: the Batch is cut into ``world`` contiguous equal chunks, rank r gets chunk r, and
  the answers are concatenated in rank order, so samples come back in the order they were
  sent. A Batch that does not divide evenly is padded with copies of its first rows, whose
  answers are dropped (``strict`` calls, the updates, refuse to pad instead: copies would
  change the gradient);
- ``RANK0``: only rank 0 runs the call.
"""

from __future__ import annotations

import enum
from typing import Any

from creditrl.batch import Batch, pad_to_divisor, unpad

__all__ = ["Dispatch", "collect", "split"]


class Dispatch(enum.Enum):
    """Dispatch modes of a worker-group method."""

    ALL = "all"
    DP = "dp"
    RANK0 = "rank0"


def split(batch: Batch, world: int, *, strict: bool = False, what: str = "") -> tuple[list, int]:
    """(one chunk per rank, number of padding rows added)."""
    if strict and len(batch) % world:
        raise ValueError(
            f"{what}: {len(batch)} samples do not divide evenly over {world} workers; choose "
            "data.train_batch_size x rollout.n divisible by trainer.workers"
        )
    padded, pad = pad_to_divisor(batch, world)
    return padded.chunk(world), pad


def collect(results: list[Any], mode: Dispatch, pad: int = 0) -> Any:
    """Combine per-rank answers: concatenation for DP Batches, rank 0's answer otherwise."""
    if mode is Dispatch.DP and isinstance(results[0], Batch):
        return unpad(Batch.concat(results), pad)
    return results[0]

"""What several learner ranks agree on over torch.distributed: whether another step follows,
each rank's share of a step's groups, and that every rank holds rank 0's weights. Rank 0 is the
main rank; with one rank each is a no-op. Messages are JSON bytes (never pickle)."""

from __future__ import annotations

import json

import torch

from creditrl.batch import Batch
from creditrl.controller.distributed import broadcast_bytes, scatter_batches

__all__ = ["check_replicas", "scatter_groups", "stop_on_every_rank"]


def stop_on_every_rank(stop: bool, world: int, main: bool) -> bool:
    """Rank 0's ``stop`` on every rank: it tells them whether another step follows."""
    if world == 1:
        return stop
    data = json.dumps({"stop": stop}).encode() if main else None
    return bool(json.loads(broadcast_bytes(data))["stop"])


def scatter_groups(batch: Batch | None, world: int, rows_per_rank: int) -> Batch:
    """Rank 0's ``batch`` split into ``world`` consecutive shares of ``rows_per_rank`` rows
    (whole groups); each rank gets its own."""
    if world == 1:
        return batch
    parts = None
    if batch is not None:
        parts = [batch[r * rows_per_rank : (r + 1) * rows_per_rank] for r in range(world)]
    return scatter_batches(parts)


def check_replicas(model: torch.nn.Module, rank: int, step: int, main: bool) -> None:
    """Every rank must hold rank 0's weights (same summed gradients, same steps): compare a
    float64 checksum of the parameters; RuntimeError on a divergent rank."""
    with torch.no_grad():
        mine = sum(float(p.double().sum()) for p in model.parameters())
    data = json.dumps({"checksum": mine}).encode() if main else None
    expected = json.loads(broadcast_bytes(data))["checksum"]
    if mine != expected:
        raise RuntimeError(
            f"learner rank {rank}: weights diverged from rank 0 at step {step} "
            f"(parameter checksum {mine!r} != {expected!r})"
        )

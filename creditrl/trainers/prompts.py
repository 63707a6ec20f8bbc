"""The prompts of a step, drawn the same way by ``creditrl train`` and by an async sampler: rows
in the data sampler's order, a uid per prompt, ``rollout.n`` copies each (interleaved), and
sample seeds that depend only on the run's seed, the stream (the sampler's index; 0 for
``creditrl train``) and the place of the batch's first prompt in that stream. So sampler 0 of
an async run draws exactly the prompts and samples that ``creditrl train`` draws."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from creditrl.batch import Batch
from creditrl.data import collate_prompts
from creditrl.pipeline import stages

__all__ = ["batch_seed", "prompt_batch"]


def batch_seed(run_seed: int, stream: int, first: int) -> int:
    """The seed of the generation batch whose first prompt is prompt ``first`` of ``stream``."""
    return int(np.random.SeedSequence([run_seed, stream, first]).generate_state(1)[0])


def prompt_batch(
    rows: Sequence[Any], pad_token_id: int, n: int, uids: list[str], seed: int
) -> Batch:
    """``rows`` collated, one uid each, repeated ``n`` times (interleaved), with a
    ``sample_seed`` and ``traj_id`` per trajectory drawn from ``seed``."""
    prompts = collate_prompts(list(rows), pad_token_id)
    prompts["uid"] = uids
    prompts = prompts.repeat(n, interleave=True)
    return stages.add_sample_seeds(prompts, np.random.default_rng(seed))

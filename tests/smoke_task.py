"""The learning smoke task: the tiny random model (no real weights) learns from scratch, in a
few steps, to start its tokens with a space. Used by tests/test_gpu_smoke.py and
benchmarks/gpu_smoke.py (which puts this directory on ``sys.path``).

At the start the tiny model samples almost uniformly over SmolLM2's 49,152 tokens (65 % of them
begin with a space; 0.70 spaces a token on average), so the score (below) starts near 0.65, with
a spread within each group of answers that GRPO learns from. Measured on the CPU (float32, 14
steps): with seeds 1-5 the mean score went from 0.62-0.71 in steps 1-3 to 0.98-1.0 by step 9
at the latest (a rise of 0.33-0.37 by ``rise`` over STEPS); bf16 autocast, seeds 1-2: 0.32-0.35;
the reverse reward (no spaces, seed 1) from 0.36 to 1.0, so it is the reward that drives it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import creditrl
from creditrl.models.tiny import tiny_model_dir

STEPS = 12  # training steps of the smoke run
RESPONSE_TOKENS = 8  # rollout.max_response_length
WINDOW = 3  # the first and the last WINDOW steps are compared
MARGIN = 0.2  # the last window's mean score exceeds the first's by at least this


def space_score(completion: str, ground_truth: Any = None) -> float:
    """The completion's spaces per token of the response budget, at most 1: about the share of
    RESPONSE_TOKENS tokens that begin a word (a response that stops early scores less)."""
    return min(completion.count(" "), RESPONSE_TOKENS) / RESPONSE_TOKENS


def learn(out: Path, device: str, autocast: str = "none", seed: int = 1) -> list[float]:
    """Train the tiny model on ``space_score`` for STEPS GRPO steps on ``device`` into ``out``;
    return the mean training score (``critic/score/mean``) of each step, in order."""
    rows = [{"prompt": f"Write a few words, please ({i})."} for i in range(64)]
    config = {
        "trainer.device": device,
        "actor.autocast": autocast,
        "data.train_batch_size": 4,
        "rollout.n": 8,
        "rollout.max_response_length": RESPONSE_TOKENS,
        "rollout.temperature": 1.0,
        "actor.ppo_mini_batch_size": 4,
        "actor.ppo_micro_batch_size": 32,
        "actor.optim.lr": 0.1,
        "trainer.total_steps": STEPS,
        "trainer.val_before_train": False,
        "trainer.test_freq": 0,
        "trainer.save_freq": 0,
        "trainer.logger": ["jsonl"],
        "trainer.seed": seed,
    }
    creditrl.train(tiny_model_dir(), space_score, rows, output_dir=out, config=config)
    return [row["critic/score/mean"] for row in _metrics(out)]


def rise(scores: list[float]) -> float:
    """Mean score of the last WINDOW steps minus that of the first WINDOW steps."""
    first, last = scores[:WINDOW], scores[-WINDOW:]
    return sum(last) / len(last) - sum(first) / len(first)


def _metrics(out: Path) -> list[dict[str, Any]]:
    lines = (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda row: row["step"])

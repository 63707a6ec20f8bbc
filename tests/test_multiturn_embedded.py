"""Multi-turn verifiers environments on the embedded model (SmolLM2-135M-Instruct), the way a
user meets them: the issue's Echo environment and the letter game (three turns, hints) train a
step, sync and async, with every episode ``ok``, later turns taken and the rubric's parts
logged. Slow (minutes on 2 cores): ``pytest -m slow tests/test_multiturn_embedded.py``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from helpers import train_async_in_process

from creditrl.config import load_config

ROOT = Path(__file__).resolve().parent.parent
ECHO = ROOT / "examples" / "verifiers_echo.py"
GAME = ROOT / "examples" / "verifiers_letter_game.py"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("verifiers") is None, reason="needs creditrl[verifiers]"
    ),
]


def overrides(out: Path, env: Path, *extra: str) -> list[str]:
    """The issue's repro settings: one prompt, two episodes, one step, on the embedded model."""
    return [
        "model.path=embedded", f"env.verifiers={env}:load_environment", "data.train_batch_size=1",
        "actor.ppo_mini_batch_size=1", "rollout.n=2", "rollout.max_response_length=128",
        "trainer.total_steps=1", "trainer.test_freq=0", "trainer.save_freq=0",
        "trainer.val_before_train=false", "agent.episode_timeout_s=600", "trainer.logger=[jsonl]",
        f"trainer.output_dir={out}", *extra,
    ]  # fmt: skip


def step_of(out: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r.get("step") == 1 and "critic/score/mean" in r)


@pytest.mark.parametrize("env,part,turns", [(ECHO, "says_answer", 2), (GAME, "solved", 1)])
def test_a_multi_turn_environment_trains_on_the_embedded_model(
    tmp_path: Path, env: Path, part: str, turns: int
) -> None:
    """Every episode ok (none timed out or failed), each with at least ``turns`` turns (the
    Echo asks twice; the game stops at a right answer), the rubric's part logged."""
    from creditrl.trainers.rl_trainer import RLTrainer

    RLTrainer(load_config(overrides=overrides(tmp_path, env))).fit()
    step = step_of(tmp_path)
    assert step["agent/episodes_ok"] == 2
    assert step["num_turns/min"] >= turns
    assert 0.0 <= step[f"reward/vf_{part}_mean"] <= 1.0


def test_the_letter_game_trains_async_on_the_embedded_model(tmp_path: Path) -> None:
    from creditrl.asynchronous.launcher import free_port, load_from_args
    from creditrl.asynchronous.learner import Learner

    cfg, _, _ = load_from_args(overrides(tmp_path, GAME, "asynchronous.num_samplers=1"))
    learner = Learner(cfg, port=free_port())
    train_async_in_process(learner, cfg)
    step = step_of(tmp_path)
    assert step["agent/episodes_ok"] == 2
    assert 0.0 <= step["reward/vf_solved_mean"] <= 1.0

"""Async equals sync where it should: one sampler, ``asynchronous.max_staleness=0`` and the same
seed, the learner and the sampler (their real loops, talking over loopback sockets in this
process) train on the same prompts in the same order with the same samples as ``creditrl
train``, and log the same per-step losses and scores and end with the same weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import train_async_in_process

from creditrl.asynchronous.launcher import free_port, load_from_args
from creditrl.asynchronous.learner import Learner
from creditrl.config import load_config
from creditrl.models.tiny import tiny_model_dir
from creditrl.trainers.rl_trainer import RLTrainer

STEPS = 3
SETTINGS = (
    "actor.autocast=none",
    f"model.path={tiny_model_dir()}",
    "data.train_size=24",
    "data.val_size=2",
    "data.train_batch_size=2",
    "rollout.max_response_length=8",
    "rollout.temperature=1.0",
    "actor.ppo_mini_batch_size=1",
    "critic.ppo_mini_batch_size=1",
    "actor.ppo_micro_batch_size=2",
    "actor.optim.lr=1e-3",
    "actor.loss_agg_mode=token-mean",
    "reward.num_workers=0",
    f"reward.scorer={__file__}:spaces",
    f"trainer.total_steps={STEPS}",
    "trainer.save_freq=0",
    "trainer.test_freq=2",
    "trainer.logger=[jsonl]",
    "asynchronous.num_samplers=1",
    "asynchronous.max_staleness=0",
)
ALGORITHMS = {
    "grpo": ("preset=grpo", "rollout.n=2", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1"),
    "ppo": ("preset=ppo", "rollout.n=1", "actor.use_rollout_log_probs=false"),
}
# what each step logs that must agree (the async run adds async/*, the sync run dapo/* etc.)
COMPARED = ("actor/pg_loss", "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl",
            "critic/vf_loss", "critic/score/mean", "critic/rewards/mean",
            "critic/advantages/mean", "critic/values/mean", "response_length/mean",
            "actor/reward_kl_penalty", "val/score")  # fmt: skip


def spaces(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """A score that varies within a group: the answer's spaces per token of its budget."""
    return min(solution_str.count(" "), 8) / 8


def _recorded(loop: Any) -> list[dict[str, Any]]:
    """Wrap ``loop.train_step`` to keep each step's prompts, responses, scores and, after the
    last step, the actor's weights."""
    steps: list[dict[str, Any]] = []
    train_step = loop.train_step

    def recording() -> dict[str, float]:
        metrics = train_step()
        batch = loop.last_batch
        prompt, response = batch["prompts"], batch["responses"]
        p, r = batch["attention_mask"][:, : prompt.shape[1]], batch["response_mask"]
        steps.append(
            {
                "prompts": [row[m.bool()].tolist() for row, m in zip(prompt, p, strict=True)],
                "responses": [row[m.bool()].tolist() for row, m in zip(response, r, strict=True)],
                "scores": batch["token_level_scores"].sum(-1).tolist(),
                "weights": {
                    k: v.detach().clone()
                    for k, v in loop.workers.worker.actor.model.state_dict().items()
                },
            }
        )
        return metrics

    loop.train_step = recording
    return steps


def _metrics(out: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row.get("step", 0) > 0]


def _sync(out: Path, extra: tuple[str, ...]) -> list[dict[str, Any]]:
    trainer = RLTrainer(load_config(overrides=[*SETTINGS, *extra, f"trainer.output_dir={out}"]))
    steps = _recorded(trainer)
    trainer.fit()
    return steps


def _async(out: Path, extra: tuple[str, ...]) -> list[dict[str, Any]]:
    cfg, _, _ = load_from_args([*SETTINGS, *extra, f"trainer.output_dir={out}"])
    port = free_port()
    learner = Learner(cfg, port=port)
    steps = _recorded(learner)
    train_async_in_process(learner, cfg)
    return steps


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_async_at_staleness_0_equals_sync(tmp_path: Path, algorithm: str) -> None:
    """Same prompts, same order, same samples and scores; the same per-step losses, scores and
    validation; final float32 weights within 1e-6."""
    extra = ALGORITHMS[algorithm]
    sync = _sync(tmp_path / "sync", extra)
    asyn = _async(tmp_path / "async", extra)
    assert len(sync) == len(asyn) == STEPS
    for step, (a, b) in enumerate(zip(sync, asyn, strict=True), start=1):
        assert a["prompts"] == b["prompts"], f"step {step}: prompts"
        assert a["responses"] == b["responses"], f"step {step}: samples"
        assert a["scores"] == b["scores"], f"step {step}: scores"
    sync_metrics, async_metrics = _metrics(tmp_path / "sync"), _metrics(tmp_path / "async")
    assert [m["step"] for m in sync_metrics] == [m["step"] for m in async_metrics] == [1, 2, 3]
    for a, b in zip(sync_metrics, async_metrics, strict=True):
        keys = [k for k in COMPARED if k in a]
        assert keys and "actor/pg_loss" in keys
        assert [k for k in keys if k not in b] == [], f"step {a['step']}"
        for key in keys:
            assert b[key] == pytest.approx(a[key], abs=1e-6), f"step {a['step']}: {key}"
    if algorithm == "ppo":
        assert "critic/vf_loss" in sync_metrics[0]
    for name, value in sync[-1]["weights"].items():
        torch.testing.assert_close(asyn[-1]["weights"][name], value, atol=1e-6, rtol=0)

"""The sampling temperature is one fact a batch carries: written when it is generated, read by
every log-prob pass and the update."""

from __future__ import annotations

from pathlib import Path

import torch

from creditrl.config.loader import load_config
from creditrl.models.tiny import tiny_model_dir
from creditrl.pipeline.step import sampled_temperature
from creditrl.trainers.rl_trainer import RLTrainer


def test_the_log_prob_passes_use_the_temperature_the_batch_was_sampled_at(tmp_path: Path) -> None:
    """A batch generated at temperature 0.5 (an override of rollout.temperature=1) records 0.5;
    its old log-probs are the actor's at 0.5, which equal the rollout's own log-probs (same
    weights, same temperature), not those at 1."""
    cfg = load_config(
        overrides=[
            f"model.path={tiny_model_dir()}",
            "data.train_size=8",
            "data.val_size=0",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2",
            "rollout.n=2",
            "rollout.max_response_length=6",
            "rollout.temperature=1.0",
            "actor.autocast=none",
            "reward.num_workers=0",
            "trainer.logger=[jsonl]",
            f"trainer.output_dir={tmp_path}",
        ]
    )
    trainer = RLTrainer(cfg)
    try:
        batch = trainer.pipeline.generate(trainer.next_prompts(), step=1, temperature=0.5)
        assert batch.meta["temperature"] == 0.5 == sampled_temperature(batch, cfg)
        old = trainer.workers.compute_log_prob(batch, sampled_temperature(batch, cfg))
        mask = batch["response_mask"].bool()
        torch.testing.assert_close(
            old["old_log_probs"][mask], batch["rollout_log_probs"][mask], atol=1e-4, rtol=0
        )
        at_one = trainer.workers.compute_log_prob(batch, 1.0)["old_log_probs"][mask]
        assert (at_one - batch["rollout_log_probs"][mask]).abs().max() > 1e-2
        batch.meta.pop("temperature")
        assert sampled_temperature(batch, cfg) == 1.0
    finally:
        trainer.close()

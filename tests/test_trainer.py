"""End to end on a tiny random model with the real tokenizer: every stage of GRPO and PPO,
checkpoint/resume exactness, and the CLI's main path."""

import shutil
from pathlib import Path

import pytest
import torch
from helpers import read_metrics, tiny_trainer_config
from safetensors.torch import load_file

from creditrl.trainers.rl_trainer import RLTrainer

VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/", "time")


def stable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}


@pytest.mark.parametrize("preset,extra_fields", [("grpo", []), ("ppo", ["values", "ref_log_prob"])])
def test_two_steps_through_every_stage(
    tmp_path: Path, preset: str, extra_fields: list[str]
) -> None:
    # float32 update on any CPU (under bf16 autocast the recomputed log-probs are the bf16
    # update's, which differ from the float32 sampler's by ~1e-3)
    cfg = tiny_trainer_config(tmp_path / preset, f"preset={preset}", "actor.autocast=none")
    trainer = RLTrainer(cfg)
    summary = trainer.fit()
    batch = trainer.last_batch
    n_traj = cfg.data.train_batch_size * cfg.rollout.n
    assert len(batch) == n_traj
    t = batch["responses"].shape[1]
    assert 1 <= t <= cfg.rollout.max_response_length
    per_token = [
        "responses", "response_mask", "rollout_log_probs", "old_log_probs", "entropys",
        "token_level_scores", "token_level_rewards", "advantages", "returns", *extra_fields,
    ]  # fmt: skip
    for name in per_token:
        assert batch[name].shape == (n_traj, t), name
    assert batch["input_ids"].shape[1] == batch["prompts"].shape[1] + t
    assert len(set(batch["uid"])) == cfg.data.train_batch_size
    mask = batch["response_mask"].bool()
    assert (batch["advantages"][~mask] == 0).all()
    # on-policy at temperature 1, no top-k/top-p: the recomputed log-probs are the sampler's
    old, rollout = batch["old_log_probs"][mask], batch["rollout_log_probs"][mask]
    torch.testing.assert_close(old, rollout, atol=1e-4, rtol=0)
    metrics = read_metrics(tmp_path / preset)
    assert set(metrics) == {0, 1, 2}
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean"):
        assert key in metrics[2], key
    if preset == "ppo":
        assert "critic/vf_loss" in metrics[2] and "actor/reward_kl_penalty" in metrics[2]
    assert "val/score" in metrics[2] and summary.val_before
    assert (tmp_path / preset / "rollouts" / "step_000002.jsonl").is_file()
    assert (tmp_path / preset / "checkpoints" / "latest").read_text() == "step_000002"


def test_resume_from_step_one_reproduces_step_two(tmp_path: Path) -> None:
    full = tmp_path / "full"
    RLTrainer(tiny_trainer_config(full)).fit()
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000002")
    (resumed / "checkpoints" / "latest").write_text("step_000001")
    trainer = RLTrainer(tiny_trainer_config(resumed))
    trainer.fit()
    assert trainer.step == 2
    first, again = read_metrics(full), read_metrics(resumed)
    assert set(again) == {0, 1, 2}
    assert stable(again[2]) == stable(first[2])
    a = load_file(str(full / "checkpoints" / "step_000002" / "actor.model.safetensors"))
    b = load_file(str(resumed / "checkpoints" / "step_000002" / "actor.model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rerunning_a_finished_run_reports_its_validations(tmp_path: Path) -> None:
    """A second `creditrl train` on a finished run's directory resumes at its end and its
    summary shows the validation before and after (it showed "n/a" after)."""
    first = RLTrainer(tiny_trainer_config(tmp_path)).fit()
    again = RLTrainer(tiny_trainer_config(tmp_path)).fit()
    assert first.val_after and "val/score" in first.val_after
    assert again.as_dict()["val_score_after"] == first.as_dict()["val_score_after"]
    assert again.as_dict()["val_score_before"] == first.as_dict()["val_score_before"]
    assert again.rewards == []


def test_reusing_rollout_log_probs_skips_the_recompute(tmp_path: Path) -> None:
    cfg = tiny_trainer_config(tmp_path, "actor.use_rollout_log_probs=true", "trainer.total_steps=1")
    trainer = RLTrainer(cfg)
    assert trainer.reuse_rollout_log_probs
    trainer.fit()
    batch = trainer.last_batch
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
    assert "timing_s/old_log_prob" in read_metrics(tmp_path)[1]
    assert read_metrics(tmp_path)[1]["actor/entropy"] > 0
    unreplayed = ("rollout.top_k=5", "rollout.sampling_replay=false")
    topk = RLTrainer(
        tiny_trainer_config(tmp_path / "k", "actor.use_rollout_log_probs=true", *unreplayed)
    )
    assert not topk.reuse_rollout_log_probs  # top-k not replayed is not the actor's distribution


SCORER = """
def parity(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(len(solution_str) % 2)
"""


@pytest.mark.parametrize("preset", ["dapo", "rloo", "reinforce_plus_plus", "gspo"])
def test_presets_run_a_step(tmp_path: Path, preset: str) -> None:
    scorer = tmp_path / "parity.py"
    scorer.write_text(SCORER)
    cfg = tiny_trainer_config(
        tmp_path / "run", f"preset={preset}", f"reward.scorer={scorer}:parity",
        "trainer.total_steps=1", "trainer.val_before_train=false",
        "algorithm.overlong_buffer.len=4",
    )  # fmt: skip
    trainer = RLTrainer(cfg)
    trainer.fit()
    metrics = read_metrics(tmp_path / "run")[1]
    assert "actor/pg_loss" in metrics
    if preset == "dapo":
        assert 0 < metrics["dapo/kept_fraction"] <= 1
        assert "reward/overlong_penalty_mean" in metrics
    scores = trainer.last_batch["token_level_scores"].sum(-1)
    assert set(scores.tolist()) <= {0.0, 1.0}  # overlong shaping is a reward term, not a score


def test_remax_uses_greedy_baselines(tmp_path: Path) -> None:
    cfg = tiny_trainer_config(tmp_path, "algorithm.adv_estimator=remax", "trainer.total_steps=1")
    trainer = RLTrainer(cfg)
    trainer.fit()
    assert trainer.last_batch["reward_baselines"].shape == (4,)
    assert "timing_s/gen_greedy" in read_metrics(tmp_path)[1]


def test_backend_choices_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"trainer\.backend='slurm' is not one of local, ray"):
        RLTrainer(tiny_trainer_config(tmp_path, "trainer.backend=slurm"))
    with pytest.raises(ValueError, match=r"needs trainer\.backend=ray"):
        RLTrainer(tiny_trainer_config(tmp_path, "trainer.workers=2"))

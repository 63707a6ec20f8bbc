"""Options that used to give silently wrong numbers: rollout correction rewriting the
trajectory, grpo_multiturn ignoring per-token reward terms, the rollout/training mismatch
metrics missing with IS off, dump rows that could not be joined to their group."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch

from creditrl.batch import Batch
from creditrl.config import AlgorithmConfig
from creditrl.config.schema import RolloutISConfig
from creditrl.core import ADV_ESTIMATORS, compute_rollout_corr_metrics
from creditrl.pipeline import stages

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask")
VETOES = (None, 0.5)


def _trajectories(seed: int = 0) -> Batch:
    """Three groups of four right-padded responses (lengths 1..6), scores on the last token,
    values, greedy baselines and structured parts; rollout log-probs far enough from the
    trainer's that mask mode and veto reject tokens, including some last tokens."""
    g = torch.Generator().manual_seed(seed)
    b, t = 12, 6
    lengths = torch.tensor([6, 3, 1, 5, 4, 6, 2, 6, 5, 1, 3, 4])
    mask = (torch.arange(t) < lengths.unsqueeze(1)).long()
    scores = torch.zeros(b, t)
    outcome = torch.randint(0, 3, (b,), generator=g).float() / 2
    scores[torch.arange(b), lengths - 1] = outcome
    old = -torch.rand(b, t, generator=g) * 2
    rollout = old + torch.randn(b, t, generator=g) * 1.5
    batch = Batch(
        {
            "responses": torch.randint(3, 100, (b, t), generator=g),
            "response_mask": mask,
            "token_level_scores": scores,
            "old_log_probs": old * mask,
            "rollout_log_probs": rollout * mask,
            "ref_log_prob": (old + 0.1 * torch.randn(b, t, generator=g)) * mask,
            "values": torch.randn(b, t, generator=g) * mask,
            "reward_baselines": torch.rand(b, generator=g),
            "turn_scores": torch.rand(b, generator=g),
            "global_scores": outcome,
        },
        {"uid": [f"u{i // 4}" for i in range(b)]},
    )
    return batch


def _advantages(batch: Batch, algorithm: AlgorithmConfig) -> Batch:
    """The trainer's advantage block (KL into rewards, rollout IS, advantages) on a copy."""
    out = copy.deepcopy(batch)
    stages.kl_into_rewards(out, algorithm, 0.05)
    stages.rollout_is_weights(out, algorithm)
    stages.compute_advantages(out, algorithm)
    return out


@pytest.mark.parametrize("estimator", sorted(ADV_ESTIMATORS.names()))
@pytest.mark.parametrize("use_kl", [False, True])
def test_rollout_correction_never_changes_advantages_or_returns(
    estimator: str, use_kl: bool
) -> None:
    """Pins, for every registered estimator and every rollout-IS level x mode x veto: the
    advantages, returns, rewards and response_mask equal those with rollout IS disabled (at
    every position, so in particular where nothing is rejected), and rejections appear only in
    ``loss_mask``. Before the fix mask mode and veto overwrote response_mask, so a sequence
    whose last token was rejected lost its score and its advantage changed sign."""
    batch = _trajectories()
    base = AlgorithmConfig(adv_estimator=estimator, use_kl_in_reward=use_kl, lam=0.9)
    plain = _advantages(batch, base)
    rejected_somewhere = False
    for level, mode, veto in itertools.product(LEVELS, MODES, VETOES):
        is_cfg = RolloutISConfig(
            enable=True, level=level, mode=mode, threshold=2.0, veto_threshold=veto
        )
        corrected = _advantages(batch, dataclasses.replace(base, rollout_is=is_cfg))
        for name in ("advantages", "returns", "token_level_rewards", "response_mask"):
            torch.testing.assert_close(corrected[name], plain[name], rtol=0, atol=0, msg=name)
        assert "rollout_is_weights" in corrected
        if mode == "mask" or veto is not None:
            loss_mask = corrected["loss_mask"]
            assert bool((loss_mask <= batch["response_mask"]).all())
            rejected_somewhere |= bool((loss_mask < batch["response_mask"]).any())
        else:
            assert "loss_mask" not in corrected
    assert rejected_somewhere  # the fixture does exercise rejection


def test_actor_loss_skips_rejected_tokens_only(tiny_actor_batch) -> None:
    """The actor aggregates its losses over ``loss_mask``: with the last token of row 0
    rejected, the loss and the updated weights equal those of the same batch whose
    response_mask drops that token, and differ from the batch without a loss_mask."""
    from creditrl.config import ActorConfig
    from creditrl.core import get_policy_loss
    from creditrl.workers.actor import ActorWorker

    model, batch = tiny_actor_batch
    loss_mask = batch["response_mask"].clone()
    loss_mask[0, 3] = 0
    with_loss_mask = copy.deepcopy(batch)
    with_loss_mask["loss_mask"] = loss_mask
    cut = copy.deepcopy(batch)
    cut["response_mask"] = loss_mask
    losses, weights = [], []
    for b in (with_loss_mask, cut, batch):
        worker = ActorWorker(
            copy.deepcopy(model),
            ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size=1, autocast="none"),
        )
        metrics = worker._optimizer_step(b, get_policy_loss("ppo"), 1.0)
        losses.append(metrics["actor/pg_loss"])
        weights.append(torch.cat([p.detach().flatten() for p in worker.model.parameters()]))
    assert losses[0] == pytest.approx(losses[1], abs=1e-7)
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=0)
    assert losses[0] != pytest.approx(losses[2], abs=1e-5)


@pytest.fixture
def tiny_actor_batch(model):
    """A real 2-row group for the tiny model (helpers.model_group: responses of 4 and
    3 tokens), with distinct advantages and old log-probs shifted so the ratio is not 1."""
    from helpers import model_group

    batch = model_group(model, "s0", 0, 0)
    mask = batch["response_mask"]
    batch["advantages"] = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-0.5, -0.5, -0.5, 0.0]])
    batch["old_log_probs"] = (batch["rollout_log_probs"] - 0.05) * mask
    return model, batch


def test_grpo_multiturn_folds_per_token_reward_terms_into_the_global_part() -> None:
    """Pins the fold: with KL in the reward, G'_i = G_i + sum_t (r_it - s_it) m_it, so the KL
    penalty changes the advantages (it was ignored before), and without per-token terms the
    result is spec 001's estimator unchanged."""
    batch = _trajectories(1)
    no_kl = _advantages(batch, AlgorithmConfig(adv_estimator="grpo_multiturn"))
    with_kl = _advantages(
        batch, AlgorithmConfig(adv_estimator="grpo_multiturn", use_kl_in_reward=True)
    )
    assert not torch.allclose(no_kl["advantages"], with_kl["advantages"])
    mask = batch["response_mask"].double()
    extra = ((with_kl["token_level_rewards"] - batch["token_level_scores"]) * mask).sum(-1)
    parts = [batch["turn_scores"].double(), batch["global_scores"].double() + extra.double()]
    expected = torch.zeros(len(batch), dtype=torch.float64)
    for part in parts:
        for uid in set(batch["uid"]):
            rows = torch.tensor([u == uid for u in batch["uid"]])
            x = part[rows]
            expected[rows] += (x - x.mean()) / (x.std() + 1e-6)
    want = (expected.unsqueeze(-1) * mask).float()
    torch.testing.assert_close(with_kl["advantages"], want, atol=1e-5, rtol=1e-5)
    # no KL, no overlong: the global part is G itself
    expected = torch.zeros(len(batch), dtype=torch.float64)
    for part in (batch["turn_scores"].double(), batch["global_scores"].double()):
        for uid in set(batch["uid"]):
            rows = torch.tensor([u == uid for u in batch["uid"]])
            x = part[rows]
            expected[rows] += (x - x.mean()) / (x.std() + 1e-6)
    torch.testing.assert_close(
        no_kl["advantages"], (expected.unsqueeze(-1) * mask).float(), atol=1e-5, rtol=1e-5
    )


def test_overlong_penalty_is_a_reward_term_that_grpo_multiturn_sees() -> None:
    """DAPO's overlong penalty lands on token_level_rewards (the score stays the task's), and
    grpo_multiturn's advantages move with it (before, it read only the structured parts)."""
    batch = _trajectories(2)
    cfg = AlgorithmConfig(adv_estimator="grpo_multiturn")
    shaped = dataclasses.replace(
        cfg, overlong_buffer=dataclasses.replace(cfg.overlong_buffer, enable=True, len=4)
    )
    plain = _advantages(batch, cfg)
    out = copy.deepcopy(batch)
    stages.kl_into_rewards(out, shaped, 0.0)
    metrics = stages.apply_overlong_penalty(out, shaped, max_response_length=6)
    stages.compute_advantages(out, shaped)
    assert metrics["reward/overlong_penalty_mean"] < 0
    torch.testing.assert_close(out["token_level_scores"], batch["token_level_scores"])
    # length 6 > 6 - 4: penalty (6 - 2) / 4 = 1 on the last token of row 0
    assert out["token_level_rewards"][0, 5] == pytest.approx(batch["token_level_scores"][0, 5] - 1)
    assert not torch.allclose(out["advantages"], plain["advantages"])


def test_rollout_corr_metrics_values() -> None:
    """rollout_corr/* on hand-made log-probs: k1, k3, per-sequence log-ppl difference and the
    largest absolute difference; all 0 when sampler and trainer agree."""
    train = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    rollout = torch.tensor([[-1.5, -2.0, 9.0], [-0.2, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    got = compute_rollout_corr_metrics(train, rollout, mask)
    d = torch.tensor([0.5, 0.0, -0.3])  # train - rollout on valid tokens
    assert got["rollout_corr/k1_kl"] == pytest.approx(float(-d.mean()), abs=1e-6)
    assert got["rollout_corr/k3_kl"] == pytest.approx(float((d.exp() - d - 1).mean()), abs=1e-6)
    assert got["rollout_corr/max_abs_logp_diff"] == pytest.approx(0.5)
    # per sequence: (mean rollout - mean train) = (-1.75 + 1.5), (-0.2 + 0.5)
    assert got["rollout_corr/log_ppl_diff"] == pytest.approx((-0.25 + 0.3) / 2, abs=1e-6)
    same = compute_rollout_corr_metrics(train, train, mask)
    assert all(v == pytest.approx(0.0, abs=1e-7) for k, v in same.items() if "ppl" not in k)


def test_learner_rollout_correction_keeps_advantages(tmp_path: Path, monkeypatch) -> None:
    """The async learner enables rollout IS by default; with mask mode and a veto its
    advantages and returns equal the uncorrected ones and rejections land in loss_mask only."""
    from helpers import model_group, tiny_learner_config

    from creditrl.asynchronous.learner import Learner

    cfg = tiny_learner_config(
        tmp_path, "algorithm.rollout_is.mode=mask", "algorithm.rollout_is.veto_threshold=0.9"
    )
    learner = Learner(cfg)
    other = copy.deepcopy(learner.actor.model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    from creditrl.asynchronous.learner import concat_groups

    groups = [
        model_group(other, "s0", 0, 0, (1.0, 0.0)),
        model_group(other, "s0", 1, 0, (0.0, 1.0)),
    ]
    batch = concat_groups(groups, pad_token_id=2)
    batch["staleness"] = torch.ones(len(batch), dtype=torch.long)  # recompute old log-probs
    seen = {}

    def capture(b, temperature, n):
        seen["batch"] = b
        return {}

    monkeypatch.setattr(learner.actor, "update_policy", capture)
    learner.update(batch, {})
    trained = seen["batch"]
    reference = copy.deepcopy(trained)
    del reference["advantages"], reference["returns"]
    stages.compute_advantages(reference, cfg.algorithm)
    torch.testing.assert_close(trained["advantages"], reference["advantages"], rtol=0, atol=0)
    torch.testing.assert_close(trained["returns"], reference["returns"], rtol=0, atol=0)
    assert torch.equal(trained["response_mask"], batch["response_mask"])
    assert bool((trained["loss_mask"] < trained["response_mask"]).any())


def test_dump_rows_carry_uid_and_a_stable_trajectory_id(tmp_path: Path) -> None:
    """Each dumped row names its prompt group (uid) and its trajectory ('<uid>/<k>'), set at
    the repeat and kept through reordering, so rows join their group and the explain view."""
    import numpy as np

    from creditrl.tracking import RolloutDumper

    prompts = Batch({"x": torch.zeros(2, 1)})
    stages.add_uids(prompts, np.random.default_rng(0))
    batch = prompts.repeat(3, interleave=True)
    stages.add_sample_seeds(batch, np.random.default_rng(1))
    uid0, uid1 = prompts["uid"]
    assert list(batch["traj_id"]) == [f"{uid0}/0", f"{uid0}/1", f"{uid0}/2",
                                      f"{uid1}/0", f"{uid1}/1", f"{uid1}/2"]  # fmt: skip
    shuffled = batch[torch.tensor([4, 0, 5, 1, 3, 2])]
    assert shuffled["traj_id"][0] == f"{uid1}/1"

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(map(str, ids))

        def convert_ids_to_tokens(self, ids):
            return [str(i) for i in ids]

    t = 2
    full = Batch(
        {
            "responses": torch.ones(6, t, dtype=torch.long),
            "response_mask": torch.ones(6, t, dtype=torch.long),
            "attention_mask": torch.ones(6, 1 + t, dtype=torch.long),
            "input_ids": torch.ones(6, 1 + t, dtype=torch.long),
        },
        {"uid": list(shuffled["uid"]), "traj_id": list(shuffled["traj_id"])},
    )
    path = RolloutDumper(tmp_path, 1, Tok()).dump(full, 1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["traj_id"] for r in rows] == list(shuffled["traj_id"])
    assert all(r["traj_id"].startswith(r["uid"] + "/") for r in rows)


@pytest.mark.parametrize("reuse", [True, False])
def test_mismatch_metrics_are_logged_with_rollout_is_off(tmp_path: Path, reuse: bool) -> None:
    """rollout_corr/* appear in every step's metrics with rollout IS off: from the recomputed
    old log-probs, or (when the old log-probs are the rollout's) from the update's first
    training forward. On-policy in float32 the two sides agree to float noise."""
    from helpers import read_metrics, tiny_trainer_config

    from creditrl.trainers.rl_trainer import RLTrainer

    cfg = tiny_trainer_config(
        tmp_path,
        f"actor.use_rollout_log_probs={str(reuse).lower()}",
        "actor.autocast=none",
        "trainer.total_steps=1",
        "trainer.val_before_train=false",
    )
    assert not cfg.algorithm.rollout_is.enable
    RLTrainer(cfg).fit()
    step = read_metrics(tmp_path)[1]
    for key in (
        "rollout_corr/k3_kl",
        "rollout_corr/log_ppl_diff",
        "rollout_corr/max_abs_logp_diff",
    ):
        assert key in step, key
    assert 0 <= step["rollout_corr/max_abs_logp_diff"] < 1e-3
    assert step["rollout_corr/k3_kl"] == pytest.approx(0.0, abs=1e-6)


def test_dapo_without_varied_groups_stops_with_one_line(tmp_path: Path, monkeypatch) -> None:
    """preset=dapo when no group's scores vary within max_num_gen_batches: a UserError naming
    the key and what to change (it was a bare RuntimeError)."""
    import numpy as np
    from helpers import tiny_trainer_config

    from creditrl.errors import NothingToLearnError
    from creditrl.trainers.rl_trainer import RLTrainer

    cfg = tiny_trainer_config(
        tmp_path, "preset=dapo", "algorithm.filter_groups.max_num_gen_batches=2",
        "algorithm.overlong_buffer.len=4", "trainer.val_before_train=false",
    )  # fmt: skip
    monkeypatch.setattr(stages, "varied_groups", lambda b: np.zeros(len(b), dtype=bool))
    trainer = RLTrainer(cfg)
    with pytest.raises(NothingToLearnError) as err:
        trainer.fit()
    message = str(err.value)
    assert "\n" not in message and "max_num_gen_batches=2" in message
    assert "algorithm.filter_groups.max_num_gen_batches" in message


def test_rollout_is_recomputes_old_log_probs(tmp_path: Path) -> None:
    """With rollout IS on, the old log-probs are the trainer's own forward, not the sampler's
    copied over (which made every weight exactly 1, a silent no-op)."""
    from helpers import tiny_trainer_config

    from creditrl.trainers.rl_trainer import RLTrainer

    cfg = tiny_trainer_config(
        tmp_path, "actor.use_rollout_log_probs=true", "algorithm.rollout_is.enable=true"
    )
    trainer = RLTrainer(cfg)
    assert not trainer.reuse_rollout_log_probs
    trainer.close()


def test_async_commands_default_to_spec_003_aggregation() -> None:
    """Spec 003 averages each sequence's token terms over its length, then over the batch:
    ``creditrl async``/``learner``/``sampler`` load with seq-mean-token-mean for the GRPO loss
    and GSPO alike (it was token-mean for GRPO); an explicit setting still wins; the
    synchronous trainer keeps token-mean."""
    from creditrl.asynchronous.launcher import load_from_args
    from creditrl.config.loader import load_config

    assert load_from_args([])[0].actor.loss_agg_mode == "seq-mean-token-mean"
    assert load_from_args(["preset=gspo"])[0].actor.loss_agg_mode == "seq-mean-token-mean"
    explicit = load_from_args(["actor.loss_agg_mode=token-mean"])[0]
    assert explicit.actor.loss_agg_mode == "token-mean"
    assert load_config().actor.loss_agg_mode == "token-mean"

"""The distillation teacher stage: its inputs (token-exact), its place in the rewards, the
config checks, and a step with it in sync, async and the agent loop."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import (
    model_group,
    read_metrics,
    refused,
    tiny_learner_config,
    tiny_trainer_config,
    train_async_in_process,
)

from creditrl.agents.scripted import ScriptedTurnGenerator
from creditrl.asynchronous.launcher import free_port
from creditrl.asynchronous.learner import Learner
from creditrl.asynchronous.messages import decode, episodes_message
from creditrl.asynchronous.receiver import GroupReceiver
from creditrl.asynchronous.validation import MessageError
from creditrl.batch import Batch
from creditrl.config import DistillConfig, load_config
from creditrl.data import build_datasets
from creditrl.models import load_causal_lm, load_tokenizer
from creditrl.models.tiny import tiny_model_dir
from creditrl.pipeline import stages
from creditrl.trainers.rl_trainer import RLTrainer


def _rollout_batch() -> Batch:
    """Two rows: prompts [5, 6] (left-padded) and [7, 8, 9]; responses [10, 11, pad] and
    [12, 13, 14]."""
    prompts = torch.tensor([[0, 5, 6], [7, 8, 9]])
    responses = torch.tensor([[10, 11, 0], [12, 13, 14]])
    response_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    attention = torch.cat([torch.tensor([[0, 1, 1], [1, 1, 1]]), response_mask], dim=1)
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
        }
    )


def test_teacher_rows_are_its_prompt_then_the_sampled_ids() -> None:
    batch = _rollout_batch()
    batch["teacher_prompt_ids"] = [[1, 2, 3, 4], [1, 99999]]  # row 1: an id past the vocabulary
    rows, rejected = stages.teacher_inputs(batch, pad_token_id=0, vocab_size=1000, max_length=8)
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4, 10, 11, 0], [0, 7, 8, 9, 12, 13, 14]]
    assert rows["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1]]
    assert rows["position_ids"][0].tolist()[:6] == [0, 1, 2, 3, 4, 5]
    assert torch.equal(rows["responses"], batch["responses"])
    assert rejected.tolist() == [False, True]  # refused: the student's own prompt is used
    for bad in ("1 2", [], [1.5], [True], list(range(9)), [-1]):
        batch["teacher_prompt_ids"] = [bad, [1]]
        _, rejected = stages.teacher_inputs(batch, 0, 1000, 8)
        assert rejected.tolist() == [True, False], bad
    del batch["teacher_prompt_ids"]  # teacher_prompt=same: the student's prompt ids
    rows, rejected = stages.teacher_inputs(batch, 0, 1000, 8)
    assert torch.equal(rows["input_ids"], batch["input_ids"]) and not rejected.any()


@pytest.mark.parametrize("combine", ["add", "replace"])
def test_distill_term_joins_the_rewards(combine: str) -> None:
    batch = _rollout_batch()
    batch["old_log_probs"] = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -3.0]])
    batch["teacher_log_prob"] = torch.tensor([[-0.5, -2.5, -9.0], [-0.5, -1.0, -1.0]])
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.5]])
    batch["token_level_scores"] = scores
    batch["token_level_rewards"] = scores - 0.1  # as if a KL penalty had been put in
    cfg = DistillConfig(teacher="self", coef=2.0, combine=combine)
    metrics = stages.distill_into_rewards(batch, cfg)
    d = torch.tensor([[0.5, -0.5, 0.0], [0.0, -0.5, 2.0]])  # teacher - student, masked
    base = scores - 0.1 if combine == "add" else torch.full_like(scores, -0.1)
    assert torch.allclose(batch["token_level_rewards"], base + 2.0 * d)
    assert metrics["distill/reverse_kl"] == pytest.approx(-1.5 / 5)
    assert metrics["distill/coef"] == 2.0


def test_few_shot_and_ground_truth_teacher_prompts() -> None:
    tok = load_tokenizer(tiny_model_dir())
    base = ["data.train_size=4", "data.val_size=2", "data.few_shot=0"]
    plain, _ = build_datasets(load_config(overrides=base).data, tok)
    assert "teacher_prompt_ids" not in plain[0]
    shown = load_config(overrides=[*base[:2], "data.few_shot=1"])
    with_example, _ = build_datasets(shown.data, tok)
    cfg = load_config(overrides=[*base, "distill.teacher=self", "distill.teacher_prompt=few_shot"])
    rows, val = build_datasets(cfg.data, tok, cfg.distill)
    # the student sees no example; the teacher sees the prompt data.few_shot=1 gives
    assert rows[0]["input_ids"] == plain[0]["input_ids"]
    assert rows[0]["teacher_prompt_ids"] == with_example[0]["input_ids"]
    assert "teacher_prompt_ids" not in val[0]  # validation never reaches the teacher
    cfg = load_config(
        overrides=[*base, "distill.teacher=self", "distill.teacher_prompt=ground_truth"]
    )
    rows, _ = build_datasets(cfg.data, tok, cfg.distill)
    hint = tok.decode(rows[0]["teacher_prompt_ids"])
    assert f"a correct final answer is {rows[0]['ground_truth']}" in hint


def test_distill_config_refusals(capsys, tmp_path: Path) -> None:
    model = f"model.path={tiny_model_dir()}"
    line = refused(capsys, model, "actor.policy_loss=distill")
    assert "set distill.teacher" in line
    line = refused(capsys, model, "distill.teacher=self", "distill.teacher_prompt=few_shot",
                   f"data.train_files=[{tmp_path / 'x.jsonl'}]")  # fmt: skip
    assert "few_shot" in line and "data.train_files" in line
    line = refused(capsys, model, "distill.teacher=self", "distill.teacher_prompt=ground_truth",
                   "preset=calculator_agent")  # fmt: skip
    assert "agent task" in line
    line = refused(capsys, model, f"distill.teacher={tmp_path}")
    assert "is not 'self', 'embedded', a model directory" in line


def test_a_teacher_with_another_vocabulary_is_refused_in_one_line(capsys, tmp_path) -> None:
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir(), other)
    tok = load_tokenizer(other)
    tok.add_tokens(["<teacher_only>"])
    tok.save_pretrained(str(other))
    line = refused(capsys, f"model.path={tiny_model_dir()}", f"distill.teacher={other}")
    assert "has another vocabulary than model.path (49153 vs 49152 tokens" in line
    assert "'<teacher_only>'" in line


def _train(out: Path, *extra: str) -> RLTrainer:
    cfg = tiny_trainer_config(
        out, "trainer.total_steps=1", "trainer.test_freq=0", "trainer.val_before_train=false",
        "trainer.save_freq=0", *extra,
    )  # fmt: skip
    trainer = RLTrainer(cfg)
    trainer.fit()
    return trainer


def test_sync_step_self_teacher_on_the_same_prompt_matches_the_student(tmp_path: Path) -> None:
    """teacher=self on the same prompt is the actor before its update: the stage's rows are
    aligned with the student's exactly when its log-probs equal old_log_probs."""
    batch = _train(tmp_path / "run", "distill.teacher=self").last_batch
    mask = batch["response_mask"].bool()
    assert torch.allclose(batch["teacher_log_prob"][mask], batch["old_log_probs"][mask], atol=1e-5)


def test_sync_step_with_a_privileged_prompt_and_the_pure_loss(tmp_path: Path) -> None:
    trainer = _train(
        tmp_path / "run",
        f"distill.teacher={tiny_model_dir(seed=1)}",
        "distill.teacher_prompt=ground_truth",
        "distill.coef=0.5",
        "actor.policy_loss=distill",
    )
    batch = trainer.last_batch
    mask = batch["response_mask"]
    d = (batch["teacher_log_prob"] - batch["old_log_probs"]) * mask
    assert d.abs().sum() > 0
    rewards = batch["token_level_scores"] + 0.5 * d
    assert torch.allclose(batch["token_level_rewards"], rewards, atol=1e-6)
    step = read_metrics(tmp_path / "run")[1]
    assert step["distill/reverse_kl"] == pytest.approx(float(-d.sum() / mask.sum()), abs=1e-5)
    assert step["distill/rejected_teacher_prompts"] == 0


def _async_step(out: Path, *extra: str) -> Learner:
    """One async step (a learner and a sampler in this process, staleness 0) with a
    privileged-prompt teacher; returns the learner after it."""
    cfg = tiny_learner_config(
        out, "data.train_size=8", "data.val_size=0", "trainer.total_steps=1",
        "trainer.save_freq=0", "trainer.test_freq=0", "trainer.val_before_train=false",
        "rollout.max_response_length=8", "reward.num_workers=0",
        f"distill.teacher={tiny_model_dir(seed=1)}", "distill.teacher_prompt=ground_truth",
        "asynchronous.max_staleness=0", *extra,
    )  # fmt: skip
    port = free_port()
    learner = Learner(cfg, port=port)
    train_async_in_process(learner, cfg)
    return learner


def test_async_learner_computes_the_teacher(tmp_path: Path) -> None:
    batch = _async_step(tmp_path / "run").last_batch
    assert all(isinstance(ids, list) and ids for ids in batch["teacher_prompt_ids"])
    mask = batch["response_mask"]
    d = (batch["teacher_log_prob"] - batch["old_log_probs"]) * mask
    assert d.abs().sum() > 0
    expected = batch["token_level_scores"] + d
    assert torch.allclose(batch["token_level_rewards"], expected, atol=1e-6)


def test_sampler_side_teacher_equals_learner_side_teacher(tmp_path: Path) -> None:
    """distill.teacher_on=sampler: the sampler scores the sampled ids under the teacher and
    ships teacher_log_prob (a checked optional log-prob field); the learner, which then builds
    no teacher, skips the stage. Same seed, staleness 0: the same tokens get the same teacher
    log-probs and the same rewards as when the learner computes them."""
    on_learner = _async_step(tmp_path / "learner")
    on_sampler = _async_step(tmp_path / "sampler", "distill.teacher_on=sampler")
    assert on_learner.workers.worker.teacher is not None
    assert on_sampler.workers.worker.teacher is None
    a, b = on_learner.last_batch, on_sampler.last_batch
    assert torch.equal(a["responses"], b["responses"])
    mask = a["response_mask"].bool()
    assert (a["teacher_log_prob"] - a["old_log_probs"])[mask].abs().sum() > 0
    for key in ("teacher_log_prob", "token_level_rewards"):
        assert torch.allclose(a[key][mask], b[key][mask], atol=1e-5), key
    key = "distill/reverse_kl"
    learned = read_metrics(tmp_path / "learner")[1][key]
    assert read_metrics(tmp_path / "sampler")[1][key] == pytest.approx(learned, abs=1e-5)


def test_teacher_log_prob_is_accepted_only_from_a_teacher_on_sampler_run(tmp_path: Path) -> None:
    """The learner accepts teacher_log_prob only with distill.teacher_on=sampler, and checks
    it like ref_log_prob (finite, <= 0)."""
    group = model_group(load_causal_lm(tiny_model_dir()), "s0", 0, 0)
    group["teacher_log_prob"] = group["rollout_log_probs"].clone()
    teacher = f"distill.teacher={tiny_model_dir(seed=1)}"
    with_teacher = GroupReceiver()
    cfg = tiny_learner_config(tmp_path, teacher, "distill.teacher_on=sampler")
    with_teacher.init_receiving(cfg, 10**6, tmp_path / "a")
    with_teacher.limits.check(group, "s0", 0, 0, 0)
    without = GroupReceiver()
    without.init_receiving(tiny_learner_config(tmp_path, teacher), 10**6, tmp_path / "b")
    with pytest.raises(MessageError, match="teacher_log_prob") as refused_group:
        without.limits.check(group, "s0", 0, 0, 0)
    assert refused_group.value.reason == "fields"
    for bad, reason in ((float("nan"), "non_finite"), (0.5, "value")):
        group["teacher_log_prob"][0, 0] = bad
        with pytest.raises(MessageError) as err:
            decode(episodes_message("s0", 0, group))
        assert err.value.reason == reason


def test_agent_loop_observation_tokens_carry_no_distill_term(tmp_path: Path) -> None:
    cfg = load_config(
        overrides=[
            "preset=calculator_agent", f"model.path={tiny_model_dir()}",
            "data.system_prompt=Use the calculator.", "data.train_size=8", "data.val_size=2",
            "data.train_batch_size=2", "data.shuffle=false", "rollout.n=2",
            "rollout.temperature=1.0", "rollout.max_response_length=64",
            "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size=2",
            "actor.autocast=none", "trainer.total_steps=1", "trainer.save_freq=0",
            "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
            f"trainer.output_dir={tmp_path / 'run'}", f"distill.teacher={tiny_model_dir(seed=1)}",
        ]
    )  # fmt: skip
    trainer = RLTrainer(cfg)
    tok = load_tokenizer(tiny_model_dir())
    call = tok.encode(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "3 + 4"}}</tool_call>',
        add_special_tokens=False,
    )
    answer = tok.encode("<answer>7</answer>", add_special_tokens=False)
    eos = tok.eos_token_id
    turns = [[[*call, eos], [*answer, eos]], [[*answer, eos]]] * 2
    rollout = trainer.workers.worker.rollout
    forced = ScriptedTurnGenerator(turns, [eos], trainer.workers.worker.actor.model)
    rollout.turns = rollout.loop.generator = forced
    trainer.fit()
    batch = trainer.last_batch
    mask = batch["response_mask"]
    real = batch["attention_mask"][:, -mask.shape[1] :].bool()
    observation = real & ~mask.bool()
    assert observation[0].any()
    term = batch["token_level_rewards"] - batch["token_level_scores"]
    assert (term[observation] == 0).all()
    assert (term[mask.bool()] != 0).any()


def test_distill_context_preset_hides_the_example_from_the_student_only() -> None:
    cfg = load_config(
        overrides=["preset=distill_context", f"model.path={tiny_model_dir()}",
                   "data.train_size=4", "data.val_size=2"],
    )  # fmt: skip
    assert (cfg.distill.teacher, cfg.actor.policy_loss, cfg.data.few_shot) == ("self", "distill", 0)
    tok = load_tokenizer(tiny_model_dir())
    rows, val = build_datasets(cfg.data, tok, cfg.distill)
    student, teacher = tok.decode(rows[0]["input_ids"]), tok.decode(rows[0]["teacher_prompt_ids"])
    # the student: the question alone; the teacher: a worked exchange, then the same question
    assert student.count("<|im_start|>assistant") == 1
    assert teacher.count("<|im_start|>assistant") == 2
    assert teacher.endswith(student.split("<|im_start|>user")[-1])
    assert "teacher_prompt_ids" not in val[0]


def test_a_runs_checkpoint_teaches(tmp_path: Path) -> None:
    """distill.teacher = a run directory: its newest checkpoint's actor, rebuilt from the run's
    config.yaml, scores the sampled tokens (config load checks its tokenizer through that
    config's model.path)."""
    teacher_run = tmp_path / "teacher"
    # an entropy bonus moves the weights even where every score is equal
    cfg = tiny_trainer_config(
        teacher_run, "trainer.total_steps=1", "trainer.test_freq=0",
        "trainer.val_before_train=false", "actor.entropy_coeff=0.1",
    )  # fmt: skip
    RLTrainer(cfg).fit()
    batch = _train(tmp_path / "student", f"distill.teacher={teacher_run}").last_batch
    mask = batch["response_mask"].bool()
    # the checkpoint is one update away from the student's initial weights: close, not equal
    gap = (batch["teacher_log_prob"] - batch["old_log_probs"])[mask].abs()
    assert 0 < float(gap.max()) < 5
    step_dir = next((teacher_run / "checkpoints").glob("step_*"))
    _train(tmp_path / "student2", f"distill.teacher={step_dir}")

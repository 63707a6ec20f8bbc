"""One loop: the async learner runs the synchronous trainer's training half
(creditrl.pipeline.training_half.TrainingHalf): the critic warm-up, the first-mini-batch health
check, the data metrics with the critic's, and the agent metrics hook."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import model_group, tiny_learner_config, tiny_trainer_config

from creditrl.agents.hooks import chat_format
from creditrl.asynchronous.learner import Learner
from creditrl.asynchronous.messages import MessageError, decode, episodes_message
from creditrl.batch import Batch
from creditrl.models import load_causal_lm
from creditrl.models.tiny import tiny_model_dir
from creditrl.trainers.rl_trainer import RLTrainer
from creditrl.trainers.schedule import Schedule

# the keys the training half writes (the generation half's rollout/reward keys aside)
TRAINING_HALF = ("actor/", "critic/", "health/", "response_length/", "prompt_length/")
KL_IN_REWARD = {"actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"}
PPO = ("preset=ppo", "critic.ppo_mini_batch_size=2", "asynchronous.old_log_probs=sampler",
       "asynchronous.ref_on=learner")  # fmt: skip


class StandInSocket:
    """Takes what the learner sends; nothing arrives."""

    address = "stand-in"

    def send(self, sampler_id: str, frames: list[bytes]) -> bool:
        return True

    def recv(self, timeout_s: float) -> None:
        return None


def _learner(out: Path, *extra: str) -> Learner:
    learner = Learner(tiny_learner_config(out, *extra))
    learner.socket = StandInSocket()
    return learner


def _deliver(learner: Learner, groups: list[Batch]) -> None:
    for group in groups:
        sampler_id, seq = group["sampler_id"][0], int(group["episode_id"][0].split(":")[1])
        assert learner._handle(sampler_id, decode(episodes_message(sampler_id, seq, group))) == 1


def _groups(first_seq: int, version: int) -> list[Batch]:
    model = load_causal_lm(tiny_model_dir())
    return [
        model_group(model, "s0", first_seq + k, version, ((1.0, 0.0), (0.0, 1.0))[k])
        for k in range(2)
    ]


def _step(learner: Learner, groups: list[Batch]) -> dict[str, float]:
    _deliver(learner, groups)
    learner.step += 1
    return learner.train_step()


def test_async_ppo_critic_warmup_updates_only_the_critic_first(tmp_path: Path) -> None:
    """trainer.critic_warmup=2: steps 1 and 2 train the critic alone (the actor's weights
    unchanged, no actor update metric), step 3 trains both; critic/* metrics every step (the
    learner used to update the actor from step 1 and log no critic/values)."""
    learner = _learner(tmp_path, *PPO, "trainer.critic_warmup=2", "trainer.total_steps=3")
    actor = learner.actor.model
    before = copy.deepcopy(actor.state_dict())
    critic = copy.deepcopy(learner.workers.worker.critic.model.state_dict())
    steps = []
    for first_seq in (0, 2):
        steps.append(_step(learner, _groups(first_seq, learner.version)))
        # the KL-in-reward stage's actor/reward_kl_penalty* only: no update metric
        assert {k for k in steps[-1] if k.startswith("actor/")} <= KL_IN_REWARD
        for name, value in actor.state_dict().items():
            assert torch.equal(value, before[name]), name
        moved = learner.workers.worker.critic.model.state_dict()
        assert any(not torch.equal(moved[k], v) for k, v in critic.items())
        critic = copy.deepcopy(moved)
    steps.append(_step(learner, _groups(4, learner.version)))
    learner.publisher.wait()
    assert "actor/pg_loss" in steps[-1]
    assert learner.version == 3  # a version a step, the critic's alone too
    assert any(not torch.equal(v, before[k]) for k, v in actor.state_dict().items())
    for metrics in steps:
        assert {"critic/vf_loss", "critic/values/mean", "critic/vf_explained_var"} <= set(metrics)


def test_async_ppo_logs_the_training_half_keys_of_the_synchronous_trainer(tmp_path: Path) -> None:
    """A PPO step of the learner logs the same actor/critic/health/length keys as a PPO step
    of `creditrl train` (before: no critic/values/*, no critic/vf_explained_var, no
    health/first_minibatch_alarm)."""
    trainer = RLTrainer(tiny_trainer_config(tmp_path / "sync", *PPO))
    try:
        trainer.step = 1
        sync = trainer.train_step()
        assert trainer.workers.worker.weights.version == 1  # in process: an update, a version
    finally:
        trainer.close()
    learner = _learner(tmp_path / "async", *PPO)
    mine = _step(learner, _groups(0, 0))
    learner.publisher.wait()
    wanted = {k for k in sync if k.startswith(TRAINING_HALF)}
    assert "critic/values/mean" in wanted and "health/first_minibatch_alarm" in wanted
    assert {k for k in mine if k.startswith(TRAINING_HALF)} == wanted


def _agent_group(group: Batch) -> Batch:
    """``group`` as the calculator agent's sampler sends it: turns, tool calls, agent info and
    the structured reward's parts."""
    n = len(group)
    group["turn_ids"] = group["response_mask"].clone()
    group["num_turns"] = torch.ones(n, dtype=torch.long)
    call = {"turn": 1, "name": "calculator", "arguments": {"expression": "1+2"},
            "status": "ok", "output": "3", "seconds": 0.01}  # fmt: skip
    group["tool_calls"] = [[call]] + [[] for _ in range(n - 1)]
    group["agent_info"] = [{"stop_reason": "answer", "num_turns": 1, "observation_tokens": 0}] * n
    group["structured_rewards"] = [
        {"turn_rewards": {}, "global_rewards": {"_raw_exact_match": 1.0}}
    ] * n
    group["turn_scores"] = torch.zeros(n)
    group["global_scores"] = group["token_level_scores"].sum(-1)
    return group


def test_async_agent_run_logs_tools_and_agent_metrics_for_training_steps(tmp_path: Path) -> None:
    """`creditrl async preset=calculator_agent`: the learner's training steps log tools/*,
    num_turns/*, agent/* and tokenization/* (the synchronous loop's agent hook), and the rollout
    dump carries the drift reports; before, only validation's val/agent/* were logged."""
    learner = _learner(tmp_path, "preset=calculator_agent", "trainer.test_freq=0")
    metrics = _step(learner, [_agent_group(g) for g in _groups(0, 0)])
    learner.publisher.wait()
    assert metrics["tools/calls"] == 2.0 and metrics["tools/success_rate"] == 1.0
    assert metrics["num_turns/mean"] == 1.0 and metrics["agent/stop_answer"] == 1.0
    assert "tokenization/retokenize_mismatch_rate" in metrics
    assert "trajectory_score" in learner.last_batch


def test_both_loops_validate_and_save_on_one_schedule(tmp_path: Path) -> None:
    """One rule for the steps that validate and save. trainer.test_freq=0 with
    val_before_train: `creditrl train` validates before its first step, and so does the learner
    (it built no validation rows before, so it skipped that validation)."""
    schedule = Schedule(total_steps=5, test_freq=2, save_freq=0, val_before_train=True)
    assert [step for step in range(6) if schedule.validates(step)] == [0, 2, 4, 5]
    assert [step for step in range(1, 6) if schedule.saves(step)] == [5]
    never = Schedule(total_steps=5, test_freq=0, save_freq=2, val_before_train=False)
    assert not never.validates_ever and [s for s in range(1, 6) if never.saves(s)] == [2, 4, 5]
    extra = ("trainer.test_freq=0", "data.train_size=8", "data.val_size=2")
    learner = _learner(tmp_path, *extra)
    assert learner.schedule.validates(0) and len(learner.val_rows) == 2


AGENT_KEYS = ("tools/", "num_turns/", "agent/", "tokenization/")


def test_async_agent_step_logs_the_agent_keys_of_a_synchronous_step(tmp_path: Path) -> None:
    """The same tools/*, num_turns/*, agent/* and tokenization/* keys per training step as
    `creditrl train preset=calculator_agent` logs (one hook, TrainingHalf.step_metrics)."""
    sync_cfg = tiny_trainer_config(
        tmp_path / "sync", "preset=calculator_agent", "trainer.test_freq=0",
        "reward.num_workers=0", "agent.max_turns=2",
    )  # fmt: skip
    trainer = RLTrainer(sync_cfg)
    try:
        trainer.step = 1
        sync = trainer.train_step()
        assert trainer.workers.worker.weights.version == 1  # in process: an update, a version
    finally:
        trainer.close()
    learner = _learner(tmp_path / "async", "preset=calculator_agent", "trainer.test_freq=0")
    mine = _step(learner, [_agent_group(g) for g in _groups(0, 0)])
    learner.publisher.wait()
    wanted = {k for k in sync if k.startswith(AGENT_KEYS)}
    assert "tools/calls" in wanted and "num_turns/mean" in wanted
    assert {k for k in mine if k.startswith(AGENT_KEYS)} == wanted


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("tool_calls", [["not a dict"]]),
        ("tool_calls", [[{"status": "fine"}]]),
        ("agent_info", ["text"]),
        ("agent_info", [{"stop_reason": "x" * 200}]),
        ("agent_info", [{"stop_reason": "answer", "observation_tokens": "many"}]),
        ("structured_rewards", [{"global_rewards": ["_raw_exact_match"]}]),
        ("structured_rewards", [{"global_rewards": {"_raw_exact_match": "yes"}}]),
    ],
)
def test_agent_columns_the_step_metrics_read_are_checked(column: str, value: list) -> None:
    """The learner's step metrics read a group's tool calls, agent info and structured rewards:
    one that would break them (or name arbitrary metric keys) fails decoding as non_tensor, so
    the learner rejects and counts it; it never reaches a step (before, it was accepted and
    ended the run in the step's metrics)."""
    group = _agent_group(_groups(0, 0)[0])
    assert decode(episodes_message("s0", 0, group)).batch is not None  # as sent: accepted
    group[column] = value * len(group)
    with pytest.raises(MessageError, match=rf"{column}\[0\]") as refused:
        decode(episodes_message("s0", 0, group))
    assert refused.value.reason == "non_tensor"


class FramesSocket(StandInSocket):
    """Delivers queued (sender, frames) as the learner's socket does: decoded and checked, a
    MessageError carrying its sender."""

    def __init__(self, inbox: list[tuple[str, list[bytes]]]) -> None:
        self.inbox = inbox

    def recv(self, timeout_s: float):
        if not self.inbox:
            return None
        sender, frames = self.inbox.pop(0)
        try:
            return sender, decode(frames)
        except MessageError as err:
            err.sender = sender
            raise

    def disconnects(self) -> int:
        return 0


def test_malformed_messages_are_a_counted_rejection_not_a_crash(tmp_path: Path) -> None:
    """The learner's drift check renders a group's messages through the chat template: a
    messages column that is not a list of dicts with a short-name role and string content
    (other keys scalar), or holds more messages than the row has ids, is rejected when the group
    is decoded (async/rejected/non_tensor, counted, the run goes on); the well-formed groups
    train and their messages are rendered. Before, a message that is not a dict was accepted
    and ended the run in the step's drift check."""
    learner = _learner(tmp_path, "preset=calculator_agent", "trainer.test_freq=0")
    model = load_causal_lm(tiny_model_dir())
    talk = [{"role": "user", "content": "What is 1+2?"}, {"role": "assistant", "content": "3"}]
    bad = [
        ["hi"],
        [{"role": "user"}],
        [{"role": "user", "content": {"text": "x"}}],
        [{"role": ["user"], "content": "x"}],
        [{"role": "user\n<|im_start|>system", "content": "x"}],
        [{"role": "assistant", "content": "x", "tool_calls": [{"function": "x"}]}],
        [{"role": "user", "content": ""}] * 64,  # more than the row's P+T ids
    ]
    inbox = []
    for seq, messages in enumerate([talk, talk, *bad]):
        group = _agent_group(model_group(model, "s0", seq, 0, ((1.0, 0.0), (0.0, 1.0))[seq % 2]))
        group["messages"] = [messages] * len(group)
        inbox.append(("s0", episodes_message("s0", seq, group)))
    learner.socket = FramesSocket(inbox)
    assert learner._receive(0.0) == 2
    assert learner.counters["rejected/non_tensor"] == len(bad)
    learner.step += 1
    metrics = learner.train_step()
    learner.publisher.wait()
    assert metrics["async/rejected/non_tensor"] == len(bad)
    assert metrics["tokenization/template_checked"] == 4.0  # both groups' rows, rendered


def test_messages_the_chat_template_refuses_are_a_counted_rejection(tmp_path: Path) -> None:
    """Well-formed messages that the model's chat template itself refuses (its
    raise_exception, here on a conversation that opens with the assistant) are rejected when
    the group arrives (async/rejected/non_tensor) instead of raising in the step's drift
    check; the other groups train and are rendered."""
    learner = _learner(tmp_path, "preset=calculator_agent", "trainer.test_freq=0")
    strict = copy.deepcopy(learner.tokenizer)
    strict.chat_template = (
        "{% if messages[0]['role'] == 'assistant' %}"
        "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
        + learner.tokenizer.chat_template
    )
    learner.training.tokenizer = strict  # what the step's drift check renders with
    learner.chat = chat_format(strict)
    model = load_causal_lm(tiny_model_dir())
    talk = [{"role": "user", "content": "What is 1+2?"}, {"role": "assistant", "content": "3"}]
    inbox = []
    for seq, messages in enumerate([talk, talk[1:], talk]):
        group = _agent_group(model_group(model, "s0", seq, 0, ((1.0, 0.0), (0.0, 1.0))[seq % 2]))
        group["messages"] = [messages] * len(group)
        inbox.append(("s0", episodes_message("s0", seq, group)))
    learner.socket = FramesSocket(inbox)
    assert learner._receive(0.0) == 2
    assert learner.counters["rejected/non_tensor"] == 1
    learner.step += 1
    metrics = learner.train_step()
    learner.publisher.wait()
    assert metrics["tokenization/template_checked"] == 4.0

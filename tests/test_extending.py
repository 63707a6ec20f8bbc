"""docs/architecture.md, "Extending creditrl": an estimator, a policy loss, a rollout engine, a
tool and a reward scorer, each registered from this test module through the public registries
and selected by its config key, then used by one training step on the tiny model. Every test
asserts something the built-in in its place would not produce. The registries are restored
after each test, so nothing leaks into other test modules."""

import json
import threading
from pathlib import Path

import pytest
import torch
from helpers import read_metrics, tiny_trainer_config

from creditrl.agents.scripted import ScriptedTurnGenerator
from creditrl.config.loader import load_config
from creditrl.core import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    compute_gae_advantage_return,
    compute_policy_loss_ppo,
    register_adv_est,
    register_policy_loss,
)
from creditrl.models import load_tokenizer
from creditrl.models.tiny import tiny_model_dir
from creditrl.pipeline import Plan
from creditrl.rewards import SCORERS, register_scorer
from creditrl.rewards.text import decode_responses
from creditrl.rollout import ROLLOUT_ENGINES, HFRolloutEngine, register_rollout_engine
from creditrl.trainers.rl_trainer import RLTrainer

ONE_STEP = ("trainer.total_steps=1", "trainer.val_before_train=false", "trainer.test_freq=0")


@pytest.fixture(autouse=True)
def registries(monkeypatch: pytest.MonkeyPatch):
    """Every registry as it was before the test, afterwards."""
    for registry in (ADV_ESTIMATORS, POLICY_LOSSES, ROLLOUT_ENGINES):
        monkeypatch.setattr(registry, "_items", dict(registry._items))
        monkeypatch.setattr(registry, "_info", dict(registry._info))
    saved = dict(SCORERS)
    yield
    SCORERS.clear()
    SCORERS.update(saved)


def test_a_registered_estimator_that_requires_values_gets_a_critic(tmp_path: Path) -> None:
    """An estimator declaring ``requires=("values",)`` makes the run build and train a critic:
    the estimator receives the critic's values, and the critic's loss is in the metrics."""
    received: list[torch.Tensor] = []

    @register_adv_est("my_gae_like", requires=("values",), options=("gamma", "lam"))
    def my_gae_like(token_level_rewards, response_mask, index=None, *, values=None, **options):
        if values is None:
            raise AssertionError("my_gae_like requires values, but no critic computed them")
        received.append(values.clone())
        return compute_gae_advantage_return(
            token_level_rewards, values, response_mask, options["gamma"], options["lam"]
        )

    cfg = tiny_trainer_config(tmp_path, "algorithm.adv_estimator=my_gae_like", *ONE_STEP)
    assert Plan.from_config(cfg).needs_critic
    trainer = RLTrainer(cfg)
    trainer.fit()
    assert len(received) == 1
    torch.testing.assert_close(received[0], trainer.last_batch["values"])
    assert "critic/vf_loss" in read_metrics(tmp_path)[1]


def test_a_registered_policy_loss_is_the_one_the_actor_optimises(tmp_path: Path) -> None:
    """``actor.policy_loss`` selects a loss registered here: every micro-batch's loss comes
    from it, and what it adds to the PPO loss shows in ``actor/pg_loss``."""
    calls: list[tuple[int, ...]] = []
    offset = 7.0

    @register_policy_loss("ppo_plus_seven")
    def ppo_plus_seven(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
        config=None, rollout_is_weights=None, **agg_kwargs,
    ):  # fmt: skip
        calls.append(tuple(log_prob.shape))
        loss, metrics = compute_policy_loss_ppo(
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
            rollout_is_weights, **agg_kwargs,
        )  # fmt: skip
        return loss + offset, metrics

    cfg = tiny_trainer_config(tmp_path, "actor.policy_loss=ppo_plus_seven", *ONE_STEP)
    RLTrainer(cfg).fit()
    # 2 prompts x n=2, mini-batches of 1 prompt (2 trajectories), micro-batches of 2: 2 calls
    assert len(calls) == 2 and all(shape[0] == 2 for shape in calls)
    assert read_metrics(tmp_path)[1]["actor/pg_loss"] > offset - 1.0


def test_a_registered_rollout_engine_generates_the_step(tmp_path: Path) -> None:
    """``rollout.engine`` selects an engine registered here: the step's responses come from
    its ``generate``, and what it adds to the batch reaches the trained batch."""
    prompts_seen: list[int] = []

    @register_rollout_engine("tagged_hf")
    class TaggedEngine(HFRolloutEngine):
        def generate(self, prompts, **kwargs):
            prompts_seen.append(len(prompts))
            batch = super().generate(prompts, **kwargs)
            batch["engine_tag"] = ["tagged_hf"] * len(batch)
            return batch

    cfg = tiny_trainer_config(tmp_path, "rollout.engine=tagged_hf", *ONE_STEP)
    trainer = RLTrainer(cfg)
    trainer.fit()
    assert sum(prompts_seen) == 4
    assert list(trainer.last_batch["engine_tag"]) == ["tagged_hf"] * 4


def test_a_registered_scorer_selected_by_reward_scorer_scores_the_step(tmp_path: Path) -> None:
    """``reward.scorer`` names a scorer registered here: the step's sequence scores are its
    values on the decoded responses (0.25 or 0.75; the task's own scorer gives 0 or 1)."""

    @register_scorer("length_parity")
    def length_parity(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return 0.25 + 0.5 * (len(solution_str) % 2)

    cfg = tiny_trainer_config(
        tmp_path, "reward.scorer=length_parity", "reward.num_workers=0", *ONE_STEP
    )
    trainer = RLTrainer(cfg)
    trainer.fit()
    batch = trainer.last_batch
    texts = decode_responses(batch, trainer.tokenizer)
    expected = torch.tensor([0.25 + 0.5 * (len(text) % 2) for text in texts])
    torch.testing.assert_close(batch["token_level_scores"].sum(-1), expected)
    assert read_metrics(tmp_path)[1]["reward/score_min"] >= 0.25


WORD_COUNT_CALLS: list[str] = []
_calls_lock = threading.Lock()


def word_count(text: str) -> str:
    """Count the words in a text.

    Args:
        text: the text whose words are counted
    """
    with _calls_lock:
        WORD_COUNT_CALLS.append(text)
    return f"{len(text.split())} words"


def test_a_tool_from_the_tool_config_is_called_by_the_agent_loop(tmp_path: Path) -> None:
    """A tool defined in this module and listed in ``agent.tool_config`` is in the agent's
    tool registry; a turn that calls it gets its output as the observation."""
    WORD_COUNT_CALLS.clear()
    tools = tmp_path / "tools.yaml"
    tools.write_text(
        f"tools:\n  - name: calculator\n  - name: word_count\n    function: {__name__}:word_count\n"
    )
    out = tmp_path / "run"
    cfg = load_config(
        overrides=[
            "preset=calculator_agent",
            f"agent.tool_config={tools}",
            f"model.path={tiny_model_dir()}",
            "data.train_size=8",
            "data.val_size=2",
            "data.train_batch_size=2",
            "rollout.n=2",
            "rollout.temperature=1.0",
            "rollout.max_response_length=64",
            "actor.ppo_mini_batch_size=1",
            "actor.ppo_micro_batch_size=2",
            "trainer.logger=[jsonl]",
            f"trainer.output_dir={out}",
            *ONE_STEP,
        ]
    )
    trainer = RLTrainer(cfg)
    rollout = trainer.workers.worker.rollout
    assert set(rollout.tools.names()) == {"calculator", "word_count"}
    tok = load_tokenizer(tiny_model_dir())
    call = tok.encode(
        '<tool_call>{"name": "word_count", "arguments": {"text": "one two three"}}</tool_call>',
        add_special_tokens=False,
    )
    answer = tok.encode("<answer>3</answer>", add_special_tokens=False)
    script = [[*call, tok.eos_token_id], [*answer, tok.eos_token_id]]
    forced = ScriptedTurnGenerator([script] * 4, [tok.eos_token_id])
    rollout.turns = rollout.loop.generator = forced
    trainer.fit()

    assert WORD_COUNT_CALLS == ["one two three"] * 4
    step = read_metrics(out)[1]
    assert (step["tools/calls"], step["tools/errors"]) == (4, 0)
    dump = [json.loads(line) for line in (out / "rollouts" / "step_000001.jsonl").open()]
    record = dump[0]["reward_extra"]["tool_calls"][0]
    assert (record["name"], record["output"]) == ("word_count", "3 words")

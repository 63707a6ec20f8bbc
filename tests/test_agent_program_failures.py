"""agent.program episodes that fail, block or misbehave, and the endpoint under abuse: every
failure is a scored, counted episode, never the end of a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_engine_config

from creditrl.agents.loop import Trajectory
from creditrl.agents.rewards import StructuredRewardManager
from creditrl.agents.rollout import trajectories_to_batch
from creditrl.batch import Batch
from creditrl.config.schema import AgentConfig, AlgorithmConfig, RewardConfig
from creditrl.pipeline import stages
from creditrl.trainers.rl_trainer import RLTrainer

PROGRAMS = Path(__file__).parent / "programs" / "agents.py"


def program_config(tmp_path: Path, name: str, *extra: str):
    return tiny_engine_config(
        tmp_path, "agent.enable=true", f"agent.program={PROGRAMS}:{name}",
        "rollout.max_response_length=24", "reward.num_workers=0", "reward.fallback_score=-1",
        *extra,
    )  # fmt: skip


def metric_rows(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "name,status,extra",
    [
        ("raises_first", "error", ()),
        ("long_first_request", "error", ()),
    ],
)
def test_an_episode_without_a_model_turn_trains_scored_the_fallback(
    tmp_path: Path, name: str, status: str, extra: tuple[str, ...]
) -> None:
    """A program that raises before its first call, or whose first request is refused as
    longer than data.max_prompt_length (e.g. an OpenAI tools block): the step and the validation
    run, every episode counted by its status and scored reward.fallback_score."""
    cfg = program_config(tmp_path, name, "trainer.total_steps=1", "trainer.test_freq=1", *extra)
    RLTrainer(cfg).fit()
    rows = metric_rows(tmp_path)
    step = next(r for r in rows if r.get("step") == 1 and "critic/score/mean" in r)
    assert step[f"agent/episodes_{status}"] == 4 and step["critic/score/mean"] == -1.0
    val = next(r for r in rows if f"val/agent/episodes_{status}" in r)
    assert val[f"val/agent/episodes_{status}"] == 2 and val["val/score"] == -1.0


def test_the_refusal_of_a_long_first_request_names_the_key_to_raise(tmp_path: Path) -> None:
    from creditrl.workers.hybrid import HybridWorker

    w = HybridWorker(program_config(tmp_path, "long_first_request"))
    try:
        batch = w.rollout.generate(_prompts(w), seed=1)
    finally:
        w.rollout.close()
    error = batch["agent_info"][0]["episode_error"]
    assert "more than data.max_prompt_length=256" in error
    assert "raise data.max_prompt_length" in error
    assert batch["num_turns"].tolist() == [0, 0]


def _prompts(worker) -> Batch:
    tok = worker.tokenizer
    chat = [{"role": "user", "content": "What is 3 + 4?"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    batch = Batch({"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids),
                  dtype=torch.long)}, {"raw_prompt": [chat], "data_source": ["toy"],
                  "ground_truth": ["7"]})  # fmt: skip
    return batch.repeat(2, interleave=True)


def test_an_empty_trajectory_is_scored_counted_and_never_trained_on() -> None:
    """The placeholder of an episode with no model turn carries its score through the KL stage
    (exactly: its log-probs are made equal) and GRPO (its group sees it), then leaves every
    mask the updates read."""
    ok = Trajectory(prompt_ids=[1, 2], num_turns=1)
    ok.append([5, 6, 7], 1, 1, [-0.1, -0.2, -0.3])
    empty = Trajectory(prompt_ids=[1, 2])
    prompts = Batch({"input_ids": torch.tensor([[1, 2], [1, 2]]),
                     "attention_mask": torch.ones(2, 2, dtype=torch.long)}, {})  # fmt: skip
    batch = trajectories_to_batch(prompts, [empty, ok], pad_token_id=0)
    assert batch["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert batch["num_turns"].tolist() == [0, 1]
    assert stages.score_only_rows(batch).tolist() == [True, False]
    batch["uid"] = ["g", "g"]
    batch["token_level_scores"] = torch.tensor([[-1.0, 0, 0], [0, 0, 1.0]])
    torch.manual_seed(0)
    batch["old_log_probs"] = torch.randn(2, 3)
    batch["ref_log_prob"] = torch.randn(2, 3)
    stages.neutral_score_only_rows(batch)
    alg = AlgorithmConfig(adv_estimator="grpo", use_kl_in_reward=True)
    stages.kl_into_rewards(batch, alg, 0.5)
    assert batch["token_level_rewards"][0].tolist() == [-1.0, 0.0, 0.0]
    assert batch["rollout_log_probs"][0].tolist() == batch["old_log_probs"][0].tolist()
    stages.compute_advantages(batch, alg)
    assert (batch["advantages"][1] > 0).all()  # better than the failed episode of its group
    stages.mask_score_only_rows(batch)
    assert batch["response_mask"][0].eq(0).all() and batch["advantages"][0].eq(0).all()
    assert batch["response_mask"][1].eq(1).all()


def test_the_built_in_loop_scores_an_empty_first_turn(tok) -> None:
    """The built-in agent loop: an engine that returns nothing for the first prompt gives an
    empty trajectory, which the structured reward manager scores like any other."""
    from creditrl.agents.rollout import AgentRollout
    from creditrl.agents.scripted import ScriptedTurnGenerator
    from creditrl.config.schema import RolloutConfig
    from creditrl.data import chat_prompt_ids, collate_prompts

    eos = tok.eos_token_id
    answer = [*tok.encode("<answer>84</answer>", add_special_tokens=False), eos]
    generator = ScriptedTurnGenerator([[[]], [answer]], [eos])
    cfg, budget = AgentConfig(enable=True), RolloutConfig(max_response_length=32)
    rollout = AgentRollout(None, tok, cfg, budget, turn_generator=generator)
    messages = [{"role": "user", "content": "12*7?"}]
    row = {"input_ids": chat_prompt_ids(tok, messages), "raw_prompt": messages,
           "ground_truth": "84", "data_source": "calc_multiturn", "extra_info": {},
           "index": 0}  # fmt: skip
    batch = rollout.generate(collate_prompts([row, row], tok.pad_token_id))
    assert batch["num_turns"].tolist() == [0, 1]
    StructuredRewardManager(RewardConfig(), AgentConfig(), tok).submit(batch).result().write_to(
        batch
    )
    assert batch["token_level_scores"].shape == batch["response_mask"].shape
    assert rollout.last_metrics["agent/stop_no_call"] == 0.5


@pytest.fixture(scope="module")
def tok():
    from creditrl.models import load_tokenizer
    from creditrl.models.tiny import tiny_model_dir

    return load_tokenizer(tiny_model_dir())

"""The calculator agent recipe: the tool-use outcome metrics (``agent/called_tool``,
``agent/tool_then_correct``) on hand-built trajectories, and the preset and prompt that the
demo trains with."""

import re

import pytest
import torch

from creditrl.agents.rewards import StructuredRewardManager, tool_use_metrics
from creditrl.agents.tasks import CALC_SHOT, CALC_SHOTS, calc_rows, calc_shots
from creditrl.batch import Batch
from creditrl.config.loader import load_config
from creditrl.config.schema import AgentConfig, RewardConfig
from creditrl.models import load_tokenizer
from creditrl.models.tiny import tiny_model_dir

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'


def _record(status: str = "ok", turn: int = 1) -> dict:
    return {"turn": turn, "name": "calculator", "status": status, "output": "84"}


def _trajectories() -> tuple[list[list[dict]], list[list[dict]], list[str]]:
    """(tool-call records, turns, final answers) of 4 trajectories for "12*7?" (gold 84):
    tool then right, tool then wrong, no tool but right, a failed call then right."""
    calls = [[_record()], [_record()], [], [_record("error")]]
    answers = ["84", "85", "84", "84"]
    turns = []
    for records, answer in zip(calls, answers, strict=True):
        first = [{"turn": 1, "text": CALL, "answer": None}] if records else []
        last = {"turn": len(first) + 1, "text": f"<answer>{answer}</answer>", "answer": answer}
        turns.append([*first, last])
    return calls, turns, answers


def _batch(tool_calls: list, turns: list) -> Batch:
    size = len(tool_calls)
    return Batch(
        {
            "responses": torch.full((size, 4), 11),
            "response_mask": torch.ones(size, 4, dtype=torch.long),
            "turn_ids": torch.ones(size, 4, dtype=torch.long),
        },
        {
            "data_source": ["calc_multiturn"] * size,
            "ground_truth": ["84"] * size,
            "tool_calls": tool_calls,
            "agent_info": [{"turns": t, "stop_reason": "answer"} for t in turns],
        },
    )


def test_tool_use_metrics_on_hand_built_rewards() -> None:
    calls, _, _ = _trajectories()
    exact = [{"_raw_exact_match": v} for v in (1.0, 0.0, 1.0, 1.0)]
    metrics, per_sample = tool_use_metrics(calls, exact)
    # 2 of 4 made a successful call (the error does not count); 1 of those answered 84
    assert metrics == {"agent/called_tool": 0.5, "agent/tool_then_correct": 0.25}
    assert per_sample == {
        "called_tool": [1.0, 1.0, 0.0, 0.0],
        "tool_then_correct": [1.0, 0.0, 0.0, 0.0],
    }
    # a scorer without an exact-match component: only the call share
    metrics, per_sample = tool_use_metrics(calls, [{"score": 1.0}] * 4)
    assert metrics == {"agent/called_tool": 0.5} and set(per_sample) == {"called_tool"}
    assert tool_use_metrics([], [])[0] == {"agent/called_tool": 0.0}


def test_structured_manager_reports_tool_then_correct() -> None:
    tok = load_tokenizer(tiny_model_dir())
    calls, turns, _ = _trajectories()
    batch = _batch(calls, turns)
    manager = StructuredRewardManager(RewardConfig(), AgentConfig(), tok)
    result = manager.submit(batch).result()
    assert result.metrics["agent/called_tool"] == 0.5
    assert result.metrics["agent/tool_then_correct"] == 0.25
    assert result.metrics["reward/_raw_exact_match_mean"] == 0.75
    result.write_to(batch)
    info = batch["reward_extra_info"]
    assert [info[i]["tool_then_correct"] for i in range(4)] == [1.0, 0.0, 0.0, 0.0]
    assert [info[i]["called_tool"] for i in range(4)] == [1.0, 1.0, 0.0, 0.0]


def test_calculator_preset_recipe_and_prompt() -> None:
    cfg = load_config(overrides=["preset=calculator_agent"])
    assert cfg.agent.enable and cfg.agent.tools == ["calculator"]
    assert cfg.data.task == "calc_multiturn" and "few_shot" not in cfg.data.task_kwargs
    assert cfg.rollout.val_temperature == 0.0
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.optim.lr) == (2, 8, 2e-5)
    train, val = calc_rows(dict(cfg.data.task_kwargs), 4, 2, 0, "SYS")
    assert (len(train), len(val)) == (4, 2)
    messages = train[0].messages
    assert messages[0] == {"role": "system", "content": "SYS"}
    # one worked example, CALC_SHOT, then the question
    assert messages[1:5] == CALC_SHOT
    assert messages[5]["role"] == "user" and messages[5]["content"].startswith("What is ")
    assert len(messages) == 6


@pytest.mark.parametrize(
    "few_shot,roles",
    [
        (False, ["system", "user"]),
        (True, ["system", "user", "assistant", "tool", "assistant", "user"]),
        (1, ["system", "user", "assistant", "tool", "assistant", "user"]),
        (2, ["system", *["user", "assistant", "tool", "assistant"] * 2, "user"]),
    ],
)
def test_few_shot_counts(few_shot: bool | int, roles: list[str]) -> None:
    shown = (len(roles) - 2) // 4  # each example is user, assistant, tool, assistant
    assert calc_shots(few_shot) == [m for shot in CALC_SHOTS[2 - shown :] for m in shot]
    train, _ = calc_rows({"few_shot": few_shot}, 2, 1, 0, "SYS")
    assert [m["role"] for m in train[0].messages] == roles
    if few_shot:
        assert train[0].messages[-5:-1] == CALC_SHOT
    with pytest.raises(ValueError, match=r"few_shot must be 0\.\.2"):
        calc_shots(3)


@pytest.mark.parametrize("few_shot", [True, False])
def test_calc_rows_keep_the_question_and_answer(few_shot: bool) -> None:
    kwargs = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    train, _ = calc_rows({**kwargs, "few_shot": few_shot}, 3, 1, 0, "SYS")
    for row in train:
        question = row.messages[-1]["content"].removeprefix("What is ").removesuffix("?")
        terms = re.findall(r"([+-]?)\s*(\d+)", question)
        assert int(row.ground_truth) == sum(int(sign + digits) for sign, digits in terms)
        assert row.data_source == "calc_multiturn"


def test_calc_rows_ask_another_source_tasks_expression() -> None:
    """``source: products`` asks reasoning-gym's 3-digit products as "What is a * b?", with
    their product as the ground truth; a source without expressions is refused."""
    kwargs = {"source": "products", "min_terms": 2, "max_terms": 2, "min_digits": 3,
              "max_digits": 3, "few_shot": 1}  # fmt: skip
    train, val = calc_rows(kwargs, 4, 2, 0, "SYS")
    for row in [*train, *val]:
        a, b = re.fullmatch(r"What is (\d{3}) \* (\d{3})\?", row.messages[-1]["content"]).groups()
        assert int(row.ground_truth) == int(a) * int(b)
        assert row.data_source == "calc_multiturn"
    with pytest.raises(ValueError, match="carry no expression"):
        calc_rows({"source": "leg_counting", "few_shot": 0}, 2, 1, 0, "SYS")


def test_calculator_hard_pays_only_a_correct_final_answer() -> None:
    """preset=calculator_hard's reward is outcome only: the four hand-built trajectories (tool
    then right, tool then wrong, no tool but right, failed call then right) score 1, 0, 1, 1;
    the calculator_agent weights pay the tool and the format on top."""
    tok = load_tokenizer(tiny_model_dir())
    calls, turns, _ = _trajectories()
    hard = load_config(overrides=["preset=calculator_hard"])
    assert hard.data.task_kwargs["source"] == "products"
    assert hard.data.task_kwargs["min_digits"] == hard.data.task_kwargs["max_digits"] == 3
    agent = load_config(overrides=["preset=calculator_agent"])
    totals = {}
    for name, cfg in (("hard", hard), ("agent", agent)):
        manager = StructuredRewardManager(cfg.reward, cfg.agent, tok)
        totals[name] = manager.submit(_batch(calls, turns)).result().scores.tolist()
    assert totals["hard"] == [1.0, 0.0, 1.0, 1.0]
    assert totals["agent"][0] > totals["agent"][2] > 1.0  # tool use and format pay there

"""Scoring is bounded: answer search is linear in the text and looks at its tail only, and a
built-in scorer stuck in C code (sympy holding the GIL) is stopped by reward.timeout_s even with
reward.num_workers=0."""

from __future__ import annotations

import itertools
import re
import threading

import pytest
from helpers import byte_tokenizer, make_batch

from creditrl.agents.parsing import parse_tool_calls
from creditrl.agents.task_rewards import AgentSample, calc_structured_reward
from creditrl.config.schema import RewardConfig
from creditrl.rewards.manager import RewardManager
from creditrl.rewards.registry import SCORERS, register_scorer
from creditrl.rewards.scorers import (
    ANSWER_SEARCH_CHARS,
    answer_format_ok,
    extract_answer,
    gsm8k_score,
    reasoning_gym_score,
    tag_blocks,
    think_answer_format_ok,
)

RESPONSE_CHARS = 240_000


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.mark.parametrize(
    "text",
    [
        "<answer>" * (RESPONSE_CHARS // 8),
        "<think>" + "</think><answer>" * (RESPONSE_CHARS // 16),
        "<think>" + "x" * RESPONSE_CHARS + "</think> <answer>7</answer>",
    ],
    ids=["unclosed_answers", "repeated_tags", "long_think"],
)
def test_gsm8k_on_a_240kb_response(text: str) -> None:
    """Each of these held the GIL for ~35 s in a backtracking regex; str search is linear."""
    result = gsm8k_score("gsm8k", text, "7")
    if text.endswith("</answer>"):
        assert result == {
            "score": 2.25,
            "format_score": 1.25,
            "answer_score": 1.0,
            "extracted_answer": "7",
        }
    else:
        assert result == {
            "score": 0.0,
            "format_score": 0.0,
            "answer_score": 0.0,
            "extracted_answer": None,
        }


def test_answer_search_looks_at_the_tail_only() -> None:
    assert extract_answer("<answer>5</answer>" + "x" * ANSWER_SEARCH_CHARS) is None
    assert extract_answer("y" * RESPONSE_CHARS + "<answer> 5 </answer>") == "5"
    text = "3 " * (RESPONSE_CHARS // 2) + "so 41."
    result = reasoning_gym_score("reasoning_gym/chain_sum", text, "41")
    assert result["extracted_answer"] == "41" and result["answer_score"] == 1.0


def test_format_checks_match_the_documented_regexes() -> None:
    """The str-search checks agree with the regexes they replaced on every short tag mix."""
    think_answer = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL)
    answer_only = re.compile(r"^.*?<answer>.*?</answer>$", re.DOTALL)

    def one_each(text: str, *tags: str) -> bool:
        return all(text.count(f"<{t}>") == 1 and text.count(f"</{t}>") == 1 for t in tags)

    pieces = ["<think>", "</think>", "<answer>", "</answer>", "a", " ", "\n"]
    for n in range(1, 6):
        for parts in itertools.product(pieces, repeat=n):
            text = "".join(parts)
            stripped = text.strip()
            assert think_answer_format_ok(text) == (
                bool(think_answer.match(stripped)) and one_each(stripped, "think", "answer")
            ), text
            assert answer_format_ok(text) == (
                bool(answer_only.match(stripped)) and one_each(stripped, "answer")
            ), text
            found = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
            assert tag_blocks(text, "<answer>", "</answer>") == found, text


def test_tool_calls_and_structured_reward_on_a_240kb_turn() -> None:
    text = "<tool_call>" * (RESPONSE_CHARS // 11)
    calls = parse_tool_calls(text)
    assert len(calls) == 1 and calls[0].error == "<tool_call> is never closed by </tool_call>"
    sample = AgentSample(
        "calculator",
        "4",
        turns=[{"turn": 0, "text": "<answer>" * (RESPONSE_CHARS // 8), "answer": None}],
        tool_calls=[],
    )
    result = calc_structured_reward(sample)
    assert result["components"] == {
        0: {"format_score": 0.0, "validity": 0.0, "is_answer_score": 0.0}
    }
    assert result["global_rewards"]["exact_match"] == 0.0


def _score_guarded(manager: RewardManager, batch, guard_s: float = 120.0):
    """``manager(batch)`` on a thread; fails the test (rather than hanging it) after guard_s."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = manager(batch)
        except BaseException as e:  # reported below
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(guard_s)
    assert not thread.is_alive(), f"scoring did not return within {guard_s}s"
    if "error" in out:
        raise out["error"]
    return out["result"]


def test_math_power_tower_times_out_with_num_workers_0(tok) -> None:
    """sympy computing 9^(9^(9^9)) holds the GIL: with num_workers=0 the built-in math scorer
    runs in a worker process, killed at reward.timeout_s; the other samples still score."""
    cfg = RewardConfig(num_workers=0, timeout_s=3.0, fallback_score=-1.0, max_failure_rate=1.0)
    texts = ["<answer>$9^{9^{9^{9}}}$</answer>", "<answer>$\\frac{1}{2}$</answer>"]
    batch = make_batch(tok, texts, ["1", "0.5"], "math")
    with RewardManager(cfg, tok) as manager:
        result = _score_guarded(manager, batch)
        assert result.extra["reward_status"] == ["timeout", "ok"]
        assert result.scores.tolist() == [-1.0, 1.0]
        assert "killed" in result.extra["reward_error"][0]
        assert result.metrics["reward/timeouts"] == 1.0
        again = _score_guarded(manager, make_batch(tok, ["<answer>2</answer>"], ["2"], "math"))
        assert again.extra["reward_status"] == ["ok"] and again.scores.tolist() == [1.0]


def test_num_workers_0_keeps_user_scorers_in_this_process(tok) -> None:
    """A registered user scorer (a closure here) still runs in this process with num_workers=0,
    next to built-in scorers that run in the worker."""
    seen: list[str] = []

    @register_scorer("closure")
    def closure(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(solution_str)
        return 3.0

    try:
        batch = make_batch(
            tok, ["abc", "<think>t</think><answer>8</answer>"], [0, "8"], ["closure", "gsm8k"]
        )
        with RewardManager(RewardConfig(num_workers=0), tok) as manager:
            result = _score_guarded(manager, batch)
        assert result.scores.tolist() == [3.0, 2.25] and seen == ["abc"]
    finally:
        del SCORERS["closure"]

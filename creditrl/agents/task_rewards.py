"""Structured rewards of the demo tasks (spec 001): per-turn components and global components.

A structured scorer gets an ``AgentSample`` (the trajectory as text: turns, tool-call records,
ground truth) and returns ``{"turn_rewards": {turn: r}, "global_rewards": {name: r}}`` plus
``"components"``, the unweighted per-turn values for logs. Keys of ``global_rewards`` starting
with ``_`` are logged only (spec 001's ``_raw_*``).

Per turn k (shared by both tasks), each in [0, 1] before weighting:

- ``format_score``: the turn is well formed: one or more tool calls that all parse and no
  answer, or one ``<answer>`` block and no tool call;
- ``kg_query_validity`` (KGQA) / ``tool_validity`` (calculator): the fraction of the turn's calls
  that ran without error (KGQA: and returned at least one fact); 0 for a turn without calls;
- ``is_answer_score``: the turn is the last one and holds an answer.

turn_reward_k = sum of weight x component. Globals: ``exact_match`` (the final answer equals a
gold answer after normalisation), KGQA ``retrieval_quality`` (a gold answer appears in a
successful lookup's output: the policy retrieved the fact), calculator ``tool_use`` (at least
one successful calculator call). Spec 001's default weights are ``KGQA_WEIGHTS``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from creditrl.agents.parsing import extract_answer, parse_tool_calls
from creditrl.rewards.scorers import tag_blocks
from creditrl.tools.kg_lookup import normalize_entity

__all__ = [
    "CALC_WEIGHTS",
    "KGQA_WEIGHTS",
    "AgentSample",
    "calc_structured_reward",
    "kgqa_structured_reward",
    "turn_components",
]

KGQA_WEIGHTS = {
    "kg_query_validity": 0.1,
    "is_answer_score": 0.1,
    "format_score": 0.15,
    "exact_match": 0.3,
    "retrieval_quality": 0.4,
}
CALC_WEIGHTS = {
    "tool_validity": 0.1,
    "is_answer_score": 0.1,
    "format_score": 0.15,
    "exact_match": 1.0,
    "tool_use": 0.2,
}


@dataclass
class AgentSample:
    """One trajectory as text, for structured scorers."""

    data_source: str
    ground_truth: Any
    turns: list[dict[str, Any]]
    tool_calls: list[dict[str, Any]]
    extra_info: dict[str, Any] = field(default_factory=dict)
    stop_reason: str = ""

    @property
    def final_answer(self) -> str | None:
        """The answer of the last turn, if it gave one."""
        return self.turns[-1].get("answer") if self.turns else None


def _format_ok(text: str) -> bool:
    calls = parse_tool_calls(text)
    answers = len(tag_blocks(text, "<answer>", "</answer>"))
    if calls:
        return all(c.ok for c in calls) and answers == 0
    return answers == 1


def turn_components(
    sample: AgentSample, tool: str, need_results: bool = False
) -> dict[int, dict[str, float]]:
    """{turn: {"format_score", "validity", "is_answer_score"}} for every turn (see module doc).

    ``validity`` counts calls of ``tool`` with status ok (and, with ``need_results``, output
    that is not a "No facts found" reply) over all of the turn's executed calls.
    """
    out = {}
    last = sample.turns[-1]["turn"] if sample.turns else 0
    for turn in sample.turns:
        k = int(turn["turn"])
        records = [c for c in sample.tool_calls if int(c["turn"]) == k]
        good = [
            c
            for c in records
            if c["status"] == "ok"
            and c["name"] == tool
            and not (need_results and str(c["output"]).startswith("No facts found"))
        ]
        out[k] = {
            "format_score": float(_format_ok(turn["text"])),
            "validity": len(good) / len(records) if records else 0.0,
            "is_answer_score": float(k == last and extract_answer(turn["text"]) is not None),
        }
    return out


def _weights(defaults: Mapping[str, float], weights: Mapping[str, float] | None) -> dict:
    merged = dict(defaults)
    for key, value in (weights or {}).items():
        if key not in merged:
            raise KeyError(f"unknown reward weight {key!r}; known: {sorted(merged)}")
        merged[key] = float(value)
    return merged


def _answers(ground_truth: Any) -> list[str]:
    values = ground_truth if isinstance(ground_truth, list | tuple) else [ground_truth]
    return [normalize_entity(v) for v in values if str(v).strip()]


def kgqa_structured_reward(
    sample: AgentSample, weights: Mapping[str, float] | None = None, **_: Any
) -> dict[str, Any]:
    """Spec 001's KGQA reward; ``ground_truth`` is one answer or a list of aliases."""
    w = _weights(KGQA_WEIGHTS, weights)
    parts = turn_components(sample, "kg_lookup", need_results=True)
    turn_rewards = {
        k: w["kg_query_validity"] * c["validity"]
        + w["is_answer_score"] * c["is_answer_score"]
        + w["format_score"] * c["format_score"]
        for k, c in parts.items()
    }
    gold = _answers(sample.ground_truth)
    answer = sample.final_answer
    exact = float(answer is not None and normalize_entity(answer) in gold)
    retrieved = " ".join(
        normalize_entity(c["output"])
        for c in sample.tool_calls
        if c["status"] == "ok" and c["name"] == "kg_lookup"
    )
    retrieval = float(any(g and g in retrieved for g in gold))
    return {
        "turn_rewards": turn_rewards,
        "global_rewards": {
            "exact_match": w["exact_match"] * exact,
            "retrieval_quality": w["retrieval_quality"] * retrieval,
            "_raw_exact_match": exact,
            "_raw_retrieval_quality": retrieval,
        },
        "components": parts,
    }


def _number(text: Any) -> Decimal | None:
    cleaned = str(text).strip().replace(",", "").rstrip(".")
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def calc_structured_reward(
    sample: AgentSample, weights: Mapping[str, float] | None = None, **_: Any
) -> dict[str, Any]:
    """The calculator task's reward: exact numeric answer, tool use, per-turn form."""
    w = _weights(CALC_WEIGHTS, weights)
    parts = turn_components(sample, "calculator")
    turn_rewards = {
        k: w["tool_validity"] * c["validity"]
        + w["is_answer_score"] * c["is_answer_score"]
        + w["format_score"] * c["format_score"]
        for k, c in parts.items()
    }
    answer, truth = sample.final_answer, _number(sample.ground_truth)
    value = _number(answer) if answer is not None else None
    exact = float(value is not None and truth is not None and value == truth)
    used = float(any(c["status"] == "ok" and c["name"] == "calculator" for c in sample.tool_calls))
    return {
        "turn_rewards": turn_rewards,
        "global_rewards": {
            "exact_match": w["exact_match"] * exact,
            "tool_use": w["tool_use"] * used,
            "_raw_exact_match": exact,
            "_raw_tool_use": used,
        },
        "components": parts,
    }

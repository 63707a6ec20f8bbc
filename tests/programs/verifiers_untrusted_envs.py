"""Verifiers environments that misbehave in the ways users' environments do, for
tests/test_verifiers_untrusted.py (one file, no creditrl imports)."""

from __future__ import annotations

import json
import sys

import verifiers as vf
from datasets import Dataset
from openai import AsyncOpenAI

QUESTIONS = [("What is 3 + 4?", "7"), ("What is 2 + 2?", "4")]


def _dataset(info: str | None = None) -> Dataset:
    rows = [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in QUESTIONS]
    if info is not None:
        rows = [{**row, "info": info} for row in rows]
    return Dataset.from_list(rows)


def says_answer(completion, answer) -> float:
    text = completion[-1].content if completion else ""
    return float(answer in (text or ""))


def exits() -> vf.Environment:
    sys.exit(0)


class Stop(BaseException):
    """Neither an Exception nor SystemExit."""


def raises_base() -> vf.Environment:
    raise Stop("stopped")


def deep_info() -> vf.Environment:
    return vf.SingleTurnEnv(dataset=_dataset("[" * 100_000 + "]" * 100_000),
                            rubric=vf.Rubric(funcs=[says_answer]))  # fmt: skip


def nan_info() -> vf.Environment:
    return vf.SingleTurnEnv(dataset=_dataset('{"x": NaN}'), rubric=vf.Rubric(funcs=[says_answer]))


def json_info() -> vf.Environment:
    return vf.SingleTurnEnv(dataset=_dataset(json.dumps({"x": 1})),
                            rubric=vf.Rubric(funcs=[says_answer]))  # fmt: skip


def fails(completion) -> float:
    raise ZeroDivisionError("judge is down")


def quiet_failing_rubric() -> vf.Environment:
    """A reward function that raises, in an environment that sets verifiers' logging up itself
    (which clears the handlers of the ``verifiers`` logger)."""
    vf.setup_logging("CRITICAL")
    return vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[says_answer, fails]))


def judged(base_url: str, api_key: str) -> vf.Environment:
    """One AsyncOpenAI client made here and used by the rubric of every episode (the usual
    JudgeRubric pattern): its pooled connections outlive each episode."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)

    async def judge(completion) -> float:
        models = await client.models.list()
        return float(len(models.data) == 1)

    return vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[judge]))

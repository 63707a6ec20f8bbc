"""Verifiers environments as a user writes them in one file (no creditrl imports), the good one
and broken ones, for tests/test_verifiers.py."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

QUESTIONS = [("What is 3 + 4?", "7"), ("What is 2 + 2?", "4")]


def _dataset() -> Dataset:
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in QUESTIONS]
    )


def says_answer(completion, answer) -> float:
    text = completion[-1].content if completion else ""
    return float(answer in (text or ""))


def short(completion) -> float:
    return float(len(completion[-1].content or "") < 40) if completion else 0.0


def load_environment(bonus: float = 0.5) -> vf.Environment:
    """A single-turn environment: 1 for the answer in the reply, ``bonus`` for a short one."""
    rubric = vf.Rubric(funcs=[says_answer, short], weights=[1.0, bonus])
    return vf.SingleTurnEnv(dataset=_dataset(), rubric=rubric)


class Echo(vf.MultiTurnEnv):
    """Two turns: the environment answers the first reply with a user message."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Are you sure?"}]


def two_turns() -> vf.Environment:
    return Echo(dataset=_dataset(), rubric=vf.Rubric(funcs=[says_answer]), max_turns=2)


class Rewrites(Echo):
    """Sends the conversation with its first reply rewritten (a re-rendered history)."""

    async def get_prompt_messages(self, state):
        messages = await super().get_prompt_messages(state)
        if state["trajectory"]:
            messages = [
                {"role": "assistant", "content": "rewritten"} if m.role == "assistant" else m
                for m in messages
            ]
        return messages


def rewrites_history() -> vf.Environment:
    return Rewrites(dataset=_dataset(), rubric=vf.Rubric(funcs=[says_answer]), max_turns=2)


def raises_in_load(size: int = 3) -> vf.Environment:
    raise RuntimeError(f"cannot build {size} rows")


class Broken(vf.SingleTurnEnv):
    async def setup_state(self, state):
        raise KeyError("missing tool server")


def raises_in_rollout() -> vf.Environment:
    return Broken(dataset=_dataset(), rubric=vf.Rubric(funcs=[says_answer]))


def fails(completion) -> float:
    raise ZeroDivisionError("judge is down")


def raises_in_rubric() -> vf.Environment:
    return vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[says_answer, fails]))


def no_prompts() -> vf.Environment:
    rows = Dataset.from_list([{"text": q, "answer": a} for q, a in QUESTIONS])
    return vf.SingleTurnEnv(dataset=rows, rubric=vf.Rubric(funcs=[says_answer]))


def empty_prompt() -> vf.Environment:
    rows = Dataset.from_list([{"prompt": "", "answer": "7"}])
    return vf.SingleTurnEnv(dataset=rows, rubric=vf.Rubric(funcs=[says_answer]))


def not_an_environment() -> dict:
    return {"dataset": QUESTIONS}


def ranked(completions) -> list[float]:
    return [float(i) for i in range(len(completions))]


def group_rubric() -> vf.Environment:
    return vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[ranked]))

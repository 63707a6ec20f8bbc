"""The plainest multi-turn verifiers environment: it answers every reply with "Are you sure?".

    creditrl train env.verifiers=examples/verifiers_echo.py:load_environment

Two turns per episode (``max_turns=2``); the rubric gives 1 when the last reply contains the
answer. A reply cut by the token budget still ends the episode cleanly: the rubric scores what
is there.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

QUESTIONS = [("What is 3 + 4?", "7"), ("What is 2 + 2?", "4"), ("What is 5 + 1?", "6"),
             ("What is 9 - 3?", "6"), ("What is 8 + 1?", "9"), ("What is 6 - 4?", "2")]  # fmt: skip


class Echo(vf.MultiTurnEnv):
    """Asks the model to confirm each reply."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Are you sure?"}]


def says_answer(completion, answer) -> float:
    """1 when the last reply contains the answer."""
    return float(answer in ((completion[-1].content if completion else "") or ""))


def load_environment(max_tokens: int = 48) -> vf.Environment:
    rows = [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in QUESTIONS]
    return Echo(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[says_answer]),
                max_turns=2, sampling_args={"max_tokens": max_tokens})  # fmt: skip

"""A three-turn game as a verifiers environment: count a letter in a word; a wrong guess gets a
hint and another try.

    creditrl train env.verifiers=examples/verifiers_letter_game.py:load_environment

The environment reads the number in the model's reply; a right one ends the game, a wrong one
is answered with a hint (the word spelled out), then with the answer's parity, up to three
model turns. The rubric's parts are logged as ``reward/vf_<name>_mean``: ``solved`` (1 when
some reply was right) and ``first_try`` (1 when the first one was), weighted 1 and 0.5.
"""

from __future__ import annotations

import re
from typing import Any

import verifiers as vf
from datasets import Dataset

WORDS = [("banana", "a"), ("strawberry", "r"), ("letter", "t"), ("mississippi", "s"),
         ("committee", "m"), ("balloon", "l"), ("coffee", "f"), ("bookkeeper", "e")]  # fmt: skip
NUMBER = re.compile(r"-?\d+")
HINTS = ("Not quite. Spelled out: {spelled}. How many '{letter}'?",
         "Still not right. The count is {parity}. Your final answer?")  # fmt: skip


def guess(text: str | None) -> int | None:
    """The last integer in ``text``."""
    found = NUMBER.findall(text or "")
    return int(found[-1]) if found else None


def _replies(messages: Any) -> list[str]:
    return [
        (m.get("content") if isinstance(m, dict) else getattr(m, "content", None)) or ""
        for m in messages or []
        if (m.get("role") if isinstance(m, dict) else getattr(m, "role", None)) == "assistant"
    ]


class LetterGame(vf.MultiTurnEnv):
    """Counts a letter; answers wrong guesses with hints (``HINTS``)."""

    async def env_response(self, messages, state, **kwargs):
        replies = _replies(messages)
        info = state["info"]
        if guess(replies[-1]) == int(state["answer"]):
            state["final_env_response"] = [{"role": "user", "content": "Correct!"}]  # game over
            return state["final_env_response"]
        hint = HINTS[min(len(replies), len(HINTS)) - 1]
        parity = "even" if int(state["answer"]) % 2 == 0 else "odd"
        spelled = "-".join(info["word"])
        return [{"role": "user", "content": hint.format(spelled=spelled, letter=info["letter"],
                                                        parity=parity)}]  # fmt: skip


def solved(completion, answer) -> float:
    """1 when some reply held the right count."""
    return float(any(guess(r) == int(answer) for r in _replies(completion)))


def first_try(completion, answer) -> float:
    """1 when the first reply held the right count."""
    replies = _replies(completion)
    return float(bool(replies) and guess(replies[0]) == int(answer))


def load_environment(max_tokens: int = 32) -> vf.Environment:
    rows = [
        {
            "prompt": [{"role": "user", "content": f"How many times does the letter '{letter}' "
                        f"appear in the word '{word}'? Answer with a number."}],
            "answer": str(word.count(letter)),
            "info": {"word": word, "letter": letter},
        }
        for word, letter in WORDS
    ]  # fmt: skip
    rubric = vf.Rubric(funcs=[solved, first_try], weights=[1.0, 0.5])
    return LetterGame(dataset=Dataset.from_list(rows), rubric=rubric, max_turns=3,
                      sampling_args={"max_tokens": max_tokens})  # fmt: skip

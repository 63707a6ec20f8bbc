"""chain_sum (the task ``make run`` trains) as a verifiers single-turn environment, scored with
math-verify; trained by creditrl unchanged:

    creditrl train examples/verifiers_chain_sum.yaml

``load_environment`` builds everything locally (nothing is downloaded): creditrl's own chain_sum
rows (the prompts ``make run`` sees: the same system prompt, worked example and questions) as a
``datasets.Dataset``, and a rubric mirroring ``make run``'s reward: 1 for the right number inside
``<answer></answer>`` (math-verify decides), half of that for a right last number without tags,
plus 0.1 for a response that ends in one answer block.
"""

from __future__ import annotations

import re
from typing import Any

import verifiers as vf
from datasets import Dataset
from math_verify import parse, verify

from creditrl.config.schema import DataConfig
from creditrl.data.tasks import build_task_rows

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _text(completion: Any) -> str:
    """The last assistant message's text."""
    if isinstance(completion, str):
        return completion
    for message in reversed(completion or []):
        role = message.get("role") if isinstance(message, dict) else getattr(message, "role", "")
        if role == "assistant":
            content = message.get("content") if isinstance(message, dict) else message.content
            return content if isinstance(content, str) else ""
    return ""


def _equal(predicted: str, answer: str) -> bool:
    """math-verify's equivalence (no signal-based timeout: episodes run off the main thread)."""
    gold = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
    guess = parse(predicted[-200:], parsing_timeout=None)
    return bool(gold and guess) and verify(gold, guess, timeout_seconds=None)


def correct_answer(completion: Any, answer: str, **_: Any) -> float:
    """1 for the right answer in the last <answer> block, 0.5 for a right last number."""
    text = _text(completion)
    tagged = ANSWER.findall(text)
    if tagged:
        return float(_equal(tagged[-1].strip(), str(answer)))
    numbers = NUMBER.findall(text)
    return 0.5 * float(bool(numbers) and _equal(numbers[-1], str(answer)))


def answer_format(completion: Any, **_: Any) -> float:
    """1 when the response ends with its one <answer> block."""
    text = _text(completion).strip()
    return float(text.count("<answer>") == 1 and text.endswith("</answer>"))


def load_environment(
    train_size: int = 2000, val_size: int = 64, seed: int = 0, few_shot: int = 1
) -> vf.Environment:
    """The chain_sum environment: ``make run``'s prompts, math-verify's scores."""
    defaults = DataConfig()
    rows = build_task_rows(
        "chain_sum", defaults.task_kwargs, train_size, val_size, seed, None, few_shot
    )

    def dataset(split: list) -> Dataset:
        return Dataset.from_list(
            [{"prompt": row.messages, "answer": str(row.ground_truth)} for row in split]
        )

    rubric = vf.Rubric(funcs=[correct_answer, answer_format], weights=[1.0, 0.1])
    return vf.SingleTurnEnv(
        dataset=dataset(rows.train), eval_dataset=dataset(rows.val), rubric=rubric
    )

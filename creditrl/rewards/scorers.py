"""Built-in rule scorers, verl's ``compute_score`` signature.

Each scorer is ``fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`` and
returns ``{"score": float, ...extra}``. ``solution_str`` is the decoded response (text for
scoring only; never re-encoded for training). Heavy libraries (reasoning_gym, math_verify) are
imported on first use so a worker process starts fast.

Model-written text is scored in time linear in its length: tags are found with ``str`` search,
never a backtracking regex, and an answer is looked for only in the last
``ANSWER_SEARCH_CHARS`` characters of a response (an answer block, a last number, a math
expression), so a huge response costs no more to search than its tail.
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation
from functools import cache
from typing import Any

__all__ = [
    "ANSWER_SEARCH_CHARS",
    "answer_format_ok",
    "extract_answer",
    "gsm8k_score",
    "math_score",
    "program_reward_score",
    "reasoning_gym_score",
    "tag_blocks",
    "think_answer_format_ok",
]

# An answer is searched for in this many last characters of a response (16 KiB of text).
ANSWER_SEARCH_CHARS = 16_384
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)")


def tag_blocks(text: str, open_tag: str, close_tag: str) -> list[str]:
    """The contents of the ``open_tag ... close_tag`` blocks of ``text``, left to right, as
    ``re.findall(open + "(.*?)" + close, text, re.DOTALL)`` finds them, in linear time: each
    block starts at the first ``open_tag`` after the previous block and ends at the first
    ``close_tag`` after that."""
    blocks = []
    position = 0
    while (start := text.find(open_tag, position)) >= 0:
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            break
        blocks.append(text[start + len(open_tag) : end])
        position = end + len(close_tag)
    return blocks


def extract_answer(solution_str: str) -> str | None:
    """Content (stripped) of the last ``<answer>...</answer>`` block within the last
    ``ANSWER_SEARCH_CHARS`` characters, or None if there is none."""
    found = tag_blocks(solution_str[-ANSWER_SEARCH_CHARS:], "<answer>", "</answer>")
    return found[-1].strip() if found else None


def _tag_counts_are_one(text: str, *tags: str) -> bool:
    return all(text.count(f"<{t}>") == 1 and text.count(f"</{t}>") == 1 for t in tags)


def think_answer_format_ok(solution_str: str) -> bool:
    """Spec 003's format: exactly ``<think>...</think>`` then ``<answer>...</answer>``.

    Leading/trailing whitespace is ignored; whitespace may separate the two blocks; each tag
    appears exactly once and nothing follows ``</answer>``.
    """
    text = solution_str.strip()
    if not (text.startswith("<think>") and text.endswith("</answer>")):
        return False
    if not _tag_counts_are_one(text, "think", "answer"):
        return False
    think_end, answer_start = text.find("</think>"), text.find("<answer>")
    return think_end < answer_start and not text[think_end + len("</think>") : answer_start].strip()


def answer_format_ok(solution_str: str) -> bool:
    """One ``<answer>...</answer>`` block ending the (stripped) text, anything before it."""
    text = solution_str.strip()
    return text.endswith("</answer>") and _tag_counts_are_one(text, "answer")


def _to_decimal(text: str) -> Decimal | None:
    """An exact number from ``text`` ("1,234", "$5", "8.", "-3.50"), or None if not one number."""
    cleaned = text.strip().replace(",", "").replace("$", "").strip().rstrip(".")
    if not _NUMBER.fullmatch(cleaned):
        return None
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def _gsm8k_truth(ground_truth: Any) -> Decimal:
    """The reference number: a number, a numeric string, or GSM8K's "... #### 72" solution."""
    text = str(ground_truth)
    if "####" in text:
        text = text.split("####")[-1]
    value = _to_decimal(text)
    if value is None:
        raise ValueError(f"gsm8k ground truth {ground_truth!r} is not a number")
    return value


def gsm8k_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    format_reward: float = 1.25,
    answer_reward: float = 1.0,
    format_miss: float = 0.0,
    answer_miss: float = 0.0,
) -> dict[str, Any]:
    """Spec 003's GSM8K reward: score = format_score + answer_score.

    - format_score = ``format_reward`` (1.25) if ``think_answer_format_ok`` else ``format_miss``.
    - answer_score = ``answer_reward`` (1.0) if the last ``<answer>`` content is exactly the
      ground-truth number (commas, "$" and a trailing "." ignored; "8" == "8.0"), else
      ``answer_miss``. No answer tags: ``answer_miss``.

    A correct, well-formatted response scores 1.25 + 1.0 = 2.25 (spec 003's example).
    """
    answer = extract_answer(solution_str)
    value = _to_decimal(answer) if answer is not None else None
    correct = value is not None and value == _gsm8k_truth(ground_truth)
    format_score = format_reward if think_answer_format_ok(solution_str) else format_miss
    answer_score = answer_reward if correct else answer_miss
    return {
        "score": format_score + answer_score,
        "format_score": format_score,
        "answer_score": answer_score,
        "extracted_answer": answer,
    }


@cache
def _rg_score_fn(name: str) -> Any:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)


def last_number(text: str) -> str | None:
    """The last number written in the last ``ANSWER_SEARCH_CHARS`` characters of ``text``
    (e.g. "2 + 3 = 5." -> "5"), or None."""
    found = [m.group(0) for m in _NUMBER.finditer(text[-ANSWER_SEARCH_CHARS:])]
    return found[-1].rstrip(".") if found else None


def reasoning_gym_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    answer_weight: float = 1.0,
    format_weight: float = 0.1,
    untagged_weight: float = 0.5,
    require_think: bool = False,
) -> dict[str, Any]:
    """reasoning_gym task reward:
    answer_weight * answer_score * (1 if tagged else untagged_weight) + format_weight * format_ok.

    answer_score in [0, 1] is the task's own ``score_answer(answer, entry)`` on the last
    ``<answer>`` content; without one, on the last number of the text, discounted by
    ``untagged_weight`` (so a small model that answers in plain text still gets a learning
    signal, and moving the answer into tags pays; 0 turns the fallback off). The dataset is
    ``entry["metadata"]["source_dataset"]``, else the part after "reasoning_gym/" in
    ``data_source``. ``entry`` is ``extra_info["rg_entry"]`` (question, answer, metadata);
    without it, ``{"answer": ground_truth, "metadata": {}}`` (enough for tasks that compare
    answers only). format_ok: one ``<answer>`` block ends the response (spec 003's
    think+answer layout when ``require_think``).
    """
    entry = (extra_info or {}).get("rg_entry") or {
        "question": "",
        "answer": ground_truth,
        "metadata": {},
    }
    name = (entry.get("metadata") or {}).get("source_dataset") or data_source.partition("/")[2]
    if not name:
        raise ValueError(
            f"data_source {data_source!r} names no reasoning_gym task "
            "(expected 'reasoning_gym/<task>' or rg_entry.metadata.source_dataset)"
        )
    answer = extract_answer(solution_str)
    weight = 1.0
    if answer is None and untagged_weight > 0:
        answer, weight = last_number(solution_str), untagged_weight
    answer_score = float(_rg_score_fn(name)(answer, entry)) if answer is not None else 0.0
    format_check = think_answer_format_ok if require_think else answer_format_ok
    format_score = float(format_check(solution_str))
    return {
        "score": answer_weight * answer_score * weight + format_weight * format_score,
        "answer_score": answer_score,
        "format_score": format_score,
        "extracted_answer": answer,
    }


def math_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    correct_score: float = 1.0,
    wrong_score: float = 0.0,
) -> dict[str, Any]:
    """Math answer equivalence with ``math_verify``: correct_score if verify(gold, pred).

    gold: ``ground_truth`` as given if it holds "\\boxed" or "$", else wrapped as
    ``\\boxed{...}``. pred: parsed from the last ``<answer>`` content if there is one, else from
    the response's last ``ANSWER_SEARCH_CHARS`` characters (math_verify finds the last boxed /
    LaTeX / plain expression).
    math_verify's own signal-based timeout runs only in a main thread.
    """
    from math_verify import parse, verify

    limit = 5 if threading.current_thread() is threading.main_thread() else None
    truth = str(ground_truth)
    if "\\boxed" not in truth and "$" not in truth:
        truth = f"\\boxed{{{truth}}}"
    gold = parse(truth, parsing_timeout=limit)
    if not gold:
        raise ValueError(f"math ground truth {ground_truth!r} could not be parsed")
    answer = extract_answer(solution_str)
    text = answer if answer is not None else solution_str[-ANSWER_SEARCH_CHARS:]
    pred = parse(text, parsing_timeout=limit)
    correct = bool(pred) and verify(gold, pred, timeout_seconds=limit)
    return {
        "score": correct_score if correct else wrong_score,
        "extracted_answer": str(pred[-1]) if pred else None,
    }


def program_reward_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **_: Any
) -> float | dict:
    """The reward an ``agent.program`` episode returned (``extra_info["program_reward"]``, set
    by ``creditrl.agents.program``): a float or a scorer dict with "score"."""
    if not extra_info or "program_reward" not in extra_info:
        raise ValueError("this sample has no program_reward in its extra_info")
    return extra_info["program_reward"]

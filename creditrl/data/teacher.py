"""A distillation teacher's view of a prompt row (``distill.teacher_prompt``).

``same``: the student's prompt (no separate ids: the teacher reads the student's prompt ids);
``few_shot``: the row's ``teacher_messages`` (a ``data.task`` row built with worked examples
the student does not see, ``build_task_rows(teacher_few_shot=...)``); ``ground_truth``: the
student's messages with the row's ground truth added to the last user message, for a row that
has one (a null or empty ground truth would tell the teacher "a correct final answer is null.":
such a row's teacher sees the student's prompt, and ``PromptDataset`` counts it). The teacher's
prompt is rendered with the student's chat template (the tokenizers must match); the
response it scores is the student's ids, never re-encoded.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from creditrl.data.rows import PromptRow

__all__ = ["GROUND_TRUTH_NOTE", "TEACHER_PROMPTS", "has_ground_truth", "teacher_messages"]

TEACHER_PROMPTS = ("same", "few_shot", "ground_truth")
GROUND_TRUTH_NOTE = "\n\n(Privileged hint: a correct final answer is {answer}.)"


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def has_ground_truth(value: Any) -> bool:
    """``value`` is an answer to show: not null, an empty or blank string, or an empty list or
    mapping."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return False
    return not (isinstance(value, list | dict) and not value)


def teacher_messages(row: PromptRow, kind: str) -> list[dict[str, Any]] | None:
    """The teacher's chat messages for ``row`` under ``kind`` (``TEACHER_PROMPTS``); None when
    the teacher sees the student's prompt (``same``, a ``few_shot`` row without examples, a
    ``ground_truth`` row without one: ``has_ground_truth``)."""
    if kind not in TEACHER_PROMPTS:
        raise ValueError(f"distill.teacher_prompt must be one of {TEACHER_PROMPTS}, got {kind!r}")
    if kind == "few_shot":
        return row.teacher_messages
    if kind == "same" or not has_ground_truth(row.ground_truth):
        return None
    messages = copy.deepcopy(row.messages)
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    note = GROUND_TRUTH_NOTE.format(answer=_as_text(row.ground_truth))
    if users:
        messages[users[-1]]["content"] += note
    else:
        messages.append({"role": "user", "content": note.strip()})
    return messages

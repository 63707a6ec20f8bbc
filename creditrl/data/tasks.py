"""Built-in tasks: reasoning-gym generators turned into prompt rows with a seeded train/val split.

``reasoning_gym.create_dataset(name, size=..., seed=..., **kwargs)`` yields entries
``{"question", "answer", "metadata"}``. Each becomes a PromptRow with a system instruction and
the question as the user message, ``ground_truth`` = the answer, ``data_source`` =
``"reasoning_gym/<name>"`` and ``extra["rg_entry"]`` = the whole entry as JSON (what the reward
side needs to call ``score_answer(answer, entry)``; see ``score_rg_answer``).

Split: reasoning-gym seeds item ``i`` with ``Random(seed + i)``, so train uses ``seed`` and
validation ``seed + VAL_SEED_OFFSET``: their per-item seeds are disjoint for sizes below the
offset. Small task spaces still repeat questions, so train rows whose question appears in
validation are dropped (counted) and validation stays a true held-out set.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from creditrl.data.rows import PromptRow
from creditrl.errors import ConfigError
from creditrl.usercode import one_line

__all__ = [
    "ANSWER_INSTRUCTION",
    "DEFAULT_SYSTEM_PROMPT",
    "VAL_SEED_OFFSET",
    "TaskRows",
    "build_task_rows",
    "score_rg_answer",
    "task_messages",
]

logger = logging.getLogger(__name__)

VAL_SEED_OFFSET = 2**30
DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Think briefly, then give the final answer inside "
    "<answer></answer> tags."
)
ANSWER_INSTRUCTION = "Think briefly, then write the final answer inside <answer></answer> tags."


@dataclass
class TaskRows:
    """Rows of a built-in task: ``train``, ``val`` and how many train rows overlapped val."""

    train: list[PromptRow]
    val: list[PromptRow]
    num_dropped_overlap: int


def task_messages(question: str, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The chat prompt for one question: system instruction, then question + answer format."""
    return [
        {"role": "system", "content": system_prompt or DEFAULT_SYSTEM_PROMPT},
        {"role": "user", "content": f"{question}\n\n{ANSWER_INSTRUCTION}"},
    ]


def _generate(name: str, kwargs: dict[str, Any], size: int, seed: int) -> list[dict[str, Any]]:
    import reasoning_gym

    reserved = sorted({"size", "seed"} & set(kwargs))
    if reserved:
        raise ConfigError(
            f"data.task_kwargs must not set {reserved}; use data.train_size/val_size/seed"
        )
    try:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **kwargs)
    except (TypeError, ValueError, AssertionError, KeyError) as e:
        raise ConfigError(
            f"data.task={name!r} with data.task_kwargs={kwargs}: {type(e).__name__}: {one_line(e)}"
        ) from e
    # default=str: metadata may hold non-JSON values (e.g. Fractions); tuples become lists.
    return [json.loads(json.dumps(entry, default=str)) for entry in dataset]


def _rows(
    name: str, entries: list[tuple[int, dict[str, Any]]], seed: int, system_prompt: str | None
) -> list[PromptRow]:
    """PromptRows from ``(item index, entry)`` pairs."""
    return [
        PromptRow(
            messages=task_messages(entry["question"], system_prompt),
            ground_truth=entry["answer"],
            data_source=f"reasoning_gym/{name}",
            extra={"rg_entry": entry},
            source=f"reasoning_gym/{name} seed {seed} item {i}",
        )
        for i, entry in entries
    ]


def build_task_rows(
    name: str,
    kwargs: dict[str, Any],
    train_size: int,
    val_size: int,
    seed: int,
    system_prompt: str | None = None,
) -> TaskRows:
    """Generate ``train_size`` train and ``val_size`` validation rows of task ``name``.

    Train uses ``seed``, validation ``seed + VAL_SEED_OFFSET``; train rows whose question is in
    validation are dropped and counted (logged). ConfigError if no train rows remain.
    """
    if train_size < 1 or val_size < 0:
        raise ConfigError(
            f"need data.train_size >= 1 and data.val_size >= 0, got {train_size}, {val_size}"
        )
    kwargs = dict(kwargs or {})
    val_seed = seed + VAL_SEED_OFFSET
    val = _generate(name, kwargs, val_size, val_seed) if val_size else []
    held_out = {entry["question"] for entry in val}
    train = _generate(name, kwargs, train_size, seed)
    kept = [(i, entry) for i, entry in enumerate(train) if entry["question"] not in held_out]
    dropped = len(train) - len(kept)
    if dropped:
        logger.info(
            "task %s: dropped %d of %d train rows whose question is in validation",
            name,
            dropped,
            len(train),
        )
    if not kept:
        raise ConfigError(
            f"data.task={name!r}: all {len(train)} train rows repeat validation questions; "
            "lower data.val_size or widen data.task_kwargs"
        )
    val_rows = _rows(name, list(enumerate(val)), val_seed, system_prompt)
    return TaskRows(_rows(name, kept, seed, system_prompt), val_rows, dropped)


def score_rg_answer(answer: str | None, rg_entry: dict[str, Any]) -> float:
    """reasoning-gym's own score of an extracted ``answer`` against a stored entry."""
    import reasoning_gym

    name = rg_entry["metadata"]["source_dataset"]
    return float(reasoning_gym.get_score_answer_fn(name)(answer, rg_entry))

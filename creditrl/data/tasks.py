"""Built-in tasks: reasoning-gym generators turned into prompt rows with a seeded train/val split.

``reasoning_gym.create_dataset(name, size=..., seed=..., **kwargs)`` yields entries
``{"question", "answer", "metadata"}``. Each becomes a PromptRow with a system instruction and
the question as the user message, ``ground_truth`` = the answer, ``data_source`` =
``"reasoning_gym/<name>"`` and ``extra["rg_entry"]`` = the whole entry as JSON (what the reward
side needs to call ``score_answer(answer, entry)``; see ``score_rg_answer``).

Worked examples (``few_shot``): a small model follows an instruction to write ``<answer>``
tags far less than it imitates an exchange that shows them (SmolLM2-135M at temperature 0.7 on
chain_sum: 0 of 64 answers tagged with the instruction alone, 16 of 64 after one worked
example, measured). ``few_shot`` examples are drawn from the task's own generator at
``seed + SHOT_SEED_OFFSET`` (never a validation question) and shown as user/assistant turns
before the question; the assistant turn is the working when the entry's metadata holds an
``expression`` (``"7 + 2 = 9"``), then ``<answer>answer</answer>``.

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
    "SHOT_SEED_OFFSET",
    "VAL_SEED_OFFSET",
    "TaskRows",
    "build_task_rows",
    "score_rg_answer",
    "task_messages",
    "worked_example",
]

logger = logging.getLogger(__name__)

VAL_SEED_OFFSET = 2**30
SHOT_SEED_OFFSET = 2**29
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


def task_messages(
    question: str,
    system_prompt: str | None = None,
    shots: list[dict[str, str]] | None = None,
) -> list[dict[str, str]]:
    """The chat prompt for one question: system instruction, the worked-example turns
    ``shots`` (see ``worked_example``), then question + answer format."""
    return [
        {"role": "system", "content": system_prompt or DEFAULT_SYSTEM_PROMPT},
        *(shots or []),
        {"role": "user", "content": f"{question}\n\n{ANSWER_INSTRUCTION}"},
    ]


def worked_example(entry: dict[str, Any]) -> list[dict[str, str]]:
    """One reasoning-gym entry as a user turn and the assistant turn a good answer would be:
    ``"<expression> = <answer>"`` when ``entry["metadata"]`` has an ``expression``, then
    ``<answer>answer</answer>``."""
    answer = str(entry["answer"])
    expression = (entry.get("metadata") or {}).get("expression")
    working = f"{expression} = {answer}\n" if expression else ""
    return [
        {"role": "user", "content": f"{entry['question']}\n\n{ANSWER_INSTRUCTION}"},
        {"role": "assistant", "content": f"{working}<answer>{answer}</answer>"},
    ]


def _shots(
    name: str, kwargs: dict[str, Any], count: int, seed: int, held_out: set[str]
) -> list[dict[str, str]]:
    """``count`` worked examples from the generator at ``seed + SHOT_SEED_OFFSET``, skipping
    validation questions (ConfigError if too few remain among ``8 * count`` candidates)."""
    if count <= 0:
        return []
    candidates = _generate(name, kwargs, 8 * count, seed + SHOT_SEED_OFFSET)
    picked = [e for e in candidates if e["question"] not in held_out][:count]
    if len(picked) < count:
        raise ConfigError(
            f"data.few_shot={count}: task {name!r} gave only {len(picked)} examples that are "
            "not validation questions; lower data.few_shot or data.val_size"
        )
    return [turn for entry in picked for turn in worked_example(entry)]


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
    name: str,
    entries: list[tuple[int, dict[str, Any]]],
    seed: int,
    system_prompt: str | None,
    shots: list[dict[str, str]],
    teacher_shots: list[dict[str, str]] | None = None,
) -> list[PromptRow]:
    """PromptRows from ``(item index, entry)`` pairs; with ``teacher_shots``, each row's
    ``teacher_messages`` show those worked examples instead of ``shots``."""
    return [
        PromptRow(
            messages=task_messages(entry["question"], system_prompt, shots),
            ground_truth=entry["answer"],
            data_source=f"reasoning_gym/{name}",
            extra={"rg_entry": entry},
            source=f"reasoning_gym/{name} seed {seed} item {i}",
            teacher_messages=None
            if teacher_shots is None
            else task_messages(entry["question"], system_prompt, teacher_shots),
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
    few_shot: int = 0,
    teacher_few_shot: int = 0,
) -> TaskRows:
    """Generate ``train_size`` train and ``val_size`` validation rows of task ``name``, each
    prompt led by the same ``few_shot`` worked examples (module docstring). With
    ``teacher_few_shot`` > 0 each train row also holds ``teacher_messages``: the prompt that
    ``few_shot=teacher_few_shot`` would give (a distillation teacher's privileged view).

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
    shots = _shots(name, kwargs, few_shot, seed, held_out)
    teacher_shots = (
        _shots(name, kwargs, teacher_few_shot, seed, held_out) if teacher_few_shot else None
    )
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
    val_rows = _rows(name, list(enumerate(val)), val_seed, system_prompt, shots)
    train_rows = _rows(name, kept, seed, system_prompt, shots, teacher_shots)
    return TaskRows(train_rows, val_rows, dropped)


def score_rg_answer(answer: str | None, rg_entry: dict[str, Any]) -> float:
    """reasoning-gym's own score of an extracted ``answer`` against a stored entry."""
    import reasoning_gym

    name = rg_entry["metadata"]["source_dataset"]
    return float(reasoning_gym.get_score_answer_fn(name)(answer, rg_entry))

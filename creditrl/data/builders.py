"""build_datasets: the train and validation PromptDatasets a DataConfig describes."""

from __future__ import annotations

import logging
from typing import Any

from creditrl.config.schema import DataConfig, DistillConfig
from creditrl.data.dataset import PromptDataset
from creditrl.data.rows import read_rows_from_files
from creditrl.data.tasks import build_task_rows
from creditrl.errors import ConfigError

__all__ = ["build_datasets", "files_origin", "validation_notice"]

logger = logging.getLogger(__name__)


def files_origin(key: str, paths: list[str]) -> str:
    """How errors name a set of data files: ``data.train_files [a.jsonl, b.jsonl]``."""
    return f"{key} [{', '.join(paths)}]"


def validation_notice(cfg: DataConfig) -> str | None:
    """A line to show at start when this data config leaves validation off, else None."""
    if cfg.train_files and not cfg.val_files:
        return (
            "data.val_files is empty: validation is off (no val/score); "
            "set data.val_files to measure held-out reward"
        )
    if not cfg.train_files and cfg.task and cfg.val_size == 0:
        return "data.val_size=0: validation is off (no val/score)"
    return None


def build_datasets(
    cfg: DataConfig, tokenizer: Any, distill: DistillConfig | None = None
) -> tuple[PromptDataset, PromptDataset | None]:
    """``(train, val)`` from ``cfg.train_files``/``val_files`` if any train file is given
    (their first ``max_train_rows``/``max_val_rows`` rows; ``cfg.task`` is then ignored),
    else from the reasoning-gym task ``cfg.task`` (``train_size`` rows; ``val_size``
    validation rows, none when 0). ``val`` is None when there is no validation data. With
    ``distill`` (a teacher set), train rows carry the teacher's prompt ids
    (``distill.teacher_prompt``; ``creditrl.data.teacher``)."""
    teacher = "same" if distill is None or distill.teacher is None else distill.teacher_prompt

    def dataset(rows: list, split: str, origin: str) -> PromptDataset:
        return PromptDataset(
            rows,
            tokenizer,
            cfg.max_prompt_length,
            cfg.overlong_prompt,
            split,
            origin,
            teacher if split == "train" else "same",
        )

    if cfg.train_files:
        if cfg.task:
            logger.info("data.train_files given: ignoring data.task=%r", cfg.task)
        key = "data.train_files"
        train_rows = read_rows_from_files(
            cfg.train_files, cfg.system_prompt, key, cfg.max_train_rows, "data.max_train_rows"
        )
        train = dataset(train_rows, "train", files_origin(key, cfg.train_files))
        key = "data.val_files"
        val_rows = read_rows_from_files(
            cfg.val_files, cfg.system_prompt, key, cfg.max_val_rows, "data.max_val_rows"
        )
        val = dataset(val_rows, "val", files_origin(key, cfg.val_files)) if val_rows else None
        return train, val
    if not cfg.task:
        raise ConfigError("no data: set data.task (a reasoning-gym name) or data.train_files")
    rows = build_task_rows(
        cfg.task,
        cfg.task_kwargs,
        cfg.train_size,
        cfg.val_size,
        cfg.seed,
        cfg.system_prompt,
        cfg.few_shot,
        distill.teacher_few_shot if teacher == "few_shot" else 0,
    )
    train = dataset(rows.train, "train", f"data.task={cfg.task!r} (train)")
    train.num_dropped_overlap = rows.num_dropped_overlap
    val = dataset(rows.val, "val", f"data.task={cfg.task!r} (val)") if rows.val else None
    return train, val

"""build_datasets: the train and validation PromptDatasets a DataConfig describes."""

from __future__ import annotations

import logging
from typing import Any

from creditrl.config.schema import DataConfig
from creditrl.data.dataset import PromptDataset
from creditrl.data.rows import read_rows_from_files
from creditrl.data.tasks import build_task_rows

__all__ = ["build_datasets"]

logger = logging.getLogger(__name__)


def build_datasets(cfg: DataConfig, tokenizer: Any) -> tuple[PromptDataset, PromptDataset | None]:
    """``(train, val)`` from ``cfg.train_files``/``val_files`` if any train file is given
    (``cfg.task`` is then ignored), else from the reasoning-gym task ``cfg.task``
    (``train_size`` rows; ``val_size`` validation rows, none when 0). ``val`` is None when
    there is no validation data."""

    def dataset(rows: list, split: str) -> PromptDataset:
        return PromptDataset(
            rows, tokenizer, cfg.max_prompt_length, cfg.overlong_prompt, split=split
        )

    if cfg.train_files:
        if cfg.task:
            logger.info("data.train_files given: ignoring data.task=%r", cfg.task)
        train = dataset(read_rows_from_files(cfg.train_files, cfg.system_prompt), "train")
        val_rows = read_rows_from_files(cfg.val_files, cfg.system_prompt)
        return train, dataset(val_rows, "val") if val_rows else None
    if not cfg.task:
        raise ValueError("no data: set data.task (a reasoning-gym name) or data.train_files")
    rows = build_task_rows(
        cfg.task, cfg.task_kwargs, cfg.train_size, cfg.val_size, cfg.seed, cfg.system_prompt
    )
    train = dataset(rows.train, "train")
    train.num_dropped_overlap = rows.num_dropped_overlap
    return train, dataset(rows.val, "val") if rows.val else None

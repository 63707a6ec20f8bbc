"""Prompts: rows from jsonl/parquet or reasoning-gym tasks, chat-templated once into token ids,
sampled resumably and collated into the left-padded prompt Batch."""

from creditrl.data.builders import build_datasets
from creditrl.data.collate import collate_prompts, position_ids_from_mask
from creditrl.data.dataset import PromptDataset, chat_prompt_ids
from creditrl.data.rows import PromptRow, RowError, parse_row, read_rows, read_rows_from_files
from creditrl.data.sampler import ResumableSampler
from creditrl.data.tasks import (
    DEFAULT_SYSTEM_PROMPT,
    TaskRows,
    build_task_rows,
    score_rg_answer,
    task_messages,
    worked_example,
)

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "PromptDataset",
    "PromptRow",
    "ResumableSampler",
    "RowError",
    "TaskRows",
    "build_datasets",
    "build_task_rows",
    "chat_prompt_ids",
    "collate_prompts",
    "parse_row",
    "position_ids_from_mask",
    "read_rows",
    "read_rows_from_files",
    "score_rg_answer",
    "task_messages",
    "worked_example",
]

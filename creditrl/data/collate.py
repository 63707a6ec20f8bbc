"""Collate prompt rows into the prompt Batch (data -> rollout)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from creditrl.batch import Batch, position_ids_from_mask

__all__ = ["collate_prompts", "position_ids_from_mask"]


def collate_prompts(rows: Sequence[Mapping[str, Any]], pad_token_id: int) -> Batch:
    """Stack rows (``PromptDataset`` items) into a Batch of B = len(rows) prompts.

    Tensors (B, P), P = the longest prompt, int64: ``input_ids`` LEFT-padded with
    ``pad_token_id``, ``attention_mask`` (1 on real tokens), ``position_ids``
    (``position_ids_from_mask``). Non-tensors: ``raw_prompt``, ``ground_truth``,
    ``data_source``, ``extra_info``, ``index``, and ``teacher_prompt_ids`` when the rows hold
    a distillation teacher's prompt. ``meta`` is empty.
    """
    if not rows:
        raise ValueError("collate_prompts needs at least one row")
    lengths = [len(row["input_ids"]) for row in rows]
    for row, length in zip(rows, lengths, strict=True):
        if length == 0:
            raise ValueError(f"row with index {row.get('index')} has an empty prompt")
    width = max(lengths)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        input_ids[i, width - length :] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        attention_mask[i, width - length :] = 1
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
    }
    names = ("raw_prompt", "ground_truth", "data_source", "extra_info", "index")
    if all("teacher_prompt_ids" in row for row in rows):
        names += ("teacher_prompt_ids",)
    return Batch(tensors, {name: [row[name] for row in rows] for name in names})

"""Per-step rollout dumps: what the policy wrote and every token-level quantity it was trained on.

``output_dir/rollouts/step_{step:06d}.jsonl`` holds one JSON object per sample::

    {"step", "row", "uid", "traj_id", "data_source", "ground_truth", "prompt", "response",
     "response_length", "score", "reward_extra": {...}, "per_token": {...}}

``prompt`` / ``response`` are decoded for humans only (training never re-encodes them).
``per_token`` (first ``rows_per_step`` rows only) covers the response's real tokens, columns
j = 0..L-1 with L = the response part of ``attention_mask`` summed (step t = j + 1, spec 000):
``ids``, ``tokens`` and each of ``PER_TOKEN_FIELDS`` that the batch holds, floats rounded to 6
decimals (non-finite as null); also ``prompt_ids``, the prompt's real token ids, so that a model
can recompute log-probs on exactly these tokens.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from creditrl.batch import Batch
from creditrl.bounded_json import RUN_RECORD_LIMITS, JsonLimitError, loads_bounded
from creditrl.config.run_files import DUMP_LINES, run_file_lines
from creditrl.tracking.metrics import response_info

__all__ = ["PER_TOKEN_FIELDS", "RolloutDumper", "load_rollout_dump"]

PER_TOKEN_FIELDS = (
    "response_mask",
    "turn_ids",
    "rollout_log_probs",
    "rollout_kept_counts",
    "token_weight_version",
    "old_log_probs",
    "ref_log_prob",
    "teacher_log_prob",
    "entropys",
    "token_level_scores",
    "token_level_rewards",
    "values",
    "advantages",
    "returns",
    "rollout_is_weights",
    "loss_mask",
)


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...


def _float(x: float) -> float | None:
    return round(x, 6) if math.isfinite(x) else None


def _token_values(t: torch.Tensor) -> list[Any]:
    """A 1-D tensor as JSON numbers: ints stay ints, floats are rounded to 6 decimals."""
    if t.is_floating_point():
        return [_float(x) for x in t.detach().to(torch.float64).tolist()]
    return [int(x) for x in t.tolist()]


def _jsonable(value: Any) -> Any:
    """``json.dumps`` fallback for numpy/torch values; anything else becomes its str()."""
    if isinstance(value, np.generic | torch.Tensor):
        return value.tolist() if getattr(value, "ndim", 0) else value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


class RolloutDumper:
    """Writes ``output_dir/rollouts/step_{step:06d}.jsonl`` (atomically) for each dumped step."""

    def __init__(
        self,
        output_dir: Path,
        rows_per_step: int,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = False,
    ) -> None:
        if rows_per_step < 0:
            raise ValueError(f"rows_per_step must be >= 0, got {rows_per_step}")
        self.dir = Path(output_dir) / "rollouts"
        self.rows_per_step = rows_per_step
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens

    def path(self, step: int) -> Path:
        """Where ``dump(batch, step)`` writes."""
        return self.dir / f"step_{step:06d}.jsonl"

    def rows(self, batch: Batch, step: int) -> list[dict[str, Any]]:
        """The records ``dump`` writes, one per sample."""
        info = response_info(batch)
        responses = batch["responses"].cpu()
        t = responses.shape[-1]
        attn = batch["attention_mask"].cpu()
        p = attn.shape[-1] - t
        prompts = batch["prompts"] if "prompts" in batch else batch["input_ids"][:, :p]
        prompts = prompts.cpu()
        lengths = info["response_length"].cpu().tolist()
        scores = (
            batch["token_level_scores"].sum(-1).tolist() if "token_level_scores" in batch else None
        )
        extra_keys = [k for k in batch.non_tensors if k.startswith("reward_")]
        extra_keys += [k for k in batch.meta.get("reward_extra_keys", []) if k not in extra_keys]
        present = [name for name in PER_TOKEN_FIELDS if name in batch.tensors]
        out = []
        for i in range(len(batch)):
            prompt_ids = prompts[i][attn[i, :p].bool()].tolist()
            length = int(lengths[i])
            response_ids = responses[i, :length].tolist()
            row: dict[str, Any] = {
                "step": step,
                "row": i,
                **{
                    k: self._column(batch, k, i)
                    for k in ("uid", "traj_id", "data_source", "ground_truth")
                },
                "prompt": self._decode(prompt_ids),
                "response": self._decode(response_ids),
                "response_length": length,
                "score": None if scores is None else _float(float(scores[i])),
                "reward_extra": {k: self._column(batch, k, i) for k in extra_keys},
            }
            if i < self.rows_per_step:
                per_token: dict[str, Any] = {
                    "ids": response_ids,
                    "prompt_ids": prompt_ids,
                    "tokens": list(self.tokenizer.convert_ids_to_tokens(response_ids)),
                }
                for name in present:
                    per_token[name] = _token_values(batch[name][i, :length].cpu())
                row["per_token"] = per_token
            out.append(row)
        return out

    def dump(self, batch: Batch, step: int) -> Path:
        """Write this step's rollouts (temp file, then rename); returns the file's path."""
        self.dir.mkdir(parents=True, exist_ok=True)
        text = "".join(
            json.dumps(row, ensure_ascii=False, default=_jsonable) + "\n"
            for row in self.rows(batch, step)
        )
        target = self.path(step)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    @staticmethod
    def _column(batch: Batch, key: str, i: int) -> Any:
        """Sample ``i`` of field ``key`` (None when absent; a (B,) tensor gives a number)."""
        if key in batch.non_tensors:
            return batch.non_tensors[key][i]
        if key in batch.tensors:
            value = batch.tensors[key][i]
            return value.item() if value.ndim == 0 else value.tolist()
        return None


def load_rollout_dump(
    path: Path,
    *,
    inside: Path | None = None,
    keep: Callable[[Any], bool] | None = None,
) -> list[Any]:
    """Read a file written by ``RolloutDumper.dump`` (the records ``keep`` accepts, default
    all); ValueError names a bad line, one over ``DUMP_LINES`` unread. The file gets a run
    file's checks (``creditrl.config.run_files``) in the run directory ``inside`` (default:
    its folder): a FIFO, a link outside the run or a file too large is one ``DataError``."""
    rows = []
    for line in run_file_lines(path, DUMP_LINES, inside=inside):
        if line.data is None:
            raise ValueError(
                f"{path} line {line.number} is too large: over the limit of "
                f"{DUMP_LINES.max_line_bytes} bytes"
            )
        if not line.data.strip():
            continue
        try:
            row = loads_bounded(line.data, RUN_RECORD_LIMITS)
        except JsonLimitError as e:
            raise ValueError(f"{path} line {line.number} is too large: {e}") from None
        except ValueError as e:
            raise ValueError(f"{path} line {line.number} is not valid JSON: {e}") from None
        if keep is None or keep(row):
            rows.append(row)
    return rows

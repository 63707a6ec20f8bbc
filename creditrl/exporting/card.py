"""The model card (``README.md``) of an export, in the Hub's format: a YAML header written by
``huggingface_hub.ModelCardData``, then what the run recorded (its config.yaml, the checkpoint's
step and its metrics.jsonl) and how to load the directory. Nothing the run did not record.

``metrics.jsonl`` is read line by line with a run file's checks and bounds
(``creditrl.config.run_files``, ``METRICS_LINES``): a FIFO, a link outside the run or a file too
large is one ``DataError`` line; a line longer than ``MAX_METRICS_LINE`` bytes (never read into
memory), beyond ``RUN_RECORD_LIMITS``, not a JSON object, or without an integer ``step`` is
skipped and counted in the returned notes.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCardData

from creditrl.bounded_json import RUN_RECORD_LIMITS, loads_bounded
from creditrl.config import Config
from creditrl.config.loader import all_keys
from creditrl.config.run_files import METRICS_LINES, run_file_lines
from creditrl.config.validate import format_value
from creditrl.exporting.sources import RunCheckpoint

__all__ = ["EMBEDDED_HUB_ID", "MAX_METRICS_LINE", "changed_keys", "model_card", "validations"]

EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # model.path=embedded, on the Hub
EMBEDDED_NOTE = f"{EMBEDDED_HUB_ID} as creditrl ships it: a Q4_1 GGUF dequantized to float32"
MAX_METRICS_LINE = METRICS_LINES.max_line_bytes  # bytes; metrics rows are a few KiB


def _value(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def changed_keys(cfg: Config) -> dict[str, str]:
    """Dotted config keys whose value differs from the default, as override text."""
    keys = all_keys()
    sections = {k.rsplit(".", 1)[0] for k in keys if "." in k}
    default = Config()
    return {
        key: format_value(_value(cfg, key))
        for key in keys
        if key not in sections and _value(cfg, key) != _value(default, key)
    }


def _escape(text: str) -> str:
    """Text for a Markdown table cell inside backticks."""
    return text.replace("|", "\\|").replace("`", "'")


def _number(value: Any) -> bool:
    """A finite JSON number (an integer too large for a float is not one)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def validations(run_dir: Path, step: int) -> tuple[dict[str, float], dict[str, float], int, int]:
    """(val/* before training, val/* of the last validation at or before ``step``, that
    validation's step, lines skipped) from ``run_dir/metrics.jsonl``; empty dicts when not
    recorded. A step logged twice counts by its last row."""
    rows: dict[int, dict[str, float]] = {}
    skipped = 0
    path = run_dir / "metrics.jsonl"
    if not os.path.lexists(path):
        return {}, {}, 0, 0
    for line in run_file_lines(path, METRICS_LINES, inside=run_dir):
        if line.data is None:  # over MAX_METRICS_LINE: left unread
            skipped += 1
            continue
        if not line.data.strip():
            continue
        try:
            row = loads_bounded(line.data, RUN_RECORD_LIMITS)
        except ValueError:  # UnicodeDecodeError and JsonLimitError too
            skipped += 1
            continue
        s = row.get("step") if isinstance(row, dict) else None
        if not isinstance(s, int) or isinstance(s, bool):
            skipped += 1
            continue
        vals = {k: float(v) for k, v in row.items() if k.startswith("val/") and _number(v)}
        if vals:
            rows[s] = vals
    before = rows.get(0, {})
    done = [s for s in rows if 0 < s <= step]
    last = max(done, default=0)
    return before, rows.get(last, {}) if last else {}, last, skipped


def _training(cfg: Config, ckpt: RunCheckpoint, adapter: bool, dtype: str) -> list[str]:
    from creditrl.rollout.strategies import strategy_traits

    data, traits = cfg.data, strategy_traits(cfg)
    if data.train_files:
        task = f"prompts from `data.train_files={format_value(data.train_files)}`"
    else:
        task = f"`data.task={data.task}` with `data.task_kwargs={format_value(data.task_kwargs)}`"
    if cfg.reward.scorer:
        reward = f"`reward.scorer={cfg.reward.scorer}`"
    else:
        reward = "creditrl's rule scorer for each row's `data_source`"
    if cfg.reward.reward_model.enable:
        reward += (
            f", reward model `{cfg.reward.reward_model.path}` ({cfg.reward.reward_model.mode})"
        )
    lines = [
        f"- base model: `model.path={cfg.model.path}`"
        + (f" ({EMBEDDED_NOTE})" if cfg.model.path == "embedded" else ""),
        f"- task: {task}" + (f", agent tools {cfg.agent.tools}" if traits.uses_tools else ""),
        f"- reward: {reward}",
        f"- algorithm: `algorithm.adv_estimator={cfg.algorithm.adv_estimator}`, "
        f"`actor.policy_loss={cfg.actor.policy_loss}`",
        f"- steps: {ckpt.step} of `trainer.total_steps={cfg.trainer.total_steps}` "
        f"(checkpoint `{ckpt.directory.name}`)",
    ]
    if cfg.model.lora_rank > 0:
        form = "the adapter alone" if adapter else "merged into the weights"
        lines.append(
            f"- LoRA: rank {cfg.model.lora_rank}, alpha {cfg.model.lora_alpha}, "
            f"`{cfg.model.target_modules}`; exported {form}"
        )
    lines.append(f"- weights: {dtype} (trained in {cfg.model.dtype})")
    return lines


def _cell(value: float | None) -> str:
    return "not recorded" if value is None else f"{value:.4f}"


def _validation(before: dict[str, float], after: dict[str, float], at: int) -> list[str]:
    if not before and not after:
        return ["The run recorded no validation up to this step."]
    columns = (["before training"] if before else []) + ([f"after step {at}"] if after else [])
    rows = ["| metric | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for key in sorted(set(before) | set(after)):
        cells = ([_cell(before.get(key))] if before else []) + (
            [_cell(after.get(key))] if after else []
        )
        rows.append(f"| `{_escape(key)}` | " + " | ".join(cells) + " |")
    return rows


def _usage(out_name: str, adapter: bool, base_dir: Path) -> list[str]:
    name, base = json.dumps(out_name), json.dumps(str(base_dir))  # Python string literals
    if adapter:
        return [
            "```python",
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f"base = AutoModelForCausalLM.from_pretrained({base})  # the run's base",
            f"model = PeftModel.from_pretrained(base, {name})",
            f"tokenizer = AutoTokenizer.from_pretrained({name})",
            "```",
        ]
    return [
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f"model = AutoModelForCausalLM.from_pretrained({name})",
        f"tokenizer = AutoTokenizer.from_pretrained({name})",
        'messages = [{"role": "user", "content": "What is 3 + 4?"}]',
        "inputs = tokenizer.apply_chat_template(",
        '    messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"',
        ")",
        "output = model.generate(**inputs, max_new_tokens=64)",
        'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], '
        "skip_special_tokens=True))",
        "```",
        "",
        f"Evaluate it on the run's task: `creditrl eval {out_name} [key=value ...]`.",
    ]


def model_card(
    cfg: Config,
    ckpt: RunCheckpoint,
    out_name: str,
    base_dir: Path,
    adapter: bool,
    dtype: str,
    version: str,
) -> tuple[str, int]:
    """The README.md text of an export (``base_dir``: the run's base model directory), and
    the metrics.jsonl lines skipped reading it."""
    before, after, at, skipped = validations(ckpt.run_dir, ckpt.step)
    data = ModelCardData(
        base_model=EMBEDDED_HUB_ID if cfg.model.path == "embedded" else None,
        base_model_relation=("adapter" if adapter else "finetune")
        if cfg.model.path == "embedded"
        else None,
        library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation",
        tags=["creditrl", "reinforcement-learning", cfg.algorithm.adv_estimator],
    )
    changed = changed_keys(cfg)
    lines = [
        "---",
        data.to_yaml(),
        "---",
        "",
        f"# {out_name}",
        "",
        f"Trained by reinforcement learning with creditrl; exported by creditrl {version} "
        f"from `{ckpt.run_dir.name}` at step {ckpt.step}.",
        "",
        "## Training",
        "",
        *_training(cfg, ckpt, adapter, dtype),
        "",
        "## Validation",
        "",
        *_validation(before, after, at),
        "",
        "## Config keys that differ from the defaults",
        "",
        "| key | value |",
        "|---|---|",
        *(f"| `{key}` | `{_escape(value)}` |" for key, value in changed.items()),
        "",
        "## How to load",
        "",
        *_usage(out_name, adapter, base_dir),
        "",
    ]
    return "\n".join(lines), skipped

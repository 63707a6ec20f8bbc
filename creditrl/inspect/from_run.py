"""Explain views of a run's rollout dump (``RUN/rollouts/step_NNNNNN.jsonl``).

The dump holds, for its first rows, the per-token tensors the step was trained on (see
``creditrl.tracking.rollout_dump``); they are shown as stored. What the dump does not hold is
derived by ``creditrl.inspect.compute.derive`` with the run's settings: the config from
``RUN/config.yaml`` or ``RUN/config.json`` when the run wrote one, else the defaults plus the
given overrides (say ``preset=ppo`` for a PPO run), and β from the step's logged
``actor/reward_kl_penalty_coeff``. The run's config is read as data: its
``trainer.extensions`` are imported only with ``trust_run_code`` (``--trust-run-code``).
Every file of the run gets a run file's checks and bounds (``creditrl.config.run_files``): a
FIFO, a link outside the run or a file too large is one line, never a hang.
With ``theta`` (a checkpoint), log π_θ, the ratio and the clip flag are computed on the dumped
token ids.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from creditrl.bounded_json import RUN_RECORD_LIMITS, loads_bounded
from creditrl.config import Config
from creditrl.config.loader import load_config
from creditrl.config.run_config import load_run_config
from creditrl.config.run_files import METRICS_LINES, run_file_lines
from creditrl.inspect.compute import Settings, derive, rewards_from_scores, to_views
from creditrl.inspect.view import TokenView, token_text
from creditrl.tracking.rollout_dump import load_rollout_dump

__all__ = ["DUMP_FIELDS", "dumped_steps", "run_config", "step_metrics", "views_from_run"]

# dump field (Batch name) -> explain column
DUMP_FIELDS = {
    "response_mask": "mask",
    "turn_ids": "turn",
    "rollout_log_probs": "rollout_log_prob",
    "rollout_kept_counts": "kept",
    "token_weight_version": "version",
    "old_log_probs": "old_log_prob",
    "ref_log_prob": "ref_log_prob",
    "teacher_log_prob": "teacher_log_prob",
    "entropys": "entropy",
    "token_level_scores": "score",
    "token_level_rewards": "reward",
    "values": "value",
    "advantages": "advantage",
    "returns": "return",
    "rollout_is_weights": "is_weight",
    "loss_mask": "loss_mask",
}
_INT_COLUMNS = ("mask", "turn", "kept", "version", "loss_mask")


def dumped_steps(run_dir: Path) -> list[int]:
    """Steps with a rollout dump in ``run_dir/rollouts``, ascending."""
    folder = Path(run_dir) / "rollouts"
    steps = []
    for path in folder.glob("step_*.jsonl"):
        try:
            steps.append(int(path.stem.removeprefix("step_")))
        except ValueError:
            continue
    return sorted(steps)


def run_config(
    run_dir: Path, overrides: Sequence[str] = (), trust_run_code: bool = False
) -> tuple[Config, str | None]:
    """The run's config (``config.yaml`` or ``config.json`` in ``run_dir``; JSON is YAML) with
    ``overrides`` on top, read as data; else defaults + overrides, and a note saying so."""
    for name in ("config.yaml", "config.json"):
        path = Path(run_dir) / name
        if os.path.lexists(path):  # a FIFO or a link too: load_run_config says what is wrong
            return load_run_config(path, overrides, trust_code=trust_run_code), None
    note = (
        f"{run_dir} holds no config.yaml/config.json: gamma, lam and the estimators are the "
        "defaults plus the overrides given" + (f" ({' '.join(overrides)})" if overrides else "")
    )
    return load_config(None, list(overrides)), note


def step_metrics(run_dir: Path, step: int, notes: list[str] | None = None) -> dict[str, Any]:
    """The metrics.jsonl record of ``step`` ({} when absent or unreadable), the file read line
    by line within ``METRICS_LINES``; a one-line ``DataError`` when it is no regular file of
    the run or too large. When ``step`` has no record and lines were left out (unreadable or
    over the line limit), ``notes`` gets a line saying so."""
    path = Path(run_dir) / "metrics.jsonl"
    if not os.path.lexists(path):
        return {}
    found: dict[str, Any] = {}
    bad, long = 0, 0
    for line in run_file_lines(path, METRICS_LINES, inside=run_dir):
        if line.data is None:
            long += 1
            continue
        try:
            row = loads_bounded(line.data, RUN_RECORD_LIMITS)
        except ValueError:
            bad += bool(line.data.strip())
            continue
        if isinstance(row, dict) and row.get("step") == step:
            found = row
    if not found and (bad or long) and notes is not None:
        notes.append(
            f"{path}: no record of step {step} read; {bad} unreadable lines and {long} lines "
            f"over the limit of {METRICS_LINES.max_line_bytes} bytes were left out"
        )
    return found


def _has_per_token(record: Any) -> bool:
    return isinstance(record, dict) and "per_token" in record


def _padded(rows: list[dict[str, Any]], field: str, width: int) -> torch.Tensor:
    """(B, width) float64 of a per-token field: NaN for null (a non-finite value was dumped),
    0 beyond each row's length."""
    out = torch.zeros((len(rows), width), dtype=torch.float64)
    for i, row in enumerate(rows):
        values = [math.nan if v is None else float(v) for v in row["per_token"][field]]
        out[i, : len(values)] = torch.tensor(values, dtype=torch.float64)
    return out


def views_from_run(
    run_dir: str | Path,
    step: int | None = None,
    rows: Sequence[int] | None = None,
    overrides: Sequence[str] = (),
    theta: str | Path | None = None,
    *,
    trust_run_code: bool = False,
) -> list[TokenView]:
    """Views of the dumped rows of ``step`` (default: the last dumped step); ``rows`` picks rows
    by their index in the batch; ``trust_run_code`` imports the run's ``trainer.extensions``."""
    run_dir = Path(run_dir)
    steps = dumped_steps(run_dir)
    if not steps:
        raise FileNotFoundError(f"{run_dir}/rollouts has no step_*.jsonl rollout dump")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise FileNotFoundError(f"{run_dir} has no rollout dump for step {step}; it has {steps}")
    path = run_dir / "rollouts" / f"step_{step:06d}.jsonl"
    detailed = load_rollout_dump(path, inside=run_dir, keep=_has_per_token)
    if rows is not None:
        have = {r["row"] for r in detailed}
        missing = [i for i in rows if i not in have]
        if missing:
            raise ValueError(
                f"step {step}: rows {missing} have no per-token dump (rows with one: "
                f"{sorted(have)}; raise trainer.rollout_dump_rows to dump more)"
            )
        detailed = [r for r in detailed if r["row"] in set(rows)]
    if not detailed:
        raise ValueError(
            f"step {step}: no row has per-token tensors (trainer.rollout_dump_rows=0?)"
        )
    cfg, config_note = run_config(run_dir, overrides, trust_run_code)
    notes = [config_note] if config_note else []
    beta = step_metrics(run_dir, step, notes).get("actor/reward_kl_penalty_coeff")
    settings = Settings.from_config(cfg, beta=beta)
    lengths = [len(r["per_token"]["ids"]) for r in detailed]
    width = max(lengths)
    t: dict[str, torch.Tensor] = {}
    for field, name in DUMP_FIELDS.items():
        if all(field in r["per_token"] for r in detailed):
            t[name] = _padded(detailed, field, width)
    if "mask" not in t:
        raise ValueError(f"step {step}: the dump has no response_mask")
    for name in _INT_COLUMNS:
        if name in t:
            t[name] = torch.nan_to_num(t[name]).to(torch.int64)
    notes += _check_rewards(t, settings)
    if theta is not None:
        t["log_prob"] = _theta_log_probs(detailed, cfg, theta, t["mask"])
    notes += derive(t, settings)
    titles = [
        f"step {step}, row {r['row']} (score {r.get('score')}, {r.get('data_source')})"
        for r in detailed
    ]
    return to_views(
        t,
        lengths,
        [[token_text(p) for p in r["per_token"]["tokens"]] for r in detailed],
        titles,
        ids=[r["per_token"]["ids"] for r in detailed],
        prompts=[r.get("prompt") for r in detailed],
        settings={"run": str(run_dir), "step": step, **settings.describe()},
        notes=notes,
    )


def _check_rewards(t: dict[str, torch.Tensor], s: Settings) -> list[str]:
    """A note when the stored rewards are not score - β·kl under the settings given."""
    need = {"score", "reward"}
    if s.kl_in == "reward":
        need |= {"old_log_prob", "ref_log_prob"}
    if not need <= set(t):
        return []
    expected, _ = rewards_from_scores(t, s)
    gap = float(torch.nan_to_num((expected - t["reward"]) * t["mask"]).abs().max())
    if gap <= 1e-5:
        return []
    return [
        f"stored rewards differ from score - beta*kl (kl {s.kl_estimator} in the "
        f"{s.kl_in or 'nowhere'}, beta={s.beta}) by up to {gap:.3g}: are the run's "
        "algorithm.use_kl_in_reward / kl_penalty given?"
    ]


def _theta_log_probs(
    rows: list[dict[str, Any]], cfg: Config, theta: str | Path, mask: torch.Tensor
) -> torch.Tensor:
    """log π_θ(y_t | s_t) (B, T) of the dumped token ids under the policy ``theta``, over each
    token's dumped kept set (sampling replay) when the dump has one."""
    from creditrl.inspect.models import build_batch, compute_log_probs, load_policy

    if not all("prompt_ids" in r["per_token"] for r in rows):
        raise ValueError(
            "this rollout dump has no prompt_ids (written by an older creditrl), so log-probs "
            "cannot be recomputed on the exact tokens; ratio and clip need a newer run"
        )
    batch = build_batch(
        [r["per_token"]["prompt_ids"] for r in rows],
        [r["per_token"]["ids"] for r in rows],
        pad_token_id=0,
        response_mask=[[int(m) for m in r["per_token"]["response_mask"]] for r in rows],
    )
    if all("rollout_kept_counts" in r["per_token"] for r in rows):  # replay the kept sets
        kept = torch.zeros(batch["responses"].shape, dtype=torch.long)
        for i, r in enumerate(rows):
            counts = r["per_token"]["rollout_kept_counts"]
            kept[i, : len(counts)] = torch.tensor(counts, dtype=torch.long)
        batch["rollout_kept_counts"] = kept
    log_probs, _ = compute_log_probs(load_policy(cfg, theta), batch, cfg)
    return log_probs.to(torch.float64)[:, : mask.shape[1]]

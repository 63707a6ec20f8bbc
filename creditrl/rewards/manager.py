"""Reward manager: decoded responses -> scorer -> token_level_scores on the last valid token.

``submit(batch)`` decodes the responses, queues one JSON request per sample on the scoring pool
(and the reward model, if enabled, on a background thread) and returns a ``RewardFuture`` at
once, so the trainer can overlap scoring with its log-prob passes. ``future.result()`` gives a
``RewardResult``. A scorer that raises, runs past ``cfg.timeout_s``, returns a result outside
``creditrl.rewards.results``' bounds (too deep or large: "error"; a score not finite or beyond
+-1e9, a sub-metric not a finite float32: "nan") gives ``cfg.fallback_score`` with its status and
message recorded per sample and counted in the metrics; when more than
``cfg.max_failure_rate`` of a batch fails, ``result()`` raises ``ScoringError`` quoting the first
failure instead.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from creditrl.batch import Batch
from creditrl.config.schema import RewardConfig
from creditrl.core import place_sequence_scores
from creditrl.rewards.failures import check_failure_rate, check_max_failure_rate
from creditrl.rewards.pool import ScoringJob, ScoringPool
from creditrl.rewards.registry import PROGRAM_SCORER, is_builtin, portable_spec, scorer_spec
from creditrl.rewards.text import decode_responses, prompt_messages

__all__ = ["RM_MODES", "RewardFuture", "RewardManager", "RewardResult", "extra_means"]

log = logging.getLogger(__name__)

RM_MODES = ("replace", "add")
STATUSES = ("ok", "error", "timeout", "nan")
_ids = itertools.count()


@dataclass
class RewardResult:
    """Scores of one batch.

    - ``token_level_scores`` (B, T) float32: ``scores[i]`` on row i's last valid response token
      (``response_mask``), 0 elsewhere.
    - ``scores`` (B,) float32: the sequence scores (rule score, RM score, or their sum).
    - ``extra``: ``{key: list of length B}``; always "reward_status" (ok|error|timeout|nan) and
      "reward_error" (message or None), plus the scorers' extra keys (None where absent) and
      "rm_score" with a reward model.
    - ``metrics``: reward/errors, reward/timeouts, reward/nan (counts), reward/score_mean,
      reward/score_min, reward/score_max, reward/<key>_mean for numeric extra keys.
    - ``rm_scores`` (B, T) float32 or None: the reward model's score on the last valid token.
    """

    token_level_scores: torch.Tensor
    scores: torch.Tensor
    extra: dict[str, list[Any]]
    metrics: dict[str, float]
    rm_scores: torch.Tensor | None = None

    def per_sample_extra(self) -> list[dict[str, Any]]:
        """``extra`` as one dict per sample (the ``reward_extra_info`` field)."""
        return [{k: v[i] for k, v in self.extra.items()} for i in range(len(self.scores))]

    def write_to(self, batch: Batch) -> None:
        """Set token_level_scores, reward_extra_info and (with a reward model) rm_scores."""
        batch["token_level_scores"] = self.token_level_scores
        batch["reward_extra_info"] = self.per_sample_extra()
        if self.rm_scores is not None:
            batch["rm_scores"] = self.rm_scores


@dataclass
class _Pending:
    job: ScoringJob
    response_mask: torch.Tensor
    fallback: float
    max_failure_rate: float = 1.0
    scorers: list[tuple[str, str]] = field(default_factory=list)  # (scorer, data_source)
    rm_mode: str | None = None
    rm_thread: threading.Thread | None = None
    rm_out: dict[str, Any] = field(default_factory=dict)


class RewardFuture:
    """A batch being scored; ``result()`` blocks until every sample has a reply."""

    def __init__(self, pending: _Pending) -> None:
        self._pending = pending
        self._result: RewardResult | None = None

    def done(self) -> bool:
        p = self._pending
        return p.job.done() and (p.rm_thread is None or not p.rm_thread.is_alive())

    def result(self, timeout: float | None = None) -> RewardResult:
        """The RewardResult; TimeoutError if not done within ``timeout`` seconds; ScoringError
        if more than ``max_failure_rate`` of the samples failed to score."""
        if self._result is None:
            p = self._pending
            if not p.job.wait(timeout):
                raise TimeoutError(f"reward scoring not done after {timeout}s")
            if p.rm_thread is not None:
                p.rm_thread.join(timeout)
                if p.rm_thread.is_alive():
                    raise TimeoutError(f"reward model scoring not done after {timeout}s")
                if "error" in p.rm_out:
                    raise RuntimeError("reward model scoring failed") from p.rm_out["error"]
            self._result = _assemble(p)
        return self._result


def _jsonable(value: Any, what: str) -> Any:
    """``value`` with numpy scalars/arrays made Python; TypeError naming ``what`` otherwise."""

    def convert(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return v.tolist()
        if isinstance(v, np.generic):
            return v.item()
        if isinstance(v, Mapping):
            return dict(v)
        if isinstance(v, Sequence) and not isinstance(v, str | bytes):
            return list(v)
        raise TypeError(f"{type(v).__name__} is not JSON serializable")

    try:
        return json.loads(json.dumps(value, default=convert))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} cannot be sent to a reward worker as JSON: {e}") from e


def _column(batch: Batch, name: str, default: Any = None) -> Sequence[Any]:
    if name in batch:
        return batch[name]
    if default is None:
        raise KeyError(f"reward manager needs the non-tensor field {name!r}; batch has {batch}")
    return [default] * len(batch)


class RewardManager:
    """Rule scorers in worker processes, optionally a reward model; see the module docstring.

    ``num_workers=0`` scores user scorers in this process, a scorer past the timeout abandoned
    on its thread, at most ``inprocess.MAX_ABANDONED`` at a time (``creditrl.rewards.inprocess``),
    and the built-in scorers in one worker process killed at the timeout
    (``creditrl.rewards.pool``). Use
    as a context manager or call ``close()``; workers also exit by themselves when this process
    ends.
    """

    def __init__(self, cfg: RewardConfig, tokenizer: Any, reward_model: Any | None = None) -> None:
        rm_cfg = cfg.reward_model
        check_max_failure_rate(cfg.max_failure_rate)
        if rm_cfg.enable and rm_cfg.mode not in RM_MODES:
            raise ValueError(
                f"reward.reward_model.mode must be one of {RM_MODES}, got {rm_cfg.mode!r}"
            )
        self.cfg = cfg
        self.tokenizer = tokenizer
        if rm_cfg.enable and reward_model is None:
            from creditrl.rewards.reward_model import RewardModelWorker

            reward_model = RewardModelWorker(rm_cfg, tokenizer)
        self.reward_model = reward_model if rm_cfg.enable else None
        self.use_rules = self.reward_model is None or rm_cfg.mode == "add"
        self.pool = ScoringPool(cfg.num_workers, cfg.timeout_s) if self.use_rules else None

    def submit(self, batch: Batch) -> RewardFuture:
        """Start scoring ``batch`` in the background and return at once.

        Needs tensors responses, response_mask and non-tensors data_source, ground_truth
        (extra_info optional; raw_prompt with a reward model). Raises at once for an unknown
        data_source or a sample whose ground_truth / extra_info is not JSON-able.
        """
        texts = decode_responses(batch, self.tokenizer)
        mask = batch["response_mask"].detach().cpu().clone()
        pending = _Pending(
            ScoringJob(0), mask, float(self.cfg.fallback_score), self.cfg.max_failure_rate
        )
        if self.pool is not None:
            pending.job = self._queue_rules(batch, texts, pending.scorers)
        if self.reward_model is not None:
            pending.rm_mode = self.cfg.reward_model.mode
            pending.rm_thread = self._start_rm(batch, texts, pending)
        return RewardFuture(pending)

    def __call__(self, batch: Batch) -> RewardResult:
        """``submit(batch).result()``."""
        return self.submit(batch).result()

    def _queue_rules(
        self, batch: Batch, texts: list[str], scorers: list[tuple[str, str]]
    ) -> ScoringJob:
        assert self.pool is not None
        sources = _column(batch, "data_source")
        truths = _column(batch, "ground_truth")
        infos = _column(batch, "extra_info", default={})
        kwargs = _jsonable(self.cfg.scorer_kwargs, "reward.scorer_kwargs")
        specs: dict[str, str] = {}
        lines = []
        for i, (source, text) in enumerate(zip(sources, texts, strict=True)):
            source = str(source)
            program = isinstance(infos[i], Mapping) and "program_reward" in infos[i]
            if not program and source not in specs:
                spec = scorer_spec(source, self.cfg.scorer)
                specs[source] = portable_spec(spec) if self.cfg.num_workers > 0 else spec
            spec = PROGRAM_SCORER if program else specs[source]
            scorers.append((spec, source))
            request_id = next(_ids)
            request = {
                "id": request_id,
                "scorer": spec,
                "scorer_kwargs": kwargs,
                "data_source": source,
                "solution_str": text,
                "ground_truth": _jsonable(truths[i], f"sample {i}: ground_truth"),
                "extra_info": _jsonable(infos[i], f"sample {i}: extra_info"),
            }
            in_process = self.cfg.num_workers == 0 and not is_builtin(spec)
            lines.append((request_id, json.dumps(request) + "\n", in_process))
        job = ScoringJob(len(lines))
        for i, (request_id, line, in_process) in enumerate(lines):
            self.pool.put(job, i, request_id, line, in_process)
        return job

    def _start_rm(self, batch: Batch, texts: list[str], pending: _Pending) -> threading.Thread:
        conversations = [
            [*prompt_messages(batch, i), {"role": "assistant", "content": text}]
            for i, text in enumerate(texts)
        ]

        def run() -> None:
            try:
                pending.rm_out["scores"] = self.reward_model.score_conversations(conversations)
            except Exception as e:
                pending.rm_out["error"] = e

        thread = threading.Thread(target=run, daemon=True, name="reward-model")
        thread.start()
        return thread

    def close(self) -> None:
        """End the worker processes (queued samples get status "error")."""
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def extra_means(extra: Mapping[str, Sequence[Any]]) -> dict[str, float]:
    """``reward/<key>_mean``: the mean of each extra column's finite numbers (a scorer dict's
    sub-scores, an environment's rubric parts); status and error columns aside."""
    metrics = {}
    for key, values in extra.items():
        nums = [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]
        if nums and key not in ("reward_status", "reward_error"):
            metrics[f"reward/{key}_mean"] = sum(nums) / len(nums)
    return metrics


def _describe_failure(index: int, error: str, scorer: tuple[str, str]) -> str:
    """The ScoringError quote of one failure: scorer, sample, data_source and error."""
    return f"{scorer[0]} on sample {index} (data_source {scorer[1]!r}): {error}"


def _assemble(p: _Pending) -> RewardResult:
    """Replies -> scores with fallbacks, extras by key, counts and means."""
    size = p.response_mask.shape[0]
    replies = p.job.replies if p.job.replies else [{"status": "ok", "score": 0.0}] * size
    statuses = [r["status"] if r else "error" for r in replies]
    rule = [r["score"] if s == "ok" else p.fallback for r, s in zip(replies, statuses, strict=True)]
    keys = list(dict.fromkeys(k for r in p.job.replies if r for k in r.get("extra", {})))
    extras = [(r or {}).get("extra", {}) for r in replies]
    extra: dict[str, list[Any]] = {k: [e.get(k) for e in extras] for k in keys}
    extra["reward_status"] = statuses
    extra["reward_error"] = [(r or {}).get("error") for r in replies]
    scores = torch.tensor(rule, dtype=torch.float32)
    rm_scores = None
    if p.rm_mode is not None:
        rm = p.rm_out["scores"].to(torch.float32).cpu()
        extra["rm_score"] = rm.tolist()
        scores = rm.clone() if p.rm_mode == "replace" else scores + rm
        rm_scores = place_sequence_scores(rm, p.response_mask)
    errors = [(i, e) for i, e in enumerate(extra["reward_error"]) if e]
    if errors:
        log.warning("%d reward failures; first: sample %d: %s", len(errors), *errors[0])
    if p.job.replies:
        failures = [
            _describe_failure(i, extra["reward_error"][i] or "no reply", p.scorers[i])
            for i, status in enumerate(statuses)
            if status != "ok"
        ]
        check_failure_rate(failures, size, p.max_failure_rate)
    metrics = {
        "reward/errors": float(statuses.count("error")),
        "reward/timeouts": float(statuses.count("timeout")),
        "reward/nan": float(statuses.count("nan")),
        "reward/score_mean": float(scores.mean()) if size else 0.0,
        "reward/score_min": float(scores.min()) if size else 0.0,
        "reward/score_max": float(scores.max()) if size else 0.0,
    }
    metrics.update(extra_means(extra))
    return RewardResult(
        token_level_scores=place_sequence_scores(scores, p.response_mask).to(torch.float32),
        scores=scores,
        extra=extra,
        metrics=metrics,
        rm_scores=rm_scores,
    )

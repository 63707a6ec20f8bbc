"""Per-step training metrics from a Batch, under verl's metric names.

Shapes follow the field catalogue: ``responses`` (B, T) right-padded, ``attention_mask``
(B, P+T) = cat(prompt mask, response part). A response's length is the number of real tokens in
the response part of ``attention_mask`` (policy and observation tokens alike, as in verl);
token statistics (advantages, returns, values) are taken where ``response_mask`` is 1.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

import torch

from creditrl.batch import Batch, require

__all__ = [
    "Timer",
    "compute_data_metrics",
    "compute_throughput_metrics",
    "compute_timing_metrics",
    "reduce_metrics",
    "response_info",
    "timer",
]


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    """``prefix/mean``, ``prefix/max``, ``prefix/min`` of a 1-D tensor (NaN when empty)."""
    x = x.detach().to(torch.float64).flatten()
    if x.numel() == 0:
        return {f"{prefix}/{k}": math.nan for k in ("mean", "max", "min")}
    return {
        f"{prefix}/mean": x.mean().item(),
        f"{prefix}/max": x.max().item(),
        f"{prefix}/min": x.min().item(),
    }


def response_info(batch: Batch) -> dict[str, torch.Tensor]:
    """Per-sample ``prompt_length`` (B,) and ``response_length`` (B,) from ``attention_mask``.

    The prompt part is ``attention_mask[:, :P]`` and the response part ``attention_mask[:, P:]``
    with T = ``responses.shape[-1]`` and P = width - T (``prompts.shape[-1]`` must agree).
    """
    require(batch, "responses", "attention_mask")
    attn = batch["attention_mask"]
    t = batch["responses"].shape[-1]
    p = attn.shape[-1] - t
    if p < 0 or ("prompts" in batch and batch["prompts"].shape[-1] != p):
        raise ValueError(
            f"attention_mask has width {attn.shape[-1]}, expected P + T with T = {t} "
            "(responses) and P = prompts' width: is it the full prompt+response mask?"
        )
    return {
        "prompt_length": attn[:, :p].sum(-1),
        "response_length": attn[:, p:].sum(-1),
    }


def _clipped(batch: Batch, response_length: torch.Tensor) -> torch.Tensor:
    """(B,) bool: the response reached max_response_length and does not end in EOS.

    ``max_response_length`` comes from ``batch.meta`` (falling back to T, verl's choice);
    EOS ids from ``batch.meta["eos_token_id"]`` (int or list) when given, else any response at
    the maximum length counts as clipped.
    """
    responses = batch["responses"]
    max_len = int(batch.meta.get("max_response_length", responses.shape[-1]))
    at_max = response_length >= max_len
    eos = batch.meta.get("eos_token_id")
    if eos is None or responses.shape[-1] == 0:
        return at_max
    eos_ids = torch.as_tensor([eos] if isinstance(eos, int) else list(eos))
    last = (response_length - 1).clamp(min=0).long().unsqueeze(-1)
    last_token = responses.gather(-1, last).squeeze(-1).cpu()
    ends_in_eos = torch.isin(last_token, eos_ids) & (response_length.cpu() > 0)
    return at_max.cpu() & ~ends_in_eos


def compute_data_metrics(batch: Batch, use_critic: bool) -> dict[str, float]:
    """verl's data metrics for one training batch.

    - ``critic/score/*``: sequence score = ``token_level_scores.sum(-1)``;
      ``critic/rewards/*``: ``token_level_rewards.sum(-1)`` (mean/max/min over samples).
    - ``critic/advantages/*``, ``critic/returns/*`` and (``use_critic``) ``critic/values/*``
      over tokens with ``response_mask == 1``; ``critic/vf_explained_var`` =
      1 - Var(returns - values) / (Var(returns) + 1e-5) over the same tokens.
    - ``response_length/*`` and ``response_length/clip_ratio`` (fraction of responses that
      reached ``meta["max_response_length"]`` without EOS), ``prompt_length/*``.

    Each ``critic/*`` group appears when its field is in the batch; ``values`` is required when
    ``use_critic``.
    """
    require(batch, "responses", "response_mask", "attention_mask")
    if use_critic:
        require(batch, "values")
    valid = batch["response_mask"].bool()
    metrics: dict[str, float] = {}
    if "token_level_scores" in batch:
        metrics |= _stats("critic/score", batch["token_level_scores"].sum(-1))
    if "token_level_rewards" in batch:
        metrics |= _stats("critic/rewards", batch["token_level_rewards"].sum(-1))
    for name in ("advantages", "returns"):
        if name in batch:
            metrics |= _stats(f"critic/{name}", batch[name][valid])
    if use_critic:
        values = batch["values"][valid].to(torch.float64)
        metrics |= _stats("critic/values", values)
        if "returns" in batch and values.numel() > 1:
            returns = batch["returns"][valid].to(torch.float64)
            explained = 1.0 - torch.var(returns - values) / (torch.var(returns) + 1e-5)
            metrics["critic/vf_explained_var"] = explained.item()
    info = response_info(batch)
    response_length = info["response_length"]
    metrics |= _stats("response_length", response_length)
    metrics["response_length/clip_ratio"] = (
        _clipped(batch, response_length).to(torch.float64).mean().item()
    )
    metrics |= _stats("prompt_length", info["prompt_length"])
    return metrics


def compute_timing_metrics(timing: Mapping[str, float], batch: Batch) -> dict[str, float]:
    """``timing_s/<stage>`` (seconds) and ``timing_per_token_ms/<stage>``.

    Per-token time divides by the response tokens for ``gen`` (generation produces them) and by
    all real tokens (prompt + response) for every other stage.
    """
    info = response_info(batch)
    n_response = int(info["response_length"].sum())
    n_overall = n_response + int(info["prompt_length"].sum())
    metrics = {f"timing_s/{name}": float(s) for name, s in timing.items()}
    for name, seconds in timing.items():
        tokens = n_response if name == "gen" else n_overall
        metrics[f"timing_per_token_ms/{name}"] = float(seconds) * 1000.0 / max(tokens, 1)
    return metrics


def compute_throughput_metrics(
    timing: Mapping[str, float], batch: Batch, n_gpus: int = 1
) -> dict[str, float]:
    """``perf/total_num_tokens`` (real prompt + response tokens), ``perf/time_per_step``
    (= ``timing["step"]``) and ``perf/throughput`` = tokens / (step seconds * n_gpus)."""
    if "step" not in timing:
        raise KeyError(f"timing has no 'step' entry (stages: {sorted(timing)}); time the step")
    info = response_info(batch)
    tokens = int(info["prompt_length"].sum() + info["response_length"].sum())
    seconds = float(timing["step"])
    return {
        "perf/total_num_tokens": float(tokens),
        "perf/time_per_step": seconds,
        "perf/throughput": tokens / (seconds * n_gpus) if seconds > 0 else math.nan,
    }


def reduce_metrics(metrics: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Mean per key over a list of metric dicts (a key averages over the dicts that hold it)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for row in metrics:
        for key, value in row.items():
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}


class Timer:
    """Context manager adding the seconds spent inside it to ``timing[name]``."""

    def __init__(self, name: str, timing: dict[str, float]) -> None:
        self.name = name
        self.timing = timing
        self.elapsed = 0.0
        self._start = 0.0

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.elapsed = time.perf_counter() - self._start
        self.timing[self.name] = self.timing.get(self.name, 0.0) + self.elapsed


def timer(name: str, timing: dict[str, float]) -> Timer:
    """``with timer("gen", timing): ...`` adds the block's seconds to ``timing["gen"]``."""
    return Timer(name, timing)

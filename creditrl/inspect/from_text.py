"""Explain views of a prompt and responses given as text, computed on the spot with a model.

The prompt goes through the chat template (as training prompts do) unless ``raw_prompt``; each
response is tokenized and, unless ``eos=False``, ends with EOS. Then, as in a training step:
log π_old (``model.path``, or the ``actor`` checkpoint) and its entropy; log π_ref (the base
``model.path``) when KL is configured; V(s_t) from the ``critic`` (a fresh zero-head critic
when the estimator is GAE and none is given); the score from ``score`` or the configured
reward (the data_source's scorer against ``ground_truth``); rewards and advantages by the
configured estimator, the responses forming one group; with ``distill.teacher``, the
teacher's log-probs of the same response ids after its prompt (``distill.teacher_prompt``:
``ground_truth`` adds the given ``ground_truth``; ``few_shot`` has no task rows here, so the
teacher sees the prompt as given) and the distillation term; and, with ``theta``, log π_θ, the
ratio and the clip flag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from creditrl.config import Config
from creditrl.core import place_sequence_scores
from creditrl.data.dataset import chat_prompt_ids
from creditrl.inspect.compute import Settings, derive, rewards_from_scores, run_estimator, to_views
from creditrl.inspect.models import (
    build_batch,
    compute_log_probs,
    compute_values,
    load_critic,
    load_policy,
)
from creditrl.inspect.view import TokenView, token_text
from creditrl.models import CriticModel, load_tokenizer, resolve_model_path

__all__ = ["views_from_text"]


def _prompt_ids(tokenizer: Any, prompt: str, cfg: Config, raw_prompt: bool) -> list[int]:
    if raw_prompt:
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    messages = [{"role": "user", "content": prompt}]
    if cfg.data.system_prompt:
        messages.insert(0, {"role": "system", "content": cfg.data.system_prompt})
    return chat_prompt_ids(tokenizer, messages)


def _teacher_log_probs(
    cfg: Config,
    tokenizer: Any,
    prompt_ids: list[int],
    response_ids: list[list[int]],
    ground_truth: str | None,
    raw_prompt: bool,
    prompt: str,
) -> tuple[torch.Tensor, str]:
    """log π_T (B, T) of the responses after the teacher's prompt, and a note saying which."""
    from creditrl.data.rows import PromptRow
    from creditrl.data.teacher import teacher_messages
    from creditrl.pipeline.teacher import load_teacher

    kind = cfg.distill.teacher_prompt
    teacher_ids, seen = prompt_ids, "the same prompt"
    if kind == "ground_truth" and ground_truth is not None and not raw_prompt:
        messages = [{"role": "user", "content": prompt}]
        if cfg.data.system_prompt:
            messages.insert(0, {"role": "system", "content": cfg.data.system_prompt})
        row = PromptRow(messages, ground_truth, "explain")
        teacher_ids = chat_prompt_ids(tokenizer, teacher_messages(row, kind) or messages)
        seen = "the prompt with the ground truth added"
    rows = build_batch([teacher_ids] * len(response_ids), response_ids, tokenizer.pad_token_id)
    teacher = load_teacher(cfg, len(tokenizer))
    log_probs = compute_log_probs(teacher, rows, cfg)[0].double()
    return log_probs, f"teacher {cfg.distill.teacher!r} (teacher_prompt={kind}) sees {seen}"


def _scores(
    batch: Any,
    cfg: Config,
    tokenizer: Any,
    score: float | None,
    ground_truth: str | None,
    data_source: str | None,
) -> tuple[torch.Tensor, list[str]]:
    """token_level_scores (B, T) and a note per response saying where its score came from."""
    mask = batch["response_mask"]
    if score is not None:
        scores = torch.full((len(batch),), float(score), dtype=torch.float64)
        return place_sequence_scores(scores, mask), [f"score {score} given (--score)"] * len(batch)
    if ground_truth is None:
        scores = torch.zeros(len(batch), dtype=torch.float64)
        note = (
            "score 0: no --ground-truth or --score given (log-probs, KL and values do not need one)"
        )
        return place_sequence_scores(scores, mask), [note] * len(batch)
    source = data_source or (f"reasoning_gym/{cfg.data.task}" if cfg.data.task else None)
    if source is None:
        raise ValueError("explain needs --data-source to pick a scorer (no data.task is set)")
    batch["data_source"] = [source] * len(batch)
    batch["ground_truth"] = [ground_truth] * len(batch)
    from creditrl.rewards import RewardManager

    with RewardManager(dataclasses.replace(cfg.reward, num_workers=0), tokenizer) as manager:
        result = manager(batch)
    notes = []
    for i, s in enumerate(result.scores.tolist()):
        status, error = result.extra["reward_status"][i], result.extra["reward_error"][i]
        detail = "" if status == "ok" else f" ({status}: {error}; fallback score)"
        notes.append(f"score {s:g} by the {source} scorer, ground truth {ground_truth!r}{detail}")
    return result.token_level_scores.to(torch.float64), notes


def views_from_text(
    prompt: str,
    responses: Sequence[str],
    cfg: Config,
    *,
    score: float | None = None,
    ground_truth: str | None = None,
    data_source: str | None = None,
    actor: str | Path | None = None,
    critic: str | Path | None = None,
    theta: str | Path | None = None,
    raw_prompt: bool = False,
    eos: bool = True,
) -> list[TokenView]:
    """One view per response (see the module docstring)."""
    if not responses:
        raise ValueError("explain needs at least one response")
    tokenizer = load_tokenizer(cfg.model.path, cfg.model.cache_dir)
    prompt_ids = _prompt_ids(tokenizer, prompt, cfg, raw_prompt)
    response_ids = [list(tokenizer.encode(r, add_special_tokens=False)) for r in responses]
    if eos:
        response_ids = [[*ids, tokenizer.eos_token_id] for ids in response_ids]
    batch = build_batch([prompt_ids] * len(responses), response_ids, tokenizer.pad_token_id)
    settings = Settings.from_config(cfg)
    notes: list[str] = []
    policy = load_policy(cfg, actor)
    t: dict[str, torch.Tensor] = {"mask": batch["response_mask"]}
    old, entropy = compute_log_probs(policy, batch, cfg)
    t["old_log_prob"], t["entropy"] = old.double(), entropy.double()
    if settings.kl_in is not None:
        ref = policy if actor is None else load_policy(cfg, None)
        t["ref_log_prob"] = compute_log_probs(ref, batch, cfg)[0].double()
        if actor is None:
            notes.append("no --actor: π_old is model.path itself, so π_ref = π_old and kl = 0")
    if cfg.distill.teacher is not None:
        t["teacher_log_prob"], note = _teacher_log_probs(
            cfg, tokenizer, prompt_ids, response_ids, ground_truth, raw_prompt, prompt
        )
        notes.append(note)
    if critic is not None:
        t["value"] = compute_values(load_critic(cfg, critic), batch, cfg).double()
    elif settings.needs_values:
        base = resolve_model_path(cfg.model.critic_path or cfg.model.path, cfg.model.cache_dir)
        t["value"] = compute_values(CriticModel.from_actor(base), batch, cfg).double()
        notes.append("no --critic: a fresh critic (zero value head), so V(s_t) = 0")
    t["score"], score_notes = _scores(batch, cfg, tokenizer, score, ground_truth, data_source)
    t["reward"], _ = rewards_from_scores(t, settings)
    t["advantage"], t["return"] = run_estimator(t, settings, ["prompt"] * len(responses))
    if len(responses) == 1 and settings.grouped:
        notes.append(
            f"{settings.adv_estimator} compares responses to one prompt: a single response "
            "gets advantage 0 (give several --response)"
        )
    if theta is not None:
        t["log_prob"] = compute_log_probs(load_policy(cfg, theta), batch, cfg)[0].double()
    notes += derive(t, settings)
    tokens = [[token_text(p) for p in tokenizer.convert_ids_to_tokens(ids)] for ids in response_ids]
    views = to_views(
        t,
        [len(ids) for ids in response_ids],
        tokens,
        [f"response {i}: {r!r}" for i, r in enumerate(responses)],
        ids=response_ids,
        prompts=[tokenizer.decode(prompt_ids)] * len(responses),
        settings={"model": str(cfg.model.path), **settings.describe()},
        notes=notes,
    )
    for view, note in zip(views, score_notes, strict=True):
        view.notes.insert(0, note)
    return views

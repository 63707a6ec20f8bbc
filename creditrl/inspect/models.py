"""Models for explain views: load a policy or critic (base weights, a run's checkpoint, or a
saved directory), build a Batch from token ids, and compute log-probs and values with the
workers the trainer uses (so the alignment is the trainer's: ``logits[:, -T-1:-1]``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_model

from creditrl.batch import Batch, position_ids_from_mask
from creditrl.config import Config
from creditrl.config.run_files import run_file_text
from creditrl.models import CriticModel, load_causal_lm, resolve_model_path
from creditrl.models.critic import VALUE_HEAD_FILE
from creditrl.trainers.checkpoint import POINTER_MAX_BYTES, STEP_DIR
from creditrl.workers import ActorWorker, CriticWorker

__all__ = ["build_batch", "compute_log_probs", "compute_values", "load_critic", "load_policy"]


def build_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    pad_token_id: int,
    response_mask: Sequence[Sequence[int]] | None = None,
) -> Batch:
    """A rollout-shaped Batch: prompts left-padded to P, responses right-padded to T;
    ``input_ids``/``attention_mask``/``position_ids`` (B, P+T), ``prompts`` (B, P),
    ``responses`` and ``response_mask`` (B, T) (mask 1 on every response token unless given)."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts for {len(response_ids)} responses")
    empty = [i for i, r in enumerate(response_ids) if len(r) == 0]
    if empty or any(len(p) == 0 for p in prompt_ids):
        raise ValueError(f"empty prompt or response in rows {empty or 'with an empty prompt'}")
    b = len(prompt_ids)
    p, t = max(map(len, prompt_ids)), max(map(len, response_ids))
    prompts = torch.full((b, p), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((b, p), dtype=torch.long)
    responses = torch.full((b, t), pad_token_id, dtype=torch.long)
    attn = torch.zeros((b, t), dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.long)
    for i, (pi, ri) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        prompts[i, p - len(pi) :] = torch.as_tensor(list(pi))
        prompt_mask[i, p - len(pi) :] = 1
        responses[i, : len(ri)] = torch.as_tensor(list(ri))
        attn[i, : len(ri)] = 1
        row_mask = [1] * len(ri) if response_mask is None else list(response_mask[i])
        if len(row_mask) != len(ri):
            raise ValueError(f"row {i}: response_mask has {len(row_mask)} entries for {len(ri)}")
        mask[i, : len(ri)] = torch.as_tensor(row_mask)
    attention_mask = torch.cat([prompt_mask, attn], dim=1)
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": mask,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask),
        }
    )


def _checkpoint_file(path: Path, name: str) -> Path | None:
    """``path/<name>.model.safetensors`` for a run checkpoint directory, following a run's
    ``checkpoints/latest`` pointer when ``path`` is a run's checkpoints folder."""
    latest = path / "latest"
    if os.path.lexists(latest):  # a run file: regular, inside, at most 64 bytes, else one line
        name = run_file_text(latest, POINTER_MAX_BYTES, error=ValueError).strip()
        if STEP_DIR.fullmatch(name) is None:
            raise ValueError(f"{latest} names {name[:64]!r}, not a step_NNNNNN checkpoint")
        path = path / name
    file = path / f"{name}.model.safetensors"
    return file if file.is_file() else None


def load_policy(cfg: Config, weights: str | Path | None = None) -> torch.nn.Module:
    """The causal LM of ``model.path``; with ``weights`` a run checkpoint directory (its
    ``actor.model.safetensors`` is loaded into that architecture) or a saved model directory."""
    if weights is None:
        return load_causal_lm(cfg.model.path, cfg.model.dtype, cache_dir=cfg.model.cache_dir)
    path = Path(weights)
    file = _checkpoint_file(path, "actor") if path.is_dir() else None
    if file is None:
        return load_causal_lm(path, cfg.model.dtype)
    model = load_causal_lm(cfg.model.path, cfg.model.dtype, cache_dir=cfg.model.cache_dir)
    try:
        load_model(model, str(file))
    except RuntimeError as e:
        raise ValueError(
            f"{file} does not fit model.path={cfg.model.path!r} (a LoRA run, or another "
            f"model?): {str(e).splitlines()[0]}"
        ) from e
    return model


def load_critic(cfg: Config, path: str | Path) -> CriticModel:
    """A critic from a directory written by ``CriticModel.save`` or a run checkpoint directory
    (``critic.model.safetensors``, on the backbone of ``model.critic_path`` or ``model.path``)."""
    path = Path(path)
    if (path / VALUE_HEAD_FILE).is_file():
        return CriticModel.load(path, cfg.model.dtype)
    file = _checkpoint_file(path, "critic") if path.is_dir() else None
    if file is None:
        raise FileNotFoundError(
            f"critic {str(path)!r}: expected a saved critic ({VALUE_HEAD_FILE}) or a run "
            "checkpoint directory holding critic.model.safetensors"
        )
    base = resolve_model_path(cfg.model.critic_path or cfg.model.path, cfg.model.cache_dir)
    critic = CriticModel.from_actor(base, cfg.model.dtype)
    load_model(critic, str(file))
    return critic


def compute_log_probs(
    model: torch.nn.Module, batch: Batch, cfg: Config
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log π(y_t | s_t), entropy of π(. | s_t)) (B, T) at ``rollout.temperature``, by
    ``ActorWorker.compute_log_prob``."""
    worker = ActorWorker(model, cfg.actor, trainable=False)
    return worker.compute_log_prob(batch, cfg.rollout.temperature)


def compute_values(critic: CriticModel, batch: Batch, cfg: Config) -> torch.Tensor:
    """V(s_t) (B, T) by ``CriticWorker.compute_values``."""
    worker = CriticWorker(critic, cfg.critic, micro_batch_size=cfg.actor.log_prob_micro_batch_size)
    return worker.compute_values(batch)

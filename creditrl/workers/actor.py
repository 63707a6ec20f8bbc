"""The actor (and the reference): per-token log-probs, and PPO-style policy updates."""

from __future__ import annotations

import math
from collections import defaultdict
from functools import partial

import torch

from creditrl.batch import Batch, require
from creditrl.config import ActorConfig
from creditrl.core import (
    POLICY_LOSSES,
    PolicyLossConfig,
    agg_loss,
    compute_rollout_corr_metrics,
    get_policy_loss,
    global_normalisers,
    kl_penalty,
)
from creditrl.workers.distributed import all_reduce_gradients, all_reduce_sum
from creditrl.workers.forward import policy_forward, split_indices
from creditrl.workers.micro_batches import micro_batches_for, resolve_on_cuda, restore_order
from creditrl.workers.optim import build_optimizer
from creditrl.workers.packing import packed_policy_forward
from creditrl.workers.placement import CPU, Placement
from creditrl.workers.precision import resolve_autocast
from creditrl.workers.prefix_tree import (
    group_by_prompt,
    prefix_tree_policy_forward,
    resolve_shared_prefix,
)

__all__ = ["ActorWorker", "policy_loss_config"]


def policy_loss_config(cfg: ActorConfig) -> PolicyLossConfig:
    """The clip and SAPO settings of the actor's policy loss."""
    return PolicyLossConfig(
        clip_ratio=cfg.clip_ratio,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c,
        tau_pos=cfg.tau_pos,
        tau_neg=cfg.tau_neg,
        kwargs=dict(cfg.policy_loss_kwargs),
    )


class ActorWorker:
    """Holds a causal LM; ``compute_log_prob`` for old/reference log-probs, ``update_policy``
    for PPO epochs over shuffled mini-batches with gradient accumulation over micro-batches.

    Losses of the micro-batches of one mini-batch use that mini-batch's token and sequence
    counts (core ``global_normalisers``) and are summed, so the accumulated gradient equals
    the mini-batch's full gradient for every aggregation mode. Micro-batches hold a fixed
    number of trajectories, or fit ``max_token_len_per_device`` tokens (``use_dynamic_bsz``);
    ``use_remove_padding`` packs each micro-batch into one row (``workers.packing``); both
    left null are on where the batches are on CUDA (``micro_batches.resolve_on_cuda``);
    ``shared_prefix`` computes each distinct token prefix of a micro-batch once
    (``workers.prefix_tree``), with the rows of one prompt in the same micro-batches.
    The model and the batches it is given are on ``placement``'s device (the CPU by default).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ActorConfig,
        *,
        total_optimizer_steps: int = 1,
        trainable: bool = True,
        seed: int = 0,
        placement: Placement = CPU,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.device = placement.device
        self.optimizer = self.scheduler = None
        if trainable:
            self.optimizer, self.scheduler = build_optimizer(
                list(model.parameters()), cfg.optim, total_optimizer_steps
            )
        self.generator = torch.Generator().manual_seed(seed)
        self.loss_cfg = policy_loss_config(cfg)
        get_policy_loss(cfg.policy_loss)  # fail at start on an unknown name
        # further batch fields the loss reads, passed by name (register_policy_loss(requires=))
        self.loss_inputs = tuple(POLICY_LOSSES.info(cfg.policy_loss).get("requires", ()))
        self.autocast = resolve_autocast(cfg.autocast, self.device.type)
        if cfg.max_token_len_per_device < 1:
            raise ValueError(
                f"actor.max_token_len_per_device must be >= 1, got {cfg.max_token_len_per_device}"
            )
        forward = partial(
            packed_policy_forward
            if resolve_on_cuda(cfg.use_remove_padding, self.device.type)
            else policy_forward,
            chunk_tokens=cfg.logits_chunk_tokens,
        )
        self.shared_prefix = resolve_shared_prefix(cfg.shared_prefix, model, self.device.type)
        if self.shared_prefix:
            forward = partial(
                prefix_tree_policy_forward, fallback=forward, chunk_tokens=cfg.logits_chunk_tokens
            )
        self._forward = forward

    def _micro_batches(self, batch: Batch, size: int) -> list[torch.Tensor]:
        """Row indices of each micro-batch: ``size`` trajectories, or a token budget."""
        return micro_batches_for(batch, size, self.cfg)

    def _autocast(self) -> torch.autocast:
        """bfloat16 autocast for the update's forward and backward when ``actor.autocast``
        resolves to bf16 (``creditrl.workers.precision``; benchmarks/results/precision.md);
        log-probs and losses stay float32."""
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.autocast == "bf16"
        )

    @torch.no_grad()
    def compute_log_prob(
        self, batch: Batch, temperature: float = 1.0, with_entropy: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log_probs (B, T), entropys (B, T) or None) of ``responses``, micro-batched; 0 where
        ``response_mask`` is 0. Under the update's autocast, so that ``old_log_probs`` are the
        log-probs the update's first forward computes (the ratio starts at 1)."""
        require(batch, "input_ids", "attention_mask", "position_ids", "responses")
        self.model.eval()
        indices = self._micro_batches(batch, self.cfg.log_prob_micro_batch_size)
        forward = self._forward
        with self._autocast():
            parts = [forward(self.model, batch[idx], temperature, with_entropy) for idx in indices]
        mask = batch["response_mask"].float() if "response_mask" in batch else 1.0
        log_probs = restore_order([p[0] for p in parts], indices).float() * mask
        entropy = None
        if with_entropy:
            entropy = restore_order([p[1] for p in parts], indices).float() * mask
        return log_probs, entropy

    def update_policy(
        self, batch: Batch, temperature: float, n_per_prompt: int
    ) -> dict[str, float]:
        """PPO epochs over ``batch``; returns verl-named metrics averaged over optimizer steps,
        plus ``health/first_minibatch_ppo_kl`` and ``health/first_minibatch_clipfrac``: ppo_kl
        and pg_clipfrac of the first mini-batch of the first epoch, whose ratio is exactly 1
        when ``old_log_probs`` came from this policy (both ~0 then; larger values mean the
        log-prob and update passes disagree)."""
        if self.optimizer is None:
            raise RuntimeError("this ActorWorker was built with trainable=False")
        need = ["responses", "response_mask", "old_log_probs", "advantages", *self.loss_inputs]
        if self.cfg.use_kl_loss:
            need.append("ref_log_prob")
        require(batch, "input_ids", "attention_mask", "position_ids", *need)
        loss_fn = get_policy_loss(self.cfg.policy_loss)
        mini_size = self.cfg.ppo_mini_batch_size * n_per_prompt
        sums: dict[str, float] = defaultdict(float)
        health: dict[str, float] = {}
        n_steps = 0
        self.model.train()
        for _ in range(self.cfg.ppo_epochs):
            order = (
                torch.randperm(len(batch), generator=self.generator)
                if self.cfg.shuffle
                else torch.arange(len(batch))
            )
            for mini_idx in split_indices(order, mini_size):
                first = not health
                step_metrics = self._optimizer_step(batch[mini_idx], loss_fn, temperature, first)
                if first:
                    health = {
                        "health/first_minibatch_ppo_kl": step_metrics["actor/ppo_kl"],
                        "health/first_minibatch_clipfrac": step_metrics["actor/pg_clipfrac"],
                        **{
                            k: step_metrics.pop(k)
                            for k in list(step_metrics)
                            if k.startswith("rollout_corr/")
                        },
                    }
                for key, value in step_metrics.items():
                    sums[key] += value
                n_steps += 1
        return {**{key: value / max(n_steps, 1) for key, value in sums.items()}, **health}

    def _optimizer_step(
        self, mini: Batch, loss_fn, temperature: float, first: bool = False
    ) -> dict[str, float]:
        """One optimizer step over a mini-batch, accumulating micro-batch gradients. Losses use
        ``loss_mask`` when rollout correction rejected tokens (else ``response_mask``). On the
        ``first`` mini-batch, whose weights are the sampler's, the training forward is compared
        with ``rollout_log_probs`` when the old log-probs are the rollout's own
        (``rollout_corr/*``)."""
        cfg = self.cfg
        if self.shared_prefix:
            mini = mini[group_by_prompt(mini)]
        mask = mini["loss_mask"] if "loss_mask" in mini else mini["response_mask"]
        compare = (
            first
            and "rollout_log_probs" in mini
            and torch.equal(mini["old_log_probs"], mini["rollout_log_probs"])
        )
        forwards: list[torch.Tensor] = []
        norms = all_reduce_sum(global_normalisers(mask))
        agg = {**norms, "loss_scale_factor": cfg.loss_scale_factor}
        total_tokens = max(norms["global_num_tokens"], 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = defaultdict(float)
        micro_indices = self._micro_batches(mini, cfg.ppo_micro_batch_size)
        for idx in micro_indices:
            micro = mini[idx]
            m = mask[idx]
            share = float(m.sum()) / total_tokens
            with self._autocast():
                log_prob, entropy = self._forward(
                    self.model, micro, temperature, True, entropy_grad=cfg.entropy_coeff != 0
                )
            if compare:
                forwards.append(log_prob.detach().float())
            weights = micro.get("rollout_is_weights", None)
            pg_loss, pg_metrics = loss_fn(
                micro["old_log_probs"],
                log_prob,
                micro["advantages"],
                m,
                cfg.loss_agg_mode,
                self.loss_cfg,
                weights,
                **agg,
                **{name: micro[name] for name in self.loss_inputs},
            )
            loss = pg_loss
            entropy_loss = agg_loss(entropy, m, cfg.loss_agg_mode, **agg)
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * entropy_loss
            metrics["actor/entropy"] += float(entropy_loss.detach())
            if cfg.use_kl_loss:
                kld = kl_penalty(log_prob, micro["ref_log_prob"], cfg.kl_loss_type)
                kl_loss = agg_loss(kld, m, cfg.loss_agg_mode, **agg)
                loss = loss + cfg.kl_loss_coef * kl_loss
                metrics["actor/kl_loss"] += float(kl_loss.detach())
                metrics["actor/kl_coef"] = cfg.kl_loss_coef
            loss.backward()
            metrics["actor/pg_loss"] += float(pg_loss.detach())
            for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
                metrics[f"actor/{key}"] += float(pg_metrics[key]) * share
        if compare:
            train_log_prob = restore_order(forwards, micro_indices)
            metrics.update(
                compute_rollout_corr_metrics(
                    train_log_prob, mini["rollout_log_probs"], mini["response_mask"]
                )
            )
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        all_reduce_gradients(params)
        max_norm = math.inf if self.cfg.grad_clip is None else self.cfg.grad_clip
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        metrics["actor/grad_norm"] = grad_norm
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            metrics["actor/skipped_steps"] = 1.0
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

"""The critic: V(s_t) per response token, and clipped value-loss updates."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from creditrl.batch import Batch, require
from creditrl.config import CriticConfig
from creditrl.core import compute_value_loss, global_normalisers, masked_mean
from creditrl.workers.distributed import all_reduce_gradients, all_reduce_sum
from creditrl.workers.forward import split_indices, trim
from creditrl.workers.micro_batches import micro_batches_for, resolve_on_cuda, restore_order
from creditrl.workers.optim import build_optimizer
from creditrl.workers.packing import packed_value_forward

__all__ = ["CriticWorker", "value_forward"]


def value_forward(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """values (B, T): ``values[:, j]`` = V(s_{j+1}), the model's value output at the position
    before response token j (the ``[-T-1:-1]`` slice); 0 beyond the micro-batch's last column."""
    window = trim(batch)
    out = model(
        input_ids=window.input_ids,
        attention_mask=window.attention_mask,
        position_ids=window.position_ids,
    )
    t = window.width
    values = out[:, -t - 1 : -1].float()
    full_t = batch["responses"].shape[1]
    return torch.nn.functional.pad(values, (0, full_t - t)) if t < full_t else values


class CriticWorker:
    """Holds a value model (``CriticModel``); ``compute_values`` and ``update_critic``.

    ``micro_batch_size`` trajectories per ``compute_values`` forward and
    ``cfg.ppo_micro_batch_size`` per update forward, or ``cfg.max_token_len_per_device``
    tokens per forward (``use_dynamic_bsz``); ``use_remove_padding`` packs each micro-batch.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: CriticConfig,
        *,
        total_optimizer_steps: int = 1,
        micro_batch_size: int = 16,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.micro_batch_size = micro_batch_size
        self.optimizer, self.scheduler = build_optimizer(
            list(model.parameters()), cfg.optim, total_optimizer_steps
        )
        self.generator = torch.Generator().manual_seed(seed + 1)
        if cfg.max_token_len_per_device < 1:
            raise ValueError(
                f"critic.max_token_len_per_device must be >= 1, got {cfg.max_token_len_per_device}"
            )
        device = next(model.parameters()).device.type
        packed = resolve_on_cuda(cfg.use_remove_padding, device)
        self._forward = packed_value_forward if packed else value_forward

    def _micro_batches(self, batch: Batch, size: int) -> list[torch.Tensor]:
        """Row indices of each micro-batch: ``size`` trajectories, or a token budget."""
        return micro_batches_for(batch, size, self.cfg)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        """values (B, T) for ``batch``, micro-batched; zero where response_mask is 0."""
        require(batch, "input_ids", "attention_mask", "position_ids", "responses", "response_mask")
        self.model.eval()
        indices = self._micro_batches(batch, self.micro_batch_size)
        parts = [self._forward(self.model, batch[idx]) for idx in indices]
        return restore_order(parts, indices) * batch["response_mask"]

    def update_critic(self, batch: Batch, n_per_prompt: int) -> dict[str, float]:
        """Epochs of clipped value-loss steps over shuffled mini-batches (verl's update_critic)."""
        require(batch, "input_ids", "attention_mask", "position_ids", "responses")
        require(batch, "response_mask", "values", "returns")
        mini_size = self.cfg.ppo_mini_batch_size * n_per_prompt
        sums: dict[str, float] = defaultdict(float)
        n_steps = 0
        self.model.train()
        for _ in range(self.cfg.ppo_epochs):
            order = torch.randperm(len(batch), generator=self.generator)
            for mini_idx in split_indices(order, mini_size):
                for key, value in self._optimizer_step(batch[mini_idx]).items():
                    sums[key] += value
                n_steps += 1
        return {key: value / max(n_steps, 1) for key, value in sums.items()}

    def _optimizer_step(self, mini: Batch) -> dict[str, float]:
        norms = all_reduce_sum(global_normalisers(mini["response_mask"]))
        total_tokens = max(norms["global_num_tokens"], 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = defaultdict(float)
        for idx in self._micro_batches(mini, self.cfg.ppo_micro_batch_size):
            micro = mini[idx]
            mask = micro["response_mask"]
            vpreds = self._forward(self.model, micro)
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds,
                micro["returns"],
                micro["values"],
                mask,
                self.cfg.cliprange_value,
                self.cfg.loss_agg_mode,
                **norms,
            )
            vf_loss.backward()
            share = float(mask.sum()) / total_tokens
            metrics["critic/vf_loss"] += float(vf_loss.detach())
            metrics["critic/vf_clipfrac"] += float(vf_clipfrac) * share
            metrics["critic/vpred_mean"] += float(masked_mean(vpreds.detach(), mask)) * share
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        all_reduce_gradients(params)
        max_norm = math.inf if self.cfg.grad_clip is None else self.cfg.grad_clip
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        metrics["critic/grad_norm"] = grad_norm
        metrics["critic/lr"] = self.optimizer.param_groups[0]["lr"]
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            metrics["critic/skipped_steps"] = 1.0
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

"""Plain reverse loops over T: the textbook forms, kept as oracles for tests and benchmarks.

Training never calls these; ``creditrl.core.advantages`` has the defining functions. Each loop
here follows verl's multi-turn form, where a position with mask 0 carries the next value and
the running advantage through unchanged.
"""

from __future__ import annotations

import torch

from creditrl.core.masked import masked_whiten

__all__ = ["gae_reverse_loop", "suffix_sum_reverse_loop"]


def gae_reverse_loop(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE by a reverse loop: delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next,
    where a masked position passes V_next and A_next through to the step before it."""
    mask = response_mask.to(token_level_rewards.dtype)
    batch, length = token_level_rewards.shape
    next_value = torch.zeros(batch, dtype=mask.dtype)
    running = torch.zeros(batch, dtype=mask.dtype)
    out = []
    for t in reversed(range(length)):
        m = mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        next_value = values[:, t] * m + (1 - m) * next_value
        running = candidate * m + (1 - m) * running
        out.append(running)
    adv = torch.stack(out[::-1], dim=1) * mask
    returns = (adv + values) * mask
    if whiten:
        adv = masked_whiten(adv, mask) * mask
    return adv, returns


def suffix_sum_reverse_loop(x: torch.Tensor, mask: torch.Tensor, c: float) -> torch.Tensor:
    """y_t = x_t + c y_next over valid steps by a reverse loop; masked positions pass y through."""
    m = mask.to(x.dtype)
    running = torch.zeros(x.shape[0], dtype=x.dtype)
    out = []
    for t in reversed(range(x.shape[1])):
        running = (x[:, t] + c * running) * m[:, t] + (1 - m[:, t]) * running
        out.append(running)
    return torch.stack(out[::-1], dim=1) * m

"""The spec 000 worked example, computed by the core: prompt "请问1+1=2？", response
"是的，等于2！" in six tokens, outcome score 1, k1 KL penalty with beta 0.1, GAE with
gamma 1 and lambda 0.95."""

from __future__ import annotations

from typing import Any

import torch

from creditrl.core.advantages import compute_gae_advantage_return
from creditrl.core.masked import masked_whiten
from creditrl.core.rewards import apply_kl_penalty, place_sequence_scores

TOKENS = ["是", "的", "，", "等于", "2", "！"]
OLD_LOG_PROBS = [-0.40, -0.30, -0.60, -0.80, -0.20, -0.25]
REF_LOG_PROBS = [-0.50, -0.35, -0.55, -0.90, -0.40, -0.30]
VALUES = [0.20, 0.25, 0.30, 0.35, 0.45, 0.60]
BETA, GAMMA, LAM = 0.1, 1.0, 0.95

HEADERS = {
    "old_log_prob": "logp_old",
    "ref_log_prob": "logp_ref",
    "value": "V(s_t)",
    "advantage_raw": "A_raw",
    "advantage": "A_whiten",
}
COLUMNS = {
    "t": "step t = column j + 1; state s_t = prompt + y_1..y_{t-1}, action a_t = y_t",
    "token": "y_t",
    "old_log_prob": "log pi_old(y_t | s_t)",
    "ref_log_prob": "log pi_ref(y_t | s_t)",
    "kl": "k1: log pi_old - log pi_ref at step t",
    "score": "task score for the transition made by y_t (sequence score on the last token)",
    "reward": "r_t = score_t - beta * kl_t",
    "value": "V(s_t), the critic's value before y_t is chosen",
    "delta": "delta_t = r_t + gamma V(s_{t+1}) - V(s_t), V(s_{T+1}) = 0",
    "advantage_raw": "A_t = delta_t + gamma lambda A_{t+1}",
    "return": "R_t = A_t + V(s_t) (from the raw A_t)",
    "advantage": "masked_whiten(A)_t: what the policy loss uses",
}


def spec000_example() -> dict[str, Any]:
    """Every column of the worked example, one entry per response token (float64)."""
    f64 = torch.float64
    mask = torch.ones(1, len(TOKENS), dtype=f64)
    old, ref = torch.tensor([OLD_LOG_PROBS], dtype=f64), torch.tensor([REF_LOG_PROBS], dtype=f64)
    values = torch.tensor([VALUES], dtype=f64)
    scores = place_sequence_scores(torch.tensor([1.0], dtype=f64), mask)
    rewards, _ = apply_kl_penalty(scores, old, ref, mask, BETA, "k1")
    adv, returns = compute_gae_advantage_return(rewards, values, mask, GAMMA, LAM, whiten=False)
    next_values = torch.nn.functional.pad(values[:, 1:], (0, 1))
    return {
        "t": list(range(1, len(TOKENS) + 1)),
        "token": TOKENS,
        "old_log_prob": old[0],
        "ref_log_prob": ref[0],
        "kl": (old - ref)[0],
        "score": scores[0],
        "reward": rewards[0],
        "value": values[0],
        "delta": (rewards + GAMMA * next_values - values)[0],
        "advantage_raw": adv[0],
        "return": returns[0],
        "advantage": masked_whiten(adv, mask)[0],
    }

"""The spec 000 worked example, computed by the core: prompt "请问1+1=2？", response
"是的，等于2！" in six tokens, outcome score 1, k1 KL penalty in the reward with β = 0.1, GAE
with γ = 1 and λ = 0.95. Expected (spec 000): rewards [-0.01, -0.005, 0.005, -0.01, -0.02,
0.995], raw advantages [0.621081, 0.611664, 0.596488, 0.569987, 0.505250, 0.395000], returns
[0.821081, 0.861664, 0.896488, 0.919987, 0.955250, 0.995000]."""

from __future__ import annotations

from typing import Any

import torch

from creditrl.core import place_sequence_scores
from creditrl.inspect.compute import Settings, derive, rewards_from_scores, run_estimator, to_views
from creditrl.inspect.view import TokenView

__all__ = ["PROMPT", "TOKENS", "example_settings", "example_view", "spec000_example"]

PROMPT = "请问1+1=2？"
TOKENS = ["是", "的", "，", "等于", "2", "！"]
OLD_LOG_PROBS = [-0.40, -0.30, -0.60, -0.80, -0.20, -0.25]
REF_LOG_PROBS = [-0.50, -0.35, -0.55, -0.90, -0.40, -0.30]
VALUES = [0.20, 0.25, 0.30, 0.35, 0.45, 0.60]
BETA, GAMMA, LAM = 0.1, 1.0, 0.95


def example_settings() -> Settings:
    """GAE (γ = 1, λ = 0.95), k1 KL in the reward with β = 0.1."""
    return Settings(
        adv_estimator="gae", gamma=GAMMA, lam=LAM, kl_in="reward", kl_estimator="k1", beta=BETA
    )


def _tensors() -> dict[str, torch.Tensor]:
    f64 = torch.float64
    s = example_settings()
    t = {
        "mask": torch.ones(1, len(TOKENS), dtype=torch.int64),
        "old_log_prob": torch.tensor([OLD_LOG_PROBS], dtype=f64),
        "ref_log_prob": torch.tensor([REF_LOG_PROBS], dtype=f64),
        "value": torch.tensor([VALUES], dtype=f64),
    }
    t["score"] = place_sequence_scores(torch.tensor([1.0], dtype=f64), t["mask"])
    t["reward"], _ = rewards_from_scores(t, s)
    t["advantage"], t["return"] = run_estimator(t, s, ["spec000"])
    derive(t, s)
    return t


def spec000_example() -> dict[str, Any]:
    """Every column of the worked example, one entry per response token (float64 tensors):
    t, token, old_log_prob, ref_log_prob, kl, score, reward, value, delta, advantage_raw,
    return, advantage (whitened)."""
    t = _tensors()
    out: dict[str, Any] = {"t": list(range(1, len(TOKENS) + 1)), "token": TOKENS}
    for name in ("old_log_prob", "ref_log_prob", "kl", "score", "reward", "value", "delta"):
        out[name] = t[name][0]
    out["advantage_raw"] = t["advantage_raw"][0]
    out["return"] = t["return"][0]
    out["advantage"] = t["advantage"][0]
    return out


def example_view() -> TokenView:
    """The worked example as a TokenView."""
    view = to_views(
        _tensors(),
        [len(TOKENS)],
        [TOKENS],
        [f"spec 000 worked example: {PROMPT} -> {''.join(TOKENS)}"],
        prompts=[PROMPT],
        settings=example_settings().describe(),
    )[0]
    view.notes.append("sequence score 1 (the answer is right), placed on the last token")
    return view

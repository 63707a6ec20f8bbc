"""The columns of a per-token explain view: header, kind and definition of each, in print order.

Index convention (docs/architecture.md, spec 000): a response has tokens y_1..y_T; tensor column j
(0-based) is step t = j + 1; state s_t = (prompt, y_1..y_{t-1}); action a_t = y_t. Every
per-token quantity at step t is stored at column j = t - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COLUMNS", "INDEX_CONVENTION", "NUMERIC", "Column", "header"]

INDEX_CONVENTION = (
    "Row t is step t = tensor column j + 1 of the response. State s_t = (prompt, y_1..y_{t-1}); "
    "action a_t = y_t. Log-probs and values at t come from the model output one position "
    "before y_t (logits[:, -T-1:-1]). Tokens with mask 0 (tool output, observations) are not "
    "time steps: they get no credit, and V and A pass through them to the previous policy token."
)


@dataclass(frozen=True)
class Column:
    """One column: ``kind`` is "int" (printed as an integer), "float" (6 decimals), "text"."""

    name: str
    header: str
    kind: str
    meaning: str


# fmt: off
_ALL = [
    Column("t", "t", "int", "step t = tensor column j + 1"),
    Column("token", "y_t", "text", "the response token chosen at step t, as text (for humans; "
           "training uses the ids)"),
    Column("id", "id", "int", "token id of y_t"),
    Column("mask", "mask", "int", "response_mask: 1 on the policy's own tokens, 0 on observation "
           "or tool tokens (not a time step)"),
    Column("turn", "turn", "int", "turn_ids: turn number of y_t (spec 001), 0 on padding"),
    Column("kept", "|K_t|", "int", "rollout_kept_counts: how many tokens top-k/top-p/min-p let "
           "the sampler choose y_t from (sampling replay; 0: the whole vocabulary); every "
           "log-prob column is over that set, renormalised"),
    Column("version", "v_t", "int", "token_weight_version: the policy version that sampled y_t "
           "(async; it rises where partial rollout took newer weights mid-response)"),
    Column("rollout_log_prob", "logp_roll", "float", "log π_rollout(y_t | s_t): the sampling "
           "engine's log-prob (rollout_log_probs), over the kept set K_t when |K_t| > 0"),
    Column("old_log_prob", "logp_old", "float", "log π_old(y_t | s_t): the actor before this "
           "update (old_log_probs)"),
    Column("ref_log_prob", "logp_ref", "float", "log π_ref(y_t | s_t): the frozen reference "
           "policy (ref_log_prob)"),
    Column("teacher_log_prob", "logp_T", "float", "log π_T(y_t | s^T_t): the distillation "
           "teacher on its own prompt followed by the sampled y_1..y_{t-1} (teacher_log_prob)"),
    Column("entropy", "H_t", "float", "entropy of π_old(· | s_t) (entropys)"),
    Column("kl", "kl_t", "float", "kl_t: the configured KL estimator of (log π_old, log π_ref) "
           "at step t, times the mask"),
    Column("distill", "d_t", "float", "d_t = (log π_T - log π_old) · mask: the per-token "
           "distillation term (-d_t estimates the reverse KL to the teacher); the reward gets "
           "coef·d_t"),
    Column("score", "score_t", "float", "token_level_scores: the task's reward for the "
           "transition made by y_t; an outcome score sits on the last policy token"),
    Column("reward", "r_t", "float", "token_level_rewards: r_t = score_t - β·kl_t when KL is in "
           "the reward, else score_t; with a distillation teacher, + coef·d_t (combine=replace: "
           "without score_t)"),
    Column("value", "V(s_t)", "float", "values: the critic's value of s_t, the state before y_t "
           "is chosen"),
    Column("delta", "δ_t", "float", "δ_t = r_t + γ·V(s_t') - V(s_t), t' the next policy step "
           "(V = 0 after the last): GAE with λ = 0"),
    Column("advantage_raw", "A_raw", "float", "A_t = δ_t + γλ·A_t' (GAE before whitening)"),
    Column("advantage", "A_t", "float", "advantages: what the policy loss uses (GAE: "
           "masked_whiten(A_raw) over the batch's policy tokens; group estimators: the "
           "sequence's advantage on every policy token)"),
    Column("return", "R_t", "float", "returns: the critic's target (GAE: A_raw_t + V(s_t), from "
           "the raw A)"),
    Column("is_weight", "w_t", "float", "rollout_is_weights: truncated importance weight "
           "π_old / π_rollout of y_t"),
    Column("loss_mask", "loss", "int", "loss_mask: 1 where the actor's losses use y_t; 0 where "
           "rollout correction rejected the token or vetoed the sequence (its advantage and "
           "return are unchanged)"),
    Column("log_prob", "logp_θ", "float", "log π_θ(y_t | s_t): the policy being updated"),
    Column("ratio", "ratio", "float", "ρ_t = π_θ(y_t | s_t) / π_old(y_t | s_t) = "
           "exp(logp_θ - logp_old)"),
    Column("clipped", "clip", "int", "1 where the configured policy loss gives y_t no gradient "
           "through its clip (ρ_t outside [1-ε_low, 1+ε_high] on the side A_t pushes, or past "
           "the dual-clip bound); ppo: its mean is pg_clipfrac + pg_clipfrac_lower"),
]
# fmt: on

COLUMNS: dict[str, Column] = {c.name: c for c in _ALL}
NUMERIC: tuple[str, ...] = tuple(c.name for c in _ALL if c.kind == "float")


def header(name: str) -> str:
    """The short header of column ``name`` (the name itself when it is not catalogued)."""
    return COLUMNS[name].header if name in COLUMNS else name

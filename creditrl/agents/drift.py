"""Tokenization drift detectors (spec 004's checks 1 and 2).

1. Re-tokenization: ``encode(decode(ids)) != ids`` for a response. The model may sample a
   non-canonical path ("<", "th", "ink", ">" where the tokenizer would write "<", "think",
   ">"); any pipeline that decodes and re-encodes would then train on ids the policy never
   produced. Metric: ``tokenization/retokenize_mismatch_rate``.
2. Template: the chat template applied to the final messages != the accumulated ids
   (prompt ids + response ids). Where they differ, a message-based pipeline would train on other
   ids than the token-in-token-out trajectory. Metric: ``tokenization/template_mismatch_rate``.
   The template's closing text after the last assistant turn (e.g. ChatML's ``<|im_end|>\\n``
   when the policy stopped without it) is not a mismatch; samples whose last observation was
   cut to fit the budget are skipped (their messages hold the whole observation).

A mismatch is reported with its first divergence: the position and a few ids from it on
each side, decoded, so the rollout dump shows both spans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from creditrl.agents.chat import ChatFormat
from creditrl.batch import Batch

__all__ = [
    "DRIFT_FIELD",
    "Divergence",
    "check_batch",
    "first_divergence",
    "retokenize_check",
    "template_check",
]

DRIFT_FIELD = "tokenization_drift"
SPAN = 8


@dataclass
class Divergence:
    """Where two id sequences first differ: ``index``, then up to SPAN ids of each from there,
    as ids, token strings and decoded text, and the two sequences' lengths."""

    index: int
    ids: list[int]
    other_ids: list[int]
    tokens: list[str]
    other_tokens: list[str]
    text: str
    other_text: str
    length: int
    other_length: int

    def as_dict(self, names: tuple[str, str] = ("ids", "other")) -> dict[str, Any]:
        a, b = names
        return {
            "index": self.index,
            f"{a}_span": self.ids,
            f"{b}_span": self.other_ids,
            f"{a}_tokens": self.tokens,
            f"{b}_tokens": self.other_tokens,
            f"{a}_text": self.text,
            f"{b}_text": self.other_text,
            f"{a}_length": self.length,
            f"{b}_length": self.other_length,
        }


def first_divergence(
    ids: Sequence[int], other: Sequence[int], tokenizer: Any, span: int = SPAN
) -> Divergence | None:
    """None if equal; else the first index where they differ (or the shorter one's length)."""
    ids, other = [int(t) for t in ids], [int(t) for t in other]
    if ids == other:
        return None
    n = min(len(ids), len(other))
    index = next((j for j in range(n) if ids[j] != other[j]), n)
    a, b = ids[index : index + span], other[index : index + span]
    return Divergence(
        index,
        a,
        b,
        list(tokenizer.convert_ids_to_tokens(a)),
        list(tokenizer.convert_ids_to_tokens(b)),
        tokenizer.decode(a, skip_special_tokens=False),
        tokenizer.decode(b, skip_special_tokens=False),
        len(ids),
        len(other),
    )


def retokenize_check(ids: Sequence[int], tokenizer: Any) -> Divergence | None:
    """Check 1: ``encode(decode(ids))`` against ``ids`` (special tokens kept as text)."""
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    again = tokenizer.encode(text, add_special_tokens=False)
    return first_divergence(ids, again, tokenizer)


def template_check(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    messages: Sequence[dict[str, Any]],
    chat: ChatFormat,
) -> Divergence | None:
    """Check 2: the template over ``messages`` against ``prompt_ids + response_ids``.

    Equal, or the template longer by only (a suffix of) its closing text: None.
    """
    accumulated = [int(t) for t in (*prompt_ids, *response_ids)]
    rendered = chat.ids(messages, add_generation_prompt=False)
    found = first_divergence(accumulated, rendered, chat.tokenizer)
    if found is None or found.index < len(accumulated):
        return found
    rest = chat.tokenizer.decode(rendered[len(accumulated) :], skip_special_tokens=False)
    return None if chat.closing_text.endswith(rest) else found


def _rows(size: int, k: int) -> list[int]:
    """``k`` rows spread over a batch of ``size`` (all rows when k >= size)."""
    if k <= 0:
        return []
    if k >= size:
        return list(range(size))
    return sorted({round(x) for x in np.linspace(0, size - 1, k)})


def check_batch(
    batch: Batch, chat: ChatFormat, rows: int | Sequence[int] | None = None
) -> tuple[dict[str, float], list[dict[str, Any] | None]]:
    """Run both checks on ``rows`` of a rollout batch (an int: that many, spread out; None: all).

    Needs ``prompts``, ``responses``, ``attention_mask``; the template check also needs the
    ``messages`` field and is skipped per sample without it or with ``observation_truncated``
    in its ``agent_info``; rows with ``num_turns`` 0 (no model turn) are not checked. Returns
    the two mismatch rates (over the samples checked) with the
    counts, and one report per sample (None for unchecked samples):
    ``{"retokenize": divergence | None, "template": divergence | None | "skipped"}``.
    """
    size = len(batch)
    if rows is None:
        picked = list(range(size))
    elif isinstance(rows, int):
        picked = _rows(size, rows)
    else:
        picked = list(rows)
    if "num_turns" in batch:  # an episode with no model turn has nothing to check
        turns = batch["num_turns"].cpu()
        picked = [i for i in picked if int(turns[i]) > 0]
    responses = batch["responses"].cpu()
    t = responses.shape[-1]
    attn = batch["attention_mask"].cpu()
    prompts = batch["prompts"].cpu()
    p = attn.shape[-1] - t
    messages = batch.get("messages")
    info = batch.get("agent_info")
    reports: list[dict[str, Any] | None] = [None] * size
    retok = templ = templ_checked = 0
    for i in picked:
        prompt_ids = prompts[i][attn[i, :p].bool()].tolist()
        response_ids = responses[i][attn[i, p:].bool()].tolist()
        report: dict[str, Any] = {}
        found = retokenize_check(response_ids, chat.tokenizer)
        retok += found is not None
        report["retokenize"] = found and found.as_dict(("ids", "reencoded"))
        truncated = bool(info is not None and (info[i] or {}).get("observation_truncated"))
        if messages is None or messages[i] is None or truncated:
            report["template"] = "skipped"
        else:
            templ_checked += 1
            found = template_check(prompt_ids, response_ids, messages[i], chat)
            templ += found is not None
            report["template"] = found and found.as_dict(("accumulated", "template"))
        reports[i] = report
    metrics = {
        "tokenization/checked": float(len(picked)),
        "tokenization/retokenize_mismatch_rate": retok / max(len(picked), 1),
        "tokenization/template_checked": float(templ_checked),
        "tokenization/template_mismatch_rate": templ / max(templ_checked, 1),
    }
    return metrics, reports

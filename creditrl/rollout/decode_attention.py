"""One-token decode attention over a static KV cache: grouped-query heads without copies, and
only the cache columns written so far.

transformers' sdpa path (before 5.24) repeats every key/value head ``n_rep`` times
(``repeat_kv``) whenever a 4-D mask is given, which the static decode step always gives: at
every step a copy of the whole static cache, ``n_rep`` times over. Here the one query token's
heads are regrouped instead: query heads ``g * n_rep .. (g + 1) * n_rep - 1`` all read
key/value head ``g`` (the order ``repeat_kv`` produces), so the query (B, H, 1, D) is viewed as
(B, Hkv, n_rep, D), its ``n_rep`` heads become the query length of one sdpa call over the
unrepeated (B, Hkv, S, D) keys and values, and the (B, 1, 1, S) additive mask broadcasts over
them. Each output is the same sum over the same columns as with ``repeat_kv``.

``kv_width`` (the active ``decode_attention`` context's) bounds the columns read: a step whose
cache holds ``length`` positions reads only ``kv_bucket(length + 1)`` of the capacity
(``rollout.cuda_graph``); the columns cut off are closed in the mask anyway, so they count
for nothing in either case.

``decode_attention(model, kv_width)`` selects this kernel for ``model``'s attention modules
while it is active (``config._attn_implementation``, restored on exit); a captured CUDA graph
keeps the kernels recorded inside it, so the switch is needed only while capturing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from transformers import AttentionInterface

from creditrl.models.document_attention import attention_configs, attention_implementation

__all__ = ["DECODE_ATTENTION", "decode_attention", "static_decode_attention"]

DECODE_ATTENTION = "creditrl_static_decode"
"""The name this kernel is registered under in transformers' ``AttentionInterface``."""

_kv_width: ContextVar[int | None] = ContextVar("creditrl_kv_width", default=None)


def static_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of one query token per row (B, H, 1, D) over the cache's keys/values
    (B, Hkv, S, D) and an additive (B, 1, 1, S) mask, read up to the active ``kv_width``;
    returns (B, 1, H, D) as transformers' kernels do. ValueError for what it does not compute
    (several query tokens, dropout, soft-capping, a sliding window)."""
    batch, heads, length, dim = query.shape
    if length != 1 or dropout or kwargs.get("softcap") or kwargs.get("sliding_window"):
        raise ValueError(
            "static decode attention takes one query token, no dropout, soft-capping or "
            "sliding window"
        )
    width = _kv_width.get()
    if width is not None:
        key, value = key[:, :, :width], value[:, :, :width]
        if attention_mask is not None:
            attention_mask = attention_mask[..., :width]
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(batch, 1, heads, value.shape[-1]), None


AttentionInterface.register(DECODE_ATTENTION, static_decode_attention)


@contextmanager
def decode_attention(model: torch.nn.Module, kv_width: int | None) -> Iterator[None]:
    """While active, ``model``'s attention runs ``static_decode_attention`` reading the first
    ``kv_width`` cache columns (None: all)."""
    token = _kv_width.set(kv_width)
    try:
        with attention_implementation(attention_configs(model), DECODE_ATTENTION):
            yield
    finally:
        _kv_width.reset(token)

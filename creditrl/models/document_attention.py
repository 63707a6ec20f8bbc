"""Attention over a packed row of documents without an N x N mask (varlen attention).

A packed micro-batch (``workers.packing``) is one row of N = sum_d L_d tokens: documents of
L_d tokens each, positions restarting at 0. Token i of document d attends to tokens 0..i of
the same document and to nothing else:

    out[o_d + i] = sum_{j <= i} softmax_j(q_{o_d + i} . k_{o_d + j} * scale) v_{o_d + j},
    o_d = sum_{e < d} L_e.

Given only the restarting ``position_ids``, transformers' sdpa path builds that pattern as one
dense (1, 1, N, N) bool mask and attends over all N columns in every layer: N^2 bytes held
through the backward and N^2 attention FLOPs where sum_d L_d^2 are needed. Here each
document's slice (1, H, L_d, D) is one causal sdpa call of its own (transformers'
``sdpa_attention_forward`` with no mask, so grouped-query heads are not copied where sdpa
takes them as they are, and the flash kernels apply), and the outputs are concatenated in
order: the same sums over the same columns, with no mask at all.

``document_attention(model, lengths)`` selects this kernel for ``model``'s sdpa attention
modules while it is active (their configs' ``_attn_implementation``, restored on exit);
``attends_by_document(model)`` says whether the model qualifies (every config sdpa, no
sliding-window layer). Under activation checkpointing the backward recomputes each layer
outside the forward's ``with`` block: ``enable_checkpointing`` passes ``recompute_context``
as the checkpoint's ``context_fn``, which re-enters the context the forward ran in.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

__all__ = [
    "DOCUMENT_ATTENTION",
    "attends_by_document",
    "attention_configs",
    "attention_implementation",
    "document_attention",
    "document_attention_kernel",
    "recompute_context",
]

DOCUMENT_ATTENTION = "creditrl_documents"
"""The name this kernel is registered under in transformers' ``AttentionInterface``."""


@dataclass(frozen=True)
class _Documents:
    lengths: tuple[int, ...]
    configs: tuple[PreTrainedConfig, ...]


_active: ContextVar[_Documents | None] = ContextVar("creditrl_documents", default=None)


def document_attention_kernel(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention of a packed row (1, H, N, D) queries over (1, Hkv, N, D) keys/values,
    document by document (the active context's lengths); returns (1, N, H, D) as
    transformers' kernels do. RuntimeError outside ``document_attention``; ValueError for
    what it does not compute (a mask, several rows, lengths not summing to N, a window)."""
    active = _active.get()
    if active is None:
        raise RuntimeError("document attention runs only inside document_attention(model, ...)")
    rows, _, tokens, _ = query.shape
    if attention_mask is not None or rows != 1 or key.shape[2] != tokens:
        raise ValueError("document attention takes one packed row, no mask and no KV cache")
    if sum(active.lengths) != tokens:
        raise ValueError(f"document lengths sum to {sum(active.lengths)}, the row has {tokens}")
    if kwargs.pop("sliding_window", None) is not None:
        raise ValueError("document attention does not compute sliding-window layers")
    kwargs.pop("is_causal", None)
    outputs, start = [], 0
    for length in active.lengths:
        end = start + length
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            None,
            dropout=dropout,
            scaling=scaling,
            is_causal=True,
            **kwargs,
        )
        outputs.append(out)
        start = end
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(DOCUMENT_ATTENTION, document_attention_kernel)


def attention_configs(model: torch.nn.Module) -> list[PreTrainedConfig]:
    """The distinct configs ``model``'s modules read their attention implementation from."""
    found: dict[int, PreTrainedConfig] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PreTrainedConfig):
            found.setdefault(id(config), config)
    return list(found.values())


def _sliding(config: PreTrainedConfig) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return any(kind != "full_attention" for kind in layer_types)
    return getattr(config, "sliding_window", None) is not None


@contextmanager
def attention_implementation(configs: Sequence[PreTrainedConfig], name: str) -> Iterator[None]:
    """While active, ``configs`` name ``name`` as their attention implementation (a kernel
    registered in transformers' ``AttentionInterface``); their own names are restored on exit."""
    before = [config._attn_implementation_internal for config in configs]
    try:
        for config in configs:
            config._attn_implementation_internal = name
        yield
    finally:
        for config, old in zip(configs, before, strict=True):
            config._attn_implementation_internal = old


def _qualifies(configs: Sequence[PreTrainedConfig]) -> bool:
    return bool(configs) and all(
        config._attn_implementation == "sdpa" and not _sliding(config) for config in configs
    )


def attends_by_document(model: torch.nn.Module) -> bool:
    """True when every config of ``model`` runs sdpa and none has a sliding-window layer: the
    packed forward can then use ``document_attention``; otherwise transformers' own packed
    masks stay (eager, flex, flash-attention varlen, windows)."""
    return _qualifies(attention_configs(model))


@contextmanager
def _entered(documents: _Documents) -> Iterator[None]:
    token = _active.set(documents)
    try:
        with attention_implementation(documents.configs, DOCUMENT_ATTENTION):
            yield
    finally:
        _active.reset(token)


def document_attention(
    model: torch.nn.Module, lengths: Sequence[int]
) -> AbstractContextManager[None]:
    """While active, ``model``'s attention runs ``document_attention_kernel`` over documents
    of ``lengths`` tokens (their sum is the packed row's length); a no-op context when
    ``attends_by_document(model)`` is False."""
    configs = tuple(attention_configs(model))
    if not _qualifies(configs):
        return nullcontext()
    return _entered(_Documents(tuple(int(n) for n in lengths), configs))


def recompute_context() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """``torch.utils.checkpoint``'s ``context_fn``: nothing around the forward; around the
    backward's recomputation, the document attention the forward ran under (if any)."""
    active = _active.get()
    return nullcontext(), (nullcontext() if active is None else _entered(active))

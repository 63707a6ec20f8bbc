"""The rollout's KV cache: a ``DynamicCache`` whose full-attention layers write in place.

``PreallocatedLayer`` keeps keys/values in buffers sized for prompt + response and writes each
step's states into them, instead of ``torch.cat`` of the whole cache at every step
(``DynamicLayer``); ``preallocated_cache`` builds a model's cache from such layers. Measured in
``benchmarks/bench_rollout.py`` ("concat-cache" switches it off). ``cache_keyword`` names the
forward keyword that takes the cache.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

__all__ = ["PreallocatedLayer", "cache_keyword", "preallocated_cache"]


class PreallocatedLayer(DynamicLayer):
    """A DynamicCache layer that writes new keys/values in place into a preallocated buffer.

    ``keys``/``values`` are views of the first ``length`` positions of buffers of
    ``capacity`` positions (grown by doubling if exceeded), so a decode step copies only the
    new token's states instead of the whole cache (``DynamicLayer`` concatenates).
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._key_buffer = key_states.new_empty(_buffer_shape(key_states, self.capacity))
        self._value_buffer = value_states.new_empty(_buffer_shape(value_states, self.capacity))
        self.length = 0
        self._refresh_views()
        self.is_initialized = True

    def _refresh_views(self) -> None:
        self.keys = self._key_buffer[:, :, : self.length]
        self.values = self._value_buffer[:, :, : self.length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:
            self._resize(len(self._key_buffer), max(end, 2 * self._key_buffer.shape[-2]))
        self._key_buffer[:, :, self.length : end] = key_states
        self._value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    def _resize(self, rows: int, capacity: int, indices: torch.Tensor | None = None) -> None:
        """New buffers of ``rows`` x ``capacity`` holding the cached rows (``indices`` of them)."""
        for name in ("_key_buffer", "_value_buffer"):
            old = getattr(self, name)
            new = old.new_empty((rows, old.shape[1], capacity, *old.shape[3:]))
            used = old[:, :, : self.length]
            new[:, :, : self.length] = used if indices is None else used[indices]
            setattr(self, name, new)
        self._refresh_views()

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._resize(len(indices), self._key_buffer.shape[-2], indices.to(self.device))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            rows = torch.arange(len(self._key_buffer), device=self.device)
            self.batch_select_indices(rows.repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)
        if self.is_initialized:
            self._refresh_views()

    def reset(self) -> None:
        self.length = 0
        super().reset()


def _buffer_shape(states: torch.Tensor, capacity: int) -> tuple[int, ...]:
    return (states.shape[0], states.shape[1], capacity, *states.shape[3:])


def preallocated_cache(model: PreTrainedModel, capacity: int) -> DynamicCache:
    """A DynamicCache for ``model`` whose plain (full-attention) layers are PreallocatedLayer;
    other layer kinds (sliding window, linear attention) stay as transformers makes them."""
    cache = DynamicCache(config=model.config)
    cache.layers = [
        PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer
        for layer in cache.layers
    ]
    return cache


def cache_keyword(model: nn.Module) -> str:
    """The forward keyword that takes a KV cache: ``cache`` where transformers renamed
    ``past_key_values`` (the old name then warns on every call), else ``past_key_values``. The
    nearest class whose ``forward`` names either decides (a subclass forwarding ``**kwargs`` to
    its parent's forward defers to the parent); a peft model passes it on to its base model,
    whose forward decides."""
    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model):
        model = get_base_model()
    for cls in type(model).__mro__:
        forward = cls.__dict__.get("forward")
        if forward is None:
            continue
        names = inspect.signature(forward).parameters
        for name in ("cache", "past_key_values"):
            if name in names:
                return name
    return "past_key_values"

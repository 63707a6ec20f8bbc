"""Decode from a static KV cache, as a captured CUDA graph on CUDA (eagerly on the CPU).

On one GPU a small model's decode step is launch-bound: hundreds of small kernels a step, each
far shorter than its launch. ``StaticDecodeStep`` runs the model's own forward for one token
per row over buffers whose shapes never change, so on CUDA the step is captured once with
``torch.cuda.CUDAGraph`` and replayed (one launch a step):

- the KV cache is transformers' ``StaticCache`` (full-attention ``StaticLayer``s: keys/values
  preallocated for ``capacity`` positions, written in place at a device-side length);
- rows: a micro-batch of m rows runs in the bucket of ``row_bucket(m, max_rows)`` rows (powers
  of two up to the micro-batch size); rows m..R-1 are padding, and a row that finished stays
  in the batch fed the pad id, its outputs ignored, so the graph's shape stays fixed;
- columns: ``capacity_bucket(prompt + new tokens)`` (a multiple of ``CAPACITY_STEP``); the 4-D
  additive attention mask (R, 1, 1, capacity) opens each column as it is written, so masked
  columns count for nothing (their softmax weight is exactly 0);
- weights: the graph reads the parameters' storage, so it stays valid while they are updated
  in place (the optimizer's step, ``load_state_dict``'s ``copy_``). ``StaticDecoder`` keys its
  steps by the parameters' ``data_ptr``s and rebuilds them when one moved (a ``model.to``),
  so a stale graph is never replayed.

The prefill is the engine's (distinct prompts once, ``PreallocatedLayer`` cache); ``load``
copies its keys/values into the static buffers. On the CPU the same step runs eagerly, which is
what the CPU tests compare with the engine's dynamic path (``tests/test_static_decode.py``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer

__all__ = [
    "CAPACITY_STEP",
    "MAX_STEPS",
    "StaticDecodeStep",
    "StaticDecoder",
    "capacity_bucket",
    "parameter_pointers",
    "row_bucket",
    "static_decode_unsupported",
]

log = logging.getLogger(__name__)

CAPACITY_STEP = 128  # cache positions are allocated in multiples of this
MAX_STEPS = 4  # steps kept per decoder, each with its KV cache (least recently used dropped)
_WARMUP = 2  # eager runs on a side stream before capture (CUDA's rule for capture)


def row_bucket(rows: int, max_rows: int) -> int:
    """The rows a step of ``rows`` (1..max_rows) runs with: the smallest power of two at
    least ``rows``, capped at ``max_rows``."""
    if not 1 <= rows <= max_rows:
        raise ValueError(f"rows must be in [1, {max_rows}], got {rows}")
    return min(1 << (rows - 1).bit_length(), max_rows)


def capacity_bucket(positions: int) -> int:
    """Cache positions allocated for ``positions`` (>= 1): the next multiple of
    ``CAPACITY_STEP``."""
    if positions < 1:
        raise ValueError(f"positions must be >= 1, got {positions}")
    return -(-positions // CAPACITY_STEP) * CAPACITY_STEP


def parameter_pointers(model: torch.nn.Module) -> tuple[int, ...]:
    """The storage address of every parameter and buffer of ``model``: equal while they are
    updated in place, different once one was replaced (a captured graph would read stale
    memory)."""
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


def static_decode_unsupported(model: PreTrainedModel) -> str | None:
    """Why ``model`` cannot decode from a static cache (one sentence), or None: every cache
    layer must be full attention (``StaticLayer``) and the attention kernel must take a 4-D
    mask (sdpa or eager)."""
    config = model.config
    attn = getattr(config, "_attn_implementation", None)
    if attn not in ("sdpa", "eager"):
        return f"its attention implementation is {attn!r}, not sdpa or eager"
    try:
        layers = StaticCache(config=config, max_cache_len=1).layers
    except (ValueError, TypeError, KeyError) as err:
        return f"transformers builds no static cache for it ({err})"
    if not layers or any(type(layer) is not StaticLayer for layer in layers):
        return "not all of its cache layers are full attention"
    return None


class StaticDecodeStep:
    """One-token decode steps of ``model`` for ``rows`` rows over ``capacity`` cache positions,
    all buffers static; captured as a CUDA graph when ``graph`` (CUDA only), else eager."""

    def __init__(
        self,
        model: PreTrainedModel,
        rows: int,
        capacity: int,
        cache_keyword: str,
        pad_token_id: int,
        *,
        graph: bool,
        pool: object | None = None,
    ) -> None:
        device = model.device
        self.model, self.rows, self.capacity = model, rows, capacity
        self.cache_keyword, self.pad_token_id = cache_keyword, pad_token_id
        self.tokens = torch.full((rows, 1), pad_token_id, dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.closed = torch.finfo(model.dtype).min
        self.mask = torch.full(
            (rows, 1, 1, capacity), self.closed, dtype=model.dtype, device=device
        )
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        self.length = 0  # positions written (host copy of the layers' cumulative_length)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits = self._warm_up(graph)
        if graph:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.logits = self._forward()

    def _forward(self) -> torch.Tensor:
        out = self.model(
            input_ids=self.tokens,
            attention_mask=self.mask,
            position_ids=self.positions,
            use_cache=True,
            **{self.cache_keyword: self.cache},
        )
        return out.logits[:, -1]

    def _warm_up(self, graph: bool) -> torch.Tensor:
        """Run the step eagerly (on a side stream before a capture): the cache's buffers are
        allocated by the first run. Returns the logits of the last run."""
        if not graph:
            logits = self._forward()
        else:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(_WARMUP):
                    logits = self._forward()
            torch.cuda.current_stream().wait_stream(stream)
        self._set_length(0)
        return logits

    def _set_length(self, length: int) -> None:
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(length)
        self.length = length

    def load(self, cache: DynamicCache, attention_mask: torch.Tensor) -> None:
        """Start from a prefilled ``cache`` of m <= rows rows and its (m, P) 0/1
        ``attention_mask`` (P cached positions, P < capacity): its keys/values are copied
        into the static buffers, the mask opens its real positions; rows m.. are padding."""
        m, width = attention_mask.shape
        if m > self.rows or width >= self.capacity:
            raise ValueError(
                f"a prefill of {m} rows x {width} positions does not fit a static step of "
                f"{self.rows} rows x {self.capacity} positions"
            )
        for source, target in zip(cache.layers, self.cache.layers, strict=True):
            target.keys[:m, :, :width] = source.keys
            target.values[:m, :, :width] = source.values
        self.mask.fill_(self.closed)
        self.mask[:m, 0, 0, :width].masked_fill_(attention_mask.bool(), 0.0)
        self.tokens.fill_(self.pad_token_id)
        self.positions.zero_()
        self._set_length(width)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Next-token logits (m, V) for ``tokens`` (m,) at ``positions`` (m,): each row
        attends to its open cached positions and the new one (written at column ``length``)."""
        if self.length >= self.capacity:
            raise ValueError(f"the static cache is full ({self.capacity} positions)")
        m = len(tokens)
        self.tokens[:m, 0] = tokens
        self.positions[:m, 0] = positions
        self.mask[:, 0, 0, self.length] = 0.0
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits = self._forward()
        self.length += 1
        return self.logits[:m]


class StaticDecoder:
    """The static steps of one model, one per (row bucket, capacity bucket), captured on CUDA;
    the ``MAX_STEPS`` most recently used are kept, and all are dropped when the model's
    parameters moved (``parameter_pointers``). ``built`` counts the steps built."""

    def __init__(
        self,
        model: PreTrainedModel,
        max_rows: int,
        cache_keyword: str,
        pad_token_id: int,
        *,
        graph: bool | None = None,
    ) -> None:
        self.model, self.max_rows = model, max_rows
        self.cache_keyword, self.pad_token_id = cache_keyword, pad_token_id
        self.graph = model.device.type == "cuda" if graph is None else graph
        self.steps: OrderedDict[tuple[int, int], StaticDecodeStep] = OrderedDict()
        self.pointers = parameter_pointers(model)
        self.built = 0
        self._pool = torch.cuda.graph_pool_handle() if self.graph else None

    def step_for(self, rows: int, positions: int) -> StaticDecodeStep:
        """The step for ``rows`` rows and ``positions`` cache positions (prompt + new tokens),
        built (and captured) the first time its buckets are asked for."""
        pointers = parameter_pointers(self.model)
        if pointers != self.pointers:
            self.steps.clear()
            self.pointers = pointers
        key = (row_bucket(rows, self.max_rows), capacity_bucket(positions))
        step = self.steps.get(key)
        if step is None:
            step = self._build(*key)
            self.steps[key] = step
            while len(self.steps) > MAX_STEPS:
                self.steps.popitem(last=False)
        self.steps.move_to_end(key)
        return step

    def _build(self, rows: int, capacity: int) -> StaticDecodeStep:
        """A new step; where CUDA refuses the capture, this decoder decodes eagerly from the
        static cache from then on (logged once)."""
        self.built += 1
        args = (self.model, rows, capacity, self.cache_keyword, self.pad_token_id)
        if not self.graph:
            return StaticDecodeStep(*args, graph=False)
        try:
            return StaticDecodeStep(*args, graph=True, pool=self._pool)
        except RuntimeError as err:
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            log.warning(
                "CUDA graph capture of the decode step failed (%s); decoding eagerly", reason
            )
            self.graph = False
            return StaticDecodeStep(*args, graph=False)

"""Decode from a static KV cache, as captured CUDA graphs on CUDA (eagerly on the CPU).

On one GPU a small model's decode step is launch-bound: hundreds of small kernels a step, each
far shorter than its launch. ``StaticDecodeStep`` runs the model's own forward for one token
per row, then the sampler, over buffers whose shapes never change, so on CUDA the step is
captured once with ``torch.cuda.CUDAGraph`` and replayed (one launch a step):

- the KV cache is transformers' ``StaticCache`` (full-attention ``StaticLayer``s: keys/values
  preallocated for ``capacity`` positions, written in place at a device-side length);
- rows: a micro-batch of m rows runs in the bucket of ``row_bucket(m, max_rows)`` rows (powers
  of two up to the micro-batch size); rows m..R-1 are padding, and a row that finished stays
  in the batch fed the pad id, its outputs ignored, so the graph's shape stays fixed;
- columns: ``capacity_bucket(prompt + new tokens)`` (a multiple of ``CAPACITY_STEP``); the 4-D
  additive attention mask (R, 1, 1, capacity) opens each column as it is written, so masked
  columns count for nothing (their softmax weight is exactly 0);
- attention (``rollout.decode_attention``): the query's heads regrouped onto the key/value
  heads (no ``repeat_kv`` copy of the cache), reading only ``kv_bucket(length + 1)`` columns,
  so one step holds a graph per kv-length bucket (and per sampler: sampling is captured too);
- weights: the graph reads the parameters' storage, so it stays valid while they are updated
  in place (the optimizer's step, ``load_state_dict``'s ``copy_``). ``StaticDecoder`` keys its
  steps by the parameters' ``data_ptr``s and rebuilds them when one moved (a ``model.to``),
  so a stale graph is never replayed.

``StaticDecoder`` keeps the most recently used steps whose caches fit ``MAX_CACHE_BYTES``
(least recently used dropped first) and drops them all in ``release()`` (the engine's
``sleep()``). A capture that fails restores the stream that was current, drops its memory
pool and is counted (``GraphCapture.fallbacks``); out of memory is raised again (the worker's
stage turns it into one line), anything else leaves that decoder eager, with a warning.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from contextlib import nullcontext
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer

from creditrl.rollout.decode_attention import decode_attention

__all__ = [
    "CAPACITY_STEP",
    "KV_STEP",
    "MAX_CACHE_BYTES",
    "GraphCapture",
    "StaticDecodeStep",
    "StaticDecoder",
    "capacity_bucket",
    "kv_bucket",
    "parameter_pointers",
    "row_bucket",
    "static_decode_unsupported",
]

log = logging.getLogger(__name__)

CAPACITY_STEP = 128  # cache positions are allocated in multiples of this
KV_STEP = 128  # a step reads its cache columns in multiples of this
MAX_CACHE_BYTES = 4 << 30  # the static caches one decoder keeps (the latest one always)
_WARMUP = 2  # eager runs on a side stream before capture (CUDA's rule for capture)
_SYNCING_ROPE = ("dynamic", "longrope")  # RoPE types that read max(position_ids) on the host

Sampler = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
"""``sampler(logits (R, V), uniforms (R,))`` -> per-row outputs (tokens, log-probs, ...)."""


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


def kv_bucket(columns: int, capacity: int) -> int:
    """Cache columns a step reads when ``columns`` (1..capacity) are written: the next
    multiple of ``KV_STEP``, at most ``capacity``."""
    if not 1 <= columns <= capacity:
        raise ValueError(f"columns must be in [1, {capacity}], got {columns}")
    return min(-(-columns // KV_STEP) * KV_STEP, capacity)


def parameter_pointers(model: torch.nn.Module) -> tuple[int, ...]:
    """The storage address of every parameter and buffer of ``model``: equal while they are
    updated in place, different once one was replaced (a captured graph would read stale
    memory)."""
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


def _rope_types(config: Any) -> set[str]:
    """The RoPE types ``config`` names (``rope_parameters``, per layer type or not)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return set()
    nested = [v for v in params.values() if isinstance(v, dict)]
    return {str(p.get("rope_type", p.get("type", ""))) for p in (nested or [params])}


def static_decode_unsupported(model: PreTrainedModel) -> str | None:
    """Why ``model`` cannot decode from a static cache (one sentence), or None: every cache
    layer must be full attention (``StaticLayer``), the attention kernel must take a 4-D
    mask (sdpa or eager), and its RoPE must not be dynamic or longrope (they read the
    largest position on the host at every step, which a CUDA graph cannot replay)."""
    config = model.config
    attn = getattr(config, "_attn_implementation", None)
    if attn not in ("sdpa", "eager"):
        return f"its attention implementation is {attn!r}, not sdpa or eager"
    syncing = sorted(t for t in _rope_types(config) if t.startswith(_SYNCING_ROPE))
    if syncing:
        return f"its RoPE type {syncing[0]!r} reads the positions on the host at every step"
    try:
        layers = StaticCache(config=config, max_cache_len=1).layers
    except (ValueError, TypeError, KeyError) as err:
        return f"transformers builds no static cache for it ({err})"
    if not layers or any(type(layer) is not StaticLayer for layer in layers):
        return "not all of its cache layers are full attention"
    return None


class GraphCapture:
    """The CUDA-graph captures of one decoder: one memory pool shared by its graphs, and
    ``fallbacks`` counting the captures that failed. ``enabled`` is False on the CPU and
    after a failure other than out of memory."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.fallbacks = 0
        self.pool = torch.cuda.graph_pool_handle() if enabled else None

    def capture(self, run: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any] | None:
        """``run`` warmed up on a side stream, then captured: (graph, its outputs), or None
        where the capture failed (the stream that was current restored, the pool replaced,
        counted, logged once per decoder); ``torch.OutOfMemoryError`` is raised again."""
        current = torch.cuda.current_stream()
        graph = torch.cuda.CUDAGraph()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(_WARMUP):
                    run()
            current.wait_stream(side)
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = run()
        except RuntimeError as err:  # torch.OutOfMemoryError included
            torch.cuda.set_stream(current)
            del graph
            self.pool = torch.cuda.graph_pool_handle()
            self.fallbacks += 1
            if isinstance(err, torch.OutOfMemoryError):
                raise
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            log.warning("CUDA graph capture of a decode step failed (%s): decoding eagerly", reason)
            self.enabled = False
            return None
        return graph, outputs


class StaticDecodeStep:
    """One-token decode steps of ``model`` for ``rows`` rows over ``capacity`` cache
    positions, all buffers static, each followed by a sampler; captured as CUDA graphs by
    ``capture`` when it is enabled (one per kv-length bucket and sampler), else eager.
    ``pack_gqa`` runs ``rollout.decode_attention`` (False: the model's own attention over all
    ``capacity`` columns)."""

    def __init__(
        self,
        model: PreTrainedModel,
        rows: int,
        capacity: int,
        cache_keyword: str,
        pad_token_id: int,
        capture: GraphCapture,
        *,
        pack_gqa: bool = True,
    ) -> None:
        device = model.device
        self.model, self.rows, self.capacity = model, rows, capacity
        self.cache_keyword, self.pad_token_id = cache_keyword, pad_token_id
        self.capture, self.pack_gqa = capture, pack_gqa
        self.tokens = torch.full((rows, 1), pad_token_id, dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.uniforms = torch.zeros(rows, dtype=torch.float64, device=device)
        self.closed = torch.finfo(model.dtype).min
        self.mask = torch.full(
            (rows, 1, 1, capacity), self.closed, dtype=model.dtype, device=device
        )
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        self.graphs: dict[tuple[int | None, Hashable], tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._forward(capacity)  # allocates the cache's buffers (transformers: lazily)
        self._set_length(0)

    @property
    def nbytes(self) -> int:
        """Bytes of the static cache and the mask."""
        layers = self.cache.layers
        return self.mask.nbytes + sum(x.keys.nbytes + x.values.nbytes for x in layers)

    def _forward(self, kv_width: int | None) -> torch.Tensor:
        context = decode_attention(self.model, kv_width) if self.pack_gqa else nullcontext()
        with context:
            out = self.model(
                input_ids=self.tokens,
                attention_mask=self.mask,
                position_ids=self.positions,
                use_cache=True,
                **{self.cache_keyword: self.cache},
            )
        return out.logits[:, -1]

    def _set_length(self, length: int) -> None:
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(length)
        self.length = length

    def load(
        self,
        cache: DynamicCache,
        attention_mask: torch.Tensor,
        positions: torch.Tensor,
        rows_of: torch.Tensor | None = None,
    ) -> None:
        """Start from a prefilled ``cache`` and the (m, P) 0/1 ``attention_mask`` of m <= rows
        rows (P < capacity): row i's keys/values are the cache's row ``rows_of[i]`` (None:
        row i), copied into the static buffers; the mask opens its real positions, and its
        next token sits at ``positions[i]``; rows m.. are padding."""
        m, width = attention_mask.shape
        if m > self.rows or width >= self.capacity:
            raise ValueError(
                f"a prefill of {m} rows x {width} positions does not fit a static step of "
                f"{self.rows} rows x {self.capacity} positions"
            )
        for source, target in zip(cache.layers, self.cache.layers, strict=True):
            keys, values = source.keys, source.values
            if rows_of is not None:
                keys, values = keys[rows_of], values[rows_of]
            target.keys[:m, :, :width] = keys
            target.values[:m, :, :width] = values
        self.mask.fill_(self.closed)
        self.mask[:m, 0, 0, :width].masked_fill_(attention_mask.bool(), 0.0)
        self.tokens.fill_(self.pad_token_id)
        self.positions.zero_()
        self.positions[:m, 0] = positions
        self._set_length(width)

    def step(
        self, tokens: torch.Tensor, uniforms: torch.Tensor | None, sampler: Sampler
    ) -> tuple[torch.Tensor, ...]:
        """Feed ``tokens`` (m,) at the rows' next positions (each row attends to its open
        cached positions and the new one, written at column ``length``), then
        ``sampler(logits, uniforms)``; returns its outputs' first m rows. No host sync."""
        if self.length >= self.capacity:
            raise ValueError(f"the static cache is full ({self.capacity} positions)")
        m = len(tokens)
        self.tokens[:m, 0] = tokens
        if uniforms is not None:
            self.uniforms[:m] = uniforms
        self.mask[:, 0, 0, self.length] = 0.0
        width = kv_bucket(self.length + 1, self.capacity) if self.pack_gqa else None
        outputs = self._replay(width, sampler)
        self.positions += 1
        self.length += 1
        return tuple(x[:m] for x in outputs)

    def _replay(self, width: int | None, sampler: Sampler) -> tuple[torch.Tensor, ...]:
        """Run the step for kv ``width`` and ``sampler``: its captured graph (captured the
        first time), else eagerly."""

        def run() -> tuple[torch.Tensor, ...]:
            return tuple(sampler(self._forward(width), self.uniforms))

        key = (width, sampler)
        if key not in self.graphs and self.capture.enabled:
            captured = self.capture.capture(run)
            self._set_length(self.length)  # the warm-up runs advanced the cache's length
            if captured is not None:
                self.graphs[key] = captured
        if key not in self.graphs:
            return run()
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs


class StaticDecoder:
    """The static steps of one model, one per (row bucket, capacity bucket), captured on CUDA
    (``graph``: default on CUDA models): the most recently used whose caches fit
    ``max_cache_bytes`` are kept (the latest always), all are dropped when the model's
    parameters moved (``parameter_pointers``) and by ``release()``. ``built`` counts the
    steps built."""

    def __init__(
        self,
        model: PreTrainedModel,
        max_rows: int,
        cache_keyword: str,
        pad_token_id: int,
        *,
        graph: bool | None = None,
        pack_gqa: bool = True,
        max_cache_bytes: int = MAX_CACHE_BYTES,
    ) -> None:
        self.model, self.max_rows = model, max_rows
        self.cache_keyword, self.pad_token_id = cache_keyword, pad_token_id
        self.pack_gqa, self.max_cache_bytes = pack_gqa, max_cache_bytes
        self.capture = GraphCapture(model.device.type == "cuda" if graph is None else graph)
        self.steps: OrderedDict[tuple[int, int], StaticDecodeStep] = OrderedDict()
        self.pointers = parameter_pointers(model)
        self.built = 0

    @property
    def graph(self) -> bool:
        """Whether steps are captured as CUDA graphs (False on the CPU, and after a failed
        capture other than out of memory)."""
        return self.capture.enabled

    def release(self) -> None:
        """Drop every step: its static cache, buffers and graphs (their memory pool too)."""
        self.steps.clear()
        if self.capture.enabled:
            self.capture.pool = torch.cuda.graph_pool_handle()

    def step_for(self, rows: int, positions: int) -> StaticDecodeStep:
        """The step for ``rows`` rows and ``positions`` cache positions (prompt + new tokens),
        built the first time its buckets are asked for."""
        pointers = parameter_pointers(self.model)
        if pointers != self.pointers:
            self.release()
            self.pointers = pointers
        key = (row_bucket(rows, self.max_rows), capacity_bucket(positions))
        step = self.steps.get(key)
        if step is None:
            self._make_room(key)
            step = self._build(*key)
            self.steps[key] = step
        self.steps.move_to_end(key)
        return step

    def _make_room(self, key: tuple[int, int]) -> None:
        """Drop the least recently used steps while they and the step ``key`` would exceed
        ``max_cache_bytes``."""
        need = self._bytes_of(*key)
        kept = self.max_cache_bytes - need
        while self.steps and sum(s.nbytes for s in self.steps.values()) > kept:
            self.steps.popitem(last=False)

    def _bytes_of(self, rows: int, capacity: int) -> int:
        """Bytes of a step's static cache and mask, from any built step's per-slot size."""
        if not self.steps:
            return 0
        step = next(iter(self.steps.values()))
        return step.nbytes * rows * capacity // (step.rows * step.capacity)

    def _build(self, rows: int, capacity: int) -> StaticDecodeStep:
        self.built += 1
        return StaticDecodeStep(
            self.model,
            rows,
            capacity,
            self.cache_keyword,
            self.pad_token_id,
            self.capture,
            pack_gqa=self.pack_gqa,
        )

"""Per-sample KV caches kept between the turns of one agent-loop run (HF engine).

A sample's entry holds the keys/values of the tokens fed through the model so far (prompt,
earlier turns, observations) and those token ids. The last token sampled in a turn was never
fed, so the next turn feeds it together with the new observation ids. At the next turn the
request's ids are compared with the cached ids: the cache is cut to their longest common
prefix L (at most ``len(ids) - 1``, so at least one token is fed and gives the next-token
logits), and only ``ids[L:]`` is prefilled; L = 0 is a full prefill. Turns cut at a stop
string or at the per-turn cap keep a prefix of the sampled ids, which the comparison handles.

Layout of one micro-batch (rows with different cached lengths L_r and appended lengths a_r),
with Cw = max L_r and Aw = max a_r::

    cache columns  [ left padding | L_r cached tokens ][ padding | a_r appended tokens ]
                   <------------- Cw ----------------><------------ Aw --------------->

``attention_mask`` is 0 on every padding column and ``position_ids`` of a token is the number of
real tokens before it in its row, so each row attends to exactly its own tokens at their own
positions: what it computes alone (up to float rounding of batch-shape dependent kernels).
Decode steps then append one column per step, as in a plain rollout.

Memory: an entry is kept only for samples asked for in the latest call (the agent loop asks for
every unfinished sample each call), entries taken into a micro-batch are dropped from the store
while it runs, and ``clear()`` (the turn generator's ``end_run``) frees everything; so besides
the running batch at most one compact (unpadded) copy of each live sample's context is held:
B x (prompt + rollout.max_response_length) positions at most (SmolLM2-135M in float32: 46 KB
per position, 30 layers x keys and values x 3 heads x 64 x 4 bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

__all__ = ["CachedSequence", "TurnKVCache", "TurnPrefill", "common_prefix_length"]


@dataclass
class CachedSequence:
    """Token ids fed so far and, per layer, their keys and values, each (heads, len(ids), dim)."""

    ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def cropped(self, length: int) -> CachedSequence:
        """The first ``length`` tokens (views, no copy)."""
        if length == len(self.ids):
            return self
        return CachedSequence(
            self.ids[:length],
            [k[:, :length] for k in self.keys],
            [v[:, :length] for v in self.values],
        )


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading positions where ``a`` and ``b`` hold the same id."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = (torch.as_tensor(a[:n]) != torch.as_tensor(b[:n])).nonzero()
    return int(diff[0, 0]) if len(diff) else n


class TurnKVCache:
    """The kept KV of each sample (key: ``TurnRequest.sample``); see the module docstring."""

    def __init__(self) -> None:
        self.entries: dict[Hashable, CachedSequence] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def retain(self, keys: Iterable[Hashable]) -> None:
        """Drop the entries of every key not in ``keys``."""
        wanted = set(keys)
        for key in [k for k in self.entries if k not in wanted]:
            del self.entries[key]

    def clear(self) -> None:
        """Drop every entry."""
        self.entries.clear()

    def take(self, contexts: Sequence[list[int]], keys: Sequence[Hashable | None]) -> TurnPrefill:
        """The prefill plan of one micro-batch: each row's entry (removed from the store) cut
        to its common prefix with the row's context. A None key is never cached."""
        reused = []
        for context, key in zip(contexts, keys, strict=True):
            entry = self.entries.pop(key, None) if key is not None else None
            length = 0 if entry is None else common_prefix_length(entry.ids, context)
            length = min(length, len(context) - 1)
            reused.append(entry.cropped(length) if entry is not None and length > 0 else None)
        return TurnPrefill(self, [list(c) for c in contexts], list(keys), reused)


@dataclass
class TurnPrefill:
    """One micro-batch of turns: ``prefill`` builds its running cache, ``keep`` stores rows'
    KV back into ``store`` when they finish."""

    store: TurnKVCache
    contexts: list[list[int]]
    keys: list[Hashable | None]
    reused: list[CachedSequence | None]

    def prefill(
        self,
        device: torch.device,
        forward: Callable[..., torch.Tensor],
        new_cache: Callable[[int], DynamicCache],
        max_new: int,
        pad_token_id: int,
        fresh_prefill: Callable[..., tuple[torch.Tensor, float]] | None = None,
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor, int, float]:
        """(cache, next-token logits (m, V), attention mask (m, Cw+Aw), next position (m,),
        rows prefilled, tokens prefilled). Rows with the same context and the same reused
        length are prefilled once. ``forward(ids, mask, positions, cache, last_only)`` is the
        engine's model call; ``new_cache(capacity)`` its empty cache; when no row reuses KV
        (a first turn), ``fresh_prefill(ids, mask, positions, cache)`` -> (logits, tokens
        pushed) prefills instead if given (the engine's token-trie prefill)."""
        cached = [0 if r is None else len(r.ids) for r in self.reused]
        groups: dict[tuple[int, tuple[int, ...]], int] = {}
        inverse, firsts = [], []
        for i, context in enumerate(self.contexts):
            group = groups.setdefault((cached[i], tuple(context)), len(groups))
            if group == len(firsts):
                firsts.append(i)
            inverse.append(group)
        lengths = torch.tensor([cached[i] for i in firsts], dtype=torch.long)
        appended = torch.tensor([len(self.contexts[i]) for i in firsts]) - lengths
        cached_width, appended_width = int(lengths.max()), int(appended.max())
        width = cached_width + appended_width
        cache = new_cache(width + max_new)
        if cached_width > 0:
            self._seed(cache, [self.reused[i] for i in firsts], cached_width)
        self.reused = []  # the running cache holds them now: let the entries go

        columns = torch.arange(width)[None]
        in_cache = (columns >= cached_width - lengths[:, None]) & (columns < cached_width)
        mask = (in_cache | (columns >= width - appended[:, None])).long()
        ids = torch.full((len(firsts), appended_width), pad_token_id, dtype=torch.long)
        for u, i in enumerate(firsts):
            ids[u, appended_width - int(appended[u]) :] = torch.tensor(
                self.contexts[i][cached[i] :]
            )
        positions = mask.cumsum(-1)[:, cached_width:] - mask[:, cached_width:]  # real tokens before
        mask, positions, ids = mask.to(device), positions.to(device), ids.to(device)
        if cached_width == 0 and fresh_prefill is not None:
            logits, pushed = fresh_prefill(ids, mask, positions, cache)
        else:
            logits, pushed = forward(ids, mask, positions, cache, True), float(appended.sum())
        if len(firsts) < len(inverse):  # one row per trajectory again, in order
            index = torch.tensor(inverse, device=device)
            cache.batch_select_indices(index)
            logits, mask = logits[index], mask[index]
        next_position = torch.tensor([len(c) for c in self.contexts], device=device)
        return cache, logits, mask, next_position, len(firsts), pushed

    @staticmethod
    def _seed(cache: DynamicCache, entries: list[CachedSequence | None], width: int) -> None:
        """Write each entry's KV right-aligned into the first ``width`` columns (zeros before)."""
        sample = next(e for e in entries if e is not None)
        for layer, (k0, v0) in enumerate(zip(sample.keys, sample.values, strict=True)):
            keys = k0.new_zeros((len(entries), k0.shape[0], width, k0.shape[-1]))
            values = v0.new_zeros((len(entries), v0.shape[0], width, v0.shape[-1]))
            for row, entry in enumerate(entries):
                if entry is not None:
                    keys[row, :, width - len(entry.ids) :] = entry.keys[layer]
                    values[row, :, width - len(entry.ids) :] = entry.values[layer]
            cache.layers[layer].update(keys, values)

    def keep(
        self,
        rows: torch.Tensor,
        running: torch.Tensor,
        fed: int,
        cache: DynamicCache,
        mask: torch.Tensor,
        responses: torch.Tensor,
    ) -> None:
        """Store the KV of micro-batch ``rows`` (at ``running`` in the running cache and
        ``mask``) under their keys: their context and their first ``fed`` sampled ids."""
        for row, at in zip(rows.tolist(), running.tolist(), strict=True):
            key = self.keys[row]
            if key is None:
                continue
            ids = self.contexts[row] + responses[row, :fed].tolist()
            real = mask[at].bool()
            if int(real.sum()) != len(ids):
                raise RuntimeError(f"row {row}: {int(real.sum())} cached positions, {len(ids)} ids")
            self.store.entries[key] = CachedSequence(
                ids,
                [layer.keys[at][:, real] for layer in cache.layers],
                [layer.values[at][:, real] for layer in cache.layers],
            )

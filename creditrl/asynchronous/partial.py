"""Partial rollout: a sampler takes newer weights between decode chunks of one batch.

``PartialRollout.generate`` samples a batch of single-turn prompts in chunks of at most
``chunk_tokens`` new tokens per row. Before each chunk it refreshes its weight channel
(``creditrl.weights``: ``weights.refresh()`` loads the newest published weights into the
engine when they are newer), and the unfinished rows continue on the version the channel then
holds (``weights.version``, the one place the version lives). Each response token records the
version that sampled it (``token_weight_version``, (B, T) int64, 0 on padding), and its
``rollout_log_probs`` entry is that version's log-prob, so the learner's rollout importance
weights pi_old / pi_behaviour use, token by token, the weights that produced the token.

The KV cache across a switch is **recomputed**: a row continued on new weights prefills its
prompt and every token sampled so far under the new weights (the turn KV kept between chunks
is dropped), so each later token's log-prob is exactly log pi_new(y_t | s_t), the log-prob a
full forward pass of the new weights gives. Between chunks without a switch, an engine that
keeps a sample's KV (``keeps_turn_kv()``: the HF engine) continues it and prefills only the
last sampled token; any other engine prefills the whole context again (still exact, slower).

Each row continues its own seed's counter stream (``advance_seed``), so with no switch the
chunks sample exactly the ids one whole ``generate`` call samples (the HF engine with
``sample_seed``), up to float rounding of batch-shape dependent kernels in the log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from creditrl.batch import Batch, assemble_rollout_batch
from creditrl.rollout.continuation import left_padded
from creditrl.rollout.sampling import advance_seed
from creditrl.rollout.turn_cache import TurnKVCache
from creditrl.weights import WeightChannel

__all__ = ["PartialRollout", "group_versions"]


@dataclass
class _Row:
    """One response being sampled: its context so far and what each token recorded."""

    prompt: list[int]
    seed: int | None
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False


class PartialRollout:
    """Single-turn sampling in chunks, the weights refreshed between them (module docstring).

    ``engine``: a ``creditrl.rollout.RolloutEngine``; ``max_response_length``: the tokens a
    response may take in all; ``chunk_tokens`` (>= 1): tokens per row per engine call;
    ``weights``: the sampler's weight channel, attached to what the engine samples with.
    ``last_stats`` (``prefill_tokens``, ``switches``: weight changes inside the latest batch,
    ``chunks``: engine calls) describes the latest ``generate``.
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        *,
        max_response_length: int,
        chunk_tokens: int,
        weights: WeightChannel,
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.engine, self.weights = engine, weights
        self.max_response_length, self.chunk_tokens = max_response_length, chunk_tokens
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else tokenizer.eos_token_id)
        eos = engine.eos_token_ids
        eos = [tokenizer.eos_token_id] if eos is None else eos
        self.eos_token_ids = {int(t) for t in (eos.tolist() if torch.is_tensor(eos) else eos)}
        self.turn_cache = TurnKVCache() if engine.keeps_turn_kv() else None
        self.last_stats: dict[str, float] = {}
        self._records_kept = False

    def generate(
        self,
        prompts: Batch,
        *,
        greedy: bool = False,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> Batch:
        """The engine's ``generate`` answer, sampled in chunks, plus ``token_weight_version``.
        A greedy call (a baseline, never trained on) is one whole engine call."""
        if greedy:
            out = self.engine.generate(prompts, greedy=True, temperature=temperature, seed=seed)
            self.last_stats = dict(self.engine.last_stats)
            return out
        if seed is not None:
            self.engine.generator.manual_seed(seed)
        mask = prompts["attention_mask"].bool()
        seeds = prompts.get("sample_seed")
        rows = [
            _Row(
                prompts["input_ids"][i][mask[i]].tolist(),
                None if seeds is None else int(seeds[i]),
            )
            for i in range(len(prompts))
        ]
        stats = {"prefill_tokens": 0.0, "switches": 0.0, "chunks": 0.0}
        try:
            while live := [i for i, r in enumerate(rows) if not r.done]:
                if self.weights.refresh() and stats["chunks"]:  # newer weights mid-batch
                    stats["switches"] += 1
                    if self.turn_cache is not None:
                        self.turn_cache.clear()  # recomputed under the new weights
                self._chunk(rows, live, self.weights.version, temperature, stats)
        finally:
            if self.turn_cache is not None:
                self.turn_cache.clear()
        self.last_stats = stats
        return self._assemble(prompts, rows)

    def _chunk(
        self,
        rows: list[_Row],
        live: list[int],
        version: int,
        temperature: float | None,
        stats: dict[str, float],
    ) -> None:
        """One engine call: at most ``chunk_tokens`` more tokens for each live row."""
        asked = [min(self.chunk_tokens, self.max_response_length - len(rows[i].ids)) for i in live]
        batch = left_padded([rows[i].prompt + rows[i].ids for i in live], self.pad_token_id)
        batch["max_new_tokens"] = torch.tensor(asked, dtype=torch.long)
        if all(rows[i].seed is not None for i in live):
            batch["sample_seed"] = torch.tensor(
                [advance_seed(rows[i].seed, len(rows[i].ids)) for i in live], dtype=torch.long
            )
        engine = self.engine.capped(max(asked))
        if self.turn_cache is not None:
            out = engine.generate_with_turn_cache(
                batch, live, self.turn_cache, greedy=False, temperature=temperature
            )
        else:
            out = engine.generate(batch, greedy=False, temperature=temperature)
        stats["chunks"] += 1
        stats["prefill_tokens"] += float(engine.last_stats.get("prefill_tokens", 0.0))
        lengths = out["response_mask"].sum(-1).tolist()
        kept = out.get("rollout_kept_counts")
        self._records_kept = kept is not None
        for k, i in enumerate(live):
            row, n = rows[i], min(int(lengths[k]), asked[k])
            new = out["responses"][k, :n].tolist()
            row.ids += new
            row.log_probs += out["rollout_log_probs"][k, :n].float().tolist()
            row.kept += [0] * n if kept is None else kept[k, :n].tolist()
            row.versions += [version] * n
            row.done = (
                n < asked[k]
                or len(row.ids) >= self.max_response_length
                or bool(new and new[-1] in self.eos_token_ids)
            )

    def _assemble(self, prompts: Batch, rows: list[_Row]) -> Batch:
        width = max(1, max(len(r.ids) for r in rows))
        b = len(rows)
        responses = torch.full((b, width), self.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros((b, width), dtype=torch.float32)
        kept = torch.zeros((b, width), dtype=torch.long)
        versions = torch.zeros((b, width), dtype=torch.long)
        real = torch.zeros((b, width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r.ids)
            responses[i, :n] = torch.as_tensor(r.ids, dtype=torch.long)
            log_probs[i, :n] = torch.as_tensor(r.log_probs, dtype=torch.float32)
            kept[i, :n] = torch.as_tensor(r.kept, dtype=torch.long)
            versions[i, :n] = torch.as_tensor(r.versions, dtype=torch.long)
            real[i, :n] = 1
        extra = {"token_weight_version": versions}
        if self._records_kept:  # the engine's answers carry the kept sets (sampling replay)
            extra["rollout_kept_counts"] = kept
        return assemble_rollout_batch(prompts, responses, log_probs, real, extra=extra)


def group_versions(batch: Batch, n: int, default: int) -> list[int]:
    """The weight version of each group of ``n`` rows: the oldest version that sampled one of
    its tokens (``token_weight_version`` over ``response_mask``), or ``default`` (the batch
    has no per-token versions, or the group none known). Unknown versions (-1: a multi-turn
    episode's tokens before its first turn, an empty episode's placeholder) are set to it in
    place, so each row's versions never decrease and the group's lowest is its version."""
    groups = len(batch) // n
    if "token_weight_version" not in batch:
        return [default] * groups
    tokens, mask = batch["token_weight_version"], batch["response_mask"].bool()
    out = []
    for k in range(groups):
        rows = tokens[k * n : (k + 1) * n]
        known = rows[mask[k * n : (k + 1) * n] & (rows >= 0)]
        version = int(known.min()) if len(known) else default
        rows[rows < 0] = version
        out.append(version)
    return out

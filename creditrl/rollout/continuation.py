"""Continue token-id sequences by one assistant turn: the engine interface of the agent loop.

``generate_turns(requests)`` takes, per sequence, its token ids so far (prompt + every earlier
turn and observation, exactly as accumulated) and a token budget, and returns the new ids and
their log-probs under the sampling distribution. Nothing is decoded and re-encoded: the new ids
are the engine's samples. A turn ends at an EOS id, at the budget, or just after the token that
completes a stop string (stop strings are found on the decoded text, only to choose where to
cut; the kept ids are a prefix of the sampled ones, so they remain the policy's own samples).

``EngineTurnGenerator`` adapts any engine with the rollout interface
(``creditrl.rollout.RolloutEngine``: ``generate(prompts: Batch, greedy=..., temperature=...) ->
Batch`` with ``responses``, ``response_mask``, ``rollout_log_probs``). It reads what the engine
declares, never which engine it is: ``capped(max_new_tokens)`` (the HF engine: a view sharing
its model, EOS ids and generator, so no turn is sampled past the per-turn cap; by default the
engine itself, sampling up to its own cap, and the turn is cut), ``eos_token_ids`` (default:
the tokenizer's EOS) and ``last_stats``.

With ``keep_kv_cache`` and an engine whose ``keeps_turn_kv()`` says so (the HF engine, with
its own ``generate`` and a model whose cache layers are all full attention), each sample's
KV cache is kept between its turns (``creditrl.rollout.turn_cache``, keyed by
``TurnRequest.sample``; a negative sample is never cached), so a turn prefills only the tokens
appended since the previous one: that turn's last sampled token and the observation. The
loop calls ``end_run()`` at the end of every run, which frees them.

``weights`` (None, or an async sampler's weight channel with ``asynchronous.partial_rollout``,
``creditrl.weights``) is refreshed before every engine call: it loads newer published weights
if any, and holds the version sampled with from then on. On a change the kept KV caches are
dropped (every context is prefilled again under the new weights), and each ``TurnOutput``
records the version of its tokens (``versions``), so a turn continued in chunks, or an
episode's later turns, can be sampled by newer weights than its earlier tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from creditrl.batch import Batch, position_ids_from_mask
from creditrl.rollout.sampling import advance_seed
from creditrl.rollout.turn_cache import TurnKVCache

if TYPE_CHECKING:
    from creditrl.rollout.engine import RolloutEngine
    from creditrl.weights import WeightChannel

__all__ = [
    "EngineTurnGenerator",
    "TurnGenerator",
    "TurnOutput",
    "TurnRequest",
    "cut_at_stop",
    "left_padded",
]


@dataclass
class TurnRequest:
    """Continue ``ids`` (the whole context so far) by at most ``max_new_tokens`` tokens.

    ``sample`` (row in the batch) and ``turn`` (1-based) say which trajectory asks; engines may
    ignore them (scripted test engines and sticky routing use them). ``seed``: this turn's own
    sampling stream (the engine's ``sample_seed``), or None for the engine's shared stream.
    ``sampled``: how many of the last ``ids`` this same turn has already sampled (a turn
    continued in chunks; ``max_new_tokens`` is then what is left of its budget); its seed's
    stream continues at that step (``advance_seed``).
    """

    ids: list[int]
    max_new_tokens: int
    sample: int = -1
    turn: int = 0
    seed: int | None = None
    sampled: int = 0


@dataclass
class TurnOutput:
    """The new tokens and log π_sample of each (float, same length); ``done`` is False when
    the turn goes on (a chunk ended before EOS, a stop string and the turn's budget); ``kept``
    the size of the set each token was drawn from when the engine records it
    (``rollout_kept_counts``: top-k/top-p/min-p with ``rollout.sampling_replay``), else None;
    ``versions`` the weight version that sampled each token when the generator has a
    ``refresh`` (partial rollout), else None."""

    ids: list[int]
    log_probs: list[float]
    done: bool = True
    kept: list[int] | None = None
    versions: list[int] | None = None


class TurnGenerator(Protocol):
    """What the agent loop needs from an engine. ``end_run`` is optional: the loop calls it,
    when defined, once a run's trajectories are done. ``chunk_tokens`` (optional, default 0)
    > 0 says ``generate_turns`` samples at most that many tokens per request a call and
    answers ``done=False`` for turns that go on, so turns that arrive meanwhile join the next
    call (``creditrl.agents.episodes``)."""

    eos_token_ids: list[int]

    def generate_turns(
        self,
        requests: Sequence[TurnRequest],
        *,
        greedy: bool = False,
        temperature: float | None = None,
    ) -> list[TurnOutput]: ...

    def end_run(self) -> None:
        """Free what was kept for the run's later turns (default: nothing kept)."""


def cut_at_stop(ids: list[int], tokenizer: Any, stop: Sequence[str]) -> int:
    """The smallest k such that ``decode(ids[:k])`` contains a stop string (len(ids) if none).

    Containment only grows with k, so k is found by bisection (O(log n) decodes).
    """

    def has_stop(k: int) -> bool:
        text = tokenizer.decode(ids[:k], skip_special_tokens=False)
        return any(s in text for s in stop)

    if not stop or not ids or not has_stop(len(ids)):
        return len(ids)
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if has_stop(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _has_stop(ids: list[int], tokenizer: Any, stop: Sequence[str]) -> bool:
    if not stop or not ids:
        return False
    text = tokenizer.decode(ids, skip_special_tokens=False)
    return any(s in text for s in stop)


def left_padded(sequences: Sequence[list[int]], pad_id: int) -> Batch:
    """``sequences`` as a left-padded prompt Batch (input_ids, attention_mask, position_ids)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if not seq:
            raise ValueError(f"sequence {i} is empty; a turn needs a context")
        ids[i, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.long)
        mask[i, width - len(seq) :] = 1
    positions = position_ids_from_mask(mask)
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": positions})


class EngineTurnGenerator:
    """One turn per request through a rollout engine; see the module docstring.

    ``max_tokens_per_turn`` (> 0) caps every turn; ``stop`` strings end a turn early;
    ``keep_kv_cache`` keeps each sample's KV between turns where the engine allows it
    (``turn_cache`` is then a ``TurnKVCache``, else None). ``chunk_tokens`` > 0 (with a kept
    KV only, else 0: a chunk would prefill the whole context again) samples each call at most
    that many tokens per request, turns continued from their kept KV in later calls.
    ``run_stats["prefill_tokens"]`` sums the engine's ``last_stats["prefill_tokens"]`` over
    the current run's calls (None when the engine does not report them); ``end_run`` moves it
    to ``last_run_stats``.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        *,
        max_tokens_per_turn: int = 0,
        stop: Sequence[str] = (),
        keep_kv_cache: bool = True,
        chunk_tokens: int = 0,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.stop = list(stop)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else tokenizer.eos_token_id)
        self.turn_engine = engine
        self.weights: WeightChannel | None = None  # refreshed before every engine call
        self.turn_cache: TurnKVCache | None = None
        self.run_stats: dict[str, float | None] = {"prefill_tokens": 0.0}
        self.last_run_stats: dict[str, float | None] = {}
        if keep_kv_cache and engine.keeps_turn_kv():
            self.turn_cache = TurnKVCache()
        self.chunk_tokens = max(int(chunk_tokens), 0) if self.turn_cache is not None else 0
        eos = engine.eos_token_ids
        if eos is None:
            eos = [tokenizer.eos_token_id]
        self.eos_token_ids = [int(t) for t in (eos.tolist() if torch.is_tensor(eos) else eos)]
        if max_tokens_per_turn > 0:
            self.turn_engine = engine.capped(max_tokens_per_turn)

    def generate_turns(
        self,
        requests: Sequence[TurnRequest],
        *,
        greedy: bool = False,
        temperature: float | None = None,
    ) -> list[TurnOutput]:
        """New ids and log-probs for each request, cut at its budget and at stop strings (at
        most ``chunk_tokens`` of them when set: ``done`` says whether the turn ended)."""
        if not requests:
            return []
        version = self._refreshed()
        asked = [max(int(r.max_new_tokens), 0) for r in requests]
        if self.chunk_tokens:
            asked = [min(a, self.chunk_tokens) for a in asked]
        prompts = left_padded([r.ids for r in requests], self.pad_token_id)
        prompts["max_new_tokens"] = torch.tensor([max(a, 1) for a in asked], dtype=torch.long)
        if all(r.seed is not None for r in requests):
            seeds = [advance_seed(r.seed, r.sampled) for r in requests]  # type: ignore[arg-type]
            prompts["sample_seed"] = torch.tensor(seeds, dtype=torch.long)
        engine = self.turn_engine.capped(max(asked)) if self.chunk_tokens else self.turn_engine
        if self.turn_cache is not None:
            keys = [r.sample if r.sample >= 0 else None for r in requests]
            if not self.chunk_tokens:  # chunked calls hold only some of the live samples
                self.turn_cache.retain(keys)
            out = engine.generate_with_turn_cache(
                prompts, keys, self.turn_cache, greedy=greedy, temperature=temperature
            )
        else:
            out = engine.generate(prompts, greedy=greedy, temperature=temperature)
        self._count(engine.last_stats)
        lengths = out["response_mask"].sum(-1).tolist()
        responses, log_probs = out["responses"].cpu(), out["rollout_log_probs"].cpu().float()
        kept = out["rollout_kept_counts"].cpu() if "rollout_kept_counts" in out else None
        outputs = []
        for i, (request, a) in enumerate(zip(requests, asked, strict=True)):
            ids = responses[i, : min(int(lengths[i]), a)].tolist()
            row_kept = None if kept is None else kept[i]
            outputs.append(self._turn(request, ids, log_probs[i], a, row_kept, version))
        return outputs

    def _refreshed(self) -> int | None:
        """The version the weight channel holds after a refresh (None without one); the kept
        KV caches are dropped when it loaded newer weights, so every context is prefilled under
        the weights that sample next (the loop's ``end_run`` drops them between runs)."""
        if self.weights is None:
            return None
        if self.weights.refresh() and self.turn_cache is not None:
            self.turn_cache.clear()
        return self.weights.version

    def _turn(
        self,
        request: TurnRequest,
        ids: list[int],
        log_probs: torch.Tensor,
        asked: int,
        kept: torch.Tensor | None,
        version: int | None = None,
    ) -> TurnOutput:
        """One request's output: ``ids`` cut at a stop string (looked for over the whole turn,
        the ids it sampled in earlier chunks included), and whether the turn ended."""
        before = request.ids[len(request.ids) - request.sampled :] if request.sampled else []
        whole = before + ids
        n = cut_at_stop(whole, self.tokenizer, self.stop)
        done = not self.chunk_tokens or (
            n < len(whole)
            or len(ids) < asked
            or len(ids) >= request.max_new_tokens
            or bool(ids and ids[-1] in self.eos_token_ids)
            or _has_stop(whole, self.tokenizer, self.stop)
        )
        n -= len(before)
        return TurnOutput(
            ids[:n],
            log_probs[:n].tolist(),
            done,
            None if kept is None else kept[:n].tolist(),
            None if version is None else [version] * n,
        )

    def _count(self, engine_stats: Mapping[str, float]) -> None:
        prefill, total = engine_stats.get("prefill_tokens"), self.run_stats["prefill_tokens"]
        self.run_stats["prefill_tokens"] = (
            None if prefill is None or total is None else total + float(prefill)
        )

    def end_run(self) -> None:
        """Free the kept KV caches and close the run's counts into ``last_run_stats``."""
        if self.turn_cache is not None:
            self.turn_cache.clear()
        self.last_run_stats = self.run_stats
        self.run_stats = {"prefill_tokens": 0.0}

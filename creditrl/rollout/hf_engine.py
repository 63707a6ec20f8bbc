"""The CPU rollout engine: batched sampling with a transformers model and a KV cache.

Token ids in, token ids out: the prompt ids of the Batch are fed as they are and the sampled ids
are returned as they are; nothing is decoded or re-encoded.

Per micro-batch of ``cfg.micro_batch_size`` trajectories:

1. trim the prompt columns that are padding in every row, and prefill each *distinct* prompt
   once (the trainer repeats every prompt ``n`` times), computing logits for the last position
   only; on CPU, prompts that share a head are prefilled as one token trie, each shared
   prefix once (``_prefill_trie``); the KV cache is then expanded to one row per trajectory;
2. decode one token per step for the running rows, with the 2-D attention mask of the real
   tokens and ``position_ids`` = the number of real tokens before the new one, so a left-padded
   row generates what it would generate alone (plain float32 CPU Llama models step through
   ``rollout.llama_decode.LlamaDecoder``, the same function with less overhead);
3. a row leaves the running batch (KV cache, mask, positions) at the step it samples EOS or
   reaches ``max_response_length``, so no forward pass is spent on finished rows.

``generate_with_turn_cache`` is the agent loop's variant: step 1 continues each row's KV kept
from its previous turn, prefilling only the tokens appended since, and step 3 keeps each
row's KV before it leaves (``creditrl.rollout.turn_cache``).

Two CPU measures, measured in ``benchmarks/bench_rollout.py`` (2 cores, SmolLM2-135M, 16 x 96
tokens): the DynamicCache's full-attention layers are ``PreallocatedLayer`` (keys/values
written in place into a buffer sized for prompt + response, instead of ``torch.cat`` of the
whole cache at every step), and float32 ``nn.Linear`` calls on at most
``SMALL_BATCH_ROWS`` rows compute ``(W @ x^T)^T`` (MKL streams the weight far faster in that
layout for few rows: the 49152 x 576 LM head takes ~5 ms instead of ~20 ms for 2-8 rows).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from creditrl.batch import Batch, assemble_rollout_batch, position_ids_from_mask
from creditrl.config.schema import RolloutConfig
from creditrl.models.token_tree import token_trie, tree_attention_mask, tree_pays, tree_unsupported
from creditrl.rollout.engine import EngineArgs, RolloutEngine, register_rollout_engine
from creditrl.rollout.llama_decode import LlamaDecoder
from creditrl.rollout.sampling import counter_uniforms, sample_next_tokens

if TYPE_CHECKING:
    from creditrl.rollout.turn_cache import TurnKVCache, TurnPrefill

__all__ = [
    "FAST_DECODE",
    "LARGE_WEIGHT_ROWS",
    "SMALL_BATCH_ROWS",
    "TREE_PREFILL",
    "HFRolloutEngine",
    "PreallocatedLayer",
    "SamplingParams",
    "cache_keyword",
    "eos_token_ids_of",
    "preallocated_cache",
    "prompt_keys",
    "sampling_params_of",
    "weight_major_linears",
]

_PROMPT_FIELDS = ("input_ids", "attention_mask", "position_ids")
_STATS = ("prefill_s", "decode_s", "prefill_rows", "prefill_tokens", "decode_rows", "decode_steps")

# float32 CPU nn.Linear calls on at most this many rows use the (W @ x^T)^T layout; 0: never.
SMALL_BATCH_ROWS = 8
# Decode plain float32 CPU Llama models with rollout.llama_decode.LlamaDecoder.
FAST_DECODE = True
# Prefill distinct prompts as one token trie on CPU where it pays (HFRolloutEngine._prefill_trie).
TREE_PREFILL = True
# ... and on at most this many rows for weights of _LARGE_WEIGHT elements or more: the 49152 x
# 576 LM head took 17 / 28 / 44 ms for 16 / 32 / 64 rows, against 25 / 40 / 73 ms as nn.Linear.
LARGE_WEIGHT_ROWS = 64
_LARGE_WEIGHT = 1 << 22  # elements (16 MiB in float32)


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


def _weight_major_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` computed as ``(W @ x^T)^T`` for 2..SMALL_BATCH_ROWS rows, and up to
    LARGE_WEIGHT_ROWS rows for large weights (the LM head). One row uses the matrix-vector
    product, except for large weights, where the row is doubled: MKL's one-row path reads them
    ~3x slower than its two-row one."""
    rows = x.numel() // x.shape[-1]
    large = module.weight.numel() >= _LARGE_WEIGHT
    limit = LARGE_WEIGHT_ROWS if large else SMALL_BATCH_ROWS
    if rows > limit or rows == 0 or (rows == 1 and not large):
        return nn.functional.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = torch.cat([flat, flat])
    out = torch.mm(module.weight, flat.t())[:, :rows].t().contiguous()
    if module.bias is not None:
        out += module.bias
    return out.view(*x.shape[:-1], out.shape[-1])


@contextmanager
def weight_major_linears(model: nn.Module) -> Iterator[int]:
    """Within the block, float32 CPU ``nn.Linear`` modules of ``model`` compute few-row inputs
    as ``(W @ x^T)^T`` (same values to float rounding). Modules whose ``forward`` is already
    replaced (e.g. by accelerate hooks) are left alone. Yields the number of modules patched."""
    patched = []
    if SMALL_BATCH_ROWS > 0:
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if (
                type(module) is nn.Linear
                and "forward" not in module.__dict__
                and weight is not None
                and weight.device.type == "cpu"
                and weight.dtype == torch.float32
            ):
                module.forward = partial(_weight_major_linear, module)
                patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward


@dataclass(frozen=True)
class SamplingParams:
    """One generate() call's settings. ``greedy`` ignores temperature, top-k and top-p."""

    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    greedy: bool


def eos_token_ids_of(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a response: the tokenizer's EOS plus the generation config's EOS ids."""
    ids: list[int] = []
    candidates: list[int | Iterable[int] | None] = [tokenizer.eos_token_id]
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        candidates.append(generation_config.eos_token_id)
    for value in candidates:
        if value is None:
            continue
        for token in [value] if isinstance(value, int) else value:
            if int(token) not in ids:
                ids.append(int(token))
    return ids


def prompt_keys(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Rows that are the same prompt (same real tokens, same padding) get equal keys."""
    return input_ids.masked_fill(attention_mask == 0, -1)


@register_rollout_engine("hf")
class HFRolloutEngine(RolloutEngine):
    """Samples responses for a prompt Batch with a transformers causal LM (the CPU engine),
    registered as ``rollout.engine=hf``. It samples with the module it is given
    (``samples_with_actor_module``), and its log-probs are that module's own at the sampling
    temperature (``exact_log_probs``); it never sleeps.

    ``seed`` seeds the engine's ``torch.Generator``: the same seed, model, prompts and settings
    give the same samples. A prompt batch with a ``sample_seed`` (B,) int64 field samples each
    row from its own counter-based stream instead (``counter_uniforms``), so the tokens do not
    depend on how rows are grouped into micro-batches or data-parallel workers (the trainer
    draws these seeds). ``eos_token_ids`` overrides the stop ids (default:
    ``eos_token_ids_of(model, tokenizer)``). ``remove_finished=False`` keeps finished rows in
    the forward passes (the naive loop, for benchmarks). Each trajectory draws one uniform per
    step from the micro-batch's stream whether or not others finished, so both loops sample
    the same tokens (up to float rounding of batch-size dependent kernels).

    ``last_stats`` describes the latest generate(): ``prefill_s``, ``decode_s`` (seconds),
    ``prefill_rows`` (distinct prompts prefilled), ``prefill_tokens`` (the positions pushed
    through prefill forwards: their real tokens, or the trie's nodes; padding not counted),
    ``decode_rows`` (rows summed over decode forwards), ``decode_steps`` and
    ``response_tokens`` (valid tokens generated).
    """

    samples_with_actor_module = True
    exact_log_probs = True

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        cfg: RolloutConfig,
        *,
        seed: int = 0,
        eos_token_ids: Sequence[int] | None = None,
        remove_finished: bool = True,
    ) -> None:
        if cfg.max_response_length < 1:
            raise ValueError(
                f"rollout.max_response_length must be >= 1, got {cfg.max_response_length}"
            )
        if cfg.micro_batch_size < 1:
            raise ValueError(f"rollout.micro_batch_size must be >= 1, got {cfg.micro_batch_size}")
        if not 0.0 < cfg.top_p <= 1.0:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {cfg.top_p}")
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.remove_finished = remove_finished
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else tokenizer.eos_token_id)
        eos = eos_token_ids_of(model, tokenizer) if eos_token_ids is None else list(eos_token_ids)
        self.eos_token_ids = torch.tensor(eos, dtype=torch.long, device=model.device)
        self.generator = torch.Generator(device=model.device)
        self.generator.manual_seed(seed)
        self._keeps_last_logits = _accepts_logits_to_keep(model)
        self._cache_keyword = cache_keyword(model)
        self._tree_prefill = (
            self._keeps_last_logits
            and tree_unsupported(model) is None
            and model.device.type == "cpu"
        )
        self.last_stats: dict[str, float] = {}

    @classmethod
    def from_args(cls, args: EngineArgs) -> HFRolloutEngine:
        """The engine over ``args.model`` (required: it samples with the actor's module)."""
        if args.model is None:
            raise ValueError("rollout.engine=hf samples with the actor's model: pass it")
        return cls(args.model, args.tokenizer, args.cfg, seed=args.seed)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load full tensors into the module it samples with (all of its state: strict);
        returns how many. Needed only when that module is a copy of a sharded actor."""
        state = dict(named_tensors)
        self.model.load_state_dict(state)
        return len(state)

    def sampling_params(
        self, *, greedy: bool = False, temperature: float | None = None
    ) -> SamplingParams:
        """See ``sampling_params_of``."""
        return sampling_params_of(self.cfg, greedy=greedy, temperature=temperature)

    def generate(
        self,
        prompts: Batch,
        *,
        greedy: bool = False,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> Batch:
        """Sample one response per row of ``prompts`` (left-padded input_ids/attention_mask).

        Returns a new Batch: the input's non-tensors, meta and other tensors, plus prompts,
        responses, response_mask, input_ids, attention_mask, position_ids and
        rollout_log_probs as described in ``creditrl.batch.FIELDS``; T is the longest
        response. ``seed`` re-seeds the engine's generator first.
        """
        if seed is not None:
            self.generator.manual_seed(seed)
        return self._sample(prompts, greedy, temperature)

    def generate_with_turn_cache(
        self,
        prompts: Batch,
        keys: Sequence[Hashable | None],
        turn_cache: TurnKVCache,
        *,
        greedy: bool = False,
        temperature: float | None = None,
    ) -> Batch:
        """``generate`` for agent turns: row i continues the KV ``turn_cache`` holds for
        ``keys[i]`` (its common prefix with the row's ids; None: no cache) and its KV is left
        there when it finishes (``creditrl.rollout.turn_cache``). The sampling is generate()'s:
        the same micro-batches, draws and settings, so only float rounding differs."""
        if len(keys) != len(prompts):
            raise ValueError(f"{len(keys)} cache keys for {len(prompts)} prompt rows")
        return self._sample(prompts, greedy, temperature, list(keys), turn_cache)

    def keeps_turn_kv(self) -> bool:
        """Whether every cache layer of the model is a full-attention ``PreallocatedLayer``:
        then a turn's KV can be kept and continued (``generate_with_turn_cache``)."""
        cache = preallocated_cache(self.model, 1)
        return bool(cache.layers) and all(type(x) is PreallocatedLayer for x in cache.layers)

    def _sample(
        self,
        prompts: Batch,
        greedy: bool,
        temperature: float | None,
        keys: list[Hashable | None] | None = None,
        turn_cache: TurnKVCache | None = None,
    ) -> Batch:
        params = self.sampling_params(greedy=greedy, temperature=temperature)
        ids, mask, positions = _prompt_tensors(prompts, self.model.device)
        seeds = prompts.get("sample_seed")
        size = self.cfg.micro_batch_size
        parts = []
        self.last_stats = dict.fromkeys(_STATS, 0.0)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode(), weight_major_linears(self.model):
                decoder = LlamaDecoder.for_model(self.model) if FAST_DECODE else None
                for start in range(0, len(ids), size):
                    rows = slice(start, start + size)
                    plan = None
                    if turn_cache is not None and keys is not None:
                        real = mask[rows].bool()
                        contexts = [ids[rows][i][real[i]].tolist() for i in range(len(real))]
                        plan = turn_cache.take(contexts, keys[rows])
                    parts.append(
                        self._generate_micro_batch(
                            ids[rows],
                            mask[rows],
                            positions[rows],
                            params,
                            None if seeds is None else seeds[rows],
                            plan,
                            decoder,
                        )
                    )
        finally:
            self.model.train(was_training)
        out = self._assemble(prompts, ids, mask, parts)
        self.last_stats["response_tokens"] = float(out["response_mask"].sum())
        return out

    def _forward(self, ids, mask, positions, cache, last_only: bool) -> torch.Tensor:
        kwargs = {"logits_to_keep": 1} if last_only and self._keeps_last_logits else {}
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_keyword: cache},
            **kwargs,
        )
        return out.logits[:, -1]

    def _prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, max_new: int
    ) -> tuple[DynamicCache, torch.Tensor]:
        """The KV cache and next-token logits (m, V) of each row, computing each distinct
        prompt once; ``ids``/``mask``/``positions`` are already trimmed of all-padding columns."""
        m, device = len(ids), ids.device
        unique_keys, inverse = torch.unique(prompt_keys(ids, mask), dim=0, return_inverse=True)
        firsts = torch.full((len(unique_keys),), m, dtype=torch.long, device=device)
        firsts = firsts.scatter_reduce(0, inverse, torch.arange(m, device=device), "amin")
        cache = preallocated_cache(self.model, ids.shape[1] + max_new)
        logits, pushed = self._fresh_prefill(ids[firsts], mask[firsts], positions[firsts], cache)
        self.last_stats["prefill_rows"] += len(firsts)
        self.last_stats["prefill_tokens"] += pushed
        if not torch.equal(inverse, torch.arange(m, device=device)):  # expand and restore order
            cache.batch_select_indices(inverse)
            logits = logits[inverse]
        return cache, logits

    def _fresh_prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> tuple[torch.Tensor, float]:
        """Next-token logits (m, V) of distinct prompts into an empty ``cache``, and the
        positions pushed: as one token trie where it pays, else padded."""
        tree = self._prefill_trie(ids, mask, cache)
        if tree is not None:
            return tree
        return self._forward(ids, mask, positions, cache, True), float(mask.sum())

    def _prefill_trie(
        self, ids: torch.Tensor, mask: torch.Tensor, cache: DynamicCache
    ) -> tuple[torch.Tensor, float] | None:
        """Prefill distinct prompts that share a head (system prompt, worked example) as one
        token trie (``models.token_tree``): each shared prefix is computed once, then every
        layer's keys/values are gathered into ``cache`` row by row along each prompt's path,
        left-padded like ``ids``. Returns the (m, V) next-token logits and the nodes run, or
        None where the trie does not pay or the model or cache cannot take it."""
        if not (TREE_PREFILL and self._tree_prefill and len(ids) > 1):
            return None
        if not all(type(layer) is PreallocatedLayer for layer in cache.layers):
            return None
        real = mask.bool()
        trie = token_trie(row[keep].tolist() for row, keep in zip(ids, real, strict=True))
        if not tree_pays(trie.nodes, int(real.sum())):
            return None
        device, width = ids.device, ids.shape[1]
        attention = tree_attention_mask(
            trie.ancestors(device), self.model.config._attn_implementation, self.model.dtype
        )
        scratch = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=torch.tensor([trie.tokens], device=device),
            attention_mask=attention,
            position_ids=torch.tensor([trie.depths], device=device),
            use_cache=True,
            **{self._cache_keyword: scratch},
            logits_to_keep=torch.tensor([path[-1] for path in trie.paths], device=device),
        )
        gather = torch.zeros(ids.shape, dtype=torch.long, device=device)  # padding: node 0
        for row, path in enumerate(trie.paths):
            gather[row, width - len(path) :] = torch.tensor(path, device=device)
        for source, target in zip(scratch.layers, cache.layers, strict=True):
            keys = source.keys[0][:, gather].transpose(0, 1)
            values = source.values[0][:, gather].transpose(0, 1)
            target.update(keys, values)
        return out.logits[0], float(trie.nodes)

    def _generate_micro_batch(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        params: SamplingParams,
        seeds: torch.Tensor | None = None,
        turns: TurnPrefill | None = None,
        decoder: LlamaDecoder | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Responses (m, L) padded, log-probs (m, L), lengths (m,) for one micro-batch; with
        ``seeds`` (m,) each row's draws come from ``counter_uniforms`` of its own seed. With
        ``turns``, the prefill continues the rows' kept KV and each row's KV is kept when it
        finishes (``creditrl.rollout.turn_cache``). ``decoder`` runs the decode steps instead
        of the model's forward when given."""
        m, device, max_new = len(ids), ids.device, params.max_new_tokens
        stats, start = self.last_stats, time.perf_counter()
        if turns is None:
            first_real = int((mask.sum(0) > 0).long().argmax())
            ids, mask = ids[:, first_real:], mask[:, first_real:]
            positions = positions[:, first_real:]
            cache, logits = self._prefill(ids, mask, positions, max_new)
            next_position = positions[:, -1] + 1
        else:
            new_cache = partial(preallocated_cache, self.model)
            cache, logits, mask, next_position, prefilled_rows, prefilled = turns.prefill(
                device, self._forward, new_cache, max_new, self.pad_token_id, self._fresh_prefill
            )
            stats["prefill_rows"] += prefilled_rows
            stats["prefill_tokens"] += prefilled

        responses = torch.full((m, max_new), self.pad_token_id, dtype=torch.long, device=device)
        log_probs = torch.zeros((m, max_new), dtype=torch.float32, device=device)
        lengths = torch.full((m,), max_new, dtype=torch.long, device=device)
        rows = torch.arange(m, device=device)  # micro-batch row of each running row
        alive = torch.ones(m, dtype=torch.bool, device=device)  # naive loop: rows still unfinished
        decode_start = time.perf_counter()
        stats["prefill_s"] += decode_start - start
        for step in range(max_new):
            uniforms = None
            if seeds is not None and not params.greedy:
                uniforms = counter_uniforms(seeds[rows], step).to(device)
            elif not params.greedy:  # one draw per trajectory, so removals do not shift the stream
                uniforms = torch.rand(m, generator=self.generator, device=device)[rows]
            tokens, token_log_probs = sample_next_tokens(
                logits,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                greedy=params.greedy,
                uniforms=uniforms,
            )
            live_rows = rows[alive]
            responses[live_rows, step] = tokens[alive]
            log_probs[live_rows, step] = token_log_probs[alive]
            finished = torch.isin(tokens, self.eos_token_ids) & alive
            lengths[rows[finished]] = step + 1
            alive &= ~finished
            last = step + 1 == max_new or not bool(alive.any())
            if turns is not None:  # keep KV before rows leave; a turn's last token is not fed
                done = (finished | alive) if last else finished
                if bool(done.any()):
                    at = done.nonzero().squeeze(1)
                    turns.keep(rows[at], at, step, cache, mask, responses)
            if last:
                break
            if self.remove_finished and not bool(alive.all()):
                keep = alive.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                rows, tokens, mask = rows[keep], tokens[keep], mask[keep]
                next_position, alive = next_position[keep], alive[keep]
            mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
            if decoder is not None:
                logits = decoder.step(tokens[:, None], next_position[:, None], mask, cache)
            else:
                logits = self._forward(tokens[:, None], mask, next_position[:, None], cache, False)
            next_position = next_position + 1
            stats["decode_rows"] += len(tokens)
            stats["decode_steps"] += 1
        stats["decode_s"] += time.perf_counter() - decode_start
        return responses, log_probs, lengths

    def _assemble(
        self,
        prompts: Batch,
        ids: torch.Tensor,
        mask: torch.Tensor,
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> Batch:
        lengths = torch.cat([p[2] for p in parts])
        width = int(lengths.max())
        responses = torch.cat([p[0][:, :width] for p in parts])
        rollout_log_probs = torch.cat([p[1][:, :width] for p in parts])
        real = (torch.arange(width, device=ids.device)[None] < lengths[:, None]).long()
        return assemble_rollout_batch(prompts, responses, rollout_log_probs, real)


def sampling_params_of(
    cfg: RolloutConfig, *, greedy: bool = False, temperature: float | None = None
) -> SamplingParams:
    """Settings from the config; ``temperature`` overrides it, 0 (or ``greedy``) is greedy."""
    temperature = cfg.temperature if temperature is None else float(temperature)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return SamplingParams(
        temperature=temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_response_length,
        greedy=greedy or temperature == 0,
    )


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


def _accepts_logits_to_keep(model: PreTrainedModel) -> bool:
    parameters = inspect.signature(model.forward).parameters
    return "logits_to_keep" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def _prompt_tensors(prompts: Batch, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Validated (input_ids, attention_mask, position_ids) on ``device``, int64, left-padded."""
    if len(prompts) == 0:
        raise ValueError("generate() got an empty prompt batch")
    for name in _PROMPT_FIELDS[:2]:
        if name not in prompts.tensors:
            raise KeyError(f"prompt batch has no tensor field {name!r} (fields: {prompts.keys()})")
    ids = prompts["input_ids"].to(device=device, dtype=torch.long)
    mask = prompts["attention_mask"].to(device=device, dtype=torch.long)
    if ids.ndim != 2 or ids.shape != mask.shape:
        raise ValueError(
            f"input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} must be the same "
            "(B, P) shape"
        )
    if "position_ids" in prompts.tensors:
        positions = prompts["position_ids"].to(device=device, dtype=torch.long)
        if positions.shape != ids.shape:
            raise ValueError(
                f"position_ids {tuple(positions.shape)} must match input_ids {tuple(ids.shape)}"
            )
    else:
        positions = position_ids_from_mask(mask)
    bad = (mask[:, -1] != 1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"prompt rows {bad[:10]} do not end with a real token (attention_mask[:, -1] != 1): "
            "prompts must be left-padded and non-empty"
        )
    return ids, mask, positions

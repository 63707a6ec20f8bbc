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
tokens): the KV cache's full-attention layers write in place (``rollout.kv_cache``), and
float32 ``nn.Linear`` calls on few rows use the weight-major product (``rollout.cpu_kernels``).

On CUDA, decode runs from a static KV cache as a captured CUDA graph
(``rollout.cuda_graph``; ``rollout.engine_kwargs.decode_cache``): finished rows then stay in the
batch, fed the pad id, so the graph's shape never changes.

A LoRA (peft) model is sampled from a plain copy with its adapters merged, W + s B A
(``rollout.merged_copy``), refreshed in place only when its weights changed since the last
merge, so the Llama decoder, the weight-major products and the CUDA graphs apply to it as to a
full model; its log-probs equal the adapter model's to float rounding.

The module-level ``FAST_DECODE`` and ``TREE_PREFILL`` (and ``cpu_kernels.SMALL_BATCH_ROWS``)
are the defaults of the engine's ``fast_decode``, ``tree_prefill`` and ``small_batch_rows``
arguments, read when an engine is built, so engines in one process can differ. The sampling
settings and stop ids come from ``rollout.sampling``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import time
from collections.abc import Hashable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from creditrl.batch import Batch, assemble_rollout_batch, position_ids_from_mask
from creditrl.config.schema import RolloutConfig
from creditrl.models.token_tree import token_trie, tree_attention_mask, tree_pays, tree_unsupported
from creditrl.rollout import cpu_kernels
from creditrl.rollout.cpu_kernels import weight_major_linears
from creditrl.rollout.cuda_graph import StaticDecoder, static_decode_unsupported
from creditrl.rollout.engine import EngineArgs, RolloutEngine
from creditrl.rollout.kv_cache import PreallocatedLayer, cache_keyword, preallocated_cache
from creditrl.rollout.llama_decode import LlamaDecoder
from creditrl.rollout.merged_copy import MergedCopy, is_lora_model
from creditrl.rollout.registries import DECODE_CACHE, SAMPLE_DTYPE
from creditrl.rollout.sample_buffers import SampleBuffers
from creditrl.rollout.sampler_copy import SamplerCopy
from creditrl.rollout.sampling import (
    SamplingParams,
    check_sampling_config,
    counter_uniforms,
    eos_token_ids_of,
    sampling_params_of,
)
from creditrl.rollout.static_loop import StepSampler, static_decode

if TYPE_CHECKING:
    from creditrl.rollout.turn_cache import TurnKVCache, TurnPrefill

__all__ = [
    "DECODE_CACHE",
    "FAST_DECODE",
    "SAMPLE_DTYPE",
    "TREE_PREFILL",
    "HFRolloutEngine",
    "prompt_keys",
]

_PROMPT_FIELDS = ("input_ids", "attention_mask", "position_ids")
_STATS = ("prefill_s", "decode_s", "prefill_rows", "prefill_tokens", "decode_rows", "decode_steps")

# Defaults of the engine's arguments (read when an engine is built):
# decode plain float32 CPU Llama models with rollout.llama_decode.LlamaDecoder;
FAST_DECODE = True
# prefill distinct prompts as one token trie on CPU where it pays (HFRolloutEngine._prefill_trie).
TREE_PREFILL = True


def prompt_keys(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Rows that are the same prompt (same real tokens, same padding) get equal keys."""
    return input_ids.masked_fill(attention_mask == 0, -1)


class HFRolloutEngine(RolloutEngine):
    """Samples responses for a prompt Batch with a transformers causal LM (the CPU engine),
    registered as ``rollout.engine=hf``. It samples with the module it is given
    (``samples_with_actor_module``), and its log-probs are that module's own at the sampling
    temperature (``exact_log_probs``; a LoRA model's through its merged copy, equal to float
    rounding: ``rollout.merged_copy``); ``sleep()`` drops its static KV caches and CUDA graphs.

    ``seed`` seeds the engine's ``torch.Generator``: the same seed, model, prompts and settings
    give the same samples. A prompt batch with a ``sample_seed`` (B,) int64 field samples each
    row from its own counter-based stream instead (``counter_uniforms``), so the tokens do not
    depend on how rows are grouped into micro-batches or data-parallel workers (the trainer
    draws these seeds); a ``max_new_tokens`` (B,) int64 field ends each row at its own
    token count, at most the engine's (agent turns ask for their own). ``eos_token_ids``
    overrides the stop ids (default:
    ``eos_token_ids_of(model, tokenizer)``). ``remove_finished=False`` keeps finished rows in
    the forward passes (the naive loop, for benchmarks). Each trajectory draws one uniform per
    step from the micro-batch's stream whether or not others finished, so both loops sample
    the same tokens (up to float rounding of batch-size dependent kernels).

    ``fast_decode`` (default ``FAST_DECODE``) decodes plain float32 CPU Llama models with
    ``LlamaDecoder``; ``tree_prefill`` (default ``TREE_PREFILL``) prefills distinct prompts as
    one token trie where it pays; ``small_batch_rows`` (default
    ``cpu_kernels.SMALL_BATCH_ROWS``; 0: off) bounds the rows of the weight-major ``nn.Linear``
    product; ``decode_cache`` (default ``cfg.engine_kwargs["decode_cache"]``, else 'auto')
    decodes from a static KV cache, captured as a CUDA graph on CUDA ('auto': CUDA models
    only; ``rollout.cuda_graph``). Each changes speed only, not the function sampled (to float
    rounding). ``merged_copy`` (default: a new one when ``model`` is a peft model) is the
    ``MergedCopy`` a LoRA model is sampled from; engines built one after another over the same
    model share one (the Tinker service builds an engine per call) so it merges once per weight
    version, not once per engine. ``merge_lora=False`` samples a peft model through peft (the
    slower path, for comparison).

    ``last_stats`` describes the latest generate(): ``prefill_s``, ``decode_s`` (seconds),
    ``prefill_rows`` (distinct prompts prefilled), ``prefill_tokens`` (the positions pushed
    through prefill forwards: their real tokens, or the trie's nodes; padding not counted),
    ``decode_rows`` (rows summed over decode forwards), ``decode_steps`` and
    ``response_tokens`` (valid tokens generated).
    """

    samples_with_actor_module = True
    exact_log_probs = True
    records_kept_set = True
    options = (DECODE_CACHE, SAMPLE_DTYPE)

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        cfg: RolloutConfig,
        *,
        seed: int = 0,
        eos_token_ids: Sequence[int] | None = None,
        remove_finished: bool = True,
        fast_decode: bool | None = None,
        tree_prefill: bool | None = None,
        small_batch_rows: int | None = None,
        decode_cache: str | None = None,
        merged_copy: MergedCopy | None = None,
        merge_lora: bool = True,
    ) -> None:
        check_sampling_config(cfg)
        if cfg.micro_batch_size < 1:
            raise ValueError(f"rollout.micro_batch_size must be >= 1, got {cfg.micro_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.remove_finished = remove_finished
        self.fast_decode = FAST_DECODE if fast_decode is None else fast_decode
        self.tree_prefill = TREE_PREFILL if tree_prefill is None else tree_prefill
        self.small_batch_rows = (
            cpu_kernels.SMALL_BATCH_ROWS if small_batch_rows is None else small_batch_rows
        )
        if decode_cache is None:
            decode_cache = cfg.engine_kwargs.get(DECODE_CACHE.name, DECODE_CACHE.default)
        self.decode_cache = DECODE_CACHE.check(decode_cache, "rollout.engine_kwargs.decode_cache")
        sample_dtype = cfg.engine_kwargs.get(SAMPLE_DTYPE.name, SAMPLE_DTYPE.default)
        sample_dtype = SAMPLE_DTYPE.check(sample_dtype, "rollout.engine_kwargs.sample_dtype")
        self._copy = SamplerCopy(torch.bfloat16) if sample_dtype == "bfloat16" else None
        # a LoRA model is sampled merged (bf16 with sample_dtype=bfloat16)
        self.merged_copy: MergedCopy | None = None
        if merge_lora and is_lora_model(model):
            dtype = torch.bfloat16 if self._copy is not None else None
            self.merged_copy = merged_copy if merged_copy is not None else MergedCopy(dtype)
        self._static: list[StaticDecoder] = []  # shared with capped() views
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else tokenizer.eos_token_id)
        eos = eos_token_ids_of(model, tokenizer) if eos_token_ids is None else list(eos_token_ids)
        self.eos_token_ids = torch.tensor(eos, dtype=torch.long, device=model.device)
        self.generator = torch.Generator(device=model.device)
        self.generator.manual_seed(seed)
        self._keeps_last_logits = _accepts_logits_to_keep(model)
        self._cache_keyword = cache_keyword(model)
        self._trie_fits = (
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
        """Whether a turn's KV can be kept and continued (``generate_with_turn_cache``): every
        cache layer of the model is a full-attention ``PreallocatedLayer``, and ``generate`` is
        this class's own (a subclass that changes it must not be bypassed by the kept path)."""
        if type(self).generate is not HFRolloutEngine.generate or self.decode_cache == "static":
            return False
        cache = preallocated_cache(self.model, 1)
        return bool(cache.layers) and all(type(x) is PreallocatedLayer for x in cache.layers)

    def capped(self, max_new_tokens: int) -> HFRolloutEngine:
        """This engine sampling at most ``max_new_tokens`` a call: a shallow copy sharing the
        model, tokenizer, EOS ids and random generator (itself when the cap is not lower)."""
        if not 0 < max_new_tokens < self.cfg.max_response_length:
            return self
        view = copy.copy(self)
        view.cfg = dataclasses.replace(self.cfg, max_response_length=max_new_tokens)
        return view

    def _sample(
        self,
        prompts: Batch,
        greedy: bool,
        temperature: float | None,
        keys: list[Hashable | None] | None = None,
        turn_cache: TurnKVCache | None = None,
    ) -> Batch:
        """``_sample_with_model`` with ``model`` the module sampled with
        (``sampling_module``)."""
        sampler = self.sampling_module()
        if sampler is self.model:
            return self._sample_with_model(prompts, greedy, temperature, keys, turn_cache)
        master, self.model = self.model, sampler
        try:
            return self._sample_with_model(prompts, greedy, temperature, keys, turn_cache)
        finally:
            self.model = master

    def sampling_module(self) -> torch.nn.Module:
        """The module the next call samples with, refreshed from ``model``: a LoRA model's
        merged copy (``rollout.merged_copy``; bf16 with ``sample_dtype=bfloat16``), else the
        bf16 copy (``sample_dtype=bfloat16``, ``rollout.sampler_copy``), else ``model`` itself
        (a peft model that cannot be merged exactly is sampled as it is)."""
        if self.merged_copy is not None:
            merged = self.merged_copy.refreshed(self.model)
            if merged is not None:
                return merged
        if self._copy is not None:
            return self._copy.refreshed(self.model)
        return self.model

    def _sample_with_model(
        self,
        prompts: Batch,
        greedy: bool,
        temperature: float | None,
        keys: list[Hashable | None] | None = None,
        turn_cache: TurnKVCache | None = None,
    ) -> Batch:
        params = sampling_params_of(self.cfg, greedy=greedy, temperature=temperature)
        device = self.model.device
        if device.type != "cpu":  # sampled where the model is; answered on the CPU
            prompts = prompts.to(device)
        ids, mask, positions = _prompt_tensors(prompts, device)
        seeds = prompts.get("sample_seed")
        caps = prompts.get("max_new_tokens")
        size = self.cfg.micro_batch_size
        parts = []
        self.last_stats = dict.fromkeys(_STATS, 0.0)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode(), weight_major_linears(self.model, self.small_batch_rows):
                static = self._static_decoder() if turn_cache is None else None
                decoder = None
                if self.fast_decode and static is None:
                    decoder = LlamaDecoder.for_model(self.model)
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
                            static,
                            None if caps is None else caps[rows],
                        )
                    )
        finally:
            self.model.train(was_training)
        out = self._assemble(prompts, ids, mask, parts)
        if device.type != "cpu":
            out = out.to("cpu")
        self.last_stats["response_tokens"] = float(out["response_mask"].sum())
        self.last_stats["static_decode"] = float(static is not None)
        self.last_stats["graph_decode"] = float(static is not None and static.graph)
        self.last_stats["graph_fallbacks"] = float(static.capture.fallbacks if static else 0)
        return out

    def _static_decoder(self) -> StaticDecoder | None:
        """The static-cache decoder of the model when ``decode_cache`` selects it ('static';
        'auto': a CUDA model), built once and shared with ``capped`` views; ValueError with
        'static' for a model it cannot take (``static_decode_unsupported``)."""
        if self.decode_cache == "dynamic":
            return None
        reason = static_decode_unsupported(self.model)
        if self.decode_cache == "auto" and (reason is not None or self.model.device.type != "cuda"):
            return None
        if reason is not None:
            raise ValueError(
                f"rollout.engine_kwargs.decode_cache=static cannot take this model: {reason}"
            )
        if not self._static or self._static[0].model is not self.model:
            self._static[:] = [
                StaticDecoder(
                    self.model, self.cfg.micro_batch_size, self._cache_keyword, self.pad_token_id
                )
            ]
        return self._static[0]

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

    def sleep(self) -> None:
        """Free the static decode caches and their CUDA graphs (rebuilt by the next call)."""
        for decoder in self._static:
            decoder.release()

    def _prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, max_new: int
    ) -> tuple[DynamicCache, torch.Tensor]:
        """The KV cache and next-token logits (m, V) of each row, computing each distinct
        prompt once; ``ids``/``mask``/``positions`` are already trimmed of all-padding columns."""
        capacity = ids.shape[1] + max_new
        cache, logits, inverse = self._prefill_distinct(ids, mask, positions, capacity)
        if inverse is not None:  # expand and restore order
            cache.batch_select_indices(inverse)
            logits = logits[inverse]
        return cache, logits

    def _prefill_distinct(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, capacity: int
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor | None]:
        """The KV cache (``capacity`` positions) and next-token logits of each distinct prompt,
        computed once, and the distinct prompt of each row (None: the rows are distinct)."""
        m, device = len(ids), ids.device
        unique_keys, inverse = torch.unique(prompt_keys(ids, mask), dim=0, return_inverse=True)
        firsts = torch.full((len(unique_keys),), m, dtype=torch.long, device=device)
        firsts = firsts.scatter_reduce(0, inverse, torch.arange(m, device=device), "amin")
        cache = preallocated_cache(self.model, capacity)
        logits, pushed = self._fresh_prefill(ids[firsts], mask[firsts], positions[firsts], cache)
        self.last_stats["prefill_rows"] += len(firsts)
        self.last_stats["prefill_tokens"] += pushed
        if torch.equal(inverse, torch.arange(m, device=device)):
            return cache, logits, None
        return cache, logits, inverse

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
        if not (self.tree_prefill and self._trie_fits and len(ids) > 1):
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
        static: StaticDecoder | None = None,
        caps: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Responses (m, L) padded, log-probs (m, L), lengths (m,) and, when the sampling
        truncates and ``rollout.sampling_replay`` is on, kept-set sizes (m, L) (else None) for
        one micro-batch; with ``seeds`` (m,) each row's draws come from ``counter_uniforms`` of
        its own seed. With ``turns``, the prefill continues the rows' kept KV and each row's KV
        is kept when it finishes (``creditrl.rollout.turn_cache``). ``decoder`` runs the decode
        steps instead of the model's forward when given; ``static`` (without ``turns``) runs
        them from its static cache, finished rows kept in the batch and fed the pad id.
        ``caps`` (m,) ends each row at its own token count (at most the engine's)."""
        max_new = params.max_new_tokens
        if caps is not None:
            caps = caps.to(device=ids.device, dtype=torch.long).clamp(1, max_new)
            max_new = int(caps.max())
        start = time.perf_counter()
        record = params.truncates and self.cfg.sampling_replay
        if turns is None:
            ids, mask, positions = _trim_padding(ids, mask, positions)
            if static is not None:
                return self._decode_static(
                    ids, mask, positions, params, max_new, seeds, caps, record, static
                )
            cache, logits = self._prefill(ids, mask, positions, max_new)
            next_position = positions[:, -1] + 1
        else:
            cache, logits, mask, next_position = self._prefill_turns(turns, ids.device, max_new)
        out = SampleBuffers.empty(len(ids), max_new, self.pad_token_id, record, ids.device)
        decode_start = time.perf_counter()
        self.last_stats["prefill_s"] += decode_start - start
        self._decode(out, logits, cache, mask, next_position, params, seeds, caps, turns, decoder)
        self.last_stats["decode_s"] += time.perf_counter() - decode_start
        return out.parts()

    def _prefill_turns(
        self, turns: TurnPrefill, device: torch.device, max_new: int
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cache, next-token logits, attention mask and next positions of rows that
        continue their kept KV (``turns.prefill``), the prefill counted in ``last_stats``."""
        new_cache = partial(preallocated_cache, self.model)
        cache, logits, mask, next_position, prefilled_rows, prefilled = turns.prefill(
            device, self._forward, new_cache, max_new, self.pad_token_id, self._fresh_prefill
        )
        self.last_stats["prefill_rows"] += prefilled_rows
        self.last_stats["prefill_tokens"] += prefilled
        return cache, logits, mask, next_position

    def _decode(
        self,
        out: SampleBuffers,
        logits: torch.Tensor,
        cache: DynamicCache,
        mask: torch.Tensor,
        next_position: torch.Tensor,
        params: SamplingParams,
        seeds: torch.Tensor | None,
        caps: torch.Tensor | None,
        turns: TurnPrefill | None,
        decoder: LlamaDecoder | None,
    ) -> None:
        """Sample one token per step into ``out`` for the running rows, from the prefill's
        ``logits`` and ``cache``, until every row has sampled an EOS id or reached its cap; a
        finished row leaves the running batch (unless ``remove_finished`` is off), its KV
        kept in ``turns`` first when given."""
        m, device, max_new = len(out.lengths), out.lengths.device, out.responses.shape[1]
        sampler = StepSampler.of(params, with_kept=out.kept is not None)
        rows = torch.arange(m, device=device)  # micro-batch row of each running row
        alive = torch.ones(m, dtype=torch.bool, device=device)  # naive loop: rows still unfinished
        for step in range(max_new):
            sampled = sampler(logits, self._uniforms(params.greedy, seeds, rows, step, m))
            tokens = sampled[0]
            out.write(step, rows, alive, sampled)
            finished = torch.isin(tokens, self.eos_token_ids) & alive
            if caps is not None:
                finished |= (caps[rows] <= step + 1) & alive
            out.lengths[rows[finished]] = step + 1
            alive &= ~finished
            last = step + 1 == max_new or not bool(alive.any())
            if turns is not None:  # keep KV before rows leave; a turn's last token is not fed
                done = (finished | alive) if last else finished
                if bool(done.any()):
                    at = done.nonzero().squeeze(1)
                    turns.keep(rows[at], at, step, cache, mask, out.responses)
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
            self.last_stats["decode_rows"] += len(tokens)
            self.last_stats["decode_steps"] += 1

    def _uniforms(
        self, greedy: bool, seeds: torch.Tensor | None, rows: torch.Tensor, step: int, m: int
    ) -> torch.Tensor | None:
        """The running rows' uniforms at ``step`` (None: greedy): each from its row's seed
        (``counter_uniforms``), else one draw for each of the micro-batch's ``m`` trajectories
        from the engine's generator, so rows that leave do not shift the stream."""
        if greedy:
            return None
        if seeds is not None:
            return counter_uniforms(seeds[rows], step).to(rows.device)
        return torch.rand(m, generator=self.generator, device=rows.device)[rows]

    def _decode_static(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        params: SamplingParams,
        max_new: int,
        seeds: torch.Tensor | None,
        caps: torch.Tensor | None,
        record: bool,
        static: StaticDecoder,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``_generate_micro_batch`` from a static cache (``rollout.static_loop``): distinct
        prompts are prefilled into a cache of their own length, copied row by row into the
        static step's buffers, and decoded there."""
        stats, start = self.last_stats, time.perf_counter()
        cache, logits, rows_of = self._prefill_distinct(ids, mask, positions, ids.shape[1])
        step = static.step_for(len(ids), ids.shape[1] + max_new)
        step.load(cache, mask, positions[:, -1] + 1, rows_of)
        del cache
        if rows_of is not None:
            logits = logits[rows_of]
        decode_start = time.perf_counter()
        stats["prefill_s"] += decode_start - start
        *out, steps = static_decode(
            step, logits, params, max_new, self.eos_token_ids, seeds, caps, record, self.generator
        )
        stats["decode_rows"] += len(ids) * steps
        stats["decode_steps"] += steps
        stats["decode_s"] += time.perf_counter() - decode_start
        return tuple(out)

    def _assemble(
        self,
        prompts: Batch,
        ids: torch.Tensor,
        mask: torch.Tensor,
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]],
    ) -> Batch:
        lengths = torch.cat([p[2] for p in parts])
        width = int(lengths.max())

        def column(k: int, fill: float) -> torch.Tensor:
            """Part field ``k`` of every micro-batch at ``width`` columns (rows capped by their
            own ``max_new_tokens`` make micro-batches of different widths)."""
            cut = [p[k][:, :width] for p in parts]
            return torch.cat([F.pad(c, (0, width - c.shape[1]), value=fill) for c in cut])

        responses = column(0, self.pad_token_id)
        rollout_log_probs = column(1, 0.0)
        real = (torch.arange(width, device=ids.device)[None] < lengths[:, None]).long()
        extra = None
        if parts[0][3] is not None:  # the sampler's kept-set sizes, for sampling replay
            extra = {"rollout_kept_counts": column(3, 0) * real}
        return assemble_rollout_batch(prompts, responses, rollout_log_probs, real, extra=extra)


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


def _trim_padding(
    ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ids``, ``mask`` and ``positions`` less the leading columns that are padding in every
    row."""
    first_real = int((mask.sum(0) > 0).long().argmax())
    return ids[:, first_real:], mask[:, first_real:], positions[:, first_real:]

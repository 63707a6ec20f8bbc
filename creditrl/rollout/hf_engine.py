"""The CPU rollout engine: batched sampling with a transformers model and a KV cache.

Token ids in, token ids out: the prompt ids of the Batch are fed as they are and the sampled ids
are returned as they are; nothing is decoded or re-encoded.

Per micro-batch of ``cfg.micro_batch_size`` trajectories:

1. trim the prompt columns that are padding in every row, and prefill each *distinct* prompt
   once (the trainer repeats every prompt ``n`` times), computing logits for the last position
   only; the KV cache is then expanded to one row per trajectory;
2. decode one token per step for the running rows, with the 2-D attention mask of the real
   tokens and ``position_ids`` = the number of real tokens before the new one, so a left-padded
   row generates what it would generate alone;
3. a row leaves the running batch (KV cache, mask, positions) at the step it samples EOS or
   reaches ``max_response_length``, so no forward pass is spent on finished rows.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from creditrl.batch import Batch
from creditrl.config.schema import RolloutConfig
from creditrl.rollout.sampling import sample_next_tokens

__all__ = ["HFRolloutEngine", "SamplingParams", "eos_token_ids_of", "prompt_keys"]

_PROMPT_FIELDS = ("input_ids", "attention_mask", "position_ids")


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


class HFRolloutEngine:
    """Samples responses for a prompt Batch with a transformers causal LM (the CPU engine).

    ``seed`` seeds the engine's ``torch.Generator``: the same seed, model, prompts and settings
    give the same samples. ``eos_token_ids`` overrides the stop ids (default:
    ``eos_token_ids_of(model, tokenizer)``). ``remove_finished=False`` keeps finished rows in
    the forward passes (the naive loop, for benchmarks); outputs are the same either way.
    """

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

    def sampling_params(
        self, *, greedy: bool = False, temperature: float | None = None
    ) -> SamplingParams:
        """Settings from the config; ``temperature`` overrides it, 0 (or ``greedy``) is greedy."""
        temperature = self.cfg.temperature if temperature is None else float(temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        return SamplingParams(
            temperature=temperature,
            top_k=self.cfg.top_k,
            top_p=self.cfg.top_p,
            max_new_tokens=self.cfg.max_response_length,
            greedy=greedy or temperature == 0,
        )

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
        params = self.sampling_params(greedy=greedy, temperature=temperature)
        ids, mask, positions = _prompt_tensors(prompts, self.model.device)
        if seed is not None:
            self.generator.manual_seed(seed)
        size = self.cfg.micro_batch_size
        parts = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for start in range(0, len(ids), size):
                    rows = slice(start, start + size)
                    parts.append(
                        self._generate_micro_batch(ids[rows], mask[rows], positions[rows], params)
                    )
        finally:
            self.model.train(was_training)
        return self._assemble(prompts, ids, mask, parts)

    def _forward(self, ids, mask, positions, cache, last_only: bool) -> torch.Tensor:
        kwargs = {"logits_to_keep": 1} if last_only and self._keeps_last_logits else {}
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            **kwargs,
        )
        return out.logits[:, -1]

    def _generate_micro_batch(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, params: SamplingParams
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Responses (m, L) padded, log-probs (m, L), lengths (m,) for one micro-batch."""
        m, device = len(ids), ids.device
        first_real = int((mask.sum(0) > 0).long().argmax())
        ids, mask, positions = ids[:, first_real:], mask[:, first_real:], positions[:, first_real:]
        unique_keys, inverse = torch.unique(prompt_keys(ids, mask), dim=0, return_inverse=True)
        firsts = torch.full((len(unique_keys),), m, dtype=torch.long, device=device)
        firsts = firsts.scatter_reduce(0, inverse, torch.arange(m, device=device), "amin")
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids[firsts], mask[firsts], positions[firsts], cache, last_only=True)
        if len(firsts) < m:
            cache.batch_select_indices(inverse)
            logits = logits[inverse]

        max_new = params.max_new_tokens
        responses = torch.full((m, max_new), self.pad_token_id, dtype=torch.long, device=device)
        log_probs = torch.zeros((m, max_new), dtype=torch.float32, device=device)
        lengths = torch.full((m,), max_new, dtype=torch.long, device=device)
        rows = torch.arange(m, device=device)  # micro-batch row of each running row
        alive = torch.ones(m, dtype=torch.bool, device=device)  # naive loop: rows still unfinished
        next_position = positions[:, -1] + 1
        for step in range(max_new):
            tokens, token_log_probs = sample_next_tokens(
                logits,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                greedy=params.greedy,
                generator=self.generator,
            )
            live_rows = rows[alive]
            responses[live_rows, step] = tokens[alive]
            log_probs[live_rows, step] = token_log_probs[alive]
            finished = torch.isin(tokens, self.eos_token_ids) & alive
            lengths[rows[finished]] = step + 1
            alive &= ~finished
            if step + 1 == max_new or not bool(alive.any()):
                break
            if self.remove_finished and not bool(alive.all()):
                keep = alive.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                rows, tokens, mask = rows[keep], tokens[keep], mask[keep]
                next_position, alive = next_position[keep], alive[keep]
            mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
            logits = self._forward(tokens[:, None], mask, next_position[:, None], cache, False)
            next_position = next_position + 1
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
        response_mask = (torch.arange(width, device=ids.device)[None] < lengths[:, None]).long()
        attention_mask = torch.cat([mask, response_mask], dim=1)
        fields = {
            "prompts": ids,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([ids, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            "rollout_log_probs": rollout_log_probs,
        }
        device = prompts["input_ids"].device
        tensors = {k: v for k, v in prompts.tensors.items() if k not in fields}
        tensors.update({k: v.to(device) for k, v in fields.items()})
        return Batch(tensors, prompts.non_tensors, prompts.meta)


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
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    bad = (mask[:, -1] != 1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"prompt rows {bad[:10]} do not end with a real token (attention_mask[:, -1] != 1): "
            "prompts must be left-padded and non-empty"
        )
    return ids, mask, positions

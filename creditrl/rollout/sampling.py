"""Next-token sampling with the log-prob of each chosen token under the sampling distribution.

The sampling distribution at one decode step, for a row of logits ``z`` (V,):

    z' = z / temperature  ->  top-k: keep the k largest (ties kept), others -inf
                          ->  top-p: keep the smallest head of the sorted distribution whose mass
                              reaches p (always at least the most likely token; ties with its
                              last token kept), others -inf
                          ->  min-p: keep tokens with p_v >= min_p * max_u p_u, i.e.
                              z'_v - max z' >= log(min_p), others -inf
    π_sample = softmax(z'),  log_prob = log_softmax(z')[token]
                                        = z'[token] - max z' - log sum_v exp(z'_v - max z')

(the normaliser's block sums added in float64), so filtered tokens have log-prob -inf and the
kept ones are renormalised. This is what ``rollout_log_probs`` records (float32). Every cut
keeps ties at its boundary, so the kept set K is always {v : z'_v >= c} for a threshold c, and
its size n = |K| (``kept_counts``) rebuilds it from the same logits: K = the n largest
(``creditrl.core.kept_set_mask``; ``rollout_kept_counts`` in the batch). Greedy decoding takes
``argmax z`` and records ``log_softmax(z)[argmax]``: the log-prob under the unscaled, unfiltered
model distribution (kept count 0: the whole vocabulary).

``SamplingParams`` (built by ``sampling_params_of`` from the rollout config, checked by
``check_sampling_config``) and ``eos_token_ids_of`` are the settings both engines (``hf``,
``vllm``) sample with.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from creditrl.config.schema import RolloutConfig

__all__ = [
    "SamplingParams",
    "advance_seed",
    "check_sampling_config",
    "counter_uniforms",
    "eos_token_ids_of",
    "filter_logits",
    "inverse_cdf_sample",
    "kept_counts",
    "sample_next_tokens",
    "sampling_params_of",
]

_MASK64 = (1 << 64) - 1
_BLOCK = 256  # tokens per block of inverse_cdf_sample's two-level search


def _to_signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _to_signed(0x9E3779B97F4A7C15)
_MIX1 = _to_signed(0xBF58476D1CE4E5B9)
_MIX2 = _to_signed(0x94D049BB133111EB)


def _logical_shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x >> bits on the 64-bit pattern of int64 ``x`` (zeros shifted in)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniforms(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """A uniform in [0, 1) per row from (``seeds`` (N,) int64, ``step``): splitmix64 of
    ``seed + (step + 1) * golden``, top 53 bits / 2^53.

    A trajectory's draws depend only on its own seed and the decode step, not on which other
    rows share its batch, so the same seeds sample the same tokens in one process or split
    over data-parallel workers (up to float rounding of batch-size dependent kernels).
    """
    offset = _to_signed(((step + 1) * _GOLDEN) & _MASK64)
    x = seeds.to(torch.int64) + offset  # int64 tensor arithmetic wraps modulo 2^64
    x = (x ^ _logical_shift(x, 30)) * _MIX1
    x = (x ^ _logical_shift(x, 27)) * _MIX2
    x = x ^ _logical_shift(x, 31)
    return _logical_shift(x, 11).double() / float(1 << 53)


def advance_seed(seed: int, steps: int) -> int:
    """The int64 seed whose ``counter_uniforms`` stream is ``seed``'s shifted by ``steps``:
    ``counter_uniforms(advance_seed(s, k), t) == counter_uniforms(s, t + k)`` (the counter
    enters only as ``seed + (step + 1) * golden`` modulo 2^64). A turn generated in chunks
    continues its own stream this way."""
    return _to_signed((int(seed) + int(steps) * _GOLDEN) & _MASK64)


def filter_logits(
    logits: torch.Tensor, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """Top-k, then top-p, then min-p filtering of ``logits`` (..., V): removed entries -inf.

    ``top_k <= 0`` or ``>= V``, ``top_p >= 1`` and ``min_p <= 0`` are no-ops (the input is
    returned as is). Top-k keeps every token tied with the k-th largest. Top-p keeps token i
    (in descending order) iff the mass strictly before it is < ``top_p``, and every token tied
    with the last one kept. Min-p keeps z_v - max z >= log(``min_p``) (p_v >= min_p * p_max).
    """
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits = torch.sort(logits, dim=-1, descending=True).values
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        last = ((mass_before < top_p).sum(dim=-1, keepdim=True) - 1).clamp(min=0)
        logits = logits.masked_fill(logits < sorted_logits.gather(-1, last), float("-inf"))
    if min_p > 0.0:
        top = logits.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(logits - top < math.log(min_p), float("-inf"))
    return logits


def kept_counts(filtered: torch.Tensor) -> torch.Tensor:
    """|K| (...,) int64: the tokens ``filter_logits`` kept in each row of ``filtered`` (the
    finite entries), the count that rebuilds K from the same logits (module docstring)."""
    return torch.isfinite(filtered).sum(dim=-1)


def inverse_cdf_sample(
    probs: torch.Tensor, uniforms: torch.Tensor, with_totals: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Token i of each row of ``probs`` (N, V) such that cdf[i-1] <= u * cdf[-1] < cdf[i].

    ``probs`` may be unnormalised (non-negative); ``uniforms`` (N,) in [0, 1). The search runs
    in two levels over blocks of ``_BLOCK`` tokens: block masses are summed (in ``probs``'
    dtype, no float64 copy of the N x V values), their float64 CDF picks a block, and the
    float64 CDF inside that block, rescaled to the block's mass, picks the token. A token is
    therefore drawn with probability (block mass / total) x (p_i / sum of its block): its
    probability up to the rounding of one block sum (~1e-7 relative in float32); a
    zero-probability token is never chosen; it avoids a float64 copy of every token, and one
    uniform per row costs far less than ``torch.multinomial`` (figures:
    ``benchmarks/results/rollout_kernels.md``). ``with_totals`` also returns the float64 row
    totals (N,) the draw used.
    """
    n, vocab = probs.shape
    pad = (-vocab) % _BLOCK
    blocks = torch.nn.functional.pad(probs, (0, pad)) if pad else probs
    blocks = blocks.reshape(n, -1, _BLOCK)
    mass = blocks.sum(-1).double()
    block_cdf = mass.cumsum(-1)
    total = block_cdf[:, -1:]
    zero = total.new_zeros(())
    target = torch.minimum(uniforms.double()[:, None] * total, total.nextafter(zero))
    block = torch.searchsorted(block_cdf, target, right=True)
    before = block_cdf.gather(-1, (block - 1).clamp(min=0)).masked_fill(block == 0, 0.0)
    rows = torch.arange(n, device=probs.device)
    inner = blocks[rows, block[:, 0]].double().cumsum(-1)
    inner_total = inner[:, -1:]
    rest = (target - before) / mass.gather(-1, block) * inner_total
    rest = torch.minimum(rest, inner_total.nextafter(zero))
    tokens = (block * _BLOCK + torch.searchsorted(inner, rest, right=True)).squeeze(-1)
    return (tokens, total.squeeze(-1)) if with_totals else tokens


def sample_next_tokens(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    min_p: float = 0.0,
    with_kept: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Choose one token per row of ``logits`` (N, V).

    Returns ``(tokens, log_probs)``: int64 (N,) and float32 (N,), the log-prob of each token
    under the sampling distribution described in the module docstring (greedy: under
    ``log_softmax(logits)``); with ``with_kept`` also ``kept`` int64 (N,), the size of each
    row's kept set (``kept_counts``; 0 for greedy: the whole vocabulary). Sampling uses
    ``uniforms`` (N,) in [0, 1) if given, else draws them from ``generator`` (on the logits'
    device); see ``inverse_cdf_sample``.
    """
    logits = logits.float()
    if greedy:
        log_probs = logits.log_softmax(dim=-1)
        tokens = logits.argmax(dim=-1)
        chosen = log_probs.gather(-1, tokens[:, None]).squeeze(-1)
        return (tokens, chosen, torch.zeros_like(tokens)) if with_kept else (tokens, chosen)
    if temperature <= 0:
        raise ValueError(f"sampling needs temperature > 0, got {temperature} (use greedy=True)")
    scaled = logits / temperature if temperature != 1.0 else logits
    filtered = filter_logits(scaled, top_k, top_p, min_p)
    # amax (values only) reads the row ~10x faster than max(dim); the exp runs in place: a
    # fresh (N, V) result a step costs page faults (rollout_kernels.md)
    top = filtered.amax(dim=-1, keepdim=True)
    weights = (filtered - top).exp_()  # softmax(z') times its row's normaliser
    if uniforms is None:
        uniforms = torch.rand(len(logits), generator=generator, device=logits.device)
    tokens, totals = inverse_cdf_sample(weights, uniforms, with_totals=True)
    chosen = filtered.gather(-1, tokens[:, None]).squeeze(-1) - top.squeeze(-1)
    log_probs = (chosen.double() - totals.log()).float()
    return (tokens, log_probs, kept_counts(filtered)) if with_kept else (tokens, log_probs)


@dataclass(frozen=True)
class SamplingParams:
    """One generate() call's settings. ``greedy`` ignores temperature, top-k, top-p, min-p."""

    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    greedy: bool
    min_p: float = 0.0

    @property
    def truncates(self) -> bool:
        """Sampling cuts the vocabulary (top-k, top-p or min-p on, not greedy)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


def check_sampling_config(cfg: RolloutConfig) -> None:
    """ValueError unless ``cfg`` allows a response (``max_response_length >= 1``) and has
    ``top_p`` in (0, 1]: what both engines check when they are built."""
    if cfg.max_response_length < 1:
        raise ValueError(f"rollout.max_response_length must be >= 1, got {cfg.max_response_length}")
    if not 0.0 < cfg.top_p <= 1.0:
        raise ValueError(f"rollout.top_p must be in (0, 1], got {cfg.top_p}")


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
        min_p=cfg.min_p,
    )


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

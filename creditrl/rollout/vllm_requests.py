"""vLLM requests from a prompt Batch, and the rollout Batch from vLLM's outputs.

Plain functions, needing neither vLLM nor a GPU: ``prompt_token_lists`` (each row's real
prompt ids), ``request_seeds`` and ``sampling_param_dicts`` (one ``vllm.SamplingParams`` per
row) build the requests; ``completions_from_outputs`` reads each request's sampled ids and
log-probs, and ``assemble_rollout`` turns them into the Batch ``HFRolloutEngine`` returns.
``creditrl.rollout.vllm_engine`` describes what they send and read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from creditrl.batch import Batch, assemble_rollout_batch, position_ids_from_mask
from creditrl.rollout.sampling import SamplingParams

__all__ = [
    "LOGPROBS_MODE",
    "MAX_TEMPERATURE",
    "VLLM_SAMPLING_EPS",
    "assemble_rollout",
    "completions_from_outputs",
    "prompt_token_lists",
    "request_seeds",
    "sampling_param_dicts",
]

LOGPROBS_MODE = "processed_logprobs"
# vLLM's SamplingParams rejects temperature > 2 (vllm/sampling_params.py ``_verify_args``,
# PR #44965, in the 2026 releases); older releases had no upper bound.
MAX_TEMPERATURE = 2.0
# Below this temperature vLLM decodes greedily and reports unscaled log-probs
# (``_SAMPLING_EPS`` in vllm/sampling_params.py and vllm/v1/sample/sampler.py).
VLLM_SAMPLING_EPS = 1e-5
_SEED_MODULUS = 1 << 63


# ---- request building (pure) ---------------------------------------------------------------


def prompt_token_lists(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> list[list[int]]:
    """Each row's real prompt ids: ``input_ids[i, P - k_i:]`` with k_i = sum of its mask.

    Rows must be left-padded and non-empty (mask ``0..0 1..1``), since vLLM receives only the
    real ids and numbers them 0..k_i-1; when ``position_ids`` are given they must be exactly
    those positions on the real tokens. Any other row is a ValueError naming it.
    """
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must be the same (B, P) shape"
        )
    ids, mask = input_ids.long().cpu(), attention_mask.long().cpu()
    width = ids.shape[1]
    lengths = mask.sum(dim=1)
    left_padded = (torch.arange(width)[None] >= width - lengths[:, None]).long()
    bad = ((mask != left_padded).any(dim=1) | (lengths == 0)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"prompt rows {bad[:10]} are not left-padded non-empty prompts (attention_mask must "
            "be 0..0 1..1): the vLLM engine sends only each row's real ids"
        )
    if position_ids is not None:
        if position_ids.shape != ids.shape:
            raise ValueError(
                f"position_ids {tuple(position_ids.shape)} must match input_ids {tuple(ids.shape)}"
            )
        expected = position_ids_from_mask(mask)
        moved = ((position_ids.long().cpu() != expected) & (mask == 1)).any(dim=1)
        rows = moved.nonzero().flatten().tolist()
        if rows:
            raise ValueError(
                f"prompt rows {rows[:10]} have position_ids other than 0..k-1 on their real "
                "tokens; vLLM numbers prompt positions 0..k-1"
            )
    return [row[width - n :].tolist() for row, n in zip(ids, lengths.tolist(), strict=True)]


def request_seeds(prompts: Batch, generator: torch.Generator) -> list[int]:
    """One vLLM seed per row: its ``sample_seed`` mod 2^63 when the batch has that field
    (trainer seeds are below 2^62 and pass unchanged), else one draw in [0, 2^62) per row, in
    row order, from ``generator`` (a CPU generator)."""
    if "sample_seed" in prompts:
        return [int(s) % _SEED_MODULUS for s in prompts["sample_seed"].tolist()]
    return torch.randint(0, 1 << 62, (len(prompts),), generator=generator).tolist()


def sampling_param_dicts(
    params: SamplingParams,
    num_rows: int,
    seeds: Sequence[int] | None,
    stop_token_ids: Sequence[int],
) -> list[dict[str, Any]]:
    """Keyword arguments of one ``vllm.SamplingParams`` per row.

    Every request samples one completion (``n=1``) of at most ``max_new_tokens`` tokens,
    returns the sampled token's log-prob only (``logprobs=0``) and no text
    (``detokenize=False``), with penalties explicitly off. It stops just after an id
    of ``stop_token_ids`` (kept in the output) and on nothing else: ``ignore_eos=True`` makes
    the list exact, so an empty list never stops early (as ``HFRolloutEngine`` with
    ``eos_token_ids=[]``). Greedy rows get temperature 0 and no seed; sampled rows get
    ``seeds[i]``, ``top_k``, ``top_p`` and ``min_p`` (vLLM applies min-p before top-k/top-p,
    the HF engine after: the two agree unless top-p and min-p are both on).

    Field names and ranges are those of vllm/sampling_params.py (0.10.2 to 2026 main): top-k
    off is ``top_k=0`` (vLLM before 0.8 wanted -1; current releases still accept -1 quietly but
    prefer 0), ``top_p`` in (0, 1], and a sampling temperature in [``VLLM_SAMPLING_EPS``,
    ``MAX_TEMPERATURE``]: vLLM decodes greedily below 1e-5 (its log-probs then unscaled) and
    current releases reject more than 2, so either is a ValueError here, not deep in vLLM.
    """
    base: dict[str, Any] = {
        "n": 1,
        "max_tokens": int(params.max_new_tokens),
        "min_tokens": 0,
        "logprobs": 0,
        "stop_token_ids": [int(t) for t in stop_token_ids],
        "ignore_eos": True,
        "detokenize": False,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_p": 0.0,
    }
    if params.greedy:
        base.update(temperature=0.0, top_k=0, top_p=1.0, seed=None)
        return [dict(base) for _ in range(num_rows)]
    if seeds is None or len(seeds) != num_rows:
        got = None if seeds is None else len(seeds)
        raise ValueError(f"sampling needs one seed per row: {num_rows} rows, {got} seeds")
    if not VLLM_SAMPLING_EPS <= params.temperature <= MAX_TEMPERATURE:
        raise ValueError(
            f"vLLM samples at temperatures in [{VLLM_SAMPLING_EPS:g}, {MAX_TEMPERATURE:g}] "
            f"(vllm.SamplingParams; below {VLLM_SAMPLING_EPS:g} it decodes greedily), got "
            f"{params.temperature}; use temperature 0 for greedy decoding"
        )
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    base.update(
        temperature=float(params.temperature),
        top_k=max(int(params.top_k), 0),
        top_p=float(params.top_p),
        min_p=float(params.min_p),
    )
    return [{**base, "seed": int(seed)} for seed in seeds]


# ---- response assembly (pure) --------------------------------------------------------------


def completions_from_outputs(outputs: Sequence[Any]) -> list[tuple[list[int], list[float]]]:
    """(sampled ids, their log-probs) of each vLLM ``RequestOutput``, in order.

    Reads ``outputs[i].outputs[0].token_ids`` (the stop id included: vllm/v1/engine/
    detokenizer.py appends it back) and ``.logprobs``: one ``{token_id: Logprob}`` per position,
    with ``.logprob`` (vllm/logprobs.py; a ``FlatLogprobs``, vLLM's compact form, reads the same
    way). A missing or non-finite log-prob, an aborted or empty completion is a ValueError
    naming the row.
    """
    completions = []
    for i, request_output in enumerate(outputs):
        if len(request_output.outputs) != 1:
            raise ValueError(
                f"row {i}: expected one completion per request, got {len(request_output.outputs)}"
            )
        completion = request_output.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        reason = getattr(completion, "finish_reason", None)
        if not ids or reason == "abort":
            raise ValueError(f"row {i}: vLLM returned no completion (finish_reason={reason!r})")
        if completion.logprobs is None or len(completion.logprobs) != len(ids):
            raise ValueError(
                f"row {i}: vLLM returned no log-prob per sampled token (SamplingParams.logprobs "
                "must be 0)"
            )
        log_probs = []
        for j, (token, entry) in enumerate(zip(ids, completion.logprobs, strict=True)):
            logprob = entry.get(token) if entry else None
            if logprob is None:
                raise ValueError(f"row {i}, token {j}: no log-prob for the sampled id {token}")
            value = float(logprob.logprob)
            if not math.isfinite(value):
                raise ValueError(
                    f"row {i}, token {j}: vLLM returned log-prob {value} for the sampled id "
                    f"{token} (logprobs_mode must be {LOGPROBS_MODE!r})"
                )
            log_probs.append(value)
        completions.append((ids, log_probs))
    return completions


def assemble_rollout(
    prompts: Batch,
    completions: Sequence[tuple[Sequence[int], Sequence[float]]],
    *,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
    max_response_length: int,
) -> Batch:
    """The rollout Batch of ``HFRolloutEngine.generate`` from per-row (ids, log-probs).

    Each row's response is cut just after its first id in ``eos_token_ids`` (the EOS is kept,
    as the HF engine keeps it); T = the longest response. New fields, on the prompts' device:
    ``prompts`` (the input ids, left-padded as given), ``responses`` (B, T) right-padded with
    ``pad_token_id``, ``response_mask`` 1 on the first L_i columns, ``input_ids`` /
    ``attention_mask`` the concatenations, ``position_ids = clamp(cumsum(attention_mask) - 1,
    0)``, ``rollout_log_probs`` (B, T) float32, 0 on padding. The input's other tensors,
    non-tensors and meta are kept.
    """
    if len(completions) != len(prompts):
        raise ValueError(f"{len(completions)} completions for {len(prompts)} prompt rows")
    eos = {int(t) for t in eos_token_ids}
    cut: list[tuple[list[int], list[float]]] = []
    for i, (ids, log_probs) in enumerate(completions):
        ids, log_probs = [int(t) for t in ids], [float(x) for x in log_probs]
        if len(ids) != len(log_probs):
            raise ValueError(f"row {i}: {len(ids)} ids but {len(log_probs)} log-probs")
        end = next((k + 1 for k, token in enumerate(ids) if token in eos), len(ids))
        if end > max_response_length:
            raise ValueError(
                f"row {i}: {end} response tokens exceed max_response_length={max_response_length}"
            )
        cut.append((ids[:end], log_probs[:end]))
    lengths = torch.tensor([len(ids) for ids, _ in cut], dtype=torch.long)
    width = int(lengths.max()) if len(cut) else 0
    responses = torch.full((len(cut), width), pad_token_id, dtype=torch.long)
    rollout_log_probs = torch.zeros((len(cut), width), dtype=torch.float32)
    for i, (ids, log_probs) in enumerate(cut):
        responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        rollout_log_probs[i, : len(ids)] = torch.tensor(log_probs, dtype=torch.float32)
    real = (torch.arange(width)[None] < lengths[:, None]).long()
    return assemble_rollout_batch(prompts, responses, rollout_log_probs, real)

"""One forward pass over (prompt + response) tokens, aligned to the response (spec 000).

For responses of length T, the model's outputs at positions ``[-T-1:-1]`` of the full sequence
predict tokens y_1..y_T: ``log_probs[:, j]`` = log pi(y_{j+1} | s_{j+1}) and ``values[:, j]`` =
V(s_{j+1}). Each micro-batch is trimmed to the columns some row uses (left prompt padding,
right response padding), and logits are computed only at the response positions.

For the architectures in ``HEAD_SPLIT_ARCHITECTURES`` (whose logits are exactly
``lm_head(model.model(...).last_hidden_state)``; LoRA-wrapped too) the backbone's hidden
states at the response positions go to ``core.token_log_probs`` with the head, which computes
the float32 logits ``actor.logits_chunk_tokens`` tokens at a time; any other model (or one
sharded by FSDP2, whose root forward gathers the head) is called whole with ``logits_to_keep``.

A batch holding ``rollout_kept_counts`` (sampling replay: the sampler's top-k/top-p/min-p kept
set sizes) gets log-probs and entropies over each position's kept set, renormalised
(``core.token_log_probs``' ``kept``): every forward here (plain, packed, prefix tree) passes the
counts of its response tokens, in the order of its labels (``kept_of``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from creditrl.batch import Batch
from creditrl.core.entropy import Head, token_log_probs

__all__ = [
    "DEFAULT_LOGITS_CHUNK_TOKENS",
    "HEAD_SPLIT_ARCHITECTURES",
    "KEPT_FIELD",
    "SequenceSlice",
    "kept_of",
    "output_rows",
    "policy_forward",
    "response_log_probs",
    "split_indices",
    "trim",
]

DEFAULT_LOGITS_CHUNK_TOKENS = 1024  # benchmarks/results/logprob_memory.md

HEAD_SPLIT_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)
KEPT_FIELD = "rollout_kept_counts"


def kept_of(batch: Batch, valid: torch.Tensor) -> torch.Tensor | None:
    """The kept-set sizes (M,) of the response tokens where ``valid`` (B, t) bool is True (the
    first t response columns), row by row; None when ``batch`` holds no ``KEPT_FIELD``."""
    if KEPT_FIELD not in batch:
        return None
    return batch[KEPT_FIELD][:, : valid.shape[1]].to(valid.device)[valid]


@dataclass
class SequenceSlice:
    """The trimmed columns of one micro-batch: model inputs and where the response sits."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    responses: torch.Tensor  # (b, t) the response ids inside the trimmed window
    width: int  # t: response columns kept (the rest of T is padding for every row)


def trim(batch: Batch) -> SequenceSlice:
    """Drop columns that are padding in every row: leading prompt columns and trailing
    response columns. Requires ``input_ids``, ``attention_mask``, ``position_ids``,
    ``responses`` (B, T)."""
    responses = batch["responses"]
    total_t = responses.shape[1]
    attention = batch["attention_mask"]
    prompt_len = attention.shape[1] - total_t
    used = attention.bool().any(dim=0)
    first = int(used[:prompt_len].nonzero()[0]) if used[:prompt_len].any() else prompt_len
    resp_used = used[prompt_len:].nonzero()
    width = int(resp_used[-1]) + 1 if len(resp_used) else 1
    end = prompt_len + width
    return SequenceSlice(
        input_ids=batch["input_ids"][:, first:end],
        attention_mask=attention[:, first:end],
        position_ids=batch["position_ids"][:, first:end],
        responses=responses[:, :width],
        width=width,
    )


def _head_split(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(backbone, output head) when ``model`` (or the model inside a peft wrapper) is one of
    ``HEAD_SPLIT_ARCHITECTURES`` as transformers defines it; else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cls = type(base)
    if cls.__name__ not in HEAD_SPLIT_ARCHITECTURES or not cls.__module__.startswith(
        "transformers.models."
    ):
        return None
    return base.model, base.lm_head


def output_rows(
    model: torch.nn.Module, keep: int | torch.Tensor, **inputs: torch.Tensor | None
) -> tuple[torch.Tensor, Head | None]:
    """(rows (b, k, D), head): the final hidden states at the kept positions (the last ``keep``
    or the indices ``keep``) and the output head, or the logits there and None when the model
    is not split (see the module docstring). ``inputs`` are the model's keyword inputs."""
    split = _head_split(model)
    if split is None:
        return model(**inputs, use_cache=False, logits_to_keep=keep).logits, None
    backbone, head = split
    hidden = backbone(**inputs, use_cache=False).last_hidden_state
    index = slice(-keep, None) if isinstance(keep, int) else keep
    return hidden[:, index], head


def response_log_probs(
    rows: torch.Tensor,
    head: Head | None,
    valid: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    chunk_tokens: int,
    kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_t | s_t) and, when asked, the entropies, shaped like ``valid`` (bool), 0 where
    it is False: ``rows`` (M, D), ``labels`` (M,) and ``kept`` (M,) (kept-set sizes; None: the
    whole vocabulary) are the M valid positions in order."""
    log_probs, entropy = token_log_probs(
        rows,
        labels,
        head=head,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        kept=kept,
    )

    def spread(flat: torch.Tensor) -> torch.Tensor:
        return flat.new_zeros(valid.shape).index_put((valid,), flat)

    return spread(log_probs), None if entropy is None else spread(entropy)


def policy_forward(
    model: torch.nn.Module,
    batch: Batch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_tokens: int = DEFAULT_LOGITS_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log pi(y_t | s_t) (B, T) of the responses under ``model`` at ``temperature``,
    and the entropy of pi(. | s_t) when asked (without a gradient when ``entropy_grad`` is
    False: a metric only); 0 on response padding (``attention_mask`` 0). Float32 logits exist
    for at most ``chunk_tokens`` tokens at a time on split models (0: all at once).
    """
    window = trim(batch)
    t = window.width
    rows, head = output_rows(
        model,
        t + 1,
        input_ids=window.input_ids,
        attention_mask=window.attention_mask,
        position_ids=window.position_ids,
    )
    valid = window.attention_mask[:, -t:].bool()
    log_probs, entropy = response_log_probs(
        rows[:, :-1][valid],
        head,
        valid,
        window.responses[valid],
        temperature,
        with_entropy,
        entropy_grad,
        chunk_tokens,
        kept_of(batch, valid),
    )
    full_t = batch["responses"].shape[1]
    if t < full_t:
        pad = (0, full_t - t)
        log_probs = torch.nn.functional.pad(log_probs, pad)
        entropy = None if entropy is None else torch.nn.functional.pad(entropy, pad)
    return log_probs, entropy


def split_indices(order: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Consecutive chunks of ``order`` of at most ``size`` (the last may be shorter)."""
    return list(torch.split(order, max(int(size), 1)))

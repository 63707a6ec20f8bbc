"""Sequence packing (``use_remove_padding``): a micro-batch's real tokens in one row.

Row i of a batch holds p_i real prompt tokens (left-padded, P columns) and r_i real response
tokens (right-padded, T columns). Packing concatenates rows' real tokens into one row of
N = sum_i (p_i + r_i) tokens, with ``position_ids`` restarting at 0 for each row. Given
``attention_mask=None``, ``position_ids`` and no KV cache (``use_cache=False``),
transformers (checked with 5.23: ``masking_utils.find_packed_sequence_indices``) reads each
restart as a new sequence and builds a block-diagonal causal mask for the sdpa,
eager and flex kernels (flash-attention uses the same position_ids as varlen boundaries), so
no token attends across rows. A model used here must pass ``position_ids`` through. An sdpa
model without sliding-window layers gets no N x N mask at all: the forward runs under
``models.document_attention``, one causal attention call per row (``PackedSequences.lengths``).

Alignment (docs/architecture.md): response token j of row i (0 <= j < r_i) sits at packed position
o_i + p_i + j, o_i = sum_{k<i} (p_k + r_k); its log-prob and value come from the output at the
position before it, o_i + p_i + j - 1 (``logit_positions``). Outputs are unpacked to the
(B, T) response layout with 0 on padding columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from creditrl.batch import Batch
from creditrl.core.entropy import Head
from creditrl.models.document_attention import document_attention
from creditrl.workers.forward import (
    DEFAULT_LOGITS_CHUNK_TOKENS,
    kept_of,
    output_rows,
    response_log_probs,
)

__all__ = [
    "PackedSequences",
    "pack",
    "packed_policy_forward",
    "packed_value_forward",
    "response_outputs",
    "unpack",
]


@dataclass
class PackedSequences:
    """One packed row and the map from its positions back to the response layout."""

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N) 0..p_i+r_i-1 for each row in turn
    logit_positions: torch.Tensor  # (M,) packed positions whose output predicts a response token
    labels: torch.Tensor  # (M,) those response tokens, row by row
    response_valid: torch.Tensor  # (B, T) bool, True on the M real response columns
    lengths: tuple[int, ...]  # p_i + r_i for each row in turn (the documents)


def _first_bad_row(bad: torch.Tensor) -> int:
    return int(bad.nonzero()[0])


def pack(batch: Batch) -> PackedSequences:
    """Pack ``input_ids`` (B, P+T) by ``attention_mask``; ValueError naming the row when a row
    is not left-padded prompt + right-padded response, has no prompt token, or its
    ``position_ids`` on real tokens are not 0, 1, 2, ... (the catalogue's definition)."""
    attention = batch["attention_mask"].bool()
    responses = batch["responses"]
    t = responses.shape[1]
    prompt_len = attention.shape[1] - t
    p = attention[:, :prompt_len].sum(-1)
    r = attention[:, prompt_len:].sum(-1)
    device = attention.device
    cols_p = torch.arange(prompt_len, device=device)
    cols_t = torch.arange(t, device=device)
    response_valid = cols_t[None, :] < r[:, None]
    layout = torch.cat([cols_p[None, :] >= (prompt_len - p)[:, None], response_valid], 1)
    bad = (layout != attention).any(-1)
    if bad.any():
        raise ValueError(
            f"cannot pack sample {_first_bad_row(bad)}: attention_mask is not a left-padded "
            "prompt followed by a right-padded response"
        )
    if (p == 0).any():
        raise ValueError(f"cannot pack sample {_first_bad_row(p == 0)}: it has no prompt token")
    expected = attention.long().cumsum(-1) - 1
    bad = ((batch["position_ids"] != expected) & attention).any(-1)
    if bad.any():
        raise ValueError(
            f"cannot pack sample {_first_bad_row(bad)}: its position_ids on real tokens are not "
            "0, 1, 2, ... (cumsum(attention_mask) - 1)"
        )
    lengths = p + r
    offsets = lengths.cumsum(0) - lengths
    before = (offsets + p - 1)[:, None] + cols_t[None, :]
    return PackedSequences(
        input_ids=batch["input_ids"][attention].unsqueeze(0),
        position_ids=expected[attention].unsqueeze(0),
        logit_positions=before[response_valid],
        labels=responses[response_valid],
        response_valid=response_valid,
        lengths=tuple(lengths.tolist()),
    )


def unpack(flat: torch.Tensor, packed: PackedSequences) -> torch.Tensor:
    """(M,) per-response-token values to (B, T), 0 on padding columns; differentiable. Reads
    only ``packed.response_valid`` (a ``prefix_tree.PrefixTree`` has it too)."""
    out = flat.new_zeros(packed.response_valid.shape)
    return out.index_put((packed.response_valid,), flat)


def packed_policy_forward(
    model: torch.nn.Module,
    batch: Batch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_tokens: int = DEFAULT_LOGITS_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``policy_forward`` on the packed micro-batch: log pi(y_t | s_t) (B, T) and entropy
    (B, T) when asked (no gradient when ``entropy_grad`` is False); 0 on padding columns.
    Logits are computed only at the M positions before response tokens."""
    packed = pack(batch)
    with document_attention(model, packed.lengths):
        rows, head = output_rows(
            model,
            packed.logit_positions,
            input_ids=packed.input_ids,
            attention_mask=None,
            position_ids=packed.position_ids,
        )
    return response_outputs(
        rows[0],
        packed,
        temperature,
        with_entropy,
        entropy_grad,
        labels=packed.labels,
        head=head,
        chunk_tokens=chunk_tokens,
        kept=kept_of(batch, packed.response_valid),
    )


def response_outputs(
    rows: torch.Tensor,
    layout: PackedSequences,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    *,
    labels: torch.Tensor,
    head: Head | None = None,
    chunk_tokens: int = DEFAULT_LOGITS_CHUNK_TOKENS,
    kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From (M, D) rows, one per real response token (its ``labels`` (M,), its kept-set size
    ``kept`` (M,); None: the whole vocabulary): logits, or hidden states with their ``head``
    (``forward.output_rows``), the log-probs (B, T) at ``temperature`` and, when asked, the
    entropies (B, T) (no gradient when ``entropy_grad`` is False), 0 on padding columns
    (``layout.response_valid``)."""
    return response_log_probs(
        rows,
        head,
        layout.response_valid,
        labels,
        temperature,
        with_entropy,
        entropy_grad,
        chunk_tokens,
        kept,
    )


def packed_value_forward(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``value_forward`` on the packed micro-batch: values (B, T), ``values[:, j]`` =
    V(s_{j+1}); 0 on padding columns. ``model`` returns (1, N) values (``CriticModel``)."""
    packed = pack(batch)
    with document_attention(model, packed.lengths):
        out = model(
            input_ids=packed.input_ids, attention_mask=None, position_ids=packed.position_ids
        )
    return unpack(out[0, packed.logit_positions].float(), packed)

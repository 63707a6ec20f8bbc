"""Micro-batches: a fixed number of trajectories, or as many as fit a token budget.

A micro-batch is a LongTensor of row indices into a (mini-)batch. With a fixed size the rows
are consecutive. With a token budget (``use_dynamic_bsz``) rows are grouped so that each
forward pass holds at most ``max_token_len`` tokens, counted as the pass will see them:

- padded (``packed=False``): rows x trimmed width, where the window of a set S of rows is
  ``max_{i in S} p_i + max_{i in S} r_i`` columns (p_i prompt tokens, r_i response tokens;
  ``forward.trim`` drops the columns every row pads). Rows are taken longest first, so rows
  of similar length share a micro-batch and little padding is computed.
- packed (``packed=True``): sum_{i in S} (p_i + r_i), the real tokens of one packed row;
  first-fit decreasing bin packing.

``use_dynamic_bsz`` and ``use_remove_padding`` left null (the default) are true where the batch
is on CUDA and false elsewhere (``resolve_on_cuda``): on a GPU the update runs padding-free
micro-batches by token budget, the budget grown to the longest sample if that is longer (no
sample is refused by a budget the user did not set); on the CPU it keeps fixed micro-batches.

Under torch.distributed every rank runs the same number of micro-batches (FSDP2 gathers
parameters in each forward, so unequal counts would hang): ``micro_batches_for`` takes the
largest count over ranks and splits groups until each rank has it (verl's
``same_micro_num_in_dp``).

Which rows share a micro-batch changes no result: per-row outputs are put back in the batch's
order (``restore_order``), and the policy and value losses are summed over micro-batches with
the mini-batch's global normalisers, so the accumulated gradient is the mini-batch's.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from creditrl.batch import Batch
from creditrl.workers.distributed import collective_device, is_distributed
from creditrl.workers.forward import split_indices

__all__ = [
    "MicroBatchConfig",
    "micro_batch_indices",
    "micro_batches_for",
    "resolve_on_cuda",
    "restore_order",
    "sequence_lengths",
]


class MicroBatchConfig(Protocol):
    """The keys of ``ActorConfig`` / ``CriticConfig`` that shape micro-batches."""

    use_dynamic_bsz: bool | None
    max_token_len_per_device: int
    use_remove_padding: bool | None


def resolve_on_cuda(setting: bool | None, device_type: str) -> bool:
    """``use_dynamic_bsz`` / ``use_remove_padding`` as they apply on ``device_type``: the
    setting when given, else true on CUDA only."""
    return device_type == "cuda" if setting is None else setting


def sequence_lengths(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, r): real prompt tokens and real response tokens per row, from ``attention_mask``
    (B, P+T) split at P = P+T - ``responses.shape[1]``."""
    attention = batch["attention_mask"]
    prompt_len = attention.shape[1] - batch["responses"].shape[1]
    return attention[:, :prompt_len].sum(-1), attention[:, prompt_len:].sum(-1)


def _check_fits(costs: list[int], max_token_len: int) -> None:
    for row, cost in enumerate(costs):
        if cost > max_token_len:
            raise ValueError(
                f"sample {row} alone needs {cost} tokens, over max_token_len_per_device="
                f"{max_token_len}; raise it to at least max_prompt_length + max_response_length"
            )


def _padded_groups(p: list[int], r: list[int], max_token_len: int) -> list[list[int]]:
    """Longest rows first; a row joins the open micro-batch while rows x window fits."""
    _check_fits([pi + max(ri, 1) for pi, ri in zip(p, r, strict=True)], max_token_len)
    order = sorted(range(len(p)), key=lambda i: (-(p[i] + r[i]), i))
    groups: list[list[int]] = []
    max_p = max_r = 0
    for i in order:
        new_p, new_r = max(max_p, p[i]), max(max_r, r[i], 1)
        if groups and (len(groups[-1]) + 1) * (new_p + new_r) <= max_token_len:
            groups[-1].append(i)
            max_p, max_r = new_p, new_r
        else:
            groups.append([i])
            max_p, max_r = p[i], max(r[i], 1)
    return groups


def _packed_groups(lengths: list[int], max_token_len: int) -> list[list[int]]:
    """First-fit decreasing: each row, longest first, goes to the first bin with room."""
    _check_fits(lengths, max_token_len)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for g, load in enumerate(loads):
            if load + lengths[i] <= max_token_len:
                groups[g].append(i)
                loads[g] += lengths[i]
                break
        else:
            groups.append([i])
            loads.append(lengths[i])
    return groups


def _split_to(groups: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """Split the heaviest group of two or more rows, alternating its rows longest first, until
    there are ``count`` groups; a part of a group that fits the budget fits too."""
    groups = [sorted(g, key=lambda i: (-lengths[i], i)) for g in groups]
    while len(groups) < count:
        splittable = [k for k, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            raise ValueError(f"cannot make {count} micro-batches from {len(lengths)} samples")
        k = max(splittable, key=lambda k: sum(lengths[i] for i in groups[k]))
        group = groups.pop(k)
        groups += [group[0::2], group[1::2]]
    return groups


def micro_batch_indices(
    batch: Batch,
    micro_batch_size: int,
    *,
    use_dynamic_bsz: bool = False,
    max_token_len: int = 4096,
    packed: bool = False,
    min_micro_batches: int = 1,
    fit_longest: bool = False,
) -> list[torch.Tensor]:
    """Row indices of each micro-batch of ``batch``; together they cover every row once.

    Fixed size (``use_dynamic_bsz=False``): consecutive runs of ``micro_batch_size`` rows.
    Token budget: groups whose token count (padded or packed, see the module docstring) is at
    most ``max_token_len``, at least ``min_micro_batches`` of them; ValueError naming the row
    if one row alone is over the budget, unless ``fit_longest``: then the budget is at least
    the longest row's cost. Each group's indices are ascending.
    """
    if not use_dynamic_bsz:
        return split_indices(torch.arange(len(batch)), micro_batch_size)
    if max_token_len < 1:
        raise ValueError(f"max_token_len_per_device must be >= 1, got {max_token_len}")
    p, r = (t.tolist() for t in sequence_lengths(batch))
    if fit_longest and p:
        costs = zip(p, r, strict=True)
        max_token_len = max(
            max_token_len, *(pi + (ri if packed else max(ri, 1)) for pi, ri in costs)
        )
    if packed:
        groups = _packed_groups([pi + ri for pi, ri in zip(p, r, strict=True)], max_token_len)
    else:
        groups = _padded_groups(p, r, max_token_len)
    if len(groups) < min_micro_batches:
        groups = _split_to(
            groups, [pi + ri for pi, ri in zip(p, r, strict=True)], min_micro_batches
        )
    return [torch.tensor(sorted(g), dtype=torch.long) for g in groups]


def micro_batches_for(
    batch: Batch, micro_batch_size: int, cfg: MicroBatchConfig
) -> list[torch.Tensor]:
    """``micro_batch_indices`` with the worker config's keys (null ones resolved for the
    batch's device: ``resolve_on_cuda``); with a token budget under torch.distributed, every
    rank gets the largest count over ranks (one MAX all-reduce)."""
    device = batch["attention_mask"].device.type
    dynamic = resolve_on_cuda(cfg.use_dynamic_bsz, device)
    kwargs = {
        "use_dynamic_bsz": dynamic,
        "max_token_len": cfg.max_token_len_per_device,
        "packed": resolve_on_cuda(cfg.use_remove_padding, device),
        "fit_longest": cfg.use_dynamic_bsz is None,
    }
    indices = micro_batch_indices(batch, micro_batch_size, **kwargs)
    if dynamic and is_distributed():
        count = torch.tensor([len(indices)], dtype=torch.int64, device=collective_device())
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        if int(count) > len(indices):
            indices = micro_batch_indices(
                batch, micro_batch_size, min_micro_batches=int(count), **kwargs
            )
    return indices


def restore_order(parts: list[torch.Tensor], indices: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-micro-batch outputs (rows ``indices[k]`` in ``parts[k]``) back into the
    batch's row order."""
    rows = torch.cat(indices)
    out = torch.cat(parts)
    inverse = torch.empty_like(rows)
    inverse[rows] = torch.arange(len(rows))
    return out[inverse.to(out.device)]

"""Discounted suffix sums over the valid positions of each row: the engine behind GAE,
REINFORCE++ returns and ReMax returns.

Why not the plain reverse loop over T (verl's form): it issues O(T) small kernels; at
(512, 2048) it is more than 20x slower than the blocked form below (``benchmarks/bench_core.py``
measures both and checks equality). The blocked form computes in the input's dtype (pass
float64 tensors for float64 accuracy); its rounding error is of the same order as the loop's.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from creditrl.core.masked import row_blocks

__all__ = ["compact", "discounted_suffix_sum", "is_right_padded", "uncompact"]

_BLOCK = 32


def is_right_padded(mask: torch.Tensor) -> bool:
    """True when every row of ``mask`` is ones then zeros (no holes inside a response)."""
    if mask.shape[1] < 2:
        return True
    return not any(bool((mask[b, 1:] > mask[b, :-1]).any()) for b in row_blocks(*mask.shape))


def compact(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Move each row's valid entries to the front, in order; the rest of the row is 0.

    Positions with mask 0 inside a response thereby stop being time steps: the step after a
    model token is the next model token (docs/architecture.md, masks). ``uncompact`` inverts it.
    """
    m = mask.bool()
    slot = torch.where(m, m.cumsum(dim=1) - 1, m.shape[1])
    out = torch.zeros(x.shape[0], x.shape[1] + 1, dtype=x.dtype, device=x.device)
    return out.scatter_(1, slot, x)[:, :-1]


def uncompact(y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Inverse of ``compact``: entry i of a row returns to its i-th valid position; 0 elsewhere."""
    m = mask.bool()
    slot = torch.where(m, m.cumsum(dim=1) - 1, 0)
    return y.gather(1, slot) * m


@functools.lru_cache(maxsize=64)
def _decay_matrix(c: float, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """M (n, n) with M[k, t] = c^(k-t) for k >= t, else 0: (x @ M)_t = sum_{k>=t} c^(k-t) x_k."""
    idx = torch.arange(n, device=device)
    power = (idx.unsqueeze(1) - idx.unsqueeze(0)).to(torch.float64)
    decay = torch.where(
        power >= 0, torch.pow(torch.tensor(c, dtype=torch.float64), power.clamp(min=0)), 0.0
    )
    return decay.to(dtype)


@functools.lru_cache(maxsize=64)
def _carry_weights(c: float, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """w (n,) with w[t] = c^(n-t): the weight of the next block's first value at column t."""
    offsets = torch.arange(n, 0, -1, device=device, dtype=torch.float64)
    return torch.pow(torch.tensor(c, dtype=torch.float64), offsets).to(dtype)


def discounted_suffix_sum(
    x: torch.Tensor, c: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """y_t = sum_{k=t}^{T} c^(k-t) x_k along the last dim, i.e. y_t = x_t + c y_{t+1}, y_{T+1} = 0.

    Blocked: within each block of 32 columns y is one matmul with the block's decay matrix;
    the value at each block's first column is carried across blocks by a second, small matmul.
    ``out`` (same shape as x), when given, receives y.
    """
    batch, length = x.shape
    if length == 0:
        return x.clone()
    block = min(_BLOCK, length)
    n_blocks = -(-length // block)
    padded = x if n_blocks * block == length else F.pad(x, (0, n_blocks * block - length))
    decay = _decay_matrix(c, block, x.dtype, x.device)
    if out is not None and padded is x and out.is_contiguous():
        local = torch.matmul(
            x.reshape(batch, n_blocks, block), decay, out=out.view(batch, n_blocks, block)
        )
    else:
        local = padded.reshape(batch, n_blocks, block) @ decay
    heads = local[:, :, 0] @ _decay_matrix(c**block, n_blocks, x.dtype, x.device)
    carry = F.pad(heads[:, 1:], (0, 1))
    local.addcmul_(carry.unsqueeze(-1), _carry_weights(c, block, x.dtype, x.device))
    y = local.reshape(batch, -1)[:, :length]
    if out is None:
        return y
    if y.data_ptr() != out.data_ptr():
        out.copy_(y)
    return out

"""Time the token-level core: blocked GAE vs the plain reverse loop, and the group estimators.

Run: .venv/bin/python benchmarks/bench_core.py [--tuned-malloc]   (or `make bench`)

``--tuned-malloc`` raises glibc's mmap and trim thresholds first, so freed buffers are reused
instead of being handed back to the OS and faulted in again (what jemalloc or tcmalloc give, as
PyTorch's CPU tuning guide suggests). On this machine a fresh (512, 2048) buffer costs about as
much as the arithmetic of the blocked GAE, so both settings are worth reading.
Prints median wall times over repeats, the GAE speed ratio, and the largest differences between
the two GAE implementations: in float64 (both exact to rounding), in float32 (as in training),
and of each float32 result against the float64 one.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

from creditrl.core import compute_advantage, compute_gae_advantage_return
from creditrl.core.reference import gae_reverse_loop

SHAPES = [(512, 2048), (64, 256)]
GROUP_SIZE = 8
ROUNDS = 5
GROUP_ESTIMATORS = ["grpo", "rloo", "opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline"]


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):  # warm-up: the allocator settles after the first calls
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def make_batch(b: int, t: int, dtype: torch.dtype, seed: int = 0):
    """Right-padded responses of random length; outcome score on the last token plus a small
    per-token KL term (as after apply_kl_penalty); values in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(t // 8, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).to(dtype)
    rewards = -0.01 * torch.rand(b, t, generator=g, dtype=dtype) * mask
    rewards[torch.arange(b), lengths - 1] += torch.randint(0, 2, (b,), generator=g).to(dtype)
    values = torch.rand(b, t, generator=g, dtype=dtype) * mask
    uids = np.array([f"prompt-{i // GROUP_SIZE}" for i in range(b)], dtype=object)
    return rewards, values, mask, uids


def grpo_python_loop(rewards: torch.Tensor, mask: torch.Tensor, uids: np.ndarray) -> torch.Tensor:
    """GRPO with a dict of lists and a Python loop over samples (verl's form), for comparison."""
    scores = (rewards * mask).sum(-1)
    groups: dict[str, list[torch.Tensor]] = defaultdict(list)
    for i in range(len(scores)):
        groups[uids[i]].append(scores[i])
    stats = {k: (torch.stack(v).mean(), torch.stack(v).std()) for k, v in groups.items()}
    out = scores.clone()
    for i in range(len(scores)):
        mean, std = stats[uids[i]]
        out[i] = (scores[i] - mean) / (std + 1e-6)
    return out.unsqueeze(-1) * mask


def max_diff(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True))


def bench_gae(b: int, t: int) -> None:
    rewards, values, mask, _ = make_batch(b, t, torch.float32)
    fast, loop = [], []
    for _ in range(ROUNDS):  # interleaved, so both see the same machine state
        fast.append(
            median_ms(lambda: compute_gae_advantage_return(rewards, values, mask, 1, 0.95), 9)
        )
        loop.append(median_ms(lambda: gae_reverse_loop(rewards, values, mask, 1.0, 0.95), 3))
    ratios = sorted(lo / fa for lo, fa in zip(loop, fast, strict=True))
    print(
        f"GAE ({b}, {t}): blocked {statistics.median(fast):7.2f} ms | reverse loop "
        f"{statistics.median(loop):7.2f} ms | speed-up median {statistics.median(ratios):5.1f}x "
        f"(range {ratios[0]:.1f}-{ratios[-1]:.1f}x over {ROUNDS} rounds)"
    )
    for whiten in (False, True):
        r64, v64, m64 = rewards.double(), values.double(), mask.double()
        truth = gae_reverse_loop(r64, v64, m64, 1.0, 0.95, whiten=whiten)
        fast64 = compute_gae_advantage_return(r64, v64, m64, 1.0, 0.95, whiten=whiten)
        fast32 = compute_gae_advantage_return(rewards, values, mask, 1.0, 0.95, whiten=whiten)
        loop32 = gae_reverse_loop(rewards, values, mask, 1.0, 0.95, whiten=whiten)
        label = "whitened advantages" if whiten else "raw advantages"
        print(
            f"    {label} + returns, max |diff|: blocked vs loop float64 "
            f"{max_diff(fast64, truth):.1e}, float32 {max_diff(fast32, loop32):.1e}; "
            f"float32 vs float64 truth: blocked {max_diff(fast32, truth):.1e}, "
            f"loop {max_diff(loop32, truth):.1e}"
        )


def bench_groups(b: int, t: int) -> None:
    rewards, _, mask, uids = make_batch(b, t, torch.float32)
    cells = []
    for name in GROUP_ESTIMATORS:
        ms = median_ms(lambda name=name: compute_advantage(name, rewards, mask, uids), 15)
        cells.append(f"{name} {ms:.2f}")
    loop_ms = median_ms(lambda: grpo_python_loop(rewards, mask, uids), 5)
    ours = compute_advantage("grpo", rewards, mask, uids)[0]
    diff = (ours - grpo_python_loop(rewards, mask, uids)).abs().max().item()
    print(f"group estimators ({b}, {t}), groups of {GROUP_SIZE}, ms: " + " | ".join(cells))
    print(f"    grpo as a Python loop over samples: {loop_ms:.2f} ms (max |diff| {diff:.1e})")


def tune_malloc() -> None:
    """mallopt(M_TRIM_THRESHOLD, 1 GiB) and mallopt(M_MMAP_THRESHOLD, 256 MiB) on glibc."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-1, 1 << 30)
    libc.mallopt(-3, 1 << 28)


def main() -> None:
    tuned = "--tuned-malloc" in sys.argv[1:]
    if tuned:
        tune_malloc()
    malloc = "tuned glibc malloc" if tuned else "default glibc malloc"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {malloc}")
    for b, t in SHAPES:
        bench_gae(b, t)
    for b, t in SHAPES:
        bench_groups(b, t)


if __name__ == "__main__":
    main()

"""Time the token-level core: blocked GAE vs the plain reverse loop, and the group estimators.

Run: .venv/bin/python benchmarks/bench_core.py   (or `make bench`)
Prints median wall times over repeats, the GAE speed ratio, and the largest difference between
the two GAE implementations (advantages and returns; float32 inputs as in training, and float64).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

from creditrl.core import compute_advantage, compute_gae_advantage_return
from creditrl.core.reference import gae_reverse_loop

SHAPES = [(512, 2048), (64, 256)]
GROUP_SIZE = 8
GROUP_ESTIMATORS = ["grpo", "rloo", "opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline"]


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
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


def bench_gae(b: int, t: int) -> None:
    repeats = 7 if b * t > 100_000 else 25
    rewards, values, mask, _ = make_batch(b, t, torch.float32)
    fast_ms = median_ms(
        lambda: compute_gae_advantage_return(rewards, values, mask, 1.0, 0.95), repeats
    )
    loop_ms = median_ms(lambda: gae_reverse_loop(rewards, values, mask, 1.0, 0.95), repeats)
    diffs = []
    for dtype in (torch.float32, torch.float64):
        r, v, m, _ = make_batch(b, t, dtype)
        for whiten in (False, True):
            fa, fr = compute_gae_advantage_return(r, v, m, 1.0, 0.95, whiten=whiten)
            la, lr = gae_reverse_loop(r, v, m, 1.0, 0.95, whiten=whiten)
            diffs.append(max((fa - la).abs().max().item(), (fr - lr).abs().max().item()))
    print(
        f"GAE ({b}, {t}): blocked {fast_ms:8.2f} ms | reverse loop {loop_ms:8.2f} ms | "
        f"speed-up {loop_ms / fast_ms:6.1f}x | max |diff| float32 raw {diffs[0]:.1e}, "
        f"whitened {diffs[1]:.1e}; float64 raw {diffs[2]:.1e}, whitened {diffs[3]:.1e}"
    )
    ok = diffs[0] <= 1e-6 and diffs[2] <= 1e-12
    print(f"    equal to 1e-6 (float32) and 1e-12 (float64): {'yes' if ok else 'NO'}")


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


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for b, t in SHAPES:
        bench_gae(b, t)
    for b, t in SHAPES:
        bench_groups(b, t)


if __name__ == "__main__":
    main()

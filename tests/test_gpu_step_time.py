"""benchmarks/gpu_step_time.py on the CPU (its dry run): the rollout part times left-padded
prompts (HF generate then gets a mask) beside unpadded ones, and the goal ratio is the
padded one's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]


def benchmark():
    spec = importlib.util.spec_from_file_location(
        "gpu_step_time", ROOT / "benchmarks/gpu_step_time.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_step_time", module)
    spec.loader.exec_module(module)
    return module


def test_padded_prompts_are_left_padded():
    bench = benchmark()
    batch = bench.prompt_batch(64, 16, 512, padded=True)
    mask, ids = batch["attention_mask"], batch["input_ids"]
    real = mask.sum(1)
    assert real.min() >= 8 and real.max() == 16 and real.min() < 16
    assert torch.equal(mask, (torch.arange(16)[None] >= 16 - real[:, None]).long())
    assert (ids[mask == 0] == bench.PAD).all() and (ids[mask == 1] >= 3).all()
    assert bench.prompt_batch(4, 16, 512)["attention_mask"].all()


def test_the_rollout_part_times_padded_and_unpadded_prompts():
    bench = benchmark()
    args = SimpleNamespace(rows=4, prompt_len=8, new_tokens=8, dry_run=True)
    results: dict = {}
    lines = bench.rollout_part(args, torch.device("cpu"), results)
    rows = [line for line in lines if line.startswith("| SmolLM2") or line.startswith("| Llama")]
    assert [r.split(" | ")[1] for r in rows] == ["left-padded", "unpadded"] * 2
    padded_ratio = rows[0].split(" | ")[7]
    assert results["rollout_vs_hf"] == padded_ratio

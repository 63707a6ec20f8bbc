"""A packed micro-batch's forward and backward with transformers' dense packed mask against
document attention (``creditrl.models.document_attention``): seconds, peak memory, and how far
apart their log-probs and gradients are.

Run: ``python benchmarks/packed_attention.py [--tokens 2048,4096,8192,16384] [--rows-of 512]
[--layers 4] [--repeats 2] [--out benchmarks/results/packed_attention.md]``

The model is the SmolLM2-135M shape (9 query heads over 3 key/value heads, head size 64) with
``--layers`` decoder layers and random weights, float32 on the CPU (CUDA when visible). The
packed row holds N tokens: documents of ``--rows-of`` tokens each, positions restarting at 0,
as ``workers.packing.pack`` lays out a micro-batch. One measurement is the actor's packed
forward (``packed_policy_forward``: log-probs of every document's second half) plus the
backward of their sum. Each (arm, N) runs in a fresh child process, so its peak resident
memory (``ru_maxrss``) minus the resident memory just before the first forward is what the
forward and backward held; seconds are the median of ``--repeats`` after one warm-up.
Arms: ``dense`` (the path before: sdpa with the (1, 1, N, N) bool mask transformers builds
from the restarting positions) and ``documents`` (one causal sdpa call per document).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_flags

from creditrl.batch import Batch
from creditrl.workers import packing

ARMS = ("dense", "documents")


def model_of(layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=32768,
        rope_theta=100000.0, tie_word_embeddings=True, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batch_of(tokens: int, rows_of: int) -> Batch:
    """``tokens // rows_of`` rows, each ``rows_of // 2`` prompt and as many response tokens."""
    rows, half = tokens // rows_of, rows_of // 2
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 49152, (rows, rows_of), generator=generator)
    return Batch.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": torch.ones(rows, rows_of, dtype=torch.long),
            "position_ids": torch.arange(rows_of).expand(rows, -1).clone(),
            "responses": input_ids[:, half:],
            "response_mask": torch.ones(rows, rows_of - half, dtype=torch.long),
        }
    )


def forward_backward(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    log_probs, _ = packing.packed_policy_forward(model, batch)
    log_probs.sum().backward()
    return log_probs.detach()


def arm_context(arm: str):
    """``dense``: packing's document attention replaced by nothing (transformers' mask)."""
    if arm == "documents":
        return nullcontext()
    return mock.patch.object(packing, "document_attention", lambda model, lengths: nullcontext())


def child(arm: str, tokens: int, rows_of: int, layers: int, repeats: int) -> dict:
    model = model_of(layers)
    batch = batch_of(tokens, rows_of)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, batch = model.to(device), batch.to(device)
    rss_before = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGESIZE")
    seconds = []
    with arm_context(arm):
        for _ in range(repeats + 1):
            start = time.perf_counter()
            log_probs = forward_backward(model, batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    torch.save({"log_probs": log_probs.cpu(), "grads": grads.cpu()}, f"/tmp/packed_{arm}.pt")
    return {
        "arm": arm,
        "tokens": tokens,
        "seconds": statistics.median(seconds[1:]),
        "held_mib": (peak - rss_before) / 2**20,
        "device": device.type,
    }


def run_child(arm: str, tokens: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", arm, "--tokens", str(tokens)]
    command += ["--rows-of", str(args.rows_of), "--layers", str(args.layers)]
    command += ["--repeats", str(args.repeats)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def distance(tokens: int, args: argparse.Namespace) -> tuple[float, float]:
    """Max |log-prob difference| and max |gradient difference| / max |gradient| between arms
    (both children of ``tokens`` ran last)."""
    dense, docs = (torch.load(f"/tmp/packed_{arm}.pt") for arm in ARMS)
    lp = float((dense["log_probs"] - docs["log_probs"]).abs().max())
    grad = float((dense["grads"] - docs["grads"]).abs().max() / dense["grads"].abs().max())
    return lp, grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="2048,4096,8192,16384")
    parser.add_argument("--rows-of", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", choices=ARMS, default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, int(args.tokens), args.rows_of, args.layers,
                               args.repeats)))  # fmt: skip
        return
    lines = [
        "# Packed micro-batch attention: transformers' dense mask against document attention",
        "",
        f"- command: `python benchmarks/packed_attention.py --tokens {args.tokens} "
        f"--rows-of {args.rows_of} --layers {args.layers} --repeats {args.repeats}`",
        f"- CPU: {cpu_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"1-minute load before: {os.getloadavg()[0]:.2f}",
        f"- model: SmolLM2-135M shape, {args.layers} layers, float32, random weights; "
        f"documents of {args.rows_of} tokens",
        "",
        "| N tokens | arm | device | fwd+bwd s | held MiB | docs/dense s | max abs d log-prob "
        "| max rel d grad |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for tokens in (int(t) for t in args.tokens.split(",")):
        results = {arm: run_child(arm, tokens, args) for arm in ARMS}
        lp, grad = distance(tokens, args)
        ratio = results["documents"]["seconds"] / results["dense"]["seconds"]
        for arm in ARMS:
            r = results[arm]
            extra = f"{ratio:.3f} | {lp:.1e} | {grad:.1e}" if arm == "documents" else "| |"
            line = (f"| {tokens:,} | {arm} | {r['device']} | {r['seconds']:.2f} | "
                    f"{r['held_mib']:,.0f} | {extra} |")  # fmt: skip
            lines.append(line)
            print(line, flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""Peak memory and time of one log-prob + entropy fwd+bwd, unchunked vs chunked over tokens.

Run: .venv/bin/python benchmarks/logprob_memory.py [--batch 8] [--prompt 32] [--response 224]
     [--chunks 0,512,1024,2048] [--pairs 2] [--out benchmarks/results/logprob_memory.md]

The model has the embedded SmolLM2-135M's shape (its LlamaConfig, read from the GGUF's
metadata: 49152-token vocabulary, tied embeddings) with random float32 weights; nothing is
downloaded. Each measurement runs in a fresh subprocess: ``policy_forward`` with entropy at
temperature 0.7 and ``actor.logits_chunk_tokens`` = chunk (0: the whole micro-batch's logits
at once), then backward of the summed log-probs and entropies. Memory is the subprocess's peak
RSS (ru_maxrss) minus its RSS just before the forward (model, its gradients, batch and torch
already there).
Time ratios come from alternating pairs (chunked, unchunked, chunked, ...), so load from other
processes on the machine falls on both.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20


def current_rss() -> int:
    """Resident bytes of this process now."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


def measure(batch: int, prompt: int, response: int, chunk: int) -> dict:
    """One fwd+bwd in this process: peak extra memory (MiB) and seconds."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    from creditrl.models.embedded import embedded_gguf_path
    from creditrl.workers.forward import policy_forward

    gguf = embedded_gguf_path()
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().train()
    g = torch.Generator().manual_seed(0)
    width = prompt + response
    data = {
        "input_ids": torch.randint(0, config.vocab_size, (batch, width), generator=g),
        "attention_mask": torch.ones(batch, width, dtype=torch.long),
        "position_ids": torch.arange(width).expand(batch, width).contiguous(),
    }
    data["responses"] = data["input_ids"][:, prompt:]
    for p in model.parameters():  # as from the second micro-batch on: gradients already held
        p.grad = torch.zeros_like(p)
    before = current_rss()
    start = time.perf_counter()
    log_probs, entropy = policy_forward(model, data, 0.7, with_entropy=True, chunk_tokens=chunk)
    (log_probs.sum() + entropy.sum()).backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"chunk": chunk, "peak_extra_mib": (peak - before) / MIB, "seconds": seconds}


def run_child(args: argparse.Namespace, chunk: int) -> dict:
    command = [
        sys.executable, __file__, "--child", str(chunk), "--batch", str(args.batch),
        "--prompt", str(args.prompt), "--response", str(args.response),
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def cpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def report(args: argparse.Namespace, memory: list[dict], pairs: list[tuple[dict, dict]]) -> str:
    tokens = args.batch * args.response
    lines = [
        "# Log-prob + entropy memory: float32 logits chunked over tokens",
        "",
        f"Command: `.venv/bin/python benchmarks/logprob_memory.py --batch {args.batch} "
        f"--prompt {args.prompt} --response {args.response} --chunks {args.chunks} "
        f"--pairs {args.pairs}`",
        "",
        f"Shape: SmolLM2-135M (30 layers, hidden 576, vocabulary 49152, tied), random float32 "
        f"weights; {args.batch} x {args.prompt + args.response} tokens, {tokens} response "
        "tokens; one fwd+bwd of log-probs and entropies at temperature 0.7 on the CPU.",
        f"Machine: {platform.processor() or platform.machine()}, "
        f"{len(__import__('os').sched_getaffinity(0))} cores, busy with other test runs "
        "(timings are noisy; ratios come from alternating pairs).",
        "",
        f"CPU flags: `{cpu_flags()}`",
        "",
        "| logits_chunk_tokens | float32 logits held at once | peak extra RSS (MiB) | seconds |",
        "|---|---|---|---|",
    ]
    for row in memory:
        held = tokens if row["chunk"] == 0 or row["chunk"] >= tokens else row["chunk"]
        lines.append(
            f"| {row['chunk']} | {held} x 49152 ({held * 49152 * 4 / MIB:.0f} MiB) "
            f"| {row['peak_extra_mib']:.0f} | {row['seconds']:.1f} |"
        )
    if pairs:
        ratios = [c["seconds"] / u["seconds"] for c, u in pairs]
        lines += [
            "",
            f"Time, chunked ({pairs[0][0]['chunk']}) / unchunked, alternating pairs: "
            + ", ".join(f"{r:.3f}" for r in ratios)
            + f" (median {statistics.median(ratios):.3f}).",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=224)
    parser.add_argument("--chunks", default="0,512,1024,2048")
    parser.add_argument("--pairs", type=int, default=2, help="alternating time pairs")
    parser.add_argument("--pair-chunk", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.batch, args.prompt, args.response, args.child)))
        return
    memory = [run_child(args, int(c)) for c in args.chunks.split(",")]
    for row in memory:
        print(json.dumps(row), flush=True)
    pairs = []
    for _ in range(args.pairs):
        chunked = run_child(args, args.pair_chunk)
        unchunked = run_child(args, 0)
        pairs.append((chunked, unchunked))
        print(json.dumps({"pair": [chunked, unchunked]}), flush=True)
    text = report(args, memory, pairs)
    print(text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()

"""Cost and effect of sampling replay (issue 42) on ``make run``'s config with top_p=0.9.

Run: .venv/bin/python benchmarks/sampling_replay.py [--model embedded|tiny] [--pairs 2]
     [--out benchmarks/results/sampling_replay.md]

``make run`` trains the default config: chain_sum, 4 prompts x 4 samples, 96 new tokens,
temperature 0.7, the embedded SmolLM2-135M-Instruct (``--model tiny``: the tests' 2-layer
random Llama with the same vocabulary, for a quick look). Here ``rollout.top_p=0.9``.

1. One rollout batch of that shape, sampled by the HF engine with the kept-set sizes recorded.
2. Effect: the behaviour ratio rho = pi_train / pi_sampler = exp(old_log_probs -
   rollout_log_probs) on the sampled tokens, with the actor's log-prob stage over the whole
   vocabulary (replay off: today's) and over each token's kept set (replay on): mean and max
   |rho - 1| and the clip fraction (rho outside [1 - clip_ratio_low, 1 + clip_ratio_high]),
   which the first update sees when the sampler's log-probs stand for the old ones.
3. Cost: the log-prob stage (``compute_log_prob``) and one update (``update_policy``, one PPO
   epoch over the batch: forward, backward, optimizer), with and without the kept counts, each
   in a fresh subprocess in alternating pairs (load on the machine falls on both); memory is
   the subprocess's peak RSS minus its RSS before the stage (model and batch already there).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MIB = 2**20
OVERRIDES = ["rollout.top_p=0.9"]
KEPT = "rollout_kept_counts"


def current_rss() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


def setup(model_name: str):
    """(cfg, model, tokenizer) of make run's config with top_p=0.9 (``tiny``: the test model)."""
    from creditrl.config import load_config
    from creditrl.models import load_causal_lm
    from creditrl.models.tiny import tiny_model_dir
    from creditrl.models.tokenizer import load_tokenizer

    cfg = load_config(overrides=OVERRIDES)
    path = tiny_model_dir() if model_name == "tiny" else cfg.model.path
    model = load_causal_lm(path, "float32", cache_dir=cfg.model.cache_dir)
    return cfg, model, load_tokenizer(tiny_model_dir() if model_name == "tiny" else path)


def sample(model_name: str, batch_file: Path) -> dict:
    """Sample make run's first batch at top_p=0.9 and save it; the ratio statistics."""
    from creditrl.data import build_datasets
    from creditrl.rollout import EngineArgs, build_rollout_engine
    from creditrl.trainers.prompts import prompt_batch
    from creditrl.workers.actor import ActorWorker

    cfg, model, tokenizer = setup(model_name)
    train, _ = build_datasets(cfg.data, tokenizer)
    rows = [train[i] for i in range(cfg.data.train_batch_size)]
    uids = [str(i) for i in range(len(rows))]
    prompts = prompt_batch(rows, tokenizer.pad_token_id, cfg.rollout.n, uids, seed=0)
    engine = build_rollout_engine(EngineArgs(cfg=cfg.rollout, tokenizer=tokenizer,
                                             model_path=cfg.model.path, model=model))  # fmt: skip
    start = time.perf_counter()
    batch = engine.generate(prompts, temperature=cfg.rollout.temperature)
    generate_s = time.perf_counter() - start
    tensors = {k: v for k, v in batch.tensors.items() if isinstance(v, torch.Tensor)}
    torch.save(tensors, batch_file)
    worker = ActorWorker(model, cfg.actor, trainable=False)
    mask = batch["response_mask"].bool()
    low = cfg.actor.clip_ratio_low if cfg.actor.clip_ratio_low is not None else cfg.actor.clip_ratio
    high = cfg.actor.clip_ratio_high
    high = cfg.actor.clip_ratio if high is None else high
    stats = {"generate_s": generate_s, "tokens": int(mask.sum()),
             "kept_median": float(batch[KEPT][mask].float().median()),
             "kept_max": int(batch[KEPT][mask].max())}  # fmt: skip
    for name, replay in (("off", False), ("on", True)):
        b = batch if replay else batch.select(*[k for k in list(batch.tensors.keys()) if k != KEPT])
        old, _ = worker.compute_log_prob(b, cfg.rollout.temperature, with_entropy=False)
        rho = torch.exp(old - batch["rollout_log_probs"])[mask]
        stats[name] = {
            "mean_abs_rho_minus_1": float((rho - 1).abs().mean()),
            "max_abs_rho_minus_1": float((rho - 1).abs().max()),
            "clipfrac": float(((rho < 1 - low) | (rho > 1 + high)).float().mean()),
            "mean_log_rho": float(rho.log().mean()),
        }
    return stats


def cost(model_name: str, batch_file: Path, replay: bool) -> dict:
    """Seconds and peak extra MiB of the log-prob stage and of one update, in this process."""
    from creditrl.batch import Batch
    from creditrl.workers.actor import ActorWorker

    cfg, model, _ = setup(model_name)
    tensors = torch.load(batch_file)
    if not replay:
        del tensors[KEPT]
    batch = Batch(tensors)
    worker = ActorWorker(model, cfg.actor)
    temperature = cfg.rollout.temperature
    before = current_rss()
    start = time.perf_counter()
    batch["old_log_probs"], _ = worker.compute_log_prob(batch, temperature)
    log_prob_s = time.perf_counter() - start
    log_prob_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    n = cfg.rollout.n
    scores = torch.arange(len(batch), dtype=torch.float32) % 3
    grouped = scores.view(-1, n)
    adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    batch["advantages"] = adv.reshape(-1, 1) * batch["response_mask"]
    start = time.perf_counter()
    metrics = worker.update_policy(batch, temperature, n_per_prompt=n)
    update_s = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {
        "replay": replay, "log_prob_s": log_prob_s, "update_s": update_s,
        "log_prob_peak_mib": log_prob_peak / MIB, "step_peak_mib": peak / MIB,
        "first_minibatch_clipfrac": metrics["health/first_minibatch_clipfrac"],
        "first_minibatch_ppo_kl": metrics["health/first_minibatch_ppo_kl"],
    }  # fmt: skip


def child(*args: str) -> dict:
    command = [sys.executable, __file__, "--child", *args]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def cpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
            return ", ".join(f"{f}: {'yes' if f in have else 'no'}" for f in wanted)
    return "unknown"


def report(args: argparse.Namespace, stats: dict, runs: list[dict]) -> str:
    def median(replay: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["replay"] == replay)

    lines = [
        "# Sampling replay: cost and effect (issue 42)",
        "",
        f"`python benchmarks/sampling_replay.py --model {args.model} --pairs {args.pairs}`; "
        f"make run's config with {' '.join(OVERRIDES)} (4 prompts x 4 samples, 96 new tokens, "
        f"temperature 0.7), model: {args.model}. {platform.processor() or platform.machine()}, "
        f"{cpu_flags()}; torch {torch.__version__}; a shared machine (other jobs running).",
        "",
        f"One batch: {stats['tokens']} sampled tokens, generated in {stats['generate_s']:.1f} s; "
        f"kept-set size median {stats['kept_median']:.0f}, max {stats['kept_max']}.",
        "",
        "## Effect: behaviour ratio rho = pi_train / pi_sampler on the sampled tokens",
        "",
        "| log-prob stage | mean abs(rho-1) | max abs(rho-1) | mean log rho | clip fraction |",
        "|---|---|---|---|---|",
    ]
    for name, label in (("off", "over the vocabulary (replay off)"),
                        ("on", "over the kept set (replay on)")):  # fmt: skip
        s = stats[name]
        lines.append(
            f"| {label} | {s['mean_abs_rho_minus_1']:.2e} | {s['max_abs_rho_minus_1']:.2e} | "
            f"{s['mean_log_rho']:.2e} | {s['clipfrac']:.4f} |"
        )
    lines += [
        "",
        "## Cost per step (medians of fresh subprocesses)",
        "",
        "| | log-prob stage s | update s | log-prob stage peak MiB | step peak MiB | "
        "first-minibatch clipfrac |",
        "|---|---|---|---|---|---|",
    ]
    for replay in (False, True):
        lines.append(
            f"| replay {'on' if replay else 'off'} | {median(replay, 'log_prob_s'):.2f} | "
            f"{median(replay, 'update_s'):.2f} | {median(replay, 'log_prob_peak_mib'):.0f} | "
            f"{median(replay, 'step_peak_mib'):.0f} | "
            f"{median(replay, 'first_minibatch_clipfrac'):.4f} |"
        )
    lines += ["", "Raw runs: " + json.dumps(runs)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("embedded", "tiny"), default="embedded")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/sampling_replay.md")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, model, batch_file, *rest = args.child
        if kind == "sample":
            print(json.dumps(sample(model, Path(batch_file))))
        else:
            print(json.dumps(cost(model, Path(batch_file), rest[0] == "on")))
        return
    batch_file = Path(tempfile.mkdtemp(prefix="creditrl-replay-")) / "batch.pt"
    stats = child("sample", args.model, str(batch_file))
    runs = []
    for _ in range(args.pairs):
        for replay in ("on", "off"):
            runs.append(child("cost", args.model, str(batch_file), replay))
    text = report(args, stats, runs)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()

"""LoRA sampling against the full model in the HF engine: tokens/s, the merge, old log-probs.

Run: .venv/bin/python benchmarks/lora_rollout.py [--repeats 3] [--threads 2] [--rank 32]
     .venv/bin/python benchmarks/lora_rollout.py --tiny --repeats 1   # a smoke run, seconds

The main job's rollout shape (as ``bench_rollout.py``): 4 chain_sum prompts x 4 trajectories,
up to 96 new tokens, temperature 1, SmolLM2-135M-Instruct in float32, no EOS stop, so every
variant generates exactly 16 x 96 tokens. Variants, alternated seed by seed so the machine's
drift falls on all of them:

- ``full``: the plain model;
- ``lora-merged``: the model with rank ``--rank`` adapters on every linear
  (``model.lora_rank``'s defaults: ``all-linear``, ``lora_alpha``), B random so the adapters
  change the policy, sampled from its merged copy (``creditrl.rollout.merged_copy``, the
  default). The adapters change before every measured call, as an optimizer step changes them
  before every rollout, so each call pays one merge; its seconds are counted in the call's and
  shown apart;
- ``lora-peft``: the same LoRA model sampled through peft (``merge_lora=False``: the path
  before the merged copy).

Each line: the median seconds, tokens/s, the ratio to ``full`` pair by pair (median), and for
the LoRA variants the largest |rollout log-prob - the LoRA model's float32 teacher-forced
log-prob| over the valid tokens.

Then the old-log-prob stage on the last sampled batch, as ``creditrl train`` runs it on this
machine for the default config with and without ``model.lora_rank``
(``rollout_log_probs_reusable``): where both reuse the sampler's log-probs (a float32 update,
no rollout IS, no top-k/top-p without replay: this CPU without native bf16) the stage copies
them for both; where they are recomputed (the update under bf16 autocast, as ``actor.autocast=
auto`` picks on a CPU with avx512_bf16 or amx) it is ``ActorWorker.compute_log_prob`` with the
full model against the LoRA model's peft forward (the forward the update runs), alternated
repeat by repeat. The recompute is timed either way (``--autocast``: the update's autocast, by
default what ``actor.autocast=auto`` resolves to here).

The last lines are issue 51's acceptance figures: LoRA's sampling tokens/s over the full
model's (pair by pair, median; target >= 0.9) and the old-log-prob stage's LoRA / full seconds
(target <= 1.2). ``--write [PATH]`` also writes them, with the command, the CPU and the commit,
to ``benchmarks/results/lora_rollout.md`` (or PATH).

``--tiny``: the tiny random model, 2 prompts x 2 trajectories, 8 new tokens (a smoke run;
the figures mean nothing).

Quiet run: ``.venv/bin/python benchmarks/lora_rollout.py --repeats 4 --threads 2 --write``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from creditrl import Batch
from creditrl.config import ActorConfig
from creditrl.config.loader import load_config
from creditrl.config.schema import DataConfig, ModelConfig, RolloutConfig
from creditrl.data import build_datasets
from creditrl.models import apply_lora, load_causal_lm
from creditrl.models.embedded import embedded_model_dir
from creditrl.models.tiny import tiny_model_dir
from creditrl.models.tokenizer import load_tokenizer
from creditrl.pipeline.step import rollout_log_probs_reusable
from creditrl.rollout import HFRolloutEngine
from creditrl.workers import ActorWorker


@dataclass
class Shape:
    prompts: int
    n: int
    max_new: int


RESULTS = Path(__file__).resolve().parent / "results" / "lora_rollout.md"
MAIN_JOB = Shape(prompts=4, n=4, max_new=96)
TINY = Shape(prompts=2, n=2, max_new=8)


@dataclass
class Runs:
    seconds: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    merge_s: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)


def prompt_batch(tokenizer, shape: Shape) -> Batch:
    """``shape.prompts`` chain_sum prompts (the main job's data config), each ``shape.n``
    times."""
    train, _ = build_datasets(DataConfig(train_size=shape.prompts, val_size=0), tokenizer)
    return train.batch(list(range(shape.prompts))).repeat(shape.n)


def lora_model(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """``model`` (copied) with ``model.lora_rank``-style adapters of ``rank``, B random."""
    defaults = ModelConfig()
    torch.manual_seed(0)
    lora = apply_lora(copy.deepcopy(model), rank, defaults.lora_alpha, defaults.target_modules)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return lora.eval()


def nudge(lora: torch.nn.Module) -> None:
    """Change the adapters a little (what an optimizer step does between rollouts)."""
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_A" in name:
                param.mul_(1.0 + 1e-4)


def log_prob_gap(worker: ActorWorker, out: Batch) -> float:
    valid = out["response_mask"].bool()
    old, _ = worker.compute_log_prob(out, 1.0)
    return float((old - out["rollout_log_probs"]).abs()[valid].max())


def runner(
    model: torch.nn.Module, tokenizer, prompts: Batch, shape: Shape, lora: bool, **options
) -> tuple[Callable[[int, Runs], Batch], ActorWorker | None]:
    """A function that times one seeded call of an engine over ``model`` into a ``Runs``."""
    cfg = RolloutConfig(max_response_length=shape.max_new, micro_batch_size=64, temperature=1.0)
    engine = HFRolloutEngine(model, tokenizer, cfg, eos_token_ids=[], **options)
    engine.generate(prompts, seed=123)  # warm-up, on the measured shape
    checker = ActorWorker(model, ActorConfig(autocast="none"), trainable=False) if lora else None

    def run(seed: int, runs: Runs) -> Batch:
        if lora:
            nudge(model)
        start = time.perf_counter()
        engine.sampling_module()  # the merge, when the engine merges (else nothing)
        merged = time.perf_counter()
        out = engine.generate(prompts, seed=seed)
        runs.seconds.append(time.perf_counter() - start)
        runs.merge_s.append(merged - start)
        runs.tokens.append(float(out["response_mask"].sum()))
        if checker is not None:
            runs.gaps.append(log_prob_gap(checker, out))
        return out

    return run, checker


def time_old_log_probs(
    models: dict[str, torch.nn.Module], out: Batch, repeats: int, autocast: str
) -> dict[str, float]:
    """Median seconds of the old-log-prob recompute (``compute_log_prob`` under ``autocast``)
    on ``out`` for each model, the models alternated repeat by repeat."""
    workers = {
        name: ActorWorker(model, ActorConfig(autocast=autocast), trainable=False)
        for name, model in models.items()
    }
    for worker in workers.values():
        worker.compute_log_prob(out, 1.0)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in workers}
    for _ in range(repeats):
        for name, worker in workers.items():
            start = time.perf_counter()
            worker.compute_log_prob(out, 1.0)
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def time_copy(out: Batch, repeats: int) -> float:
    """Median seconds of the stage where it reuses the sampler's log-probs (a copy)."""
    seconds = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        out["rollout_log_probs"].clone()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def verdict(value: float, target: str) -> str:
    ok = value >= 0.9 if target == ">= 0.9" else value <= 1.2
    return f"{value:.2f} (target {target}: {'met' if ok else 'NOT met'})"


def old_log_prob_lines(
    model: torch.nn.Module, lora: torch.nn.Module, out: Batch, args: argparse.Namespace
) -> list[str]:
    """The old-log-prob stage as ``creditrl train`` runs it here, and the recompute timed."""
    from creditrl.workers.placement import update_autocast

    configs = {"full": [], "LoRA": [f"model.lora_rank={args.rank}"]}
    cfgs = {name: load_config(overrides=o) for name, o in configs.items()}
    reused = {name: rollout_log_probs_reusable(cfg) for name, cfg in cfgs.items()}
    resolved = update_autocast(cfgs["full"])
    autocast = resolved if args.autocast == "auto" else args.autocast
    recompute = time_old_log_probs({"full": model, "LoRA": lora}, out, args.repeats, autocast)
    copy_s = time_copy(out, args.repeats)
    stage = {name: copy_s if reused[name] else recompute[name] for name in configs}
    how = {
        name: "reuses the rollout log-probs" if reused[name] else "recomputes" for name in reused
    }
    lines = [
        f"old log-probs, recomputed (compute_log_prob, autocast {autocast}, {len(out)} rows, "
        f"alternated): full {recompute['full']:.3f} s, LoRA (peft forward) "
        f"{recompute['LoRA']:.3f} s: x{recompute['LoRA'] / recompute['full']:.2f}",
        f"old-log-prob stage in creditrl train here (actor.autocast=auto -> {resolved}): "
        f"full {how['full']}, LoRA {how['LoRA']}",
        f"acceptance (issue 51, LoRA rank {args.rank} against the full model):",
    ]
    stage_ratio = stage["LoRA"] / stage["full"] if stage["full"] > 0 else 1.0
    if reused["full"] and reused["LoRA"]:
        stage_ratio = 1.0  # both copy the same tensor: the same stage
        note = "both copy the sampled log-probs"
    else:
        note = f"{stage['LoRA']:.3f} s against {stage['full']:.3f} s"
    lines.append(f"  old-log-prob stage, LoRA / full seconds: {verdict(stage_ratio, '<= 1.2')}"
                 f" ({note})")  # fmt: skip
    lines.append(
        f"  old-log-prob recompute, LoRA / full seconds (where a run recomputes: autocast "
        f"{autocast}): {verdict(recompute['LoRA'] / recompute['full'], '<= 1.2')}"
    )
    return lines


def write_results(path: Path, lines: list[str], argv: Sequence[str], tiny: bool) -> None:
    """The figures as markdown, with the command, the CPU, the commit and the date."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import cpu_flags

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = " ".join(["benchmarks/lora_rollout.py", *argv])
    text = [
        "# LoRA sampling against the full model (issue 51)",
        "",
        f"Command: `.venv/bin/python {command}`  ",
        f"CPU: {cpu_flags()}  ",
        f"Commit {commit or 'unknown'}, {when}; load average (1 min) at the end "
        f"{os.getloadavg()[0]:.1f} (a busy machine moves the ratios less than the times)."
        + (" A --tiny smoke run: the figures mean nothing." if tiny else ""),
        "",
        "```",
        *lines,
        "```",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(text), encoding="utf-8")
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--model-dir", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--tiny", action="store_true", help="the tiny random model, tiny shape")
    parser.add_argument(
        "--autocast", choices=("auto", "none", "bf16"), default="auto",
        help="the old-log-prob recompute's autocast (auto: what actor.autocast=auto picks here)",
    )  # fmt: skip
    parser.add_argument(
        "--write", nargs="?", const=str(RESULTS), default=None, metavar="PATH",
        help=f"also write the figures as markdown (default path: {RESULTS})",
    )  # fmt: skip
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = TINY if args.tiny else MAIN_JOB
    model_dir = str(tiny_model_dir() if args.tiny else args.model_dir or embedded_model_dir())
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir).eval()
    lora = lora_model(model, args.rank)
    prompts = prompt_batch(tokenizer, shape)
    lines = [
        f"{len(prompts)} trajectories ({shape.prompts} prompts x {shape.n}), prompt width "
        f"{prompts['input_ids'].shape[1]}, {shape.max_new} new tokens (no EOS stop), LoRA rank "
        f"{args.rank} on every linear, torch threads {torch.get_num_threads()}, "
        f"{args.repeats} repeats"
    ]
    print(lines[-1], flush=True)
    variants = {
        "full": runner(model, tokenizer, prompts, shape, lora=False),
        "lora-merged": runner(lora, tokenizer, prompts, shape, lora=True),
        "lora-peft": runner(lora, tokenizer, prompts, shape, lora=True, merge_lora=False),
    }
    runs = {name: Runs() for name in variants}
    last: Batch | None = None
    for seed in range(args.repeats):
        for name, (run, _) in variants.items():
            last = run(seed, runs[name])
    full = runs["full"]
    speed: dict[str, float] = {}
    for name, r in runs.items():
        median = statistics.median(r.seconds)
        tokens = statistics.median(r.tokens)
        line = f"{name:<12} median {median:7.3f} s  {tokens:6.0f} tokens  "
        line += f"{tokens / median:8.1f} tok/s"
        if name != "full":
            # tokens/s over the full model's, pair by pair (the same seed, back to back)
            ratios = [
                (t / s) / (ft / fs)
                for s, t, fs, ft in zip(r.seconds, r.tokens, full.seconds, full.tokens, strict=True)
            ]
            speed[name] = statistics.median(ratios)
            line += f"  tok/s x{speed[name]:.2f} of full"
            line += f"  |logp - LoRA teacher-forced| max {max(r.gaps):.1e}"
        if name == "lora-merged":
            line += f"  (merge {statistics.median(r.merge_s):.3f} s of it)"
        lines.append(line)
        print(line, flush=True)
    assert last is not None
    tail = old_log_prob_lines(model, lora, last, args)
    tail.insert(
        3,
        f"  sampling tokens/s, LoRA (merged) / full: {verdict(speed['lora-merged'], '>= 0.9')}"
        f" (through peft: {speed['lora-peft']:.2f})",
    )
    for line in tail:
        print(line, flush=True)
    lines += tail
    if args.write is not None:
        write_results(Path(args.write), lines, argv, args.tiny)


if __name__ == "__main__":
    main()

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

Then the old-log-prob stage on the last sampled batch: ``ActorWorker.compute_log_prob`` with
the full model and with the LoRA model (the peft forward the update also runs), and whether a
``creditrl train`` run with ``model.lora_rank`` > 0 skips that stage here
(``rollout_log_probs_reusable``: it reuses the sampler's log-probs in float32, recomputes
them under bf16 autocast, with rollout IS, or top-k/top-p without replay).

``--tiny``: the tiny random model, 2 prompts x 2 trajectories, 8 new tokens (a smoke run;
the figures mean nothing).

Not measured on a quiet machine yet: the figures in the README are the issue's (``timing_s/gen``
3.1-3.6 s with ``model.lora_rank=32`` against 1.8-2.2 s without, before the merged copy).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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


def time_old_log_probs(model: torch.nn.Module, out: Batch, repeats: int) -> float:
    """Median seconds of the old-log-prob stage (``compute_log_prob``) on ``out``."""
    worker = ActorWorker(model, ActorConfig(autocast="none"), trainable=False)
    worker.compute_log_prob(out, 1.0)  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        worker.compute_log_prob(out, 1.0)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--model-dir", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--tiny", action="store_true", help="the tiny random model, tiny shape")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = TINY if args.tiny else MAIN_JOB
    model_dir = str(tiny_model_dir() if args.tiny else args.model_dir or embedded_model_dir())
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir).eval()
    lora = lora_model(model, args.rank)
    prompts = prompt_batch(tokenizer, shape)
    print(
        f"{len(prompts)} trajectories ({shape.prompts} prompts x {shape.n}), prompt width "
        f"{prompts['input_ids'].shape[1]}, {shape.max_new} new tokens (no EOS stop), LoRA rank "
        f"{args.rank} on every linear, torch threads {torch.get_num_threads()}, "
        f"{args.repeats} repeats"
    )
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
    full = runs["full"].seconds
    for name, r in runs.items():
        median = statistics.median(r.seconds)
        tokens = statistics.median(r.tokens)
        line = f"{name:<12} median {median:7.3f} s  {tokens:6.0f} tokens  "
        line += f"{tokens / median:8.1f} tok/s"
        if name != "full":
            ratios = [b / a for a, b in zip(full, r.seconds, strict=True)]
            line += f"  x{statistics.median(ratios):.2f} of full"
            line += f"  |logp - LoRA teacher-forced| max {max(r.gaps):.1e}"
        if name == "lora-merged":
            line += f"  (merge {statistics.median(r.merge_s):.3f} s of it)"
        print(line, flush=True)
    assert last is not None
    full_s = time_old_log_probs(model, last, args.repeats)
    lora_s = time_old_log_probs(lora, last, args.repeats)
    reused = rollout_log_probs_reusable(
        load_config(overrides=[f"model.lora_rank={args.rank}", "actor.autocast=none"])
    )
    print(
        f"old log-probs (compute_log_prob, {len(last)} rows): full {full_s:.3f} s, LoRA "
        f"{lora_s:.3f} s (x{lora_s / full_s:.2f}); a float32 LoRA run "
        f"{'reuses the rollout log-probs (stage skipped)' if reused else 'recomputes them'}"
    )


if __name__ == "__main__":
    main()

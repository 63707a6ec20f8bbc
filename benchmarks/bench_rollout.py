"""Time HFRolloutEngine.generate() against transformers' model.generate() on the embedded model.

Run: .venv/bin/python benchmarks/bench_rollout.py [--repeats 3] [--threads 2] [--only a,b]

The main job's rollout: 4 chain_sum prompts x 4 trajectories, up to 96 new tokens, temperature
1, SmolLM2-135M-Instruct in float32. Each variant runs ``--repeats`` times with seeds 0, 1, ...
(ours: the engine seed; HF: torch.manual_seed) and reports the median wall time, the valid
response tokens per second, and for ours the prefill/decode split and the decode rows (rows
summed over decode forwards: the work the removal of finished rows saves). "full" variants
never stop at EOS (HF: ``min_new_tokens``), so both sides generate exactly 16 x 96 tokens.
"ours" and bf16 also report how far rollout_log_probs are from a float32 teacher-forced forward.
"concat-cache" and "linear-as-is" switch off one of the engine's CPU measures (hf_engine docs).

Each variant warms up once on the measured batch first. ``--paired a,b`` alternates two
variants seed by seed and prints the ratio of every pair: on this noisy machine a ratio taken
pair by pair is the figure to quote.

Measured on the 2-core AMD EPYC dev box (torch 2.13, transformers 5.24, 2 threads; the prompts
carry the default worked example, 130 tokens, 4 distinct prompts prefilled as one token trie,
decode through ``rollout.llama_decode``; single runs swing by 20-50 %):

    --paired ours-full,hf-full --repeats 4:  ours-full 10.32 s, hf-full 19.93 s (1536 tokens
        each); pair by pair 1.90, 2.43, 1.83, 1.74: median 1.87x
    --paired ours-full,hf-full --repeats 5 (2-row warm-up):  10.88 s, 18.84 s; median 1.78x
    --only ours,ours-full,hf-full --repeats 3:  ours 2.67 s (162 tokens, |logp - teacher-forced|
        <= 6.8e-5), ours-full 11.52 s, hf-full 21.73 s: 1.89x; an earlier run 10.29 s against
        21.58 s: 2.10x
    (before the query was made contiguous: ours-full 11.09 s, hf-full 20.38 s, 1.84x; before the
    Llama decode step: 13.42 s, 20.60 s, 1.54x)

On the 2-core Intel Xeon @ 2.50GHz (avx512f/bw/vl/vnni, no avx512_bf16/amx; torch 2.13,
transformers 5.24, 2 threads), the session of issue 51, before its changes (main 49e248b, the
machine nearly idle):

    --paired ours-full,hf-full --repeats 2:  ours-full 9.51 s (decode 9.55 s), hf-full 25.42 s;
        pair by pair 2.77, 2.59: median 2.68x
    after them (quiet):  --paired ours-full,hf-full --repeats 4:  ours-full 11.82 s (min
        10.49 s, decode 9.90 s), hf-full 32.41 s (min 29.91 s); pair by pair 2.48, 2.48, 2.92,
        2.95: median 2.70x (both sides ran ~25 % slower than the run before: the ratio is the
        figure)

A decode step of ours-full (~100 ms there) is bound by memory reads: it reads every weight once
(538 MB) and every row's cached keys and values (S x 737 KB for S positions, ~131 MB on
average here) at the ~9-11 GB/s this machine reads, ~61-67 ms of the step; the weight products
(~49 ms of an 82 ms step without the sampler, torch.profiler) and attention (~11.5 ms) run at
about that rate whatever the kernel. Of the rest, the sampler on row-strided logits took 7.0 ms
a step on one thread in the engine (2.3 ms since the head returns row-major logits and the
sampler reads them with amax and an in-place exp); the small ops around the products and the
prefill make up the remainder. Figures and commands: ``benchmarks/results/rollout_kernels.md``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from creditrl import Batch
from creditrl.config.schema import DataConfig, RolloutConfig
from creditrl.data import build_datasets
from creditrl.models.embedded import embedded_model_dir
from creditrl.models.tokenizer import load_tokenizer
from creditrl.rollout import HFRolloutEngine, cpu_kernels, hf_engine

PROMPTS, N, MAX_NEW = 4, 4, 96


@dataclass
class Result:
    seconds: list[float]
    tokens: list[float]
    notes: str = ""

    def line(self, name: str) -> str:
        median = statistics.median(self.seconds)
        tokens = statistics.median(self.tokens)
        return (
            f"{name:<22} median {median:6.2f} s  (min {min(self.seconds):6.2f})  "
            f"tokens {tokens:6.0f}  {tokens / median:7.1f} tok/s  {self.notes}"
        )


def prompt_batch(tokenizer) -> Batch:
    """4 chain_sum prompts (the main job's data config), each repeated N times."""
    train, _ = build_datasets(DataConfig(train_size=PROMPTS, val_size=0), tokenizer)
    return train.batch(list(range(PROMPTS))).repeat(N)


def teacher_forced(model: PreTrainedModel, out: Batch) -> torch.Tensor:
    width = out["responses"].shape[1]
    with torch.inference_mode():
        logits = model(
            input_ids=out["input_ids"],
            attention_mask=out["attention_mask"],
            position_ids=out["position_ids"],
        ).logits[:, -width - 1 : -1]
    log_probs = logits.float().log_softmax(-1)
    return log_probs.gather(-1, out["responses"][..., None]).squeeze(-1)


def run_ours(model, tokenizer, prompts, seeds, reference=None, **options) -> Result:
    cfg = RolloutConfig(max_response_length=MAX_NEW, micro_batch_size=64, temperature=1.0)
    engine = HFRolloutEngine(model, tokenizer, cfg, **options)
    engine.generate(prompts, seed=123)  # warm-up, on the measured shape
    seconds, tokens, stats, errors = [], [], [], []
    for seed in seeds:
        start = time.perf_counter()
        out = engine.generate(prompts, seed=seed)
        seconds.append(time.perf_counter() - start)
        tokens.append(float(out["response_mask"].sum()))
        stats.append(engine.last_stats)
        if reference is not None:
            valid = out["response_mask"].bool()
            diff = (out["rollout_log_probs"] - teacher_forced(reference, out)).abs()[valid]
            errors.append((diff.max().item(), diff.mean().item()))
    notes = (
        f"prefill {statistics.median(s['prefill_s'] for s in stats):.2f} s, "
        f"decode {statistics.median(s['decode_s'] for s in stats):.2f} s, "
        f"decode rows {statistics.median(s['decode_rows'] for s in stats):.0f}"
    )
    if errors:
        notes += (
            f", |logp - fp32 teacher-forced| max {max(e[0] for e in errors):.2e} "
            f"mean {statistics.mean(e[1] for e in errors):.2e}"
        )
    return Result(seconds, tokens, notes)


def plain_dynamic_cache(model: PreTrainedModel, capacity: int) -> DynamicCache:
    return DynamicCache(config=model.config)


def run_ours_without(measure: str, *args, **kwargs) -> Result:
    """run_ours with one of the engine's CPU measures switched off."""
    saved = cpu_kernels.SMALL_BATCH_ROWS, hf_engine.preallocated_cache
    if measure == "weight_major":
        cpu_kernels.SMALL_BATCH_ROWS = 0
    else:
        hf_engine.preallocated_cache = plain_dynamic_cache
    try:
        return run_ours(*args, **kwargs)
    finally:
        cpu_kernels.SMALL_BATCH_ROWS, hf_engine.preallocated_cache = saved


def run_hf(model, tokenizer, prompts, seeds, **options) -> Result:
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=MAX_NEW,
        pad_token_id=tokenizer.pad_token_id,
        **options,
    )
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, **kwargs)  # warm-up, same shape
    seconds, tokens = [], []
    for seed in seeds:
        torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        seconds.append(time.perf_counter() - start)
        responses = out[:, ids.shape[1] :]
        is_eos = responses == tokenizer.eos_token_id
        after_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0  # pad after the first EOS
        tokens.append(float((~after_eos).sum()))
    return Result(seconds, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-dir", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--only", default="", help="comma-separated variant names")
    parser.add_argument("--paired", default="", help="a,b: alternate two variants seed by seed")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model_dir or str(embedded_model_dir())
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = prompt_batch(tokenizer)
    print(
        f"{len(prompts)} trajectories ({PROMPTS} prompts x {N}), prompt width "
        f"{prompts['input_ids'].shape[1]}, up to {MAX_NEW} new tokens, torch threads "
        f"{torch.get_num_threads()}, {args.repeats} repeats"
    )
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    variants: dict[str, Callable[[list[int]], Result]] = {
        "ours": lambda r: run_ours(model, tokenizer, prompts, r, reference=model),
        "ours-keep-finished": lambda r: run_ours(
            model, tokenizer, prompts, r, remove_finished=False
        ),
        "ours-concat-cache": lambda r: run_ours_without("prealloc", model, tokenizer, prompts, r),
        "ours-linear-as-is": lambda r: run_ours_without(
            "weight_major", model, tokenizer, prompts, r
        ),
        "ours-eager": lambda r: run_ours(eager, tokenizer, prompts, r),
        "ours-bf16": lambda r: run_ours(bf16, tokenizer, prompts, r, reference=model),
        "hf": lambda r: run_hf(model, tokenizer, prompts, r),
        "hf-static-cache": lambda r: run_hf(
            model, tokenizer, prompts, r, cache_implementation="static"
        ),
        "ours-full": lambda r: run_ours(model, tokenizer, prompts, r, eos_token_ids=[]),
        "hf-full": lambda r: run_hf(model, tokenizer, prompts, r, min_new_tokens=MAX_NEW),
    }
    if args.paired:
        run_paired(variants, args.paired.split(","), args.repeats)
        return
    only = [v for v in args.only.split(",") if v]
    for name, run in variants.items():
        if not only or name in only:
            print(run(list(range(args.repeats))).line(name), flush=True)


def run_paired(
    variants: dict[str, Callable[[list[int]], Result]], names: list[str], repeats: int
) -> None:
    """``a,b``: a and b alternate, one seed each in turn, so that the machine's drift falls on
    both; prints each side and the ratio b / a of every pair with their median."""
    if len(names) != 2 or not set(names) <= set(variants):
        raise SystemExit(f"--paired takes two of {', '.join(variants)}; got {names}")
    results = {name: Result([], []) for name in names}
    for seed in range(repeats):
        for name in names:
            one = variants[name]([seed])
            results[name].seconds += one.seconds
            results[name].tokens += one.tokens
            results[name].notes = one.notes
    for name in names:
        print(results[name].line(name))
    first, second = (results[name].seconds for name in names)
    ratios = [b / a for a, b in zip(first, second, strict=True)]
    print(
        f"{names[1]} / {names[0]} pair by pair: {', '.join(f'{x:.2f}' for x in ratios)}; "
        f"median {statistics.median(ratios):.2f}x"
    )


if __name__ == "__main__":
    main()

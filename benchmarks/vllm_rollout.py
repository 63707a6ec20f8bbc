"""Rollout throughput of the vLLM engine against the HF engine on one GPU, and how far vLLM's
rollout log-probs are from the trainer's.

Run (a CUDA machine with `pip install 'creditrl[vllm]'`):

    python benchmarks/vllm_rollout.py [--prompts 64] [--n 8] [--max-new 96] [--repeats 3]

The embedded SmolLM2-135M-Instruct (or ``--model-dir``), the default task's prompts (reasoning-gym
chain_sum, chat-templated), each repeated ``--n`` times with its own ``sample_seed``, sampled at
``--temperature`` up to ``--max-new`` tokens. Each engine warms up, then runs ``--repeats``
times (new seeds each time); reported: median wall seconds, valid response tokens and tokens/s.

Mismatch: the trainer (``ActorWorker.compute_log_prob``, float32) recomputes the log-probs of
vLLM's samples; reported are the k3 KL mean over valid tokens, E[exp(d) - d - 1] with
d = old_log_prob - rollout_log_prob (``kl_penalty(rollout, old, "low_var_kl")``), and the
``compute_rollout_importance_weights`` metrics (token level, truncate at 2). The same after
pushing the trainer's weights into vLLM with ``update_weights`` (a check of that path), and the
HF engine's own mismatch (float32 sampler: ~0). Weight sync: seconds of ``update_weights``,
``sleep()`` and ``wake_up()``, and the GPU memory ``sleep()`` frees.

Prints the results as JSON and writes them to benchmarks/results/vllm_rollout.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from creditrl import Batch
from creditrl.config.schema import ActorConfig, DataConfig, RolloutConfig
from creditrl.core import compute_rollout_importance_weights, kl_penalty, masked_mean
from creditrl.data import build_datasets
from creditrl.models import load_causal_lm, load_tokenizer, resolve_model_path
from creditrl.rollout import HFRolloutEngine
from creditrl.rollout.vllm_engine import VLLMRolloutEngine, vllm_unavailable_reason
from creditrl.workers import ActorWorker

RESULTS = Path(__file__).parent / "results" / "vllm_rollout.json"


def prompt_batch(tokenizer: Any, prompts: int, n: int) -> Batch:
    """``prompts`` chain_sum prompts (the default data config), each repeated ``n`` times."""
    train, _ = build_datasets(DataConfig(train_size=prompts, val_size=0), tokenizer)
    count = min(prompts, len(train))
    return train.batch(list(range(count))).repeat(n)


def with_seeds(batch: Batch, offset: int) -> Batch:
    batch["sample_seed"] = torch.arange(offset, offset + len(batch), dtype=torch.long)
    return batch


def time_engine(engine: Any, prompts: Batch, repeats: int) -> tuple[dict[str, Any], Batch]:
    """Warm up, then ``repeats`` timed generate() calls; the stats and the last output."""
    engine.generate(with_seeds(prompts[:8], 10**9))
    seconds, tokens = [], []
    out = prompts
    for r in range(repeats):
        batch = with_seeds(prompts, r * len(prompts))
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate(batch)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        tokens.append(float(out["response_mask"].sum()))
    median_s, median_tokens = statistics.median(seconds), statistics.median(tokens)
    stats = {
        "seconds": seconds,
        "median_s": median_s,
        "tokens": tokens,
        "median_tokens": median_tokens,
        "tokens_per_s": median_tokens / median_s,
    }
    return stats, out


def mismatch(worker: ActorWorker, out: Batch, temperature: float) -> dict[str, float]:
    """k3 KL mean and rollout-IS metrics of the trainer's log-probs against the rollout's."""
    old, _ = worker.compute_log_prob(out.to("cuda"), temperature, with_entropy=False)
    rollout = out["rollout_log_probs"].to(old.device)
    mask = out["response_mask"].to(old.device)
    k3 = masked_mean(kl_penalty(rollout, old, "low_var_kl"), mask.float())
    _, _, metrics = compute_rollout_importance_weights(old, rollout, mask)
    return {"k3_kl_mean": float(k3), **metrics}


def weight_sync(engine: VLLMRolloutEngine, model: torch.nn.Module) -> dict[str, float]:
    """Seconds of update_weights (and of sleep / wake_up with the memory sleep frees)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    count = engine.update_weights(model.named_parameters())
    torch.cuda.synchronize()
    stats = {"update_weights_s": time.perf_counter() - start, "tensors": float(count)}
    if engine.enable_sleep_mode:
        free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        engine.sleep(level=1)
        stats["sleep_s"] = time.perf_counter() - start
        stats["sleep_frees_gib"] = (torch.cuda.mem_get_info()[0] - free_before) / 2**30
        start = time.perf_counter()
        engine.wake_up()
        stats["wake_up_s"] = time.perf_counter() - start
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-dir", default="embedded")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--vllm-dtype", default="bfloat16")
    parser.add_argument("--hf-micro-batch", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true", help="time vLLM only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    reason = vllm_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"benchmarks/vllm_rollout.py needs vLLM on a CUDA GPU: {reason}")
    import vllm

    model_dir = resolve_model_path(args.model_dir)
    tokenizer = load_tokenizer(model_dir)
    prompts = prompt_batch(tokenizer, args.prompts, args.n)
    cfg = RolloutConfig(
        temperature=args.temperature,
        max_response_length=args.max_new,
        micro_batch_size=args.hf_micro_batch,
    )
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "model": str(model_dir),
        "trajectories": len(prompts),
        "prompt_width": prompts["input_ids"].shape[1],
        "max_new_tokens": args.max_new,
        "temperature": args.temperature,
    }
    start = time.perf_counter()
    engine = VLLMRolloutEngine(
        model_dir,
        tokenizer,
        cfg,
        gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.vllm_dtype,
    )
    init_s = time.perf_counter() - start
    stats, out = time_engine(engine, prompts, args.repeats)
    results["vllm"] = {"dtype": args.vllm_dtype, "init_s": init_s, **stats}
    trainer = load_causal_lm(model_dir, "float32").cuda().eval()
    worker = ActorWorker(trainer, ActorConfig(log_prob_micro_batch_size=64), trainable=False)
    results["mismatch"] = mismatch(worker, out, args.temperature)
    results["weight_sync"] = weight_sync(engine, trainer)
    synced = engine.generate(with_seeds(prompts, 0))
    results["mismatch_after_update_weights"] = mismatch(worker, synced, args.temperature)
    if not args.skip_hf:
        engine.sleep()
        hf_engine = HFRolloutEngine(trainer, tokenizer, cfg, seed=0)
        hf_stats, hf_out = time_engine(hf_engine, prompts, args.repeats)
        results["hf"] = {"dtype": "float32", "micro_batch_size": args.hf_micro_batch, **hf_stats}
        results["hf_mismatch"] = mismatch(worker, hf_out, args.temperature)
        results["speedup_tokens_per_s"] = stats["tokens_per_s"] / hf_stats["tokens_per_s"]
    text = json.dumps(results, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

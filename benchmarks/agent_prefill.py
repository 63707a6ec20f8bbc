"""Agent rollouts with each sample's KV cache kept between turns vs the whole context
re-prefilled every turn (``agent.keep_kv_cache``), on the embedded model.

Run: .venv/bin/python benchmarks/agent_prefill.py [--prompts 8] [--n 4] [--repeats 3]
     [--threads 2]

The calculator agent (``preset=calculator_agent``, ``agent.max_turns=4``) on SmolLM2-135M-Instruct
(``model.path=embedded``, float32), ``--prompts`` chain_sum questions x ``--n`` samples, the
HF engine at the preset's sampling settings. Repeat r samples with seeds r * 1000 + row in both
modes (the same draws); the two modes alternate which runs first. Prints
one JSON line: median wall seconds per rollout of each mode and their ratio (re-prefill /
kept), median CPU seconds of each (less swayed by other jobs on the cores), the prefilled
tokens of each (median), turns per sample (mean), whether the token ids matched in every
repeat and the largest log-prob difference. Ids may differ where a draw falls within float
rounding (~1e-5 in log-prob) of a token boundary: the two modes compute the same logits in
different batch shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from creditrl.agents.rollout import AgentRollout
from creditrl.agents.tasks import build_agent_datasets
from creditrl.batch import Batch
from creditrl.config.loader import load_config
from creditrl.data import collate_prompts
from creditrl.models import load_causal_lm, load_tokenizer, resolve_model_path
from creditrl.rollout import HFRolloutEngine


def rollout_once(rollout: AgentRollout, prompts: Batch) -> tuple[float, float, Batch]:
    """(wall seconds, CPU seconds of this process, rollout batch)."""
    start, cpu = time.perf_counter(), time.process_time()
    out = rollout.generate(prompts)
    return time.perf_counter() - start, time.process_time() - cpu, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(
        overrides=[
            "preset=calculator_agent",
            "agent.max_turns=4",
            "model.path=embedded",
            f"data.train_size={args.prompts}",
        ]
    )
    path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, "float32").eval()
    train, _ = build_agent_datasets(cfg, tokenizer)
    rows = [train[i] for i in range(args.prompts)]
    prompts = collate_prompts(rows, tokenizer.pad_token_id).repeat(args.n, interleave=True)
    rollouts = {}
    for keep in (True, False):
        agent = dataclasses.replace(cfg.agent, keep_kv_cache=keep)
        engine = HFRolloutEngine(model, tokenizer, cfg.rollout, seed=cfg.trainer.seed)
        rollouts[keep] = AgentRollout(engine, tokenizer, agent, cfg.rollout)
    rollout_once(rollouts[True], prompts[:2])  # warm-up
    seconds: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    prefill: dict[bool, list[float]] = {True: [], False: []}
    turns, match, max_diff = [], True, 0.0
    for r in range(args.repeats):
        prompts["sample_seed"] = torch.arange(len(prompts)) + r * 1000
        outs = {}
        for keep in (True, False) if r % 2 == 0 else (False, True):
            elapsed, cpu_seconds, outs[keep] = rollout_once(rollouts[keep], prompts)
            seconds[keep].append(elapsed)
            cpu[keep].append(cpu_seconds)
            prefill[keep].append(rollouts[keep].last_stats["prefill_tokens"])
        turns.append(float(outs[True]["num_turns"].float().mean()))
        match &= torch.equal(outs[True]["responses"], outs[False]["responses"])
        diff = outs[True]["rollout_log_probs"] - outs[False]["rollout_log_probs"]
        max_diff = max(max_diff, float(diff.abs().max()))
    kept, fresh = statistics.median(seconds[True]), statistics.median(seconds[False])
    print(
        json.dumps(
            {
                "prompts": args.prompts,
                "n": args.n,
                "repeats": args.repeats,
                "threads": torch.get_num_threads(),
                "seconds_kept": round(kept, 3),
                "seconds_reprefill": round(fresh, 3),
                "ratio_reprefill_over_kept": round(fresh / kept, 3),
                "cpu_seconds_kept": round(statistics.median(cpu[True]), 3),
                "cpu_seconds_reprefill": round(statistics.median(cpu[False]), 3),
                "prefill_tokens_kept": statistics.median(prefill[True]),
                "prefill_tokens_reprefill": statistics.median(prefill[False]),
                "turns_per_sample": round(statistics.mean(turns), 3),
                "ids_match": match,
                "max_log_prob_diff": max_diff,
            }
        )
    )


if __name__ == "__main__":
    main()

"""The OpenAI-compatible endpoint's overhead per request (``agent.program``) against the
built-in agent loop's per turn, on the calculator task and the embedded model.

Run: .venv/bin/python benchmarks/agent_endpoint.py [--prompts 4] [--n 4] [--repeats 3]
     [--threads 2]

The built-in loop (``preset=calculator_agent``, its calculator tool) and
``examples/calculator_agent.py:episode`` (the same task through the endpoint, its own
calculator) roll out the same ``--prompts`` x ``--n`` chain_sum questions with the same
per-row seeds, on SmolLM2-135M-Instruct (float32) and one HF engine each. Engine time (inside
``generate_turns``) is measured separately from the wall time; what is left is each path's own
work (the built-in loop: parsing, tools, rendering observations; the endpoint: HTTP, JSON,
the OpenAI client, rendering and matching the request, the program's own tool code). Prints
one JSON line: medians over the repeats of wall and engine seconds, model calls (requests /
turns), and the non-engine milliseconds per call of each path; repeats alternate which path
runs first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from creditrl.agents.program import ProgramRollout
from creditrl.agents.rollout import AgentRollout
from creditrl.agents.tasks import build_agent_datasets
from creditrl.config.loader import load_config
from creditrl.data import collate_prompts
from creditrl.models import load_causal_lm, load_tokenizer, resolve_model_path
from creditrl.rollout import HFRolloutEngine

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "calculator_agent.py"


def timed(rollout: Any) -> dict[str, float]:
    """Wrap the rollout's turn generator so engine seconds and calls are counted."""
    counts = {"engine_s": 0.0, "calls": 0.0}
    real = rollout.turns.generate_turns

    def generate_turns(requests: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = real(requests, **kwargs)
        counts["engine_s"] += time.perf_counter() - start
        counts["calls"] += len(requests)
        return out

    rollout.turns.generate_turns = generate_turns
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(
        overrides=[
            "preset=calculator_agent",
            "model.path=embedded",
            f"data.train_size={args.prompts}",
            f"agent.program={EXAMPLE}:episode",
        ]
    )
    path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, "float32").eval()
    train, _ = build_agent_datasets(cfg, tokenizer)
    prompts = collate_prompts([train[i] for i in range(args.prompts)], tokenizer.pad_token_id)
    prompts = prompts.repeat(args.n, interleave=True)
    builtin_cfg = dataclasses.replace(cfg.agent, program=None)
    rollouts = {
        "builtin": AgentRollout(
            HFRolloutEngine(model, tokenizer, cfg.rollout, seed=0), tokenizer, builtin_cfg,
            cfg.rollout,
        ),
        "endpoint": ProgramRollout(
            HFRolloutEngine(model, tokenizer, cfg.rollout, seed=0), tokenizer, cfg.agent,
            cfg.rollout,
        ),
    }  # fmt: skip
    counters = {name: timed(r) for name, r in rollouts.items()}
    for rollout in rollouts.values():  # warm-up
        rollout.generate(prompts[:2])
    results: dict[str, dict[str, list[float]]] = {
        name: {"wall_s": [], "engine_s": [], "calls": []} for name in rollouts
    }
    for r in range(args.repeats):
        prompts["sample_seed"] = torch.arange(len(prompts)) + r * 1000
        order = ("builtin", "endpoint") if r % 2 == 0 else ("endpoint", "builtin")
        for name in order:
            counters[name].update(engine_s=0.0, calls=0.0)
            start = time.perf_counter()
            rollouts[name].generate(prompts)
            results[name]["wall_s"].append(time.perf_counter() - start)
            results[name]["engine_s"].append(counters[name]["engine_s"])
            results[name]["calls"].append(counters[name]["calls"])
    rollouts["endpoint"].close()
    out: dict[str, Any] = {"prompts": args.prompts, "n": args.n, "repeats": args.repeats,
                           "threads": torch.get_num_threads()}  # fmt: skip
    for name, got in results.items():
        wall, engine = statistics.median(got["wall_s"]), statistics.median(got["engine_s"])
        calls = statistics.median(got["calls"])
        out[f"{name}_wall_s"] = round(wall, 3)
        out[f"{name}_engine_s"] = round(engine, 3)
        out[f"{name}_model_calls"] = calls
        out[f"{name}_other_ms_per_call"] = round(1000 * (wall - engine) / max(calls, 1), 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

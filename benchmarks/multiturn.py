"""Multi-turn against single-turn generation: seconds per generated (policy) token.

Run: .venv/bin/python benchmarks/multiturn.py [--questions 4] [--n 2] [--repeats 2]
     [--threads 2] [--env game|echo] [--max-response-length 96]
     [--out benchmarks/results/multiturn]

On SmolLM2-135M-Instruct (float32, one HF engine), the same ``--questions`` x ``--n`` rows of
an environment (``game``: ``examples/verifiers_letter_game.py``, up to three turns of at most
32 tokens, a hint after each wrong guess; ``echo``: ``examples/verifiers_echo.py``, two turns
of at most 48, "Are you sure?" between) are generated five ways:

- ``single``: one turn per row (``HFRolloutEngine.generate``, up to
  ``--max-response-length`` tokens), as ``make run``'s rollout does;
- ``env``: the environment through the endpoint (verifiers' rollout, its turns batched continuously:
  ``agent.turn_chunk_tokens=16``, each trajectory's KV kept between turns);
- ``env_lockstep``: the same with ``agent.turn_chunk_tokens=0``, the default (each engine call
  runs its turns to their ends);
- ``env_no_kv``: chunked, without the kept KV (``agent.keep_kv_cache=false``): the prefill the
  turn cache saves;
- ``program``: an agent program (``confirm`` below: answer, then "Are you sure?" twice) through
  the endpoint, chunked.

Per way: wall seconds, policy tokens generated (``response_mask``), seconds per token, its
ratio to ``single``, turns per row and the tokens prefilled. Medians over ``--repeats``, the
order of the ways rotated each repeat; the per-row seeds are the same for every way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from machine import cpu_flags

from creditrl.config.loader import load_config
from creditrl.data import collate_prompts
from creditrl.models import load_causal_lm, load_tokenizer, resolve_model_path
from creditrl.rollout import HFRolloutEngine
from creditrl.rollout.strategies import build_rollout

ROOT = Path(__file__).resolve().parents[1]
ENVS = {"game": ROOT / "examples" / "verifiers_letter_game.py",
        "echo": ROOT / "examples" / "verifiers_echo.py"}  # fmt: skip
WAYS = ("single", "env", "env_lockstep", "env_no_kv", "program")


async def confirm(row: dict[str, Any], client: Any) -> None:
    """An agent program of three turns: the question, then "Are you sure?" twice (the
    configured scorer scores the conversation)."""
    messages = list(row["messages"])
    for _ in range(3):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=32
        )
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "user", "content": "Are you sure?"}]  # fmt: skip


def build(way: str, model: Any, tokenizer: Any, args: Any, path: str) -> tuple[Any, Any]:
    """(the rollout, its config) of one way."""
    questions = args.questions
    overrides = [
        f"model.path={path}",
        f"env.verifiers={ENVS[args.env]}:load_environment",
        f"rollout.max_response_length={args.max_response_length}",
        f"data.max_train_rows={questions}",
        "agent.max_concurrent_episodes=64",
        f"agent.turn_chunk_tokens={0 if way == 'env_lockstep' else 16}",
        f"agent.keep_kv_cache={way != 'env_no_kv'}",
    ]
    if way == "program":
        overrides += [f"agent.program={Path(__file__).resolve()}:confirm", "env.verifiers=null"]
    cfg = load_config(overrides=overrides)
    engine = HFRolloutEngine(model, tokenizer, cfg.rollout, seed=0)
    if way == "single":
        return engine, cfg
    return build_rollout(engine, tokenizer, cfg), cfg


def prompts_of(tokenizer: Any, args: Any, path: str) -> Any:
    from creditrl.environments import environment_datasets

    env = f"env.verifiers={ENVS[args.env]}:load_environment"
    cfg = load_config(
        overrides=[env, f"model.path={path}", f"data.max_train_rows={args.questions}"]
    )
    train, _ = environment_datasets(cfg, tokenizer)
    prompts = collate_prompts([train[i] for i in range(args.questions)], tokenizer.pad_token_id)
    return prompts.repeat(args.n, interleave=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="embedded", help="embedded or a model directory")
    parser.add_argument("--env", choices=sorted(ENVS), default="game")
    parser.add_argument("--max-response-length", type=int, default=96)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "multiturn"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = str(resolve_model_path(args.model, None))
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, "float32").eval()
    prompts = prompts_of(tokenizer, args, path)
    rollouts = {way: build(way, model, tokenizer, args, path)[0] for way in WAYS}
    for rollout in rollouts.values():  # warm-up
        rollout.generate(prompts[:2])
    got: dict[str, dict[str, list[float]]] = {w: {} for w in WAYS}
    for r in range(args.repeats):
        prompts["sample_seed"] = torch.arange(len(prompts)) + 1000 * r
        for way in WAYS[r % len(WAYS) :] + WAYS[: r % len(WAYS)]:
            start = time.perf_counter()
            batch = rollouts[way].generate(prompts)
            seconds = time.perf_counter() - start
            stats = getattr(rollouts[way], "last_stats", {}) or {}
            turns = batch["num_turns"].float().mean() if "num_turns" in batch else 1.0
            for key, value in (
                ("wall_s", seconds),
                ("tokens", float(batch["response_mask"].sum())),
                ("turns_per_row", float(turns)),
                ("prefill_tokens", float(stats.get("prefill_tokens") or 0.0)),
            ):
                got[way].setdefault(key, []).append(value)
    for rollout in rollouts.values():
        close = getattr(rollout, "close", None)
        if close is not None:
            close()
    rows = {}
    for way in WAYS:
        med = {k: statistics.median(v) for k, v in got[way].items()}
        med["s_per_token"] = med["wall_s"] / max(med["tokens"], 1.0)
        rows[way] = med
    for way in WAYS:
        rows[way]["vs_single"] = rows[way]["s_per_token"] / rows["single"]["s_per_token"]
    command = "python benchmarks/multiturn.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"
    )
    result = {"command": command, "cpu": cpu_flags(), "threads": torch.get_num_threads(),
              "rows": args.questions * args.n, "ways": rows}  # fmt: skip
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# Multi-turn against single-turn: seconds per generated token",
        "",
        f"`{command}` on {result['cpu']}, {result['threads']} threads, "
        f"{result['rows']} rows (medians of {args.repeats}).",
        "",
        "| way | wall s | policy tokens | s / token | vs single | turns / row | prefilled |",
        "|---|---|---|---|---|---|---|",
    ]
    for way, m in rows.items():
        lines.append(
            f"| {way} | {m['wall_s']:.1f} | {m['tokens']:.0f} | {m['s_per_token']:.4f} | "
            f"{m['vs_single']:.2f} | {m['turns_per_row']:.2f} | {m['prefill_tokens']:.0f} |"
        )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

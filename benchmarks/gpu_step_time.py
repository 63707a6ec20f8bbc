"""Fast on one GPU: rollout, update and a whole GRPO step against HF generate and TRL.

Run (on a machine where torch sees CUDA; scripts/gpu_check.sh runs it):

    python3 benchmarks/gpu_step_time.py [--out benchmarks/results/gpu_step_time.md]
        [--parts rollout,update,grpo,trl] [--budget-s 200] [--pytest-log LOG]

It refuses to run without CUDA (one line, exit 2) unless ``--dry-run`` (tiny shapes on the
CPU, for checking the script; its file says no GPU was used). Random weights throughout (no
download), sampling at temperature 1 with no EOS, so every row runs its whole budget:

- ``rollout``: creditrl's HFRolloutEngine (``decode_cache=auto``: the CUDA-graph decode of
  ``rollout.cuda_graph``) against transformers' ``generate`` on the same work, ``--rows`` x
  ``--new-tokens`` after ``--prompt-len`` prompt columns, bf16 weights, for the SmolLM2-135M
  shape and the Llama-3.2-1B shape, each on left-padded prompts (real lengths drawn between
  half and all of the columns, as RL prompts are padded: HF ``generate`` then gets a mask and
  cannot use flash attention's native GQA) and on unpadded ones; ``rollout_vs_hf`` is the
  135M shape's padded ratio; on the 135M shape also the distance of the graph's tokens
  and log-probs to the eager path's (same weights, same seed) and of its log-probs to a
  teacher-forced forward in float32 and in bf16;
- ``update``: creditrl's actor update (ActorWorker: packed micro-batches by token budget,
  chunked log-probs, bf16 autocast, fused AdamW) over ``--prompts`` x ``--n`` sequences of
  128 prompt + ``--response`` tokens on the Qwen2.5-0.5B shape: tokens/s and ``perf/mfu``;
- ``grpo``: one whole GRPO step through ``creditrl.train`` (``--prompts`` x ``--n`` x
  ``--response``) on the Qwen2.5-0.5B shape with the SmolLM2 tokenizer's vocabulary: the
  step's generation, log-prob and update seconds (the weight hand-off is inside the update:
  none, the engine samples with the actor's module) and peak memory; the second step is
  reported (the first captures the graphs);
- ``trl``: TRL's GRPOTrainer (its default HF generation) on the same model, prompts, reward
  and sizes, in a child process (needs trl; see the README's "On a GPU").

Each part is written to the file as it ends (a part that fails or runs out of ``--budget-s``
says so in one line; a failure makes the exit status 1); the file ends with the four goal
figures, one per line: ``rollout_vs_hf: X``, ``grpo_step_s: X``, ``vs_trl: X``, ``mfu: X``
(``n/a`` when unmeasured).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gpu_smoke import PAD, machine, pytest_lines, smollm2_135m_config
from smoke_task import space_score

from creditrl.batch import Batch
from creditrl.config.schema import ActorConfig, OptimConfig, RolloutConfig
from creditrl.rollout import HFRolloutEngine
from creditrl.rollout.cuda_graph import StaticDecoder
from creditrl.tracking.mfu import device_peak_flops, mfu_metrics
from creditrl.workers.actor import ActorWorker
from creditrl.workers.placement import Placement

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("rollout", "update", "grpo", "trl")
PROMPT_TOKENS = 128  # prompt tokens per sequence of the update part


def llama_1b_config() -> LlamaConfig:
    """Llama-3.2-1B's shape (16 layers, 8 KV heads, a 128k vocabulary; plain RoPE)."""
    return LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=PAD, pad_token_id=PAD,
    )  # fmt: skip


def qwen_05b_config(vocab: int = 151936) -> Qwen2Config:
    """Qwen2.5-0.5B's shape (24 layers, 2 KV heads, q/k/v biases, tied embeddings)."""
    return Qwen2Config(
        vocab_size=vocab, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=PAD, pad_token_id=PAD,
    )  # fmt: skip


def tiny(config, **sizes):
    """``config`` shrunk for a dry run on the CPU."""
    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    small |= {"num_attention_heads": 4, "num_key_value_heads": 2, **sizes}
    fields = {k: v for k, v in config.to_dict().items() if k != "layer_types"}
    return type(config)(**{**fields, **small})


class Clock:
    """The time left of ``budget_s`` seconds."""

    def __init__(self, budget_s: float) -> None:
        self.end = time.monotonic() + budget_s

    def left(self) -> float:
        return self.end - time.monotonic()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run, device: torch.device) -> float:
    """Seconds of ``run()`` (device work included)."""
    sync(device)
    start = time.perf_counter()
    run()
    sync(device)
    return time.perf_counter() - start


def peak_gb(device: torch.device) -> str:
    if device.type != "cuda":
        return "-"
    return f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f}"


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def random_model(cls, config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``cls(config)`` with random weights, built on ``device`` in ``dtype``, eval mode."""
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config)
    return model.to(dtype).eval()


def engine_for(model, rows: int, new_tokens: int, cache: str) -> HFRolloutEngine:
    cfg = RolloutConfig(
        max_response_length=new_tokens, micro_batch_size=rows, temperature=1.0,
        engine_kwargs={"decode_cache": cache},
    )  # fmt: skip
    stub = SimpleNamespace(pad_token_id=PAD, eos_token_id=PAD)  # the engine reads these
    return HFRolloutEngine(model, stub, cfg, eos_token_ids=[])


def prompt_batch(rows: int, length: int, vocab: int, padded: bool = False) -> Batch:
    """``rows`` random prompts of ``length`` columns; ``padded``: left-padded with PAD, each
    row's real length drawn uniformly in [length // 2, length]."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    if padded:
        real = torch.randint(max(length // 2, 1), length + 1, (rows,), generator=generator)
        mask = (torch.arange(length)[None] >= length - real[:, None]).long()
        ids = ids.masked_fill(mask == 0, PAD)
    return Batch.from_dict({"input_ids": ids, "attention_mask": mask})


def rollout_part(args, device: torch.device, results: dict) -> list[str]:
    """Rows of the rollout table, and the exactness lines of the 135M shape."""
    shapes = [("SmolLM2-135M", smollm2_135m_config()), ("Llama-3.2-1B", llama_1b_config())]
    cache = "static" if device.type == "cpu" else "auto"  # a dry run: the eager static path
    if args.dry_run:
        shapes = [(name, tiny(config, vocab_size=512)) for name, config in shapes]
    lines = [
        f"{args.rows} rows x {args.new_tokens} new tokens after {args.prompt_len} prompt tokens, "
        "bf16 weights, temperature 1, no EOS; one timed run after a warm-up (creditrl: the "
        "whole call, graph capture in the warm-up; HF: an 8-token call).",
        "",
        "| shape | prompts | HF generate s | tok/s | creditrl s | tok/s | graph | x HF | peak GB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    tokens = args.rows * args.new_tokens
    for name, config in shapes:
        model = random_model(LlamaForCausalLM, config, device, torch.bfloat16)
        engine = engine_for(model, args.rows, args.new_tokens, cache)
        for padded in (True, False):
            prompts = prompt_batch(args.rows, args.prompt_len, config.vocab_size, padded)
            hf_s, ours_s, graph, peak = rollout_times(args, device, model, engine, prompts)
            ratio = hf_s / ours_s
            results.setdefault("rollout_vs_hf", f"{ratio:.2f}")  # the 135M shape's, padded
            lines.append(
                f"| {name} | {'left-padded' if padded else 'unpadded'} | {hf_s:.2f} | "
                f"{tokens / hf_s:,.0f} | {ours_s:.2f} | {tokens / ours_s:,.0f} | {graph} | "
                f"{ratio:.2f} | {peak} |"
            )
        if name == "SmolLM2-135M":
            size = (8, 32) if args.dry_run else (32, 128)
            exact = exactness(model, device, config.vocab_size, cache, *size)
        del model, engine
        reset_peak(device)
    return [*lines, "", *exact]


def rollout_times(args, device: torch.device, model, engine, prompts: Batch) -> tuple:
    """(HF generate seconds, creditrl seconds, graph used, peak GB) on ``prompts``, each
    after a warm-up call (creditrl's captures its graphs there)."""
    ids = prompts["input_ids"].to(device)
    hf_kwargs = dict(
        attention_mask=prompts["attention_mask"].to(device), do_sample=True, temperature=1.0,
        top_k=0, top_p=1.0, pad_token_id=PAD, eos_token_id=None,
    )  # fmt: skip

    def hf(new: int) -> None:
        with torch.inference_mode():
            model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, **hf_kwargs)

    engine.generate(prompts, seed=0)
    reset_peak(device)
    ours_s = timed(lambda: engine.generate(prompts, seed=1), device)
    graph = "yes" if engine.last_stats.get("graph_decode") else "no"
    peak = peak_gb(device)
    hf(8)
    hf_s = timed(lambda: hf(args.new_tokens), device)
    return hf_s, ours_s, graph, peak


def exactness(
    model, device: torch.device, vocab: int, cache: str, rows: int = 32, tokens: int = 128
) -> list[str]:
    """The graph path against the eager paths (same weights and seed): the static cache run
    eagerly, and the dynamic cache (rows leave as they finish); and its log-probs against
    teacher-forced forwards in float32 and bf16; ``rows`` x ``tokens`` (a dry run: fewer)."""
    prompts = prompt_batch(rows, 32, vocab)
    graphed = engine_for(model, rows, tokens, cache)
    out = graphed.generate(prompts, seed=5)
    eager_static = engine_for(model, rows, tokens, cache)
    eager_static._static = [StaticDecoder(model, rows, graphed._cache_keyword, PAD, graph=False)]
    lines = [f"Exactness (SmolLM2-135M shape, {rows} rows x {tokens} tokens, same seed):", ""]
    for name, engine in (("static cache, eager", eager_static), ("dynamic cache", None)):
        engine = engine or engine_for(model, rows, tokens, "dynamic")
        eager = engine.generate(prompts, seed=5)
        same = (out["responses"] == eager["responses"]).long().cumprod(1).bool()
        diff = (out["rollout_log_probs"] - eager["rollout_log_probs"]).abs()[same]
        lines.append(
            f"- the graph's tokens against the eager path's ({name}): equal up to the first "
            f"difference on {same.float().mean():.1%} of positions "
            f"({int(same.all(1).sum())}/{rows}"
            f" rows entirely); log-probs there within {diff.max():.2e} (mean {diff.mean():.2e})"
        )
    inputs = {k: out[k].to(device) for k in ("input_ids", "attention_mask", "position_ids")}
    labels = out["responses"].to(device)[..., None]
    for dtype in (torch.float32, torch.bfloat16):
        reference = model.to(dtype)
        with torch.inference_mode():
            logits = reference(**inputs).logits[:, -tokens - 1 : -1].float()
        teacher = logits.log_softmax(-1).gather(-1, labels).squeeze(-1).cpu()
        gap = (out["rollout_log_probs"] - teacher).abs()
        lines.append(
            f"- rollout log-probs (bf16 decode) against a teacher-forced forward in {dtype}: max "
            f"|diff| {gap.max():.2e}, mean {gap.mean():.2e}"
        )
    model.to(torch.bfloat16)
    return lines


def update_batch(rows: int, response: int, vocab: int) -> Batch:
    g = torch.Generator().manual_seed(1)
    width = PROMPT_TOKENS + response
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    return Batch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(width).expand(rows, width).clone(),
            "responses": ids[:, PROMPT_TOKENS:].clone(),
            "response_mask": torch.ones(rows, response, dtype=torch.long),
            "advantages": torch.randn(rows, response, generator=g),
        }
    )


def update_part(args, device: torch.device, results: dict) -> list[str]:
    """One actor update over prompts x n sequences: tokens/s and MFU (float32 master weights,
    bf16 autocast, packed micro-batches of at most 16,384 tokens, fused AdamW)."""
    config = tiny(qwen_05b_config(512)) if args.dry_run else qwen_05b_config()
    model = random_model(Qwen2ForCausalLM, config, device, torch.float32).train()
    cfg = ActorConfig(
        optim=OptimConfig(lr=1e-6), ppo_mini_batch_size=args.prompts, use_dynamic_bsz=True,
        use_remove_padding=True, max_token_len_per_device=16384, autocast="bf16",
    )  # fmt: skip
    placement = Placement(device=device, backend="nccl", autocast="bf16")
    actor = ActorWorker(model, cfg, placement=placement)
    batch = update_batch(args.prompts * args.n, args.response, config.vocab_size).to(device)
    old = actor.compute_log_prob(batch, 1.0, False)[0]
    batch["old_log_probs"] = old
    actor.update_policy(batch, 1.0, args.n)  # warm-up
    reset_peak(device)
    log_prob_s = timed(lambda: actor.compute_log_prob(batch, 1.0, False), device)
    update_s = timed(lambda: actor.update_policy(batch, 1.0, args.n), device)
    tokens = int(batch["attention_mask"].sum())
    params = sum(p.numel() for p in model.parameters())
    peak = device_peak_flops(device)
    figures = mfu_metrics(params, tokens, update_s, peak)
    mfu = figures.get("perf/mfu")
    results["mfu"] = "n/a" if mfu is None else f"{mfu:.3f}"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak_text = "unknown" if peak is None else f"{peak / 1e12:.1f} TFLOP/s"
    return [
        f"Qwen2.5-0.5B shape ({params / 1e6:.0f}M parameters), {args.prompts * args.n} sequences"
        f" x ({PROMPT_TOKENS} + {args.response}) tokens = {tokens:,} tokens; one optimizer step"
        " (one mini-batch) after a warm-up update.",
        "",
        "| pass | s | tokens/s | MFU (6 N T / s / peak) | peak GB |",
        "|---|---|---|---|---|",
        f"| log-probs (no grad) | {log_prob_s:.2f} | {tokens / log_prob_s:,.0f} | - | - |",
        f"| update (fwd + bwd + AdamW) | {update_s:.2f} | {tokens / update_s:,.0f} | "
        f"{'n/a' if mfu is None else f'{mfu:.1%}'} | {peak_gb(device)} |",
        "",
        f"Peak: {peak_text} ({name}, dense bf16, creditrl.tracking.mfu).",
    ]


def model_dir(root: Path, dry_run: bool, device: torch.device) -> Path:
    """A Qwen2.5-0.5B-shaped model with the SmolLM2 tokenizer's vocabulary, random weights."""
    from creditrl.models import load_tokenizer
    from creditrl.models.tiny import tiny_model_dir

    config = qwen_05b_config(49152)
    if dry_run:
        config = tiny(config)
    model = random_model(Qwen2ForCausalLM, config, device, torch.float32)
    out = root / "qwen-0.5b-shape"
    model.save_pretrained(out)
    load_tokenizer(tiny_model_dir()).save_pretrained(out)
    del model
    return out


def prompts_rows(count: int) -> list[dict]:
    return [{"prompt": f"Write a few words, please ({i})."} for i in range(count)]


def grpo_part(args, device: torch.device, results: dict, model: Path) -> list[str]:
    """Two GRPO steps through creditrl.train; the second step's stages."""
    import creditrl

    out = model.parent / "creditrl-run"
    config = {
        "trainer.device": device.type,
        "data.train_batch_size": args.prompts,
        "rollout.n": args.n,
        "rollout.max_response_length": args.response,
        "rollout.temperature": 1.0,
        "rollout.micro_batch_size": args.prompts * args.n,
        "actor.ppo_mini_batch_size": args.prompts,
        "actor.use_dynamic_bsz": True,
        "actor.use_remove_padding": True,
        "actor.max_token_len_per_device": 16384,
        "trainer.total_steps": 2,
        "trainer.val_before_train": False,
        "trainer.test_freq": 0,
        "trainer.save_freq": 0,
        "trainer.logger": ["jsonl"],
    }
    creditrl.train(model, space_score, prompts_rows(4 * args.prompts), output_dir=out,
                   config=config)  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = max(rows, key=lambda row: row["step"])
    results["grpo_step_s"] = f"{step['timing_s/step']:.2f}"
    results["_grpo_step_s"] = step["timing_s/step"]
    stages = ("gen", "old_log_prob", "ref", "adv", "update_actor", "step")
    table = ["| stage | s |", "|---|---|"]
    table += [f"| {s} | {step[f'timing_s/{s}']:.2f} |" for s in stages if f"timing_s/{s}" in step]
    extra = [
        f"perf/mfu of the update: {step.get('perf/mfu', 'n/a')}; peak memory "
        f"{step.get('perf/max_memory_allocated_gb', 'n/a')} GB; response tokens "
        f"{step.get('response_length/mean', 0) * args.prompts * args.n:,.0f}.",
    ]
    return [
        f"creditrl.train, {args.prompts} prompts x {args.n} samples x {args.response} new tokens,"
        " float32 weights (model.dtype default), bf16 autocast update, packed micro-batches of"
        " 16,384 tokens; the weight hand-off is part of update_actor (nothing is copied: the "
        "engine samples with the actor's module). Step 2 of 2:",
        "",
        *table,
        "",
        *extra,
    ]


def trl_part(args, device: torch.device, results: dict, model: Path, seconds: float) -> list[str]:
    """TRL's GRPOTrainer in a child process (``--trl-child``), at most ``seconds``; not run
    where trl is not importable."""
    if importlib.util.find_spec("trl") is None:
        return ["Not run: trl is not importable here (its wheels: see the README, On a GPU)."]
    command = [sys.executable, __file__, "--trl-child", str(model), "--prompts", str(args.prompts)]
    command += ["--n", str(args.n), "--response", str(args.response)]
    if device.type == "cpu":
        command.append("--dry-run")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds, env=env)
    report = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not report:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise RuntimeError(f"TRL did not finish (exit {done.returncode}): {tail}")
    trl = json.loads(report[-1])
    ours = results.get("_grpo_step_s")
    if ours:
        results["vs_trl"] = f"{trl['step_s'] / ours:.2f}"
    return [
        f"TRL {trl['version']} GRPOTrainer, the same model, prompts, reward and sizes, bf16, "
        f"its default generation; step seconds: {', '.join(f'{s:.2f}' for s in trl['seconds'])}"
        f" (the last reported: {trl['step_s']:.2f} s).",
    ]


def trl_child(args) -> None:
    """Run TRL's GRPOTrainer for 2 steps and print one JSON line of its step seconds."""
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.start = 0.0

        def on_step_begin(self, *_, **__) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__) -> None:
            self.seconds.append(time.perf_counter() - self.start)

    def reward(completions, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [space_score(text) for text in texts]

    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in prompts_rows(256)]
    micro = 16
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=args.prompts * args.n // micro,
        num_generations=args.n,
        max_completion_length=args.response,
        temperature=1.0,
        max_steps=2,
        bf16=not args.dry_run,
        use_cpu=args.dry_run,
        gradient_checkpointing=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    clock = StepClock()
    trainer = GRPOTrainer(
        model=args.trl_child, reward_funcs=reward, args=config,
        train_dataset=Dataset.from_list(rows), callbacks=[clock],
    )  # fmt: skip
    trainer.train()
    report = {"version": trl.__version__, "seconds": clock.seconds, "step_s": clock.seconds[-1]}
    print(json.dumps(report))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--budget-s", type=float, default=200.0)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response", type=int, default=512)
    parser.add_argument("--pytest-log", type=Path, help="a pytest log to summarise first")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--trl-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        trl_child(args)
        return 0
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        print(f"error: --parts {unknown} are not among {list(PARTS)}")
        return 2
    if not torch.cuda.is_available() and not args.dry_run:
        print(
            "error: no CUDA device visible (torch.cuda.is_available() is False); "
            "gpu_step_time.py measures a GPU (--dry-run checks the script on the CPU)"
        )
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    default = (
        "runs/gpu_step_time_dry_run.md" if args.dry_run else "benchmarks/results/gpu_step_time.md"
    )
    out = args.out or ROOT / default
    out.parent.mkdir(parents=True, exist_ok=True)
    clock, results, failed = Clock(args.budget_s), {}, []
    command = "python3 benchmarks/gpu_step_time.py " + " ".join(sys.argv[1:])
    lines = ["# One GPU: rollout, update and a GRPO step (benchmarks/gpu_step_time.py)", ""]
    if args.dry_run:
        lines += ["**DRY RUN on the CPU, tiny shapes: no GPU was used, no figure is a GPU's.**", ""]
    lines += [*machine(device), f"- command: `{command.strip()}`"]
    if args.pytest_log is not None:
        lines += ["", "## pytest -m gpu", "", *pytest_lines(args.pytest_log)]
    titles = {
        "rollout": "Rollout: creditrl's engine against HF generate",
        "update": "Update: tokens/s and MFU",
        "grpo": "A whole GRPO step (creditrl)",
        "trl": "TRL's GRPOTrainer on the same GPU",
    }
    with tempfile.TemporaryDirectory() as tmp:
        model: Path | None = None
        for part in parts:
            lines += ["", f"## {titles[part]}", ""]
            if clock.left() < 20:
                lines.append(f"Not run: the budget of {args.budget_s:.0f} s was spent.")
                continue
            try:
                if part in ("grpo", "trl") and model is None:
                    model = model_dir(Path(tmp), args.dry_run, device)
                if part == "rollout":
                    lines += rollout_part(args, device, results)
                elif part == "update":
                    lines += update_part(args, device, results)
                elif part == "grpo":
                    lines += grpo_part(args, device, results, model)
                else:
                    lines += trl_part(args, device, results, model, clock.left() - 5)
            except Exception as err:  # one part's failure leaves the others' figures
                text = (str(err).strip().splitlines() or [""])[0][:300]
                lines.append(f"FAILED: {type(err).__name__}: {text}")
                failed.append(part)
            write(out, lines, results)
    write(out, lines, results)
    print(out.read_text())
    return 1 if failed else 0


def write(path: Path, lines: list[str], results: dict) -> None:
    """The report so far, ending with the four goal figures."""
    goals = [
        f"{key}: {results.get(key, 'n/a')}"
        for key in ("rollout_vs_hf", "grpo_step_s", "vs_trl", "mfu")
    ]
    path.write_text("\n".join([*lines, "", "## Goal figures", "", *goals]) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())

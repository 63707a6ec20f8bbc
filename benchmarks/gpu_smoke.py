"""The figures of scripts/gpu_check.sh: the learning smoke run and rollout speed, as Markdown.

Run: python3 benchmarks/gpu_smoke.py --out FILE [--device cuda] [--learn-devices cuda,cpu]
     [--rows 64 --prompt-len 64 --new-tokens 128 --repeats 3] [--pytest-log LOG] [--dry-run]

Needs no real weights and no download. It writes FILE naming the machine (nvidia-smi's GPU
name, torch.cuda.get_device_name, the torch, CUDA and transformers versions) and:

- the learning smoke run (tests/smoke_task.py: the tiny random model, 12 GRPO steps, a reward
  for starting tokens with a space) on each of ``--learn-devices`` (CUDA under the default bf16
  autocast, the CPU in float32): the mean score of the first and last 3 steps and whether it
  rose by the test's margin;
- rollout speed on ``--device``: creditrl's HFRolloutEngine against transformers' generate,
  both sampling ``--rows`` x ``--new-tokens`` tokens (no EOS) at temperature 1 after
  ``--prompt-len`` random prompt tokens, with SmolLM2-135M's shape (a LlamaConfig, random
  weights) in bf16: median seconds over ``--repeats`` after one warm-up, tokens/s, peak device
  memory, and how far the engine's bf16 log-probs are from a float32 teacher-forced forward;
- with ``--pytest-log``, the summary line and the skip reasons of a pytest run.

``--dry-run`` heads the file with a line saying no GPU was used. Exit status 1 when a learning
run did not rise by the margin.
"""

from __future__ import annotations

import argparse
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from creditrl.batch import Batch
from creditrl.config.schema import RolloutConfig
from creditrl.rollout import HFRolloutEngine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from smoke_task import MARGIN, STEPS, WINDOW, learn, rise

PAD = 2  # SmolLM2's pad and EOS id
SUMMARY = re.compile(r"\d+ (passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s")


def smollm2_135m_config() -> LlamaConfig:
    """SmolLM2-135M's architecture (read from the embedded model's GGUF header)."""
    return LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=PAD, pad_token_id=PAD,
    )  # fmt: skip


def machine(device: torch.device) -> list[str]:
    """Lines naming the device and the versions."""
    lines = [f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; host: {platform.node()}"]
    smi = shutil.which("nvidia-smi")
    if smi:
        query = [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        result = subprocess.run(query, capture_output=True, text=True, timeout=30, check=False)
        lines.append(f"- nvidia-smi: {result.stdout.strip() or result.stderr.strip()}")
    else:
        lines.append("- nvidia-smi: not found")
    if device.type == "cuda":
        lines.append(f"- torch.cuda.get_device_name(): {torch.cuda.get_device_name(device)}")
    lines.append(
        f"- torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
        f"{transformers.__version__}, Python {platform.python_version()}, "
        f"{torch.get_num_threads()} CPU threads"
    )
    return lines


def learning_rows(devices: list[str]) -> tuple[list[str], bool]:
    """The learning smoke run on each device: table rows, and whether every run rose."""
    rows = [
        f"| device | autocast | mean score, steps 1-{WINDOW} | steps {STEPS - WINDOW + 1}-{STEPS} "
        f"| rise (needed > {MARGIN}) | wall s |",
        "|---|---|---|---|---|---|",
    ]
    ok, curves = True, []
    for device in devices:
        autocast = "auto" if device == "cuda" else "none"
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            scores = learn(Path(tmp) / "run", device, autocast)
            seconds = time.perf_counter() - start
        gain = rise(scores)
        ok &= gain > MARGIN
        first = sum(scores[:WINDOW]) / WINDOW
        last = sum(scores[-WINDOW:]) / WINDOW
        rows.append(
            f"| {device} | {autocast} | {first:.3f} | {last:.3f} | {gain:.3f} "
            f"{'(rose)' if gain > MARGIN else '(FAILED)'} | {seconds:.1f} |"
        )
        curves.append(f"- {device}, mean score by step: {', '.join(f'{x:.2f}' for x in scores)}")
    return [*rows, "", *curves], ok


@dataclass
class Timing:
    seconds: list[float]
    tokens: int
    peak_gb: float | None  # None: not measured (the CPU)

    def row(self, name: str, shape: str) -> str:
        median = statistics.median(self.seconds)
        peak = "-" if self.peak_gb is None else f"{self.peak_gb:.2f}"
        return (
            f"| {name} | {shape} | {median:.2f} | {min(self.seconds):.2f} | "
            f"{self.tokens / median:,.0f} | {peak} |"
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(run, device: torch.device, repeats: int) -> tuple[list[float], float | None]:
    """Seconds of each of ``repeats`` calls ``run(seed)`` after one warm-up, and the peak GB
    of device memory allocated during them (None on the CPU)."""
    run(123)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for seed in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run(seed)
        _sync(device)
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return seconds, peak


def rollout_rows(
    device: torch.device, rows: int, prompt_len: int, new_tokens: int, repeats: int
) -> list[str]:
    """HFRolloutEngine against model.generate on the 135M shape in bf16: table and distance."""
    torch.manual_seed(0)
    reference = LlamaForCausalLM(smollm2_135m_config()).eval().to(device)  # float32
    model = LlamaForCausalLM(smollm2_135m_config()).eval()
    model.load_state_dict(reference.state_dict())
    model.to(device=device, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 49152, (rows, prompt_len), generator=g)
    prompts = Batch.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    cfg = RolloutConfig(max_response_length=new_tokens, micro_batch_size=rows, temperature=1.0)
    tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=PAD)  # the engine reads these
    engine = HFRolloutEngine(model, tokenizer, cfg, eos_token_ids=[])
    outputs: list[Batch] = []

    def ours(seed: int) -> None:
        outputs.append(engine.generate(prompts, seed=seed))

    on_device = ids.to(device)
    kwargs = dict(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, pad_token_id=PAD,
    )  # fmt: skip

    def hf(seed: int) -> None:
        torch.manual_seed(seed)
        with torch.inference_mode():
            model.generate(input_ids=on_device, attention_mask=torch.ones_like(on_device), **kwargs)

    shape = f"{rows} x {new_tokens} (prompt {prompt_len})"
    table = [
        "| sampler | rows x new tokens | median s | min s | tokens/s | peak GB |",
        "|---|---|---|---|---|---|",
    ]
    for name, run in (("creditrl HFRolloutEngine", ours), ("transformers generate", hf)):
        seconds, peak = _timed(run, device, repeats)
        table.append(Timing(seconds, rows * new_tokens, peak).row(name, shape))
    out = outputs[-1]
    assert int(out["response_mask"].sum()) == rows * new_tokens, "the engine stopped early"
    with torch.inference_mode():
        logits = reference(
            input_ids=out["input_ids"].to(device),
            attention_mask=out["attention_mask"].to(device),
            position_ids=out["position_ids"].to(device),
        ).logits[:, -new_tokens - 1 : -1]
        teacher = logits.float().log_softmax(-1)
        teacher = teacher.gather(-1, out["responses"].to(device)[..., None]).squeeze(-1).cpu()
    diff = (out["rollout_log_probs"] - teacher).abs()
    table.append("")
    table.append(
        f"The engine's bf16 rollout log-probs against a float32 teacher-forced forward of the "
        f"same weights (last repeat, {rows * new_tokens} tokens): max |diff| {diff.max():.3e}, "
        f"mean {diff.mean():.3e}."
    )
    return table


def pytest_lines(log: Path) -> list[str]:
    """The summary line and the SKIPPED/FAILED/ERROR lines of a pytest log."""
    text = log.read_text(encoding="utf-8", errors="replace").splitlines()
    keep = [ln for ln in text if ln.startswith(("SKIPPED", "FAILED", "ERROR", "XFAIL"))]
    summary = [ln.strip("= ") for ln in text if SUMMARY.search(ln)]
    return [f"- {ln}" for ln in summary[-1:] + keep] or ["- (no pytest summary found)"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--learn-devices", default="cuda,cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pytest-log", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    lines = ["# GPU check (scripts/gpu_check.sh)", ""]
    if args.dry_run:
        lines += ["**DRY RUN on the CPU: no GPU was used; no figure here is a GPU figure.**", ""]
    lines += machine(device)
    if args.pytest_log is not None:
        lines += ["", "## pytest -m gpu", "", *pytest_lines(args.pytest_log)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write(args.out, lines)  # each part is written as it ends: a part cut short keeps the rest
    learned, ok = learning_rows([d for d in args.learn_devices.split(",") if d])
    lines += ["", f"## Learning smoke run (tests/smoke_task.py, {STEPS} GRPO steps)", "", *learned]
    write(args.out, lines)
    lines += ["", "## Rollout: SmolLM2-135M shape, random weights, bf16, temperature 1", ""]
    lines += rollout_rows(device, args.rows, args.prompt_len, args.new_tokens, args.repeats)
    write(args.out, lines)
    print("\n".join(lines))
    return 0 if ok else 1


def write(path: Path, lines: list[str]) -> None:
    """Write ``lines`` to ``path`` as one Markdown file."""
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())

"""One RL step through the Tinker SDK against ``creditrl serve-tinker``, and through ``creditrl
train``, alternated step by step: seconds per step and their ratio.

Run: .venv/bin/python benchmarks/tinker_step.py [--rounds 4] [--threads 2] [--prompts 8]
     [--n 4] [--max-tokens 32] [--tiny]

Both arms: the embedded SmolLM2-135M-Instruct in float32 with LoRA rank 32, alpha 32, on every
attention and MLP linear (creditrl's ``all-linear``; the SDK client is created with
``train_unembed=False`` so the output head has no adapter on either side), ``--prompts`` prompts
x ``--n`` samples of at most ``--max-tokens`` tokens at temperature 1, stopping at the
tokenizer's EOS ids, then one PPO update over them (ratio clipped to [0.8, 1.2], no dual clip,
losses summed over tokens: Tinker's ``ppo``; creditrl's ``actor.loss_agg_mode=token-sum``,
``actor.clip_ratio_c`` opened), one AdamW step at the same learning rate.

- ``creditrl``: ``RLTrainer.train_step()`` in this process (its rollout, reward, advantages,
  update; the sampler's float32 log-probs are reused as old log-probs, as a LoRA run does);
  the prompts are its dataloader's (the default chain_sum task).
- ``tinker``: the SDK in this process against ``creditrl serve-tinker --threads T`` in a
  subprocess: ``save_weights_and_get_sampling_client``, one ``sample`` per prompt (concurrent,
  as the cookbook sends them), rewards and group-centred advantages here, then
  ``forward_backward(..., "ppo")`` and ``optim_step``. Its prompts are the ones the creditrl
  step just used. The reward is a stand-in (shorter is better: it costs nothing and gives
  non-zero advantages); it changes no amount of work.

The two never run at once; round 0 (one step of each) is a warm-up and is not counted. Each
line gives the step's seconds, its stages (sampling, update) and the generated tokens; the
summary gives the medians and the median of the per-round ratios tinker/creditrl. Sampled
lengths differ between the arms (different random draws): compare seconds per generated token
too. Set the same ``--threads`` as the machine's cores on a quiet machine.

``--tiny``: the tiny random model, 2 prompts x 2 samples of 4 tokens (a smoke run; the figures
mean nothing).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from dataclasses import dataclass
from types import SimpleNamespace

RANK = 32
ALPHA = 32  # Tinker's fixed LoRA scale


@dataclass
class Arm:
    step: float
    sample: float
    update: float
    tokens: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_service(threads: int, out: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "creditrl.cli", "serve-tinker", "--port", str(port)]
    cmd += ["--threads", str(threads), "--out", out]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve-tinker exited:\n{proc.stderr.read()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("serve-tinker did not start within 300 s")


def generation(directory: str):
    """The model's generation config (its EOS ids), None without one."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(directory)
    except OSError:
        return None


def build_trainer(args: argparse.Namespace, out: str):
    from creditrl.config.loader import load_config
    from creditrl.trainers.rl_trainer import RLTrainer

    overrides = [
        f"data.train_batch_size={args.prompts}",
        f"actor.ppo_mini_batch_size={args.prompts}",
        f"rollout.n={args.n}",
        f"rollout.max_response_length={args.max_tokens}",
        "rollout.temperature=1.0",
        f"model.lora_rank={RANK}",
        f"model.lora_alpha={ALPHA}",
        "actor.loss_agg_mode=token-sum",
        "actor.clip_ratio=0.2",
        "actor.clip_ratio_c=1e30",
        f"trainer.total_steps={args.rounds + 1}",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        f"trainer.output_dir={out}",
    ]
    if args.tiny:
        from creditrl.models.tiny import tiny_model_dir

        overrides.append(f"model.path={tiny_model_dir()}")
    return RLTrainer(load_config(overrides=overrides))


def creditrl_step(trainer, step: int) -> tuple[Arm, list[list[int]]]:
    trainer.step = step
    metrics = trainer.train_step()
    batch = trainer.last_batch
    width = batch["prompts"].shape[1]
    prompts: list[list[int]] = []
    for row, mask in zip(batch["prompts"], batch["attention_mask"][:, :width], strict=True):
        ids = row[mask.bool()].tolist()
        if ids not in prompts:
            prompts.append(ids)
    arm = Arm(
        step=metrics["timing_s/step"],
        sample=metrics["timing_s/gen"],
        update=metrics.get("timing_s/update_actor", float("nan")),
        tokens=int(batch["response_mask"].sum()),
    )
    return arm, prompts


def tinker_step(training, tinker, prompts: list[list[int]], args, eos: list[int], lr: float) -> Arm:
    types = tinker.types
    start = time.perf_counter()
    sampler = training.save_weights_and_get_sampling_client()
    sampler = sampler.result() if hasattr(sampler, "result") else sampler
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=eos)
    futures: list[Future] = [
        sampler.sample(types.ModelInput.from_ints(p), num_samples=args.n, sampling_params=params)
        for p in prompts
    ]
    results = [f.result() for f in futures]
    sampled = time.perf_counter()
    datums, tokens = [], 0
    for prompt, result in zip(prompts, results, strict=True):
        rewards = [-len(s.tokens) / args.max_tokens for s in result.sequences]
        mean = sum(rewards) / len(rewards)
        for seq, reward in zip(result.sequences, rewards, strict=True):
            if not seq.tokens:
                continue
            tokens += len(seq.tokens)
            full = prompt + list(seq.tokens)
            lead = [0.0] * (len(prompt) - 1)
            datums.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={
                        "target_tokens": full[1:],
                        "logprobs": lead + list(seq.logprobs),
                        "advantages": lead + [reward - mean] * len(seq.tokens),
                    },
                )
            )
    backward = training.forward_backward(datums, "ppo")
    step = training.optim_step(types.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.999))
    backward.result()
    step.result()
    end = time.perf_counter()
    return Arm(step=end - start, sample=sampled - start, update=end - sampled, tokens=tokens)


def line(name: str, arm: Arm) -> str:
    return (
        f"{name:<9} {arm.step:7.2f} s  (sample {arm.sample:6.2f}, update {arm.update:6.2f}) "
        f"{arm.tokens:5d} tokens  {1000 * arm.step / max(arm.tokens, 1):6.1f} ms/token"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.prompts, args.n, args.max_tokens = 2, 2, 4
    import torch

    torch.set_num_threads(args.threads)
    import tinker

    from creditrl.models.embedded import embedded_model_dir
    from creditrl.models.tiny import tiny_model_dir
    from creditrl.rollout.sampling import eos_token_ids_of

    began = time.perf_counter()
    out = tempfile.mkdtemp(prefix="creditrl-tinker-step-")
    service, url = start_service(args.threads, os.path.join(out, "service"))
    try:
        os.environ["TINKER_API_KEY"] = "tml-local"
        client = tinker.ServiceClient(base_url=url)
        base = str(tiny_model_dir()) if args.tiny else str(embedded_model_dir())
        training = client.create_lora_training_client(
            base_model=base, rank=RANK, train_unembed=False
        ).result()
        tokenizer = training.get_tokenizer()
        trainer = build_trainer(args, os.path.join(out, "train"))
        eos = eos_token_ids_of(SimpleNamespace(generation_config=generation(base)), tokenizer)
        lr = float(trainer.cfg.actor.optim.lr)
        print(
            f"{args.prompts} prompts x {args.n} samples, <= {args.max_tokens} tokens, LoRA rank "
            f"{RANK}, {args.threads} threads; stop ids {eos}; lr {lr:g}",
            flush=True,
        )
        ours: list[Arm] = []
        theirs: list[Arm] = []
        for r in range(args.rounds + 1):
            arm, prompts = creditrl_step(trainer, r + 1)
            print(f"round {r}: " + line("creditrl", arm), flush=True)
            sdk = tinker_step(training, tinker, prompts, args, eos, lr)
            print(f"round {r}: " + line("tinker", sdk), flush=True)
            if r > 0:
                ours.append(arm)
                theirs.append(sdk)
        trainer.reward.close()
    finally:
        service.terminate()
        service.wait(timeout=30)
    if not ours:
        return
    med = statistics.median
    ratios = [t.step / o.step for t, o in zip(theirs, ours, strict=True)]
    per_token = [
        (t.step / max(t.tokens, 1)) / (o.step / max(o.tokens, 1))
        for t, o in zip(theirs, ours, strict=True)
    ]
    for name, arms in (("creditrl", ours), ("tinker", theirs)):
        print(
            f"{name:<9} median {med(a.step for a in arms):6.2f} s/step (sample "
            f"{med(a.sample for a in arms):5.2f}, update {med(a.update for a in arms):5.2f}), "
            f"{med(a.tokens for a in arms):.0f} tokens"
        )
    print(
        f"tinker / creditrl: {med(ratios):.2f}x per step (rounds: "
        f"{', '.join(f'{x:.2f}' for x in ratios)}); {med(per_token):.2f}x per generated token"
    )
    print(f"(benchmark wall time {time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()

"""Plain helpers shared by several test files (fixtures live in ``conftest.py``). Import them
as ``from helpers import ...``: pytest puts this directory on ``sys.path``. No test file
imports from another test file."""

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from creditrl.asynchronous.messages import Message, decode, group_of
from creditrl.batch import Batch
from creditrl.cli import main
from creditrl.config import ActorConfig
from creditrl.config.loader import load_config
from creditrl.config.schema import RolloutConfig
from creditrl.models.tiny import tiny_model_dir
from creditrl.rollout import HFRolloutEngine
from creditrl.workers import ActorWorker, policy_forward

# ---- configs of tiny runs (the tiny random model, the real tokenizer) ---------------------


def tiny_trainer_config(out: Path, *extra: str):
    """The synchronous trainer: 2 prompts x 2 answers of at most 8 tokens, 2 steps, a
    checkpoint every step, validation every 2 steps, metrics to ``out/metrics.jsonl``."""
    return load_config(
        overrides=[
            "actor.autocast=none",  # float32 on any CPU; tests that want bf16 say so
            f"model.path={tiny_model_dir()}",
            "data.train_size=24",
            "data.val_size=4",
            "data.train_batch_size=2",
            "rollout.n=2",
            "rollout.max_response_length=8",
            "rollout.temperature=1.0",
            "actor.ppo_mini_batch_size=1",
            "critic.ppo_mini_batch_size=1",
            "actor.ppo_micro_batch_size=2",
            "actor.optim.lr=1e-3",
            "actor.use_rollout_log_probs=false",
            "reward.num_workers=1",
            "trainer.total_steps=2",
            "trainer.save_freq=1",
            "trainer.test_freq=2",
            "trainer.logger=[jsonl]",
            f"trainer.output_dir={out}",
            *extra,
        ]
    )


def tiny_learner_config(out: Path, *extra: str):
    """The async learner: groups of 2 answers, 2 prompts a step, float32, no shuffling."""
    return load_config(
        overrides=[
            "actor.autocast=none",  # float32 on any CPU; tests that want bf16 say so
            f"model.path={tiny_model_dir()}",
            "data.train_batch_size=2",
            "rollout.n=2",
            "rollout.temperature=1.0",
            "actor.ppo_mini_batch_size=2",
            "actor.ppo_micro_batch_size=4",
            "actor.optim.lr=1e-3",
            "actor.autocast=none",
            "actor.shuffle=false",
            "trainer.logger=[jsonl]",
            f"trainer.output_dir={out}",
            *extra,
        ]
    )


def tiny_engine_config(out: Path, *extra: str):
    """GRPO on the tiny model: 2 prompts x 2 answers of at most 8 tokens per step."""
    return load_config(
        overrides=[
            "actor.autocast=none",  # float32 on any CPU; tests that want bf16 say so
            f"model.path={tiny_model_dir()}",
            "data.train_size=8",
            "data.val_size=2",
            "data.train_batch_size=2",
            "rollout.n=2",
            "rollout.max_response_length=8",
            "rollout.temperature=1.0",
            "actor.ppo_mini_batch_size=1",
            "actor.ppo_micro_batch_size=2",
            "actor.optim.lr=1e-3",
            "actor.autocast=none",
            "reward.num_workers=1",
            "trainer.total_steps=1",
            "trainer.save_freq=0",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.logger=[jsonl]",
            f"trainer.output_dir={out}",
            *extra,
        ]
    )


# The metrics a Ray run and the in-process run of ``tiny_scale_out_config`` must share.
COMPARED_METRICS = (
    "critic/score/mean",
    "response_length/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "val/score",
)


def tiny_scale_out_config(out: Path, *extra: str):
    """``tiny_trainer_config`` in float32 with mini-batches of 2: the run the Ray backend's
    workers are compared in-process against."""
    return tiny_trainer_config(
        out,
        "actor.autocast=none",
        "actor.ppo_mini_batch_size=2",
        "trainer.test_freq=2",
        *extra,
    )


def read_metrics(out: Path) -> dict[int, dict]:
    """A run's ``metrics.jsonl``, by step."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}


def refused(capsys, *args: str) -> str:
    """Run ``creditrl config ARGS``; assert exit code 2 and one 'error:' line; return it."""
    code = main(["config", *args])
    out = capsys.readouterr().out
    assert code == 2, out
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    assert lines[0].startswith("error: ") and "Traceback" not in out
    return lines[0]


# ---- async groups -------------------------------------------------------------------------


def model_group(
    model, sampler_id: str, seq: int, version: int, score: tuple[float, float] = (1.0, 0.0)
) -> Batch:
    """A real group for ``model``: 2 answers of lengths 4 and 3 to one prompt; behaviour
    log-probs computed by ``model`` at temperature 1."""
    g = torch.Generator().manual_seed(seq + 100 * version)
    p, t = 3 + seq % 3, 4
    prompt = torch.randint(3, 40000, (1, p), generator=g).repeat(2, 1)
    responses = torch.randint(3, 40000, (2, t), generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    responses[mask == 0] = 2
    attention = torch.cat([torch.ones(2, p, dtype=torch.long), mask], dim=1)
    scores = torch.zeros(2, t)
    scores[0, 3], scores[1, 2] = score
    batch = Batch(
        {
            "prompts": prompt,
            "responses": responses,
            "response_mask": mask,
            "input_ids": torch.cat([prompt, responses], dim=1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "token_level_scores": scores,
        },
        {"uid": [f"{sampler_id}:{seq}"] * 2, "data_source": ["x"] * 2, "ground_truth": ["1"] * 2},
    )
    with torch.no_grad():
        batch["rollout_log_probs"] = policy_forward(model, batch, 1.0)[0] * mask
    return group_of(batch, sampler_id, seq, version)


def synthetic_group(sampler_id: str = "s0", seq: int = 0, version: int = 0, n: int = 2) -> Batch:
    """One synthetic group: n answers (lengths 4 and 3) to one left-padded prompt."""
    g = torch.Generator().manual_seed(seq)
    p, t = 5, 4
    prompts = torch.randint(3, 1000, (n, p), generator=g)
    prompts[:, 0] = 2
    prompt_mask = torch.ones(n, p, dtype=torch.long)
    prompt_mask[:, 0] = 0
    prompts[1:] = prompts[0]
    responses = torch.randint(3, 1000, (n, t), generator=g)
    response_mask = torch.ones(n, t, dtype=torch.long)
    response_mask[1:, -1] = 0
    responses[response_mask == 0] = 2
    attention = torch.cat([prompt_mask, response_mask], dim=1)
    scores = torch.zeros(n, t)
    scores[0, -1] = 1.0
    batch = Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "rollout_log_probs": -torch.rand(n, t, generator=g) * response_mask,
            "token_level_scores": scores,
        },
        {
            "uid": [f"{sampler_id}:{seq}"] * n,
            "data_source": ["reasoning_gym/chain_sum"] * n,
            "ground_truth": ["7"] * n,
            "reward_extra_info": [{"answer_score": float(k == 0)} for k in range(n)],
        },
        {"temperature": 1.0},
    )
    return group_of(batch, sampler_id, seq, version)


# ---- a 96-token random Llama and padded batches for the workers ---------------------------

VOCAB = 96


def small_llama_config() -> LlamaConfig:
    """2 layers, hidden size 32, a vocabulary of ``VOCAB`` ids."""
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip


def tiny_lm(seed: int = 0) -> LlamaForCausalLM:
    """The random ``small_llama_config`` model from ``seed``, float32."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(small_llama_config()).float()


def tiny_lm_with_attn(seed: int = 0, attn: str = "sdpa") -> LlamaForCausalLM:
    """``tiny_lm`` with its attention implementation set to ``attn``."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(small_llama_config()).float()
    model.set_attn_implementation(attn)
    return model


class TinyCritic(torch.nn.Module):
    """A value head on the tiny LM's hidden states: (B, L) values."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = tiny_lm(1)
        self.head = torch.nn.Linear(32, 1)

    def forward(self, input_ids, attention_mask, position_ids):
        out = self.lm.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        )
        return self.head(out.last_hidden_state).squeeze(-1)


def padded_batch(prompt_lens, response_lens, p=6, t=5, seed=0) -> Batch:
    """Left-padded prompts, right-padded responses (pad id 0), as the rollout writes them."""
    g = torch.Generator().manual_seed(seed)
    b = len(prompt_lens)
    prompts = torch.zeros(b, p, dtype=torch.long)
    responses = torch.zeros(b, t, dtype=torch.long)
    pmask = torch.zeros(b, p, dtype=torch.long)
    rmask = torch.zeros(b, t, dtype=torch.long)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        prompts[i, p - pl :] = torch.randint(3, VOCAB, (pl,), generator=g)
        pmask[i, p - pl :] = 1
        responses[i, :rl] = torch.randint(3, VOCAB, (rl,), generator=g)
        rmask[i, :rl] = 1
    attention = torch.cat([pmask, rmask], 1)
    return Batch.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": rmask,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
        }
    )


def padded_actor_batch(model) -> Batch:
    """A 4-row ``padded_batch`` ready for an actor update: ``model``'s old log-probs,
    advantages of +-1 and +-0.5, reference log-probs 0.1 below the old ones."""
    batch = padded_batch([6, 2, 4, 5], [5, 1, 3, 4], seed=3)
    worker = ActorWorker(model, ActorConfig(autocast="none"), trainable=False)  # float32
    batch["old_log_probs"], _ = worker.compute_log_prob(batch, 1.0, with_entropy=False)
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * batch["response_mask"]
    batch["ref_log_prob"] = batch["old_log_probs"] - 0.1
    return batch


def spy_grads(worker, model, grads: list) -> None:
    """Append the flat gradient of ``model`` to ``grads`` before each optimizer step."""

    def spy(*_):
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))

    worker.optimizer.register_step_pre_hook(spy)


def chat_prompts(tokenizer, questions: tuple[str, ...], n: int = 2) -> Batch:
    """One user turn per question, left-padded, each ``n`` times (a group of n), with the
    messages as the dataset gives them (``raw_prompt``) and toy ground truths."""
    chats = [[{"role": "user", "content": q}] for q in questions]
    rows = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=False)
        for c in chats
    ]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    truths = ["7", "red", *[""] * max(0, len(questions) - 2)][: len(questions)]
    batch = Batch({"input_ids": ids, "attention_mask": mask}, {"raw_prompt": chats,
                  "data_source": ["toy"] * len(questions), "ground_truth": truths})  # fmt: skip
    return batch.repeat(n, interleave=True)


def train_async_in_process(learner, cfg) -> None:
    """Run ``learner.fit()`` on a thread and one sampler (index 0, on the learner's port) in
    this thread until the learner stops it; asserts both ended cleanly."""
    import threading

    from creditrl.asynchronous.sampler import Sampler

    errors: list[BaseException] = []

    def fit() -> None:
        try:
            learner.fit()
        except BaseException as e:  # shown by the assertion below
            errors.append(e)

    thread = threading.Thread(target=fit)
    thread.start()
    code = Sampler(cfg, 0, port=learner.port).run()
    thread.join(timeout=120)
    assert not errors and code == 0, errors


# ---- rollout engines on token-id prompts ---------------------------------------------------

PAD = EOS = 2  # prompt_batch's pad id; byte_tokenizer's <|im_end|> (its EOS and pad)


def prompt_batch(rows: list[list[int]], repeat: int = 1) -> Batch:
    """Left-padded prompt batch (pad id 2), each row repeated ``repeat`` times in a row."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows]).repeat_interleave(repeat, 0)
    lengths = torch.tensor([len(r) for r in rows]).repeat_interleave(repeat)
    mask = (torch.arange(width)[None] >= width - lengths[:, None]).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    n = len(ids)
    return Batch(
        {"input_ids": ids, "attention_mask": mask, "position_ids": positions},
        {"index": list(range(n)), "ground_truth": [str(i) for i in range(n)]},
        {"step": 3},
    )


PROMPTS = [[1, 520, 9, 33, 4001, 77], [1, 12, 13], [1, 900, 901, 902, 903, 904, 905, 906, 907]]


def tiny_hf_engine(model, tokenizer, **overrides) -> HFRolloutEngine:
    """The HF engine on ``model`` with a 12-token budget; engine options and ``rollout.*``
    settings as keywords."""
    engine_options = (
        "seed",
        "eos_token_ids",
        "remove_finished",
        "fast_decode",
        "tree_prefill",
        "small_batch_rows",
        "merge_lora",
    )
    options = {k: overrides.pop(k) for k in engine_options if k in overrides}
    cfg = replace(RolloutConfig(max_response_length=12, micro_batch_size=64), **overrides)
    return HFRolloutEngine(model, tokenizer, cfg, **options)


# ---- a byte-level tokenizer and response batches for scoring -------------------------------

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny byte-level tokenizer (ids 0-2 special: unk, <|im_start|>, <|im_end|> = eos = pad)."""
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = CHATML
    return fast


def make_batch(
    tok: PreTrainedTokenizerFast,
    texts: list[str],
    ground_truth: list,
    data_source: str | list[str] = "user",
    extra_info: list[dict] | None = None,
    eos: list[bool] | None = None,
) -> Batch:
    """responses right-padded with PAD, response_mask 1 up to and including EOS."""
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    ids = [[*x, EOS] if (eos is None or eos[i]) else x for i, x in enumerate(ids)]
    width = max(len(x) for x in ids) + 2
    responses = torch.full((len(ids), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for i, x in enumerate(ids):
        responses[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    sources = [data_source] * len(texts) if isinstance(data_source, str) else data_source
    return Batch(
        {"responses": responses, "response_mask": mask},
        {
            "data_source": sources,
            "ground_truth": ground_truth,
            "extra_info": extra_info or [{} for _ in texts],
            "raw_prompt": [[{"role": "user", "content": f"question {i}"}] for i in range(len(ids))],
        },
    )


def restore_registries(monkeypatch: Any, *registries: Any) -> None:
    """Each registry (``creditrl.registry.Registry``) as it was before the test, afterwards."""
    for registry in registries:
        for attr in ("_paths", "_loaded", "_info", "_first"):
            monkeypatch.setattr(registry, attr, dict(getattr(registry, attr)))


class Recorder:
    """A stand-in for the learner's socket: keeps what is sent."""

    address = "stand-in"

    def __init__(self) -> None:
        self.sent: list[tuple[str, Message]] = []

    def send(self, sampler_id: str, frames: list[bytes]) -> bool:
        self.sent.append((sampler_id, decode(frames)))
        return True

"""Log-probs and entropies from hidden states, float32 logits a chunk of tokens at a time.

Tolerances: float32 (eps = 2**-23 ~ 1.2e-7). A chunk's logits come from a smaller matmul than
the whole batch's, so a logit may differ in its last bits: log-probs and entropies (|x| < 10
here) agree within 1e-6. A gradient entry w.r.t. the head weight (or a tied embedding) sums
one product per token, and chunking reorders that sum: the reordering error of N float32 terms
is at most N * eps * sum |terms|, so they agree within ``N * EPS * max |grad|``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import padded_batch, refused, small_llama_config
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from creditrl.config import ActorConfig
from creditrl.core.entropy import token_log_probs
from creditrl.workers import ActorWorker, policy_forward
from creditrl.workers.forward import HEAD_SPLIT_ARCHITECTURES
from creditrl.workers.packing import packed_policy_forward
from creditrl.workers.prefix_tree import prefix_tree_policy_forward

EPS = torch.finfo(torch.float32).eps
LP_ATOL = 1e-6


def _grad_close(got: torch.Tensor, want: torch.Tensor, terms: int) -> None:
    atol = terms * EPS * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


def _lm(tied: bool, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = small_llama_config()
    config.tie_word_embeddings = tied
    return LlamaForCausalLM(config).float()


def _reference(model, batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Today's unchunked numbers: the whole model's logits at [-T-1:-1], float32, / temperature."""
    t = batch["responses"].shape[1]
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).logits[:, -t - 1 : -1]
    z = logits.float() / temperature
    log_probs = torch.log_softmax(z, -1).gather(-1, batch["responses"][..., None]).squeeze(-1)
    entropy = torch.distributions.Categorical(logits=z).entropy()
    return log_probs, entropy


def _head_rows(model: torch.nn.Module) -> list[int]:
    """Row counts of every call of the output head (forward and backward recomputation)."""
    rows: list[int] = []
    model.lm_head.register_forward_hook(lambda _m, a, _out: rows.append(a[0][..., 0].numel()))
    return rows


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 5, 8, 40])  # 40 rows: 5 and 8 divide it, 1 too; 40 = one
def test_token_log_probs_chunks_equal_one_pass(temperature: float, chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(40, 16, generator=g)
    labels = torch.randint(0, 50, (40,), generator=g)
    head = torch.nn.Linear(16, 50, bias=False)

    def run(chunk_tokens: int) -> list[torch.Tensor]:
        x = rows.clone().requires_grad_(True)
        head.weight.grad = None
        lp, ent = token_log_probs(
            x, labels, head=head, temperature=temperature, chunk_tokens=chunk_tokens,
            with_entropy=True,
        )  # fmt: skip
        (lp.sum() + 0.5 * ent.sum()).backward()
        return [lp.detach(), ent.detach(), x.grad, head.weight.grad.clone()]

    want = run(0)
    got = run(chunk)
    z = head(rows).detach().double() / temperature
    exact = torch.log_softmax(z, -1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(want[0].double(), exact, rtol=0, atol=LP_ATOL)
    for i in (0, 1):
        torch.testing.assert_close(got[i], want[i], rtol=0, atol=LP_ATOL)
    _grad_close(got[2], want[2], 50)  # a row sums V = 50 products through the head
    _grad_close(got[3], want[3], 40)


def test_token_log_probs_without_entropy_gradient_and_empty() -> None:
    rows = torch.randn(7, 4, requires_grad=True)
    head = torch.nn.Linear(4, 9)
    lp, ent = token_log_probs(
        rows, torch.arange(7), head=head, chunk_tokens=3, with_entropy=True, entropy_grad=False
    )
    assert lp.requires_grad and not ent.requires_grad and lp.shape == ent.shape == (7,)
    lp, ent = token_log_probs(rows[:0], torch.arange(0), head=head, chunk_tokens=3)
    assert lp.shape == (0,) and ent is None
    with pytest.raises(ValueError, match="chunk_tokens must be >= 0"):
        token_log_probs(rows, torch.arange(7), head=head, chunk_tokens=-1)
    with pytest.raises(ValueError, match=r"labels \(N,\)"):
        token_log_probs(rows, torch.arange(6), head=head)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [0, 4, 7])  # 15 valid tokens: 7 does not divide, 0 = one pass
def test_policy_forward_equals_the_whole_model(tied: bool, chunk: int) -> None:
    """Padded rows (a 1-token response, prompt padding), temperature 0.7: log-probs, entropies
    and every parameter's gradient equal the whole model's unchunked logits path."""
    model = _lm(tied)
    batch = padded_batch([6, 2, 4, 5], [5, 1, 4, 5])
    mask = batch["response_mask"].bool()
    lp, ent = policy_forward(model, batch, 0.7, with_entropy=True, chunk_tokens=chunk)
    ((lp * mask).sum() + (ent * mask).sum()).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want_lp, want_ent = _reference(model, batch, 0.7)
    ((want_lp * mask).sum() + (want_ent * mask).sum()).backward()
    torch.testing.assert_close(lp[mask], want_lp[mask], rtol=0, atol=LP_ATOL)
    torch.testing.assert_close(ent[mask], want_ent[mask], rtol=0, atol=LP_ATOL)
    assert (lp[~mask] == 0).all() and (ent[~mask] == 0).all()
    tokens = batch["input_ids"].numel()
    for name, p in model.named_parameters():
        _grad_close(got[name], p.grad, tokens)
    assert model.lm_head.weight is model.model.embed_tokens.weight or not tied


def test_head_holds_at_most_a_chunk_of_tokens_forward_and_backward() -> None:
    """The fix: the head (so the float32 logits) sees at most chunk_tokens rows per call, and
    the backward recomputes each chunk; the unchunked path fed it every kept position."""
    model = _lm(tied=True)
    rows = _head_rows(model)
    batch = padded_batch([6, 2, 4, 5], [5, 1, 4, 5])
    lp, _ = policy_forward(model, batch, 1.0, chunk_tokens=4)
    assert rows == [4, 4, 4, 3]  # the 15 real response tokens, padding never computed
    lp.sum().backward()
    assert sorted(rows[4:]) == [3, 4, 4, 4]
    rows.clear()
    with torch.no_grad():
        policy_forward(model, batch, 1.0, chunk_tokens=0)
    assert rows == [15]


def test_packed_and_prefix_tree_forwards_chunk_with_the_same_numbers() -> None:
    model = _lm(tied=True)
    rows = _head_rows(model)
    batch = padded_batch([6, 6, 6], [5, 2, 4], seed=1)
    batch["input_ids"][1, :6] = batch["input_ids"][0, :6]  # a shared prompt for the tree
    batch["input_ids"][2, :6] = batch["input_ids"][0, :6]
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        want, want_h = policy_forward(model, batch, 0.7, True, chunk_tokens=0)
        rows.clear()
        packed = packed_policy_forward(model, batch, 0.7, True, chunk_tokens=2)
        assert max(rows) == 2
        rows.clear()
        tree = prefix_tree_policy_forward(
            model, batch, 0.7, True, fallback=None, chunk_tokens=2
        )  # the 3 rows share their prompt: the tree pays
        assert max(rows) == 2
    for lp, h in (packed, tree):
        torch.testing.assert_close(lp[mask], want[mask], rtol=0, atol=LP_ATOL)
        torch.testing.assert_close(h[mask], want_h[mask], rtol=0, atol=LP_ATOL)


ARCHITECTURES = {
    "LlamaForCausalLM": (LlamaConfig, LlamaForCausalLM),
    "MistralForCausalLM": (MistralConfig, MistralForCausalLM),
    "Qwen2ForCausalLM": (Qwen2Config, Qwen2ForCausalLM),
    "Qwen3ForCausalLM": (Qwen3Config, Qwen3ForCausalLM),
}


@pytest.mark.parametrize("name", sorted(HEAD_SPLIT_ARCHITECTURES))
def test_every_split_architecture_computes_its_logits_with_its_head(name: str) -> None:
    """What the split relies on, per listed class: its logits are lm_head(model(...))."""
    config_cls, model_cls = ARCHITECTURES[name]
    config = config_cls(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = model_cls(config).float()
    batch = padded_batch([6, 3], [5, 2])
    with torch.no_grad():
        want, want_h = _reference(model, batch, 0.7)
        got, got_h = policy_forward(model, batch, 0.7, True, chunk_tokens=2)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=LP_ATOL)
    torch.testing.assert_close(got_h[mask], want_h[mask], rtol=0, atol=LP_ATOL)


def test_lora_model_splits_and_other_models_run_whole() -> None:
    from creditrl.models.loading import apply_lora

    lora = apply_lora(_lm(tied=True), rank=4, alpha=8)
    for p in lora.parameters():  # B starts at 0: make the adapters change the outputs
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    rows = _head_rows(lora.get_base_model())
    batch = padded_batch([6, 3], [5, 2])
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        got, _ = policy_forward(lora, batch, 1.0, chunk_tokens=3)
        want, _ = _reference(lora, batch, 1.0)
    assert rows[:3] == [3, 3, 1]
    torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=LP_ATOL)

    class OwnHead(LlamaForCausalLM):  # not transformers' class: its forward may differ
        pass

    torch.manual_seed(0)
    other = OwnHead(small_llama_config()).float()
    rows = _head_rows(other)
    with torch.no_grad():
        got, _ = policy_forward(other, batch, 1.0, chunk_tokens=3)
        want, _ = _reference(other, batch, 1.0)
    assert rows[0] == 2 * 6  # called whole: logits_to_keep = t + 1 positions of both rows
    torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=LP_ATOL)


def test_actor_logits_chunk_tokens_reaches_every_forward(capsys) -> None:
    model = _lm(tied=True)
    rows = _head_rows(model)
    batch = padded_batch([6, 2, 4, 5], [5, 1, 4, 5])
    for prefix in ("never", "always"):
        for packed in (False, True):
            rows.clear()
            cfg = ActorConfig(
                logits_chunk_tokens=3, autocast="none", use_remove_padding=packed,
                shared_prefix=prefix,
            )  # fmt: skip
            ActorWorker(model, cfg, trainable=False).compute_log_prob(batch)
            assert rows and max(rows) == 3
    line = refused(capsys, "actor.logits_chunk_tokens=-1")
    assert "actor.logits_chunk_tokens=" in line and "must be" in line


def test_fsdp2_sharded_model_runs_whole() -> None:
    """fully_shard's root forward gathers the head's parameters: a sharded model is not split."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    batch = padded_batch([6, 3], [5, 2])
    mask = batch["response_mask"].bool()
    model = _lm(tied=True)
    with torch.no_grad():
        want, _ = _reference(model, batch, 1.0)
    # an in-memory store: a TCP store would listen on every interface (tests/test_loopback.py)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fully_shard(model)
        rows = _head_rows(model)
        got, _ = policy_forward(model, batch, 1.0, chunk_tokens=2)
        got.sum().backward()
    finally:
        dist.destroy_process_group()
    assert rows == [2 * 6]  # the whole model once, its own lm_head on t + 1 positions
    torch.testing.assert_close(got[mask].detach(), want[mask], rtol=0, atol=LP_ATOL)

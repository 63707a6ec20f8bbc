"""The shared-prefix forward gives the padded forward's log-probs, entropies and gradients."""

import copy

import pytest
import torch
from helpers import padded_batch, spy_grads, tiny_lm_with_attn

from creditrl import Batch
from creditrl.config import ActorConfig, OptimConfig
from creditrl.config.loader import load_config
from creditrl.models.token_tree import tree_unsupported
from creditrl.workers import ActorWorker, policy_forward
from creditrl.workers.prefix_tree import (
    build_prefix_tree,
    group_by_prompt,
    prefix_tree_policy_forward,
    resolve_shared_prefix,
)


def grpo_batch(n: int = 3, seed: int = 0) -> Batch:
    """Two prompts (5 and 3 real tokens, the same first 2 tokens) x ``n`` responses, rows of
    one prompt interleaved with the other's; row 0's first two response tokens equal row 2's;
    an observation token (response_mask 0) inside row 1's response."""
    batch = padded_batch([5, 3] * n, [4, 2, 5, 3, 1, 4][: 2 * n], p=6, t=5, seed=seed)
    ids = batch["input_ids"]
    prompt_a, prompt_b = ids[0, 1:6].clone(), ids[1, 3:6].clone()
    prompt_b[:2] = prompt_a[:2]
    for row in range(2 * n):
        if row % 2 == 0:
            ids[row, 1:6] = prompt_a
        else:
            ids[row, 3:6] = prompt_b
    ids[2, 6:8] = ids[0, 6:8]
    batch["responses"] = ids[:, 6:].clone()
    batch["prompts"] = ids[:, :6].clone()
    batch["response_mask"][1, 1] = 0
    return batch


def test_tree_layout_by_hand() -> None:
    ids = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 6], [0, 0, 1, 7, 8, 0]])
    attention = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0]])
    batch = Batch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "responses": ids[:, 4:],
            "response_mask": attention[:, 4:],
        }
    )
    tree = build_prefix_tree(batch)
    # rows: 1 2 3 | 4 5 ; 1 2 3 | 4 6 ; 1 7 | 8  -> nodes 1 2 3 4 5 6 7 8 (8 of 13 tokens)
    assert tree.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert tree.position_ids.tolist() == [[0, 1, 2, 3, 4, 4, 1, 2]]
    assert tree.tokens == 13 and tree.nodes == 8
    assert tree.ancestors[5].nonzero().flatten().tolist() == [0, 1, 2, 3, 5]  # token 6
    assert tree.ancestors[7].nonzero().flatten().tolist() == [0, 6, 7]  # token 8
    # response tokens 4,5 | 4,6 | 8 are predicted at nodes 2,3 | 2,3 | 6
    assert tree.logit_nodes.tolist() == [2, 3, 6]
    assert tree.logit_index.tolist() == [0, 1, 0, 1, 2]
    assert tree.labels.tolist() == [4, 5, 4, 6, 8]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_entropy_match_the_padded_forward(attn: str, temperature: float) -> None:
    model = tiny_lm_with_attn(attn=attn)
    batch = grpo_batch()
    tree = build_prefix_tree(batch)
    assert tree.nodes < 0.9 * tree.tokens  # the tree path runs, not the fallback

    def refuse(*args):
        raise AssertionError("fell back")

    with torch.no_grad():
        want_lp, want_h = policy_forward(model, batch, temperature, True)
        got_lp, got_h = prefix_tree_policy_forward(model, batch, temperature, True, fallback=refuse)
    valid = batch["attention_mask"][:, 6:].bool()
    torch.testing.assert_close(got_lp[valid], want_lp[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(got_h[valid], want_h[valid], atol=1e-5, rtol=0)
    assert (got_lp[~valid] == 0).all() and (got_h[~valid] == 0).all()


def test_gradients_match_the_padded_forward() -> None:
    batch = grpo_batch()
    weights = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(3))
    weights = weights * batch["attention_mask"][:, 6:]  # the padded forward fills padding too
    grads = []
    for use_tree in (False, True):
        model = tiny_lm_with_attn()
        if use_tree:
            lp, h = prefix_tree_policy_forward(model, batch, 1.0, True, fallback=None)
        else:
            lp, h = policy_forward(model, batch, 1.0, True)
        ((lp * weights).sum() + (h * weights).sum()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for want, got in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_falls_back_where_nothing_is_shared() -> None:
    batch = padded_batch([3, 2], [2, 2])  # random tokens: no shared prefix
    calls = []

    def fallback(*args):
        calls.append(args)
        return "padded"

    out = prefix_tree_policy_forward(tiny_lm_with_attn(), batch, 1.0, False, fallback=fallback)
    assert out == "padded" and len(calls) == 1


def test_group_by_prompt_is_stable_and_groups_rows() -> None:
    batch = grpo_batch()
    assert group_by_prompt(batch).tolist() == [0, 2, 4, 1, 3, 5]


def test_update_equals_the_padded_update() -> None:
    """The gradient each optimizer step receives is the padded path's, in float32 (autocast
    "auto" would pick bf16 on CPUs with avx512_bf16 or amx_bf16, whose rounding is not what this
    compares). Compared before the step: AdamW's first step moves a weight by lr * g / (|g| +
    eps), which turns the rounding of a near-zero gradient (the two forwards sum in different
    orders) into a parameter difference of up to lr."""
    batch = grpo_batch()
    batch["old_log_probs"] = torch.zeros_like(batch["responses"], dtype=torch.float)
    batch["advantages"] = torch.linspace(-1, 1, batch["responses"].numel()).view(6, 5)
    grads: list[torch.Tensor] = []
    for setting in ("never", "always"):
        model = tiny_lm_with_attn()
        cfg = ActorConfig(
            optim=OptimConfig(lr=1e-2), ppo_mini_batch_size=2, ppo_micro_batch_size=3,
            shared_prefix=setting, entropy_coeff=0.01, autocast="none",
        )  # fmt: skip
        worker = ActorWorker(model, cfg)
        assert worker.shared_prefix is (setting == "always")
        spy_grads(worker, model, grads)
        worker.update_policy(copy.deepcopy(batch), temperature=1.0, n_per_prompt=3)
    assert len(grads) == 2 and grads[0].abs().max() > 0  # one optimizer step each
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


def test_resolve_and_refusals() -> None:
    model = tiny_lm_with_attn()
    assert resolve_shared_prefix("auto", model) is True  # a CPU model with sdpa
    assert resolve_shared_prefix("never", model) is False
    with pytest.raises(ValueError, match="must be one of"):
        resolve_shared_prefix("on", model)
    model.config._attn_implementation = "flash_attention_2"
    assert "attention implementation" in tree_unsupported(model)
    assert resolve_shared_prefix("auto", model) is False
    with pytest.raises(ValueError, match="shared_prefix=always cannot be used"):
        resolve_shared_prefix("always", model)
    model.config._attn_implementation = "sdpa"
    model.config.layer_types = ["full_attention", "sliding_attention"]
    assert "sliding window" in tree_unsupported(model)


def test_config_load_refuses_an_unknown_value() -> None:
    with pytest.raises(ValueError, match=r"actor\.shared_prefix"):
        load_config(overrides=["actor.shared_prefix=sometimes"])

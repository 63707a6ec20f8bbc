"""How the Tinker service's ``forward_backward`` batches its datums: on the CPU through the
actor update's shared-prefix forward (the datums of one prompt run its tokens once; the head
runs once per distinct (prefix, target) pair), equal to the padded forward up to float rounding
in the returned log-probs, the loss and the adapters' gradient; micro-batches hold neighbours
in token order within a trie-node budget."""

from __future__ import annotations

import pytest
import torch

import creditrl.tinker.policy as policy_module
from creditrl.models.tiny import tiny_model_dir
from creditrl.tinker.messages import Datum
from creditrl.tinker.policy import LoraSpec, Policy, micro_batches


def _datum(tokens: list[int], trained_from: int, targets: list[int] | None = None) -> Datum:
    """Inputs tokens[:-1], targets tokens[1:] (or ``targets``), advantages on the positions
    from ``trained_from`` on, sampler log-probs -1 there."""
    n = len(tokens) - 1
    lead = [0.0] * trained_from
    advantages = lead + [0.5 if len(tokens) % 2 else -0.25] * (n - trained_from)
    return Datum(
        tokens[:-1],
        {
            "target_tokens": torch.tensor(targets if targets is not None else tokens[1:]),
            "logprobs": torch.tensor(lead + [-1.0] * (n - trained_from)),
            "advantages": torch.tensor(advantages),
        },
    )


def _group_datums() -> list[Datum]:
    """Two prompts, three continuations each, interleaved; one datum's targets are not its next
    inputs (Tinker allows any target)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 400, (20 + k,), generator=g).tolist() for k in range(2)]
    datums = []
    for j in range(3):
        for k, prompt in enumerate(prompts):
            tail = torch.randint(5, 400, (3 + 2 * j + k,), generator=g).tolist()
            tokens = prompt + tail
            targets = None
            if j == 1 and k == 0:
                targets = torch.randint(5, 400, (len(tokens) - 1,), generator=g).tolist()
            datums.append(_datum(tokens, len(prompt) - 1, targets))
    return datums


@pytest.fixture(scope="module")
def policy() -> Policy:
    p = Policy("tiny", str(tiny_model_dir()), LoraSpec(rank=4, seed=1))
    with torch.no_grad():  # B = 0 at init: make the adapters change the outputs
        for name, param in p.trainable().items():
            if "lora_B" in name:
                param.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(7))
    return p


def _run(policy: Policy, datums: list[Datum], shared: bool):
    policy.shared_prefix = shared
    policy.optimizer.zero_grad(set_to_none=True)
    outputs, metrics = policy.forward_backward(datums, "ppo", {}, forward_only=False)
    grads = {n: p.grad.clone() for n, p in policy.trainable().items() if p.grad is not None}
    policy.optimizer.zero_grad(set_to_none=True)
    policy.pending_grad = False
    return outputs, metrics, grads


def test_the_shared_prefix_forward_equals_the_padded_one(policy, monkeypatch) -> None:
    assert policy.shared_prefix  # the CPU default for a model that can run a trie
    datums = _group_datums()
    seen: list[int] = []
    original = policy_module.token_log_probs

    def counting(rows, labels, **kwargs):
        seen.append(len(labels))
        return original(rows, labels, **kwargs)

    monkeypatch.setattr(policy_module, "token_log_probs", counting)
    tree_out, tree_metrics, tree_grads = _run(policy, datums, shared=True)
    # one micro-batch; the head ran once per distinct (prefix, target) pair: a prompt's
    # positions once for the datums whose targets there are the prompt's next tokens
    pairs = {
        (tuple(d.tokens[: t + 1]), int(d.inputs["target_tokens"][t]))
        for d in datums
        for t in range(len(d.tokens))
    }
    positions = sum(len(d.tokens) for d in datums)
    assert seen == [len(pairs)]
    assert len(pairs) < positions - 2 * 19
    padded_out, padded_metrics, padded_grads = _run(policy, datums, shared=False)
    assert len(tree_out) == len(padded_out) == len(datums)
    for a, b, d in zip(tree_out, padded_out, datums, strict=True):
        assert a.shape == b.shape == (len(d.tokens),)
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    assert tree_metrics["loss:sum"] == pytest.approx(padded_metrics["loss:sum"], rel=1e-5)
    assert tree_metrics["tokens:sum"] == padded_metrics["tokens:sum"]
    assert tree_grads.keys() == padded_grads.keys() and tree_grads
    for name, grad in tree_grads.items():
        torch.testing.assert_close(grad, padded_grads[name], rtol=1e-4, atol=1e-6)


def test_micro_batches_hold_token_order_neighbours_within_the_node_budget() -> None:
    a = _datum([1, 2, 3, 4], 0)  # row [1, 2, 3, 4]: the inputs and the last target
    b = _datum([9, 9], 0)  # row [9, 9]
    c = _datum([1, 2, 3, 5], 0)  # row [1, 2, 3, 5]: shares 3 tokens with a
    d = _datum([1, 7], 0)  # row [1, 7]: shares 1 token with a and c
    # token order a, c, d, b; trie nodes 4, +1, +1, +2
    assert micro_batches([a, b, c, d], 6, shared=True) == [[0, 2, 3], [1]]
    assert micro_batches([a, b, c, d], 8, shared=True) == [[0, 2, 3, 1]]
    assert micro_batches([a, b, c, d], 3, shared=True) == [[0], [2], [3], [1]]
    # padded: in the given order while rows x the longest row fit
    assert micro_batches([a, b, c, d], 8, shared=False) == [[0, 1], [2, 3]]

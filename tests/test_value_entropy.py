"""Clipped value loss, chunked entropy and selected-token log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from creditrl.core.entropy import entropy_from_logits, log_probs_from_logits
from creditrl.core.value_loss import compute_value_loss

DTYPE = torch.float64


def test_value_loss_and_clipfrac_by_hand() -> None:
    values = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=DTYPE)
    returns = torch.tensor([[1.0, 0.0, 2.0, -100.0]], dtype=DTYPE)
    vpreds = torch.tensor([[0.5, 0.1, 0.0, 100.0]], dtype=DTYPE, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=DTYPE)
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, returns, values, mask, 0.2)
    # token 0: clipped pred 0.2 -> max(0.25, 0.64); token 1: 0.01; token 2: max(4, 1.44)
    assert vf_loss.item() == pytest.approx(0.5 * (0.64 + 0.01 + 4.0) / 3)
    assert vf_clipfrac.item() == pytest.approx(1 / 3)
    assert not vf_clipfrac.requires_grad
    vf_loss.backward()
    expected = torch.tensor([[0.0, 0.2 / 6, -4.0 / 6, 0.0]], dtype=DTYPE)
    torch.testing.assert_close(vpreds.grad, expected)

    summed, _ = compute_value_loss(vpreds, returns, values, mask, 0.2, "token-sum")
    assert summed.item() == pytest.approx(0.5 * 4.65)
    scaled, _ = compute_value_loss(vpreds, returns, values, mask, 0.2, global_num_tokens=6)
    assert scaled.item() == pytest.approx(0.5 * 4.65 / 6)


@pytest.mark.parametrize("shape", [(3, 5, 11), (7, 11)])
def test_entropy_matches_categorical_chunked_and_unchunked(shape: tuple[int, ...]) -> None:
    logits = torch.randn(*shape, dtype=DTYPE, generator=torch.Generator().manual_seed(0)) * 3
    expected = torch.distributions.Categorical(logits=logits).entropy()
    whole = entropy_from_logits(logits, chunk_size=10**6)
    chunked = entropy_from_logits(logits, chunk_size=4)
    assert whole.shape == shape[:-1]
    torch.testing.assert_close(whole, expected)
    torch.testing.assert_close(chunked, whole)

    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    entropy_from_logits(a, chunk_size=4).sum().backward()
    torch.distributions.Categorical(logits=b).entropy().sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_log_probs_match_log_softmax_gather() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 13, dtype=DTYPE, generator=g)
    labels = torch.randint(0, 13, (2, 6), generator=g)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    out = log_probs_from_logits(a, labels, chunk_size=5)
    ref = torch.log_softmax(b, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert out.shape == (2, 6)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(a.grad, b.grad)

    with pytest.raises(ValueError, match="labels shape"):
        log_probs_from_logits(logits, labels[:, :-1])
    half = log_probs_from_logits(logits.to(torch.bfloat16), labels)
    assert half.dtype == torch.float32
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(logits, chunk_size=0)


def test_large_logits_are_stable() -> None:
    logits = torch.tensor([[1e4, 1e4, -1e4], [1e4, 0.0, -1e4]], requires_grad=True)
    ent = entropy_from_logits(logits, chunk_size=1)
    torch.testing.assert_close(ent, torch.tensor([math.log(2.0), 0.0]))
    lp = log_probs_from_logits(logits, torch.tensor([0, 2]), chunk_size=1)
    torch.testing.assert_close(lp, torch.tensor([-math.log(2.0), -2e4]))
    (ent.sum() + lp.sum()).backward()
    assert torch.isfinite(ent).all() and torch.isfinite(lp).all()
    assert torch.isfinite(logits.grad).all()

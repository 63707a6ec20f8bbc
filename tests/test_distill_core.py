"""The distillation term and the pure distillation loss on hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from creditrl.core import POLICY_LOSSES, distill_term, get_policy_loss


def test_distill_term_is_teacher_minus_student_on_policy_tokens() -> None:
    # row 0: three policy tokens; row 1: a policy token, an observation (mask 0), a policy token
    teacher = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -3.0, -0.7]])
    student = torch.tensor([[-1.5, -1.0, -0.5], [-0.4, -0.2, -0.7]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    d = distill_term(teacher, student, mask)
    expected = torch.tensor([[1.0, 0.0, -1.5], [0.3, 0.0, 0.0]])
    assert torch.allclose(d, expected, atol=1e-6)
    assert d[1, 1] == 0  # the observation token carries no term


def test_distill_loss_value_and_gradient() -> None:
    loss_fn = get_policy_loss("distill")
    assert POLICY_LOSSES.info("distill")["requires"] == ("teacher_log_prob",)
    old = torch.tensor([[math.log(0.5), math.log(0.25)]])
    teacher = torch.tensor([[math.log(0.25), math.log(0.5)]])
    mask = torch.tensor([[1, 1]])
    log_prob = old.clone().requires_grad_(True)  # first pass: r = 1
    loss, metrics = loss_fn(
        old, log_prob, torch.zeros_like(old), mask, "token-sum", teacher_log_prob=teacher
    )
    # value: sum_t (log pi - log pi_T) = (ln .5 - ln .25) + (ln .25 - ln .5) = 0
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-6)
    loss.backward()
    # d loss / d log pi_t = -d_t * r_t = log pi_t - log pi_T_t = [ln 2, -ln 2]
    assert log_prob.grad.tolist()[0] == pytest.approx([math.log(2), -math.log(2)], abs=1e-6)
    assert float(metrics["pg_clipfrac"]) == 0.0
    # away from r = 1 the term is taken at the current policy and weighted by r
    log_prob = torch.tensor([[math.log(0.25), math.log(0.25)]])
    loss, _ = loss_fn(
        old, log_prob, torch.zeros_like(old), mask, "token-sum", teacher_log_prob=teacher
    )
    # token 0: r = .5, d = 0 -> 0; token 1: r = 1, d = ln 2 -> -ln 2
    assert float(loss) == pytest.approx(-math.log(2), abs=1e-6)

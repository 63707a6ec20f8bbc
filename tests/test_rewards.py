"""Reward placement: sequence scores, structured multi-turn rewards (spec 001), KL in reward."""

import pytest
import torch

from creditrl.core import (
    apply_kl_penalty,
    last_valid_index,
    place_sequence_scores,
    structured_to_token_level,
    total_score,
)

# Row 0: turn 1 = cols 0-1 (policy), cols 2-3 (observation, mask 0), turn 2 = cols 4-5.
MASK = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0]])
TURNS = torch.tensor([[1, 1, 1, 1, 2, 2, 0], [1, 1, 1, 0, 0, 0, 0]])
TURN_REWARDS = [{1: 0.2, 2: 0.4}, {1: 0.3}]
GLOBAL_REWARDS = [{"exact_match": 0.3, "_raw_exact_match": 5.0}, {}]


def test_sequence_score_lands_on_the_last_valid_token() -> None:
    out = place_sequence_scores(torch.tensor([2.0, -1.0]), MASK)
    assert out.tolist() == [[0, 0, 0, 0, 0, 2.0, 0], [0, 0, -1.0, 0, 0, 0, 0]]
    assert last_valid_index(MASK).tolist() == [5, 2]


def test_bad_scores_and_empty_rows_raise_naming_the_sample() -> None:
    with pytest.raises(ValueError, match=r"samples \[1\]"):
        place_sequence_scores(torch.tensor([1.0, float("nan")]), MASK)
    with pytest.raises(ValueError, match=r"samples \[1\]"):
        place_sequence_scores(torch.tensor([1.0, 1.0]), torch.tensor([[1, 0], [0, 0]]))


def test_total_score_skips_log_only_keys() -> None:
    assert total_score(TURN_REWARDS[0], GLOBAL_REWARDS[0]) == pytest.approx(0.3 + 0.3)
    assert total_score({}, {"a": 0.5}) == 0.5


def test_turn_proportional() -> None:
    out = structured_to_token_level(TURN_REWARDS, GLOBAL_REWARDS, MASK, TURNS, "turn_proportional")
    g = 0.3 / 4  # global reward over the 4 policy tokens of row 0
    expected = torch.tensor(
        [[0.1 + g, 0.1 + g, 0, 0, 0.2 + g, 0.2 + g, 0], [0.1, 0.1, 0.1, 0, 0, 0, 0]]
    )
    torch.testing.assert_close(out, expected)
    assert (out * (1 - MASK)).abs().max() == 0  # observation tokens get no reward
    torch.testing.assert_close(out.sum(-1), torch.tensor([0.2 + 0.4 + 0.3, 0.3]))


def test_final_token_only() -> None:
    out = structured_to_token_level(TURN_REWARDS, GLOBAL_REWARDS, MASK, TURNS, "final_token_only")
    expected = torch.zeros(2, 7)
    expected[0, 5] = 0.3 + 0.3
    expected[1, 2] = 0.3
    torch.testing.assert_close(out, expected)


def test_structured_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="sample 1: turn 2"):
        structured_to_token_level([{1: 0.1}, {2: 0.5}], [{}, {}], MASK, TURNS, "turn_proportional")
    with pytest.raises(ValueError, match="unknown reward distribution"):
        structured_to_token_level(TURN_REWARDS, GLOBAL_REWARDS, MASK, TURNS, "spread")
    with pytest.raises(ValueError, match="batch of 2"):
        structured_to_token_level(TURN_REWARDS[:1], GLOBAL_REWARDS, MASK, TURNS)


def test_kl_penalty_is_masked_and_reports_batch_kl() -> None:
    scores = place_sequence_scores(torch.tensor([1.0, 0.0]), MASK)
    old = torch.full((2, 7), -0.5)
    ref = torch.full((2, 7), -0.7)
    rewards, metrics = apply_kl_penalty(scores, old, ref, MASK, 0.5, "k1")
    expected = scores - 0.5 * 0.2 * MASK
    torch.testing.assert_close(rewards, expected)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.2)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5

"""Advantage estimators: hand values, group rules, masks, and the blocked GAE vs the loop."""

import numpy as np
import pytest
import torch
from helpers import restore_registries

from creditrl.core import ADV_ESTIMATORS, compute_advantage, compute_gae_advantage_return
from creditrl.core.reference import gae_reverse_loop, suffix_sum_reverse_loop
from creditrl.core.scan import compact, discounted_suffix_sum, uncompact

UIDS = np.array(["a", "a", "b", "b", "b", "c"], dtype=object)
SCORES = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
LENGTHS = [4, 2, 3, 1, 4, 2]


def outcome_batch(scores=SCORES, lengths=LENGTHS, width=5):
    mask = torch.zeros(len(scores), width)
    rewards = torch.zeros(len(scores), width)
    for i, (s, n) in enumerate(zip(scores, lengths, strict=True)):
        mask[i, :n] = 1
        rewards[i, n - 1] = s
    return rewards, mask


def seq_adv(adv: torch.Tensor) -> list[float]:
    """The first column: every group estimator puts one value on all valid tokens."""
    return adv[:, 0].tolist()


def test_grpo_hand_values() -> None:
    rewards, mask = outcome_batch()
    adv, ret = compute_advantage("grpo", rewards, mask, UIDS)
    s2 = 2**-0.5  # group a: scores 1, 0 -> mean .5, unbiased std .7071
    b_std = (1 / 3) ** 0.5  # group b: 1, 1, 0 -> mean 2/3, std sqrt(1/3)
    expected = [
        0.5 / (s2 + 1e-6),
        -0.5 / (s2 + 1e-6),
        (1 / 3) / (b_std + 1e-6),
        (1 / 3) / (b_std + 1e-6),
        (-2 / 3) / (b_std + 1e-6),
        0.0,
    ]
    assert seq_adv(adv) == pytest.approx(expected, abs=1e-6)
    assert torch.equal(adv, ret)
    assert torch.equal(adv * (1 - mask), torch.zeros_like(adv))
    assert torch.all((adv != 0) | (mask == 0) | (torch.tensor(expected)[:, None] == 0))


def test_grpo_without_std_and_dr_grpo_agree() -> None:
    rewards, mask = outcome_batch()
    no_std, _ = compute_advantage("grpo", rewards, mask, UIDS, norm_adv_by_std_in_grpo=False)
    dr, _ = compute_advantage("dr_grpo", rewards, mask, UIDS)
    assert seq_adv(dr) == pytest.approx([0.5, -0.5, 1 / 3, 1 / 3, -2 / 3, 0.0], abs=1e-6)
    torch.testing.assert_close(no_std, dr)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "opo", "gpg", "grpo_passk"])
def test_equal_scores_in_a_group_give_zero(name: str) -> None:
    rewards, mask = outcome_batch(scores=[0.7] * 6)
    adv, _ = compute_advantage(name, rewards, mask, UIDS)
    assert adv.abs().max() == 0


@pytest.mark.parametrize(
    "name", ["grpo", "dr_grpo", "rloo", "opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline"]
)
def test_permuting_the_batch_permutes_the_result(name: str) -> None:
    rewards, mask = outcome_batch(scores=[1.0, 0.0, 0.5, 1.0, 0.2, 1.0])
    perm = torch.tensor([4, 0, 5, 2, 1, 3])
    adv, ret = compute_advantage(name, rewards, mask, UIDS)
    adv_p, ret_p = compute_advantage(name, rewards[perm], mask[perm], UIDS[perm.numpy()])
    torch.testing.assert_close(adv_p, adv[perm], atol=1e-6, rtol=0)
    torch.testing.assert_close(ret_p, ret[perm], atol=1e-6, rtol=0)


def test_rloo_opo_gpg_passk_hand_values() -> None:
    rewards, mask = outcome_batch()
    rloo, _ = compute_advantage("rloo", rewards, mask, UIDS)
    assert seq_adv(rloo) == pytest.approx([1.0, -1.0, 0.5, 0.5, -1.0, 0.0], abs=1e-6)
    opo, _ = compute_advantage("opo", rewards, mask, UIDS)
    # group a: lengths 4, 2 -> baseline 4/6; group b: lengths 3, 1, 4 -> baseline 4/8
    assert seq_adv(opo) == pytest.approx([1 / 3, -2 / 3, 0.5, 0.5, -0.5, 0.0], abs=1e-6)
    gpg, _ = compute_advantage("gpg", rewards, mask, UIDS)
    alpha = 6 / 4  # 4 non-zero scores in a batch of 6
    assert seq_adv(gpg) == pytest.approx(
        [alpha * 0.5, -alpha * 0.5, alpha / 3, alpha / 3, -alpha * 2 / 3, 0.0], abs=1e-6
    )
    passk, _ = compute_advantage("grpo_passk", rewards, mask, UIDS)
    # group a: best 1, second 0 -> 1 / std; group b: best and second tie -> 0
    assert seq_adv(passk) == pytest.approx([1 / (2**-0.5 + 1e-6), 0, 0, 0, 0, 0], abs=1e-6)


def test_passk_tie_goes_to_the_earliest_sample() -> None:
    rewards, mask = outcome_batch(scores=[0.0, 1.0, 1.0, 0.5], lengths=[1, 1, 1, 1])
    adv, _ = compute_advantage(
        "grpo_passk", rewards, mask, ["g"] * 4, norm_adv_by_std_in_grpo=False
    )
    assert seq_adv(adv) == [0.0, 0.0, 0.0, 0.0]
    rewards, mask = outcome_batch(scores=[0.0, 1.0, 0.25, 0.5], lengths=[1, 1, 1, 1])
    adv, _ = compute_advantage(
        "grpo_passk", rewards, mask, ["g"] * 4, norm_adv_by_std_in_grpo=False
    )
    assert seq_adv(adv) == pytest.approx([0.0, 0.5, 0.0, 0.0])


def test_group_estimators_accept_integer_uid_tensors() -> None:
    rewards, mask = outcome_batch()
    as_strings, _ = compute_advantage("grpo", rewards, mask, UIDS)
    as_ints, _ = compute_advantage("grpo", rewards, mask, torch.tensor([7, 7, 3, 3, 3, 9]))
    torch.testing.assert_close(as_strings, as_ints)


def test_reinforce_plus_plus_returns_and_whitening() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 1, 1]])  # row 1 has a masked observation
    adv, ret = compute_advantage("reinforce_plus_plus", rewards, mask, gamma=0.5)
    expected = torch.tensor([[0.25, 0.5, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(ret, expected)
    valid = adv[mask.bool()]
    assert valid.mean().abs() < 1e-6 and (valid.var() - 1).abs() < 1e-5
    assert adv[0, 3] == 0 and adv[1, 1] == 0


def test_reinforce_plus_plus_baseline() -> None:
    rewards, mask = outcome_batch()
    adv, ret = compute_advantage("reinforce_plus_plus_baseline", rewards, mask, UIDS)
    raw = torch.tensor([0.5, -0.5, 1 / 3, 1 / 3, -2 / 3, 0.0])[:, None] * mask
    valid = raw[mask.bool()]
    expected = (raw - valid.mean()) / valid.std() * mask
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    assert torch.equal(adv, ret)


def test_remax() -> None:
    rewards = torch.tensor([[0.1, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0]])
    adv, ret = compute_advantage("remax", rewards, mask, reward_baselines=torch.tensor([0.4]))
    torch.testing.assert_close(ret, torch.tensor([[1.1, 1.0, 1.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.7, 0.6, 0.6, 0.0]]))
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantage("remax", rewards, mask)


def test_missing_inputs_and_bad_rewards_raise_naming_them() -> None:
    rewards, mask = outcome_batch()
    with pytest.raises(ValueError, match="index"):
        compute_advantage("grpo", rewards, mask)
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", rewards, mask)
    with pytest.raises(KeyError, match="grpo"):
        compute_advantage("no_such_estimator", rewards, mask, UIDS)
    with pytest.raises(ValueError, match="6 uids for a batch of 5"):
        compute_advantage("grpo", rewards[:5], mask[:5], UIDS)
    rewards[3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"samples \[3\]"):
        compute_advantage("grpo", rewards, mask, UIDS)


def test_every_registered_estimator_is_zero_outside_the_mask() -> None:
    rewards, mask = outcome_batch()
    mask[2, 1] = 0  # a hole inside a response
    options = {
        "values": torch.rand(6, 5),
        "reward_baselines": torch.rand(6),
        "gamma": 0.9,
        "lam": 0.8,
    }
    for name in ADV_ESTIMATORS.names():
        adv, ret = compute_advantage(name, rewards * mask, mask, UIDS, **options)
        assert adv.shape == ret.shape == mask.shape, name
        assert (adv * (1 - mask)).abs().max() == 0, name
        assert (ret * (1 - mask)).abs().max() == 0, name


def test_gae_across_a_masked_span_equals_gae_with_the_span_removed() -> None:
    torch.manual_seed(0)
    rewards, values = torch.randn(1, 10), torch.rand(1, 10)
    mask = torch.ones(1, 10)
    mask[0, 3:6] = 0  # an observation span: tokens 3, 4, 5
    keep = mask[0].bool()
    adv, ret = compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8, whiten=False)
    adv_ref, ret_ref = compute_gae_advantage_return(
        rewards[:, keep], values[:, keep], torch.ones(1, 7), 0.9, 0.8, whiten=False
    )
    torch.testing.assert_close(adv[:, keep], adv_ref)
    torch.testing.assert_close(ret[:, keep], ret_ref)
    assert adv[0, 3:6].abs().max() == 0 and ret[0, 3:6].abs().max() == 0


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 1.0), (0.5, 0.5), (1.0, 0.0)])
def test_gae_equals_the_reverse_loop(holes: bool, gamma: float, lam: float) -> None:
    torch.manual_seed(1)
    b, t = 9, 150
    lengths = torch.randint(1, t + 1, (b,))
    mask = (torch.arange(t)[None] < lengths[:, None]).double()
    if holes:
        mask *= (torch.rand(b, t) > 0.3).double()
        mask[:, 0] = 1
    rewards, values = torch.randn(b, t, dtype=torch.float64), torch.randn(b, t, dtype=torch.float64)
    for whiten in (False, True):
        fast = compute_gae_advantage_return(rewards * mask, values, mask, gamma, lam, whiten=whiten)
        slow = gae_reverse_loop(rewards * mask, values, mask, gamma, lam, whiten=whiten)
        torch.testing.assert_close(fast[0], slow[0], atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(fast[1], slow[1], atol=1e-9, rtol=1e-9)


def test_suffix_sum_and_compaction_primitives() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert discounted_suffix_sum(x, 0.5).tolist() == [[3.25, 4.5, 5.0, 4.0]]
    assert discounted_suffix_sum(x, 0.0).tolist() == x.tolist()
    mask = torch.tensor([[1.0, 0, 1, 1]])
    assert compact(x, mask).tolist() == [[1.0, 3.0, 4.0, 0.0]]
    assert uncompact(compact(x, mask), mask).tolist() == [[1.0, 0.0, 3.0, 4.0]]
    torch.testing.assert_close(
        suffix_sum_reverse_loop(x, mask, 0.5), torch.tensor([[1 + 0.5 * 5, 0, 5.0, 4.0]])
    )


def test_estimators_are_called_by_keyword_in_any_parameter_order(monkeypatch) -> None:
    """An estimator written in verl's GAE argument order (values second, no **kwargs) gets
    every argument by name and only those it takes (before: index landed in `values` by
    position, or an unexpected keyword raised TypeError); it equals the built-in gae."""
    from creditrl.core import register_adv_est

    restore_registries(monkeypatch, ADV_ESTIMATORS)

    @register_adv_est("verl_order_gae_test", requires=("values",), options=("gamma", "lam"))
    def verl_gae(token_level_rewards, values, response_mask, gamma, lam):
        return compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam)

    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    options = dict(values=values, gamma=0.9, lam=0.8, norm_adv_by_std_in_grpo=True)
    ours = compute_advantage("gae", rewards, mask, ["a", "b", "c"], **options)
    theirs = compute_advantage("verl_order_gae_test", rewards, mask, ["a", "b", "c"], **options)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])

"""Actor and critic workers on a tiny random model: alignment, trimming, accumulation."""

import copy

import pytest
import torch
from helpers import TinyCritic, padded_actor_batch, padded_batch, tiny_lm

from creditrl import Batch
from creditrl.config import ActorConfig, CriticConfig, OptimConfig
from creditrl.workers import ActorWorker, CriticWorker, policy_forward, value_forward


def direct_log_probs(model, batch: Batch, temperature: float) -> torch.Tensor:
    """Each row alone, unpadded: log pi(y_t | prompt, y_<t) by one full forward."""
    rows = []
    t = batch["responses"].shape[1]
    for i in range(len(batch)):
        keep = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][keep].unsqueeze(0)
        n = int(batch["response_mask"][i].sum())
        logits = model(input_ids=ids).logits[0, -n - 1 : -1] / temperature
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, -n:, None]).squeeze(-1)
        rows.append(torch.nn.functional.pad(lp, (0, t - n)))
    return torch.stack(rows)


def test_policy_forward_matches_each_row_alone() -> None:
    model = tiny_lm().eval()
    batch = padded_batch([6, 2, 4], [5, 1, 3])
    with torch.no_grad():
        got, entropy = policy_forward(model, batch, temperature=0.7, with_entropy=True)
        want = direct_log_probs(model, batch, 0.7)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)
    assert got.shape == entropy.shape == (3, 5)
    assert (entropy[mask] > 0).all()


def test_trimming_does_not_change_log_probs() -> None:
    model = tiny_lm().eval()
    batch = padded_batch([2, 3], [2, 1], p=9, t=7)  # lots of all-padding columns
    with torch.no_grad():
        got, _ = policy_forward(model, batch)
        want = direct_log_probs(model, batch, 1.0)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)
    assert (got[:, 2:] == 0).all() and got.shape == (2, 7)  # columns no row uses
    cfg = ActorConfig(log_prob_micro_batch_size=1, autocast="none")  # float32 on any CPU
    worker = ActorWorker(model, cfg, trainable=False)
    log_probs, _ = worker.compute_log_prob(batch, with_entropy=False)
    torch.testing.assert_close(log_probs, want * mask)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_accumulate_the_same_gradient(mode: str) -> None:
    base = tiny_lm()
    batch = padded_actor_batch(base)
    grads = []
    for micro in (4, 1):
        model = copy.deepcopy(base)
        cfg = ActorConfig(
            optim=OptimConfig(lr=1e-2), ppo_mini_batch_size=4, ppo_micro_batch_size=micro,
            loss_agg_mode=mode, use_kl_loss=True, entropy_coeff=0.01, shuffle=False,
            autocast="none",
        )  # fmt: skip
        worker = ActorWorker(model, cfg)

        def spy(*_, model=model):
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))

        worker.optimizer.register_step_pre_hook(spy)
        metrics = worker.update_policy(batch, temperature=1.0, n_per_prompt=1)
        assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm"} <= set(
            metrics
        )
        assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)  # first step is on-policy
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        assert not torch.allclose(after, torch.cat([p.flatten() for p in base.parameters()]))
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_critic_values_are_aligned_and_update_runs() -> None:
    critic = TinyCritic()
    batch = padded_batch([6, 2, 4], [5, 1, 3])
    worker = CriticWorker(critic, CriticConfig(ppo_mini_batch_size=3, ppo_micro_batch_size=2))
    values = worker.compute_values(batch)
    with torch.no_grad():
        for i in range(3):
            keep = batch["attention_mask"][i].bool()
            n = int(batch["response_mask"][i].sum())
            ids = batch["input_ids"][i][keep].unsqueeze(0)
            pos = torch.arange(ids.shape[1]).unsqueeze(0)
            alone = critic(ids, torch.ones_like(ids), pos)[0, -n - 1 : -1]
            torch.testing.assert_close(values[i, :n], alone, atol=1e-5, rtol=1e-5)
    assert (values[batch["response_mask"] == 0] == 0).all()
    batch["values"] = values
    batch["returns"] = values + 1.0
    metrics = worker.update_critic(batch, n_per_prompt=1)
    assert metrics["critic/vf_loss"] > 0 and "critic/vf_clipfrac" in metrics
    with torch.no_grad():
        assert not torch.allclose(value_forward(critic, batch), values)


def test_bf16_autocast_update_stays_close_to_float32() -> None:
    base = tiny_lm()
    batch = padded_actor_batch(base)
    grads = []
    for autocast in ("none", "bf16"):
        model = copy.deepcopy(base)
        cfg = ActorConfig(ppo_mini_batch_size=4, shuffle=False, autocast=autocast)
        worker = ActorWorker(model, cfg)

        def spy(*_, model=model):
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))

        worker.optimizer.register_step_pre_hook(spy)
        metrics = worker.update_policy(batch, temperature=1.0, n_per_prompt=1)
        assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
    cosine = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0)
    assert cosine > 0.99
    with pytest.raises(ValueError, match="autocast"):
        ActorWorker(tiny_lm(), ActorConfig(autocast="fp8"))


@pytest.mark.parametrize("packed", [False, True])
def test_first_minibatch_health_metrics_are_zero_on_policy(packed: bool) -> None:
    model = tiny_lm()
    batch = padded_actor_batch(model)
    cfg = ActorConfig(
        optim=OptimConfig(lr=1e-2), ppo_mini_batch_size=2, ppo_micro_batch_size=1, ppo_epochs=2,
        autocast="none", use_remove_padding=packed, use_dynamic_bsz=packed,
    )  # fmt: skip
    metrics = ActorWorker(model, cfg).update_policy(batch, temperature=1.0, n_per_prompt=1)
    assert metrics["health/first_minibatch_ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["health/first_minibatch_clipfrac"] == pytest.approx(0.0, abs=1e-6)
    assert abs(metrics["actor/ppo_kl"]) > 1e-4  # later mini-batches are off-policy

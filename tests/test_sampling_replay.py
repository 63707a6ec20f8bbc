"""Sampling replay (issue 42): the sampler records each token's top-k/top-p/min-p kept-set size
(``rollout_kept_counts``) and every log-prob stage renormalises over the set it rebuilds, so
truncated-sampling runs train the policy that sampled. Float32, CPU, the tiny random Llama."""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import pytest
import torch
from helpers import PROMPTS, prompt_batch, tiny_hf_engine

from creditrl.config import ActorConfig, load_config
from creditrl.core.entropy import kept_set_mask, token_log_probs
from creditrl.errors import ConfigError
from creditrl.models.loading import apply_lora
from creditrl.rollout import (
    EngineArgs,
    build_rollout_engine,
    check_sampling_replay,
    filter_logits,
    kept_sets_recorded,
    rollout_log_probs_are_actors,
    sample_next_tokens,
)
from creditrl.rollout.sampling import kept_counts
from creditrl.workers.actor import ActorWorker

GRID = list(itertools.product([0.7, 1.0], [-1, 20], [1.0, 0.9], [0.0, 0.05]))
# |log p| of the tiny model's tokens is at most ~15 (log 49152 / 0.7): float32 spacing there
# is 9.5e-7, and the sampler's decode-path logits and the training forward (a prefix tree on
# the CPU) each round differently; 3e-5 is ~30 ulps, far below any effect of a wrong kept set
# (one token of a 20-token set moves a log-prob by ~1e-2; a sampled token outside it by inf)
LOG_PROB_ATOL = 3e-5


# ---- the sampler's kept set -----------------------------------------------------------------


def test_min_p_keeps_tokens_within_a_factor_of_the_top_one():
    logits = torch.tensor([[0.0, -1.0, -3.0, -4.0]])  # p_v / p_max = 1, e^-1, e^-3, e^-4
    assert torch.isinf(filter_logits(logits, min_p=0.1)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, min_p=0.04)).tolist() == [[False, False, False, True]]
    assert torch.equal(filter_logits(logits, min_p=0.0), logits)
    with pytest.raises(ValueError, match="min_p"):
        filter_logits(logits, min_p=1.5)


def test_every_cut_keeps_ties_at_its_boundary():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    # p = 0.534, 0.196, 0.196, 0.072: top-p 0.6 needs the first 1.0, and keeps its tie
    assert kept_counts(filter_logits(logits, top_p=0.6)).tolist() == [3]
    assert kept_counts(filter_logits(logits, top_k=2)).tolist() == [3]
    assert kept_counts(filter_logits(logits, top_p=0.4)).tolist() == [1]


def test_greedy_records_the_whole_vocabulary():
    *_, kept = sample_next_tokens(torch.randn(3, 7), greedy=True, with_kept=True)
    assert kept.tolist() == [0, 0, 0]
    assert len(sample_next_tokens(torch.randn(3, 7), greedy=True)) == 2  # the default is a pair


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", GRID)
def test_the_kept_set_is_rebuilt_exactly_from_its_size(temperature, top_k, top_p, min_p):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 300, generator=gen) * 3
    logits[:8, 10:14] = logits[:8, 20:21]  # exact ties
    tokens, log_probs, kept = sample_next_tokens(
        logits,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        generator=gen,
        with_kept=True,
    )
    z = logits / temperature
    sampler_set = torch.isfinite(filter_logits(z, top_k, top_p, min_p))
    rebuilt = kept_set_mask(z, kept, tokens)
    if bool((kept == 300).all()):  # nothing was cut: no mask at all
        assert rebuilt is None
    else:
        assert torch.equal(rebuilt, sampler_set)
    replayed, _ = token_log_probs(logits, tokens, temperature=temperature, kept=kept)
    torch.testing.assert_close(replayed, log_probs, atol=2e-6, rtol=0)


def test_the_kept_set_and_the_entropy_over_it():
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    assert kept_set_mask(z, torch.tensor([2]), torch.tensor([0])).tolist() == [
        [True, True, False, False, False]
    ]
    # the sampled token is always in the set, even if float noise put it just below the cut
    assert kept_set_mask(z, torch.tensor([2]), torch.tensor([3])).tolist() == [
        [True, True, False, True, False]
    ]
    assert kept_set_mask(z, torch.tensor([0]), torch.tensor([0])) is None  # 0: no cut
    assert kept_set_mask(z, torch.tensor([5]), torch.tensor([0])) is None  # all V kept
    log_prob, entropy = token_log_probs(
        z, torch.tensor([1]), kept=torch.tensor([2]), with_entropy=True
    )
    p = torch.softmax(torch.tensor([3.0, 2.0]), 0)  # renormalised over the two kept tokens
    torch.testing.assert_close(log_prob, p[1:].log())
    torch.testing.assert_close(entropy, -(p * p.log()).sum()[None])


def test_chunked_replay_equals_one_pass_with_gradients():
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(10, 8, generator=gen)
    head = torch.nn.Linear(8, 50, bias=False)
    labels = torch.randint(0, 50, (10,), generator=gen)
    kept = torch.tensor([0, 3, 50, 7, 1, 12, 2, 49, 5, 9])
    with torch.no_grad():
        labels[1] = torch.topk(head(hidden[1]), 3).indices[-1]  # a token inside its set
    outs = []
    for chunk in (0, 3):
        head.zero_grad()
        lp, ent = token_log_probs(
            hidden, labels, head=head, kept=kept, chunk_tokens=chunk, with_entropy=True
        )
        (lp.sum() + ent.sum()).backward()
        outs.append((lp.detach(), ent.detach(), head.weight.grad.clone()))
        assert torch.isfinite(lp).all() and torch.isfinite(head.weight.grad).all()
    for one, chunked in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(one, chunked)


# ---- the training forward replays what the engine sampled -----------------------------------


def _first_update_log_probs(worker: ActorWorker, batch, temperature: float) -> torch.Tensor:
    """The log-probs the update's first forward computes (before any optimizer step)."""
    seen: list[torch.Tensor] = []
    forward = worker._forward

    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append(out[0].detach())
        return out

    worker._forward = spy
    worker.update_policy(batch, temperature, n_per_prompt=1)
    return seen[0]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", GRID)
def test_sampled_log_probs_are_the_training_forwards(
    model, tokenizer, temperature, top_k, top_p, min_p
):
    """Acceptance: over temperature x top_k x top_p x min_p, the engine's rollout_log_probs
    equal the actor's (old) log-probs to float precision and the first update's ratio
    new/old is 1 within 1e-6 (fp32, CPU)."""
    engine = tiny_hf_engine(
        model, tokenizer, top_k=top_k, top_p=top_p, min_p=min_p, seed=5,
        eos_token_ids=list(range(0, 49152, 8)),
    )  # fmt: skip
    out = engine.generate(prompt_batch(PROMPTS), temperature=temperature)
    truncated = top_k > 0 or top_p < 1 or min_p > 0
    assert ("rollout_kept_counts" in out) == truncated
    valid = out["response_mask"].bool()
    actor = copy.deepcopy(model)
    size = len(out)
    cfg = ActorConfig(
        autocast="none", ppo_mini_batch_size=size, ppo_micro_batch_size=size,
        log_prob_micro_batch_size=size, shuffle=False,
    )  # fmt: skip
    worker = ActorWorker(actor, cfg)
    old, _ = worker.compute_log_prob(out, temperature)
    assert (old - out["rollout_log_probs"]).abs()[valid].max() < LOG_PROB_ATOL
    out["old_log_probs"] = old
    out["advantages"] = torch.linspace(-1, 1, size)[:, None] * out["response_mask"]
    new = _first_update_log_probs(worker, out, temperature)
    ratio = torch.exp(new - old)[valid]
    assert (ratio - 1).abs().max() < 1e-6


def test_without_replay_the_log_probs_are_another_distributions(model, tokenizer):
    """rollout.sampling_replay=false (today's behaviour, biased): nothing is recorded and the
    training forward's log-probs are over the whole vocabulary, far from the sampler's."""
    engine = tiny_hf_engine(model, tokenizer, top_k=20, sampling_replay=False, seed=5)
    out = engine.generate(prompt_batch(PROMPTS), temperature=1.0)
    assert "rollout_kept_counts" not in out
    old, _ = ActorWorker(model, ActorConfig(autocast="none"), trainable=False).compute_log_prob(
        out, 1.0
    )
    valid = out["response_mask"].bool()
    assert (out["rollout_log_probs"] - old)[valid].min() > 1.0  # log(49152 / 20) ~ 7.8 here


def test_lora_actors_replay_too(model, tokenizer):
    lora = apply_lora(copy.deepcopy(model), rank=4, alpha=8)
    with torch.no_grad():  # adapters that change the policy (B starts at 0)
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    engine = tiny_hf_engine(lora, tokenizer, top_p=0.9, min_p=0.05, seed=2)
    out = engine.generate(prompt_batch(PROMPTS, repeat=2), temperature=0.7)
    worker = ActorWorker(lora, ActorConfig(autocast="none"), trainable=False)
    old, _ = worker.compute_log_prob(out, 0.7)
    valid = out["response_mask"].bool()
    assert (old - out["rollout_log_probs"]).abs()[valid].max() < LOG_PROB_ATOL


# ---- who replays: the key, the engines' declarations ----------------------------------------


def test_replay_is_the_default_and_makes_rollout_log_probs_the_actors():
    assert rollout_log_probs_are_actors(load_config(overrides=["rollout.top_p=0.9"]))
    assert kept_sets_recorded(load_config(overrides=["rollout.min_p=0.05"]))
    off = load_config(overrides=["rollout.top_k=20", "rollout.sampling_replay=false"])
    assert not rollout_log_probs_are_actors(off) and not kept_sets_recorded(off)
    assert not kept_sets_recorded(load_config())  # nothing cut: nothing to record


def test_an_engine_that_cannot_record_is_refused_in_one_line(tokenizer):
    cfg = load_config(overrides=["rollout.engine=vllm", "rollout.top_p=0.9"]).rollout
    with pytest.raises(ConfigError, match="sampling_replay=false") as e:
        build_rollout_engine(EngineArgs(cfg=cfg, tokenizer=tokenizer, model_path="."))
    assert "\n" not in str(e.value) and "rollout.engine=vllm" in str(e.value)
    check_sampling_replay(replace(cfg, top_p=1.0))  # nothing cut: nothing to replay
    check_sampling_replay(replace(cfg, sampling_replay=False))  # today's, biased


# ---- on the wire: a sampler's kept-set sizes are checked like every field -------------------


def _group(kept: torch.Tensor):
    from creditrl.asynchronous.messages import group_of
    from creditrl.batch import Batch

    prompts, responses = torch.full((2, 3), 5), torch.full((2, 4), 7)
    attention = torch.ones(2, 7, dtype=torch.long)
    batch = Batch(
        {
            "prompts": prompts, "responses": responses,
            "response_mask": torch.ones(2, 4, dtype=torch.long),
            "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention,
            "position_ids": attention.cumsum(1) - 1, "token_level_scores": torch.zeros(2, 4),
            "rollout_log_probs": torch.full((2, 4), -0.5), "rollout_kept_counts": kept,
        },
        {"uid": ["s0:0"] * 2},
    )  # fmt: skip
    return group_of(batch, "s0", 0, 0)


def test_kept_set_sizes_from_a_sampler_are_checked():
    from creditrl.asynchronous.messages import episode_ids
    from creditrl.asynchronous.validation import GroupLimits, MessageError, check_payload

    def decoded(kept: torch.Tensor):
        group = _group(kept)
        return check_payload(group.to_bytes(), "s0", 0, 0, episode_ids("s0", 0, 2))[0]

    limits = GroupLimits(2, 10, 8, 8, optional=frozenset({"rollout_kept_counts"}))
    limits.check(decoded(torch.full((2, 4), 10)), "s0", 0, 0, 0)  # the whole vocabulary
    with pytest.raises(MessageError, match="more than the vocabulary") as e:
        limits.check(decoded(torch.full((2, 4), 11)), "s0", 0, 0, 0)
    assert e.value.reason == "value"
    with pytest.raises(MessageError, match="counts outside") as e:
        decoded(torch.full((2, 4), -1))
    assert e.value.reason == "value"
    with pytest.raises(MessageError) as e:  # dtype: int64 only
        decoded(torch.full((2, 4), 3.0))
    assert e.value.reason == "dtype"
    with pytest.raises(MessageError, match="rollout_kept_counts") as e:  # a run without replay
        GroupLimits(2, 10, 8, 8).check(decoded(torch.full((2, 4), 3)), "s0", 0, 0, 0)
    assert e.value.reason == "fields"


# ---- in the rollout dump and creditrl explain --------------------------------------------------


def test_explain_shows_the_kept_set_size_and_the_log_prob_over_it(tmp_path, tokenizer):
    from creditrl.batch import Batch
    from creditrl.inspect.from_run import views_from_run
    from creditrl.tracking import RolloutDumper

    prompts, responses = torch.tensor([[504, 1032]]), torch.tensor([[330, 331, 332, 2]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 0]])
    rollout = torch.tensor([[-0.5, -1.25, -0.75, 0.0]])
    batch = Batch(
        {
            "prompts": prompts, "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention,
            "response_mask": attention[:, 2:], "rollout_log_probs": rollout,
            "rollout_kept_counts": torch.tensor([[3, 17, 1, 0]]), "old_log_probs": rollout,
            "token_level_scores": torch.tensor([[0.0, 0.0, 1.0, 0.0]]),
        },
        {"uid": ["a"], "data_source": ["toy"], "ground_truth": ["1"]},
    )  # fmt: skip
    RolloutDumper(tmp_path, rows_per_step=1, tokenizer=tokenizer).dump(batch, step=1)
    (view,) = views_from_run(tmp_path)
    assert view.columns["kept"] == [3, 17, 1]
    assert view.columns["rollout_log_prob"] == pytest.approx([-0.5, -1.25, -0.75])


# ---- end to end: a truncated-sampling run trains the policy that sampled -------------------------


def _first_step(out) -> tuple[dict, dict]:
    import json

    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    dump = json.loads((out / "rollouts" / "step_000001.jsonl").read_text().splitlines()[0])
    return metrics, dump["per_token"]


REPLAY_RUN = (
    "data.train_size=8", "data.val_size=0", "trainer.total_steps=1", "trainer.save_freq=0",
    "trainer.test_freq=0", "trainer.val_before_train=false", "rollout.max_response_length=8",
    "reward.num_workers=0", "rollout.top_p=0.9", "rollout.min_p=0.05",
    "actor.use_rollout_log_probs=true", "actor.use_kl_loss=true",
)  # fmt: skip


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_top_p_run_reuses_the_samplers_log_probs_and_starts_at_ratio_one(tmp_path, mode):
    from helpers import tiny_learner_config, tiny_trainer_config, train_async_in_process

    from creditrl.asynchronous.launcher import free_port

    if mode == "sync":
        from creditrl.trainers.rl_trainer import RLTrainer

        cfg = tiny_trainer_config(tmp_path, *REPLAY_RUN)
        RLTrainer(cfg).fit()
    else:
        from creditrl.asynchronous.learner import Learner

        cfg = tiny_learner_config(tmp_path, *REPLAY_RUN, "asynchronous.max_staleness=0")
        learner = Learner(cfg, port=free_port())
        train_async_in_process(learner, cfg)
    metrics, per_token = _first_step(tmp_path)
    kept = per_token["rollout_kept_counts"]
    assert all(k >= 1 for k, m in zip(kept, per_token["response_mask"], strict=True) if m)
    # the old log-probs are the sampler's (reused: they are the actor's), so ratio 1 at first
    assert per_token["old_log_probs"] == per_token["rollout_log_probs"]
    assert metrics["health/first_minibatch_clipfrac"] == 0.0
    assert abs(metrics["health/first_minibatch_ppo_kl"]) < 1e-5


def test_a_multi_turn_top_p_run_replays_each_turns_kept_sets(tmp_path):
    """An agent program of two turns through the endpoint with top_p=0.9 and min_p=0.05: each
    policy token carries its kept-set size (observations 0), the sampler's log-probs are reused
    as the old ones and the first update's ratio is 1 (a multi-turn run was trained over the
    whole vocabulary, off by about 0.02 per token)."""
    from pathlib import Path

    from helpers import tiny_trainer_config

    from creditrl.trainers.rl_trainer import RLTrainer

    programs = Path(__file__).parent / "programs" / "agents.py"
    cfg = tiny_trainer_config(
        tmp_path, *REPLAY_RUN, "agent.enable=true", f"agent.program={programs}:two_turns",
        "rollout.max_response_length=24",
    )  # fmt: skip
    assert rollout_log_probs_are_actors(cfg) and kept_sets_recorded(cfg)
    RLTrainer(cfg).fit()
    metrics, per_token = _first_step(tmp_path)
    kept, mask = per_token["rollout_kept_counts"], per_token["response_mask"]
    assert sum(mask) > 0 and 0 in mask  # policy tokens and a masked observation
    assert all((k >= 1) == bool(m) for k, m in zip(kept, mask, strict=True))
    assert per_token["old_log_probs"] == per_token["rollout_log_probs"]
    assert metrics["health/first_minibatch_clipfrac"] == 0.0
    assert abs(metrics["health/first_minibatch_ppo_kl"]) < 1e-5

"""Partial rollout (``asynchronous.partial_rollout``): a sampler takes newer weights between
decode chunks, the unfinished rows continue on them, each token records the version that
sampled it, and the learner's importance weights use that version's log-probs.

Model: the conftest's tiny random Llama (float32, the real tokenizer's vocabulary; it never
samples EOS, so every row runs to the budget) with 1000 ids declared EOS in the first test so
rows end at different steps. Tolerances: ids equal; log-probs to 1e-5 (float32 sums over
other batch shapes; the turn-cache tests measure <= 2e-6).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import (
    chat_prompts,
    synthetic_group,
    tiny_engine_config,
    tiny_learner_config,
    train_async_in_process,
)

from creditrl.asynchronous.launcher import free_port, load_from_args
from creditrl.asynchronous.learner import Learner
from creditrl.asynchronous.messages import MessageError
from creditrl.asynchronous.partial import PartialRollout, group_versions
from creditrl.asynchronous.settings import check_async_config
from creditrl.asynchronous.staleness import GroupBuffer, GroupStats, version_metrics
from creditrl.asynchronous.validation import GroupLimits
from creditrl.batch import Batch, position_ids_from_mask
from creditrl.config import load_config
from creditrl.config.schema import RolloutConfig
from creditrl.core import compute_rollout_importance_weights
from creditrl.inspect.from_run import views_from_run
from creditrl.models.tiny import tiny_model_dir
from creditrl.rollout import HFRolloutEngine
from creditrl.trainers.rl_trainer import RLTrainer
from creditrl.weights import InProcessChannel
from creditrl.workers import policy_forward
from creditrl.workers.hybrid import HybridWorker

LOG_PROB_ATOL = 1e-5
QUESTIONS = ("What is 3 + 4?", "Name a colour, then stop.")
PROMPTS = [[1, 520, 9, 33, 4001, 77], [1, 12, 13], [1, 900, 901, 902, 903, 904, 905]]


def prompts(repeat: int = 2) -> Batch:
    """Left-padded PROMPTS, each ``repeat`` times, with a ``sample_seed`` per row."""
    rows = [p for p in PROMPTS for _ in range(repeat)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    batch = Batch(
        {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}
    )
    batch["sample_seed"] = torch.arange(len(rows), dtype=torch.long) * 7919 + 11
    return batch


def engine(model, tokenizer, eos: list[int] | None = None, length: int = 20) -> HFRolloutEngine:
    cfg = RolloutConfig(max_response_length=length, temperature=1.0, micro_batch_size=8)
    return HFRolloutEngine(model, tokenizer, cfg, seed=0, eos_token_ids=eos)


def test_chunks_without_a_switch_sample_what_one_call_samples(model, tokenizer):
    """Rows ending at different steps (1000 EOS ids): chunks of 3 give the ids, the log-probs
    and the mask of one whole call, every token at version 5, and no switch."""
    eos = list(range(6000, 7000))
    whole = engine(model, tokenizer, eos).generate(prompts())
    partial = PartialRollout(
        engine(model, tokenizer, eos), tokenizer, max_response_length=20, chunk_tokens=3,
        weights=InProcessChannel(version=5),
    )  # fmt: skip
    out = partial.generate(prompts())
    assert torch.equal(out["responses"], whole["responses"])
    assert torch.equal(out["response_mask"], whole["response_mask"])
    assert torch.equal(out["attention_mask"], whole["attention_mask"])
    torch.testing.assert_close(
        out["rollout_log_probs"], whole["rollout_log_probs"], atol=LOG_PROB_ATOL, rtol=0
    )
    lengths = out["response_mask"].sum(-1)
    assert len(set(lengths.tolist())) > 1  # rows ended at different steps
    assert torch.equal(out["token_weight_version"], out["response_mask"] * 5)
    assert partial.last_stats["switches"] == 0 and partial.last_stats["chunks"] >= 7


def test_a_weight_update_mid_generation_switches_at_the_right_token(model, tokenizer):
    """New weights land after the first chunk of 4: every row's tokens 1-4 are version 0 and
    5-12 version 1; each token's rollout log-prob is the log-prob of the weights that sampled
    it (a full forward pass of that version); the learner, now at version 1, computes
    importance weights exactly 1 on the new version's tokens and not on the old ones."""
    policy = copy.deepcopy(model)
    old = copy.deepcopy(model)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    calls = []
    channel = InProcessChannel()
    channel.attach(policy)  # what the engine samples with
    refresh = channel.refresh

    def refreshed() -> bool:
        calls.append(len(calls))
        if len(calls) == 2:  # the learner published version 1 during the first chunk
            channel.publish(new, 1)
        return refresh()

    channel.refresh = refreshed
    partial = PartialRollout(
        engine(policy, tokenizer, length=12), tokenizer, max_response_length=12,
        chunk_tokens=4, weights=channel,
    )  # fmt: skip
    out = partial.generate(prompts(repeat=1))
    assert out["responses"].shape == (3, 12) and bool(out["response_mask"].all())
    versions = out["token_weight_version"]
    assert versions[:, :4].eq(0).all() and versions[:, 4:].eq(1).all()
    assert partial.last_stats["switches"] == 1 and len(calls) == 3
    with torch.no_grad():
        under_old, _ = policy_forward(old, out, 1.0)
        under_new, _ = policy_forward(new, out, 1.0)
    behaviour = out["rollout_log_probs"]
    torch.testing.assert_close(behaviour[:, :4], under_old[:, :4], atol=LOG_PROB_ATOL, rtol=0)
    torch.testing.assert_close(behaviour[:, 4:], under_new[:, 4:], atol=LOG_PROB_ATOL, rtol=0)
    assert (behaviour[:, :4] - under_new[:, :4]).abs().max() > 1e-3  # the versions differ
    weights, _, _ = compute_rollout_importance_weights(
        under_new, behaviour, out["response_mask"], rollout_is_threshold=1e6
    )
    torch.testing.assert_close(weights[:, 4:], torch.ones(3, 8), atol=1e-4, rtol=0)
    assert (weights[:, :4] - 1).abs().max() > 1e-3
    metrics = version_metrics(out, 1)
    assert metrics["async/token_staleness/mean"] == pytest.approx(4 / 12)
    assert metrics["async/token_staleness/max"] == 1.0
    assert metrics["async/partial/switched_fraction"] == 1.0


def test_a_greedy_call_is_one_whole_engine_call(model, tokenizer):
    calls = []
    channel = InProcessChannel()
    channel.refresh = lambda: calls.append(1) or False
    partial = PartialRollout(
        engine(model, tokenizer), tokenizer, max_response_length=20, chunk_tokens=3,
        weights=channel,
    )  # fmt: skip
    out = partial.generate(prompts(repeat=1), greedy=True)
    assert "token_weight_version" not in out and not calls


# ---- the learner's checks of token_weight_version ------------------------------------------


def _with_versions(versions: list[list[int]], weight_version: int = 2) -> Batch:
    group = synthetic_group(version=weight_version)
    group["token_weight_version"] = torch.tensor(versions, dtype=torch.long)
    return group


def _limits() -> GroupLimits:
    return GroupLimits(
        n=2, vocab_size=1000, max_prompt=16, max_response=16,
        optional=frozenset({"token_weight_version"}),
    )  # fmt: skip


def test_token_versions_that_rise_from_the_group_version_pass():
    _limits().check(_with_versions([[2, 2, 3, 4], [2, 3, 3, 0]]), "s0", 0, 2, 4)
    _limits().check(_with_versions([[3, 3, 3, 4], [2, 3, 3, 0]]), "s0", 0, 2, 4)  # a later start


@pytest.mark.parametrize(
    ("versions", "current", "reason", "words"),
    [
        ([[2, 2, 3, 4], [2, 3, 3, 1]], 4, "value", "not 0 on padding"),
        ([[2, 3, 2, 4], [2, 3, 3, 0]], 4, "value", "row 0 decreases"),
        ([[3, 3, 3, 3], [3, 3, 3, 0]], 4, "value", "oldest token_weight_version 3 is not"),
        ([[2, 2, 3, 5], [2, 3, 3, 0]], 4, "version", "outside [2, 4]"),
        ([[2, 1, 3, 4], [2, 3, 3, 0]], 4, "version", "outside [2, 4]"),
    ],
)
def test_bad_token_versions_are_refused(versions, current, reason, words):
    with pytest.raises(MessageError) as err:
        _limits().check(_with_versions(versions), "s0", 0, 2, current)
    assert err.value.reason == reason and words in str(err.value)


# ---- the staleness policies -----------------------------------------------------------------


def test_keep_trains_stale_groups_and_stats_show_their_length_and_score():
    from creditrl.asynchronous.staleness import BufferedGroup

    keep, drop = GroupBuffer(1, drop=False), GroupBuffer(1)
    for buffer in (keep, drop):
        buffer.add(BufferedGroup("s0", 0, 0, synthetic_group(version=0)))
    assert keep.drop_stale(5) == [] and len(keep) == 1
    assert len(drop.drop_stale(5)) == 1 and len(drop) == 0
    stats = GroupStats()
    late = synthetic_group(version=0)  # lengths 4 and 3, scores 1 and 0
    late["staleness"] = torch.tensor([3, 3])
    fresh = synthetic_group(seq=1, version=2)
    fresh["staleness"] = torch.tensor([0, 0])
    stats.add_trained(late, 1)
    stats.add_trained(fresh, 1)
    stats.add("dropped", synthetic_group(seq=2))
    metrics = stats.metrics()
    assert metrics["async/late/episodes"] == 2 and metrics["async/trained/episodes"] == 2
    assert metrics["async/late/response_length"] == 3.5
    assert metrics["async/late/score"] == 0.5
    assert metrics["async/dropped/episodes"] == 2
    assert metrics["async/dropped/response_length"] == 3.5


def test_config_refuses_keep_without_the_learners_importance_weights(tmp_path):
    cfg = tiny_learner_config(
        tmp_path, "asynchronous.staleness_policy=keep", "asynchronous.old_log_probs=sampler"
    )
    with pytest.raises(ValueError, match="old_log_probs=learner"):
        check_async_config(cfg)


def test_between_two_turns_an_episode_takes_new_weights(tmp_path):
    """An agent program of two turns (tests/programs/agents.py:two_turns) whose turn generator
    refreshes: the weights change after the first turns' engine call. Every episode's first
    turn is version 0, the tool result between takes the version before it, its second turn
    version 1, and each turn's log-probs are those of the weights that sampled it (the kept
    KV was dropped, so the second turn's context was prefilled under the new weights)."""
    programs = Path(__file__).parent / "programs" / "agents.py"
    cfg = tiny_engine_config(
        tmp_path, "agent.enable=true", f"agent.program={programs}:two_turns",
        "rollout.max_response_length=24", "reward.num_workers=0",
        "asynchronous.partial_rollout=true",
    )  # fmt: skip
    worker = HybridWorker(cfg)
    try:
        model = worker.engine.model
        old = copy.deepcopy(model)
        calls = []
        channel = InProcessChannel()
        channel.attach(model)
        refresh = channel.refresh

        def refreshed() -> bool:
            calls.append(1)
            if len(calls) == 2:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.05 * torch.randn_like(p))
                channel.publish(model, 1)  # trained in place: the engine's own module
            return refresh()

        channel.refresh = refreshed
        worker.rollout.turns.weights = channel
        batch = worker.rollout.generate(chat_prompts(worker.tokenizer, QUESTIONS), seed=3)
    finally:
        worker.rollout.close()
    assert len(calls) == 2  # the first turns in one engine call, the second turns in another
    versions, turns = batch["token_weight_version"], batch["turn_ids"]
    mask = batch["response_mask"].bool()
    real = batch["attention_mask"][:, -mask.shape[1] :].bool()
    assert versions[mask & (turns == 1)].eq(0).all() and versions[mask & (turns == 2)].eq(1).all()
    assert versions[real & ~mask].eq(0).all() and versions[~real].eq(0).all()
    with torch.no_grad():
        under_old, _ = policy_forward(old, batch, 1.0)
        under_new, _ = policy_forward(model, batch, 1.0)
    behaviour = batch["rollout_log_probs"]
    first, second = mask & (turns == 1), mask & (turns == 2)
    torch.testing.assert_close(behaviour[first], under_old[first], atol=LOG_PROB_ATOL, rtol=0)
    torch.testing.assert_close(behaviour[second], under_new[second], atol=LOG_PROB_ATOL, rtol=0)
    assert (behaviour[second] - under_old[second]).abs().max() > 1e-3
    assert group_versions(batch, 2, 7) == [0, 0]


def test_unknown_versions_take_their_groups_oldest():
    """-1 (before an episode's first turn, an empty episode's placeholder) becomes the group's
    oldest known version, or the default for a group with none."""
    batch = synthetic_group()  # lengths 4 and 3
    batch = Batch.concat([batch, synthetic_group(seq=1)])
    batch["token_weight_version"] = torch.tensor(
        [[-1, 3, 3, 4], [4, 4, 5, 0], [-1, -1, -1, -1], [-1, -1, -1, 0]]
    )
    assert group_versions(batch, 2, 9) == [3, 9]
    assert batch["token_weight_version"].tolist() == [
        [3, 3, 3, 4], [4, 4, 5, 0], [9, 9, 9, 9], [9, 9, 9, 0]
    ]  # fmt: skip


# ---- a run: the learner and a sampler in process ----------------------------------------------


def spaces(data_source: str, solution_str: str, ground_truth: object, extra_info: object = None):
    """A score that varies within a group: the answer's spaces per token of its budget."""
    return min(solution_str.count(" "), 8) / 8


def _recorded(loop) -> list[dict]:
    """Wrap ``loop.train_step`` to keep each step's responses, scores and metrics."""
    steps: list[dict] = []
    train_step = loop.train_step

    def recording() -> dict[str, float]:
        metrics = train_step()
        batch = loop.last_batch
        rows = zip(batch["responses"], batch["response_mask"].bool(), strict=True)
        steps.append(
            {
                "responses": [row[m].tolist() for row, m in rows],
                "scores": batch["token_level_scores"].sum(-1).tolist(),
                "metrics": metrics,
            }
        )
        return metrics

    loop.train_step = recording
    return steps


def _settings(out, *extra: str) -> list[str]:
    """3 GRPO steps of the tiny model: 2 prompts x 2 answers of at most 8 tokens, dumped."""
    return [
        "preset=grpo", "rollout.n=2", "actor.autocast=none", f"model.path={tiny_model_dir()}",
        "data.train_size=24", "data.val_size=2", "data.train_batch_size=2",
        "rollout.max_response_length=8", "rollout.temperature=1.0",
        "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size=2", "actor.optim.lr=1e-3",
        "reward.num_workers=0", f"reward.scorer={__file__}:spaces", "trainer.total_steps=3",
        "trainer.save_freq=0", "trainer.test_freq=0", "trainer.logger=[jsonl]",
        "trainer.rollout_dump_rows=2", "asynchronous.max_staleness=0",
        f"trainer.output_dir={out}", *extra,
    ]  # fmt: skip


def test_partial_rollout_at_staleness_0_trains_what_sync_trains_and_explains_versions(tmp_path):
    """One sampler at staleness 0 never sees new weights mid-batch: chunks of 3 tokens sample
    the samples `creditrl train` samples, scored alike, with equal losses (to float rounding
    of the chunked log-probs), every token at the step's version; the dump and `creditrl
    explain` show each token's version."""
    trainer = RLTrainer(load_config(overrides=_settings(tmp_path / "sync")))
    sync = _recorded(trainer)
    trainer.fit()
    partial = ("asynchronous.partial_rollout=true", "asynchronous.partial_chunk_tokens=3")
    cfg, _, _ = load_from_args(_settings(tmp_path / "async", *partial))
    learner = Learner(cfg, port=free_port())
    asyn = _recorded(learner)
    train_async_in_process(learner, cfg)
    assert len(sync) == len(asyn) == 3
    for step, (a, b) in enumerate(zip(sync, asyn, strict=True), start=1):
        assert a["responses"] == b["responses"], f"step {step}: samples"
        assert a["scores"] == b["scores"], f"step {step}: scores"
        loss = a["metrics"]["actor/pg_loss"]
        assert b["metrics"]["actor/pg_loss"] == pytest.approx(loss, abs=1e-5), f"step {step}"
        assert b["metrics"]["async/token_staleness/mean"] == 0.0
        assert b["metrics"]["async/partial/switched_fraction"] == 0.0
    views = views_from_run(tmp_path / "async", step=3)
    assert views and all(set(v.columns["version"]) == {2} for v in views)

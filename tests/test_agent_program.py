"""agent.program: an OpenAI-client agent trained token-exact through creditrl's endpoint."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from helpers import chat_prompts, tiny_engine_config

from creditrl.batch import Batch
from creditrl.errors import UserCodeError
from creditrl.trainers.rl_trainer import RLTrainer
from creditrl.workers.hybrid import HybridWorker

PROGRAMS = Path(__file__).parent / "programs" / "agents.py"
QUESTIONS = ("What is 3 + 4?", "Name a colour, then stop.")


def prompts_of(worker: HybridWorker) -> Batch:
    """Two chat prompts, each twice (a group of 2), with their messages as the dataset gives."""
    return chat_prompts(worker.tokenizer, QUESTIONS)


def program_config(tmp_path: Path, name: str, *extra: str):
    return tiny_engine_config(
        tmp_path, "agent.enable=true", f"agent.program={PROGRAMS}:{name}",
        "rollout.max_response_length=24", "reward.num_workers=0", *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = HybridWorker(program_config(tmp_path_factory.mktemp("w"), "two_turns"))
    yield w
    w.rollout.close()


def test_the_trained_ids_and_log_probs_are_what_the_engine_answered(worker) -> None:
    """Each episode's two turns: the response holds exactly the ids the endpoint returned to
    the client (mask 1, turn 1 and 2) with their log-probs, and between them the tool result
    (mask 0, turn 1, log-prob 0); the prompt is the first request rendered."""
    recorded = worker.rollout.program.__globals__["RECORDED"]
    recorded.clear()
    prompts = prompts_of(worker)
    batch = worker.rollout.generate(prompts, seed=3)
    assert len(recorded) == len(prompts)
    answered = list(recorded.values())
    for i in range(len(batch)):
        mask, turns = batch["response_mask"][i], batch["turn_ids"][i]
        real = batch["attention_mask"][i, -batch["responses"].shape[1] :].bool()
        ids = batch["responses"][i][real].tolist()
        policy = batch["responses"][i][real & mask.bool()].tolist()
        log_probs = batch["rollout_log_probs"][i][real & mask.bool()].tolist()
        matching = [a for a in answered if a[0][0] + a[1][0] == policy]
        assert matching, (i, policy)
        (first_ids, first_lp), (second_ids, second_lp) = matching[0]
        torch.testing.assert_close(torch.tensor(log_probs), torch.tensor(first_lp + second_lp))
        n1 = len(first_ids)
        assert ids[:n1] == first_ids and ids[-len(second_ids) :] == second_ids
        observation = real.nonzero().flatten()[n1 : len(ids) - len(second_ids)]
        assert len(observation) > 0
        assert mask[observation].eq(0).all() and turns[observation].eq(1).all()
        assert batch["rollout_log_probs"][i][observation].eq(0).all()
        assert "42" in worker.tokenizer.decode(batch["responses"][i][observation])
        assert batch["agent_info"][i]["episode"] == "ok"
        assert batch["extra_info"][i]["program_reward"] == 1.0


def test_the_log_probs_match_the_training_forward(worker) -> None:
    """The rollout log-probs of the policy's tokens equal a teacher-forced forward of the
    trained sequence at the rollout temperature (observations included in the context)."""
    from creditrl.workers.actor import policy_forward

    batch = worker.rollout.generate(prompts_of(worker), seed=5)
    with torch.no_grad():
        forward = policy_forward(worker.actor.model, batch, worker.cfg.rollout.temperature)[0]
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(forward[mask], batch["rollout_log_probs"][mask], atol=1e-4, rtol=0)


def test_a_program_that_rewrites_its_history_is_counted_and_located(tmp_path: Path) -> None:
    """The second request edits the first reply: recording stops there ("rewritten"), the
    first diverging token is recorded, and nothing after it is trained on."""
    w = HybridWorker(program_config(tmp_path, "rewrites_history"))
    try:
        batch = w.rollout.generate(prompts_of(w), seed=1)
    finally:
        w.rollout.close()
    for i, info in enumerate(batch["agent_info"]):
        assert info["stop_reason"] == "rewritten" and batch["num_turns"][i] == 1
        drift = info["endpoint_drift"]
        assert len(drift) == 1 and drift[0]["turn"] == 1
        assert "edited" in drift[0]["rendered_text"] or drift[0]["rendered_span"]
        assert batch["turn_ids"][i].max() == 1
        assert "program_reward" not in batch["extra_info"][i]
    from creditrl.agents.rollout import agent_metrics

    metrics = agent_metrics(batch)
    assert metrics["tokenization/endpoint_rewritten"] == len(batch)
    assert metrics["tokenization/endpoint_drift_rate"] == 1.0


@pytest.mark.parametrize(
    "name,status",
    [
        ("raises", "error"),
        ("never_calls", "no_model_call"),
        ("sleeps", "timeout"),
        ("long_first_request", "refused"),
    ],
)
def test_failed_episodes_are_counted_and_scored_the_fallback(tmp_path: Path, name, status) -> None:
    """An episode that raises, never calls the model, or runs past its timeout (the program
    sleeps 60 s; the timeout is 2 s, or 120 s for the others) is counted by its status and
    scored reward.fallback_score; one bad episode never ends the batch."""
    timeout = 2 if status == "timeout" else 120
    w = HybridWorker(program_config(tmp_path, name, f"agent.episode_timeout_s={timeout}",
                                    "reward.fallback_score=-1"))  # fmt: skip
    try:
        batch = w.rollout.generate(prompts_of(w), seed=1)
    finally:
        w.rollout.close()
    assert [info["episode"] for info in batch["agent_info"]] == [status] * len(batch)
    assert [e["program_reward"] for e in batch["extra_info"]] == [-1.0] * len(batch)
    if name == "raises":
        assert "RuntimeError: the agent crashed" in batch["agent_info"][0]["episode_error"]
    if name == "long_first_request":  # refused as the async learner would refuse its width
        assert "more than data.max_prompt_length" in batch["agent_info"][0]["episode_error"]
        assert batch.meta["endpoint"]["refused"] == len(batch)


def test_the_endpoint_refuses_with_openai_errors(worker) -> None:
    """Over a real loopback socket with the real openai package: a wrong key (401), an unknown
    trajectory (404), streaming (400) and an oversized body (413) are OpenAI errors, counted."""
    import openai

    rollout = worker.rollout
    endpoint = rollout._endpoint()
    before = sum(endpoint.refused.values())

    async def attempts():
        bad_key = openai.AsyncOpenAI(base_url=endpoint.base_url("x"), api_key="no", max_retries=0)
        unknown = openai.AsyncOpenAI(base_url=endpoint.base_url("nope"), api_key=endpoint.key,
                                     max_retries=0)  # fmt: skip
        errors = []
        for client, kwargs in (
            (bad_key, {}),
            (unknown, {}),
            (unknown, {"messages": [{"role": "user", "content": "x" * (5 << 20)}]}),
        ):
            try:
                await client.chat.completions.create(
                    model="p", **{"messages": [{"role": "user", "content": "hi"}], **kwargs}
                )
            except openai.APIStatusError as e:
                errors.append(
                    (e.status_code, e.body.get("code") if isinstance(e.body, dict) else None)
                )
        models = await unknown.models.list()
        await bad_key.close()
        await unknown.close()
        return errors, [m.id for m in models.data]

    errors, models = asyncio.run(attempts())
    assert errors == [
        (401, "invalid_api_key"),
        (404, "unknown_trajectory"),
        (413, "body_too_large"),
    ]
    assert models == ["creditrl-policy"]
    assert sum(endpoint.refused.values()) == before + 3


def test_two_training_steps_with_a_program(tmp_path: Path) -> None:
    """`agent.program` through the whole trainer: 2 steps, episodes ok, rewards from the
    program, metrics logged."""
    cfg = program_config(tmp_path, "two_turns", "trainer.total_steps=2", "trainer.test_freq=0")
    trainer = RLTrainer(cfg)
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) > 0]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["agent/episodes_ok"] == 4 and r["critic/score/mean"] == 1.0 for r in steps)
    assert all(r["endpoint/refused"] == 0 and r["endpoint/requests"] >= 8 for r in steps)


def test_program_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(UserCodeError, match=r"is not an async function"):
        HybridWorker(program_config(tmp_path, "not_async"))

"""agent.program episodes that fail, block or misbehave, and the endpoint under abuse: every
failure is a scored, counted episode, never the end of a run."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
from pathlib import Path

import pytest
import torch
from helpers import chat_prompts, tiny_engine_config

from creditrl.agents.loop import Trajectory
from creditrl.agents.rewards import StructuredRewardManager
from creditrl.agents.rollout import trajectories_to_batch
from creditrl.batch import Batch
from creditrl.config.schema import AgentConfig, AlgorithmConfig, RewardConfig
from creditrl.pipeline import stages
from creditrl.trainers.rl_trainer import RLTrainer

PROGRAMS = Path(__file__).parent / "programs" / "agents.py"


def program_config(tmp_path: Path, name: str, *extra: str):
    return tiny_engine_config(
        tmp_path, "agent.enable=true", f"agent.program={PROGRAMS}:{name}",
        "rollout.max_response_length=24", "reward.num_workers=0", "reward.fallback_score=-1",
        *extra,
    )  # fmt: skip


def metric_rows(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "name,status,extra",
    [
        ("raises_first", "error", ()),
        ("long_first_request", "refused", ()),
    ],
)
def test_an_episode_without_a_model_turn_trains_scored_the_fallback(
    tmp_path: Path, name: str, status: str, extra: tuple[str, ...]
) -> None:
    """A program that raises before its first call, or whose first request is refused as
    longer than data.max_prompt_length (e.g. an OpenAI tools block): the step and the validation
    run, every episode counted by its status and scored reward.fallback_score."""
    cfg = program_config(tmp_path, name, "trainer.total_steps=1", "trainer.test_freq=1", *extra)
    RLTrainer(cfg).fit()
    rows = metric_rows(tmp_path)
    step = next(r for r in rows if r.get("step") == 1 and "critic/score/mean" in r)
    assert step[f"agent/episodes_{status}"] == 4 and step["critic/score/mean"] == -1.0
    val = next(r for r in rows if f"val/agent/episodes_{status}" in r)
    assert val[f"val/agent/episodes_{status}"] == 2 and val["val/score"] == -1.0


def test_the_refusal_of_a_long_first_request_names_the_key_to_raise(tmp_path: Path) -> None:
    from creditrl.workers.hybrid import HybridWorker

    w = HybridWorker(program_config(tmp_path, "long_first_request"))
    try:
        batch = w.rollout.generate(_prompts(w), seed=1)
    finally:
        w.rollout.close()
    error = batch["agent_info"][0]["episode_error"]
    assert "more than data.max_prompt_length=256" in error
    assert "raise data.max_prompt_length" in error
    assert batch["num_turns"].tolist() == [0, 0]


def test_a_spent_budget_is_a_truncation_not_an_error(worker) -> None:
    """Turns of 16 tokens in a budget of 24: the first turn and the start of its observation
    fill it, the next request is a 400 saying "maximum context length", and the program that
    lets it raise is "truncated": its turn trained on, scored by the scorer, not the
    fallback."""
    batch = run_program(worker, "asks_until_refused")
    assert statuses(batch) == ["truncated"] * 4
    assert batch["num_turns"].tolist() == [1] * 4
    assert batch["response_mask"].sum(-1).tolist() == [16] * 4
    assert batch["attention_mask"][:, -24:].sum(-1).tolist() == [24] * 4
    assert [info["stop_reason"] for info in batch["agent_info"]] == ["length"] * 4
    assert all("program_reward" not in e for e in batch["extra_info"])
    assert worker.rollout.last_metrics["agent/episodes_truncated"] == 4


def test_failed_episodes_are_said_on_the_console_and_stop_the_run(tmp_path: Path) -> None:
    """Every episode refused (its first request past data.max_prompt_length): each step says
    so in one line with the reason, and agent.max_failed_steps=2 such steps stop the run in one
    line (it would train on placeholders only)."""
    from io import StringIO

    from rich.console import Console

    from creditrl.errors import NothingToLearnError

    out = StringIO()
    cfg = program_config(tmp_path, "long_first_request", "trainer.total_steps=5",
                         "agent.max_failed_steps=2")  # fmt: skip
    with pytest.raises(NothingToLearnError, match="every episode failed in 2 steps in a row"):
        RLTrainer(cfg, console=Console(file=out, width=400)).fit()
    lines = [ln for ln in out.getvalue().splitlines() if "episodes failed" in ln]
    assert len(lines) == 2
    assert lines[0].startswith("step 1: 4 of 4 episodes failed (refused: its first request")
    assert "data.max_prompt_length=256" in lines[0]
    assert max(r.get("step", 0) for r in metric_rows(tmp_path)) == 2


def _prompts(worker) -> Batch:
    tok = worker.tokenizer
    chat = [{"role": "user", "content": "What is 3 + 4?"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    batch = Batch({"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids),
                  dtype=torch.long)}, {"raw_prompt": [chat], "data_source": ["toy"],
                  "ground_truth": ["7"]})  # fmt: skip
    return batch.repeat(2, interleave=True)


def test_an_empty_trajectory_is_scored_counted_and_never_trained_on() -> None:
    """The placeholder of an episode with no model turn carries its score through the KL stage
    (exactly: its log-probs are made equal) and GRPO (its group sees it), then leaves every
    mask the updates read."""
    ok = Trajectory(prompt_ids=[1, 2], num_turns=1)
    ok.append([5, 6, 7], 1, 1, [-0.1, -0.2, -0.3])
    empty = Trajectory(prompt_ids=[1, 2])
    prompts = Batch({"input_ids": torch.tensor([[1, 2], [1, 2]]),
                     "attention_mask": torch.ones(2, 2, dtype=torch.long)}, {})  # fmt: skip
    batch = trajectories_to_batch(prompts, [empty, ok], pad_token_id=0)
    assert batch["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert batch["num_turns"].tolist() == [0, 1]
    assert stages.score_only_rows(batch).tolist() == [True, False]
    batch["uid"] = ["g", "g"]
    batch["token_level_scores"] = torch.tensor([[-1.0, 0, 0], [0, 0, 1.0]])
    torch.manual_seed(0)
    batch["old_log_probs"] = torch.randn(2, 3)
    batch["ref_log_prob"] = torch.randn(2, 3)
    stages.neutral_score_only_rows(batch)
    alg = AlgorithmConfig(adv_estimator="grpo", use_kl_in_reward=True)
    stages.kl_into_rewards(batch, alg, 0.5)
    assert batch["token_level_rewards"][0].tolist() == [-1.0, 0.0, 0.0]
    assert batch["rollout_log_probs"][0].tolist() == batch["old_log_probs"][0].tolist()
    stages.compute_advantages(batch, alg)
    assert (batch["advantages"][1] > 0).all()  # better than the failed episode of its group
    stages.mask_score_only_rows(batch)
    assert batch["response_mask"][0].eq(0).all() and batch["advantages"][0].eq(0).all()
    assert batch["response_mask"][1].eq(1).all()


def test_the_built_in_loop_scores_an_empty_first_turn(tok) -> None:
    """The built-in agent loop: an engine that returns nothing for the first prompt gives an
    empty trajectory, which the structured reward manager scores like any other."""
    from creditrl.agents.rollout import AgentRollout
    from creditrl.agents.scripted import ScriptedTurnGenerator
    from creditrl.config.schema import RolloutConfig
    from creditrl.data import chat_prompt_ids, collate_prompts

    eos = tok.eos_token_id
    answer = [*tok.encode("<answer>84</answer>", add_special_tokens=False), eos]
    generator = ScriptedTurnGenerator([[[]], [answer]], [eos])
    cfg, budget = AgentConfig(enable=True), RolloutConfig(max_response_length=32)
    rollout = AgentRollout(None, tok, cfg, budget, turn_generator=generator)
    messages = [{"role": "user", "content": "12*7?"}]
    row = {"input_ids": chat_prompt_ids(tok, messages), "raw_prompt": messages,
           "ground_truth": "84", "data_source": "calc_multiturn", "extra_info": {},
           "index": 0}  # fmt: skip
    batch = rollout.generate(collate_prompts([row, row], tok.pad_token_id))
    assert batch["num_turns"].tolist() == [0, 1]
    StructuredRewardManager(RewardConfig(), AgentConfig(), tok).submit(batch).result().write_to(
        batch
    )
    assert batch["token_level_scores"].shape == batch["response_mask"].shape
    assert rollout.last_metrics["agent/stop_no_call"] == 0.5


@pytest.fixture(scope="module")
def tok():
    from creditrl.models import load_tokenizer
    from creditrl.models.tiny import tiny_model_dir

    return load_tokenizer(tiny_model_dir())


# ---- isolation: each episode on its own thread, timed out whatever it does -----------------


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    from creditrl.workers.hybrid import HybridWorker

    w = HybridWorker(program_config(tmp_path_factory.mktemp("w"), "two_turns"))
    assert statuses(run_program(w, "two_turns")) == ["ok"] * 4  # warm: imports, first clients
    yield w
    w.rollout.close()


def two_questions(worker) -> Batch:
    """Two chat prompts, each twice, with their messages as the dataset gives them."""
    return chat_prompts(worker.tokenizer, ("What is 3 + 4?", "Name a colour."))


def run_program(worker, name: str, timeout_s: float = 120) -> Batch:
    """Program ``name`` of tests/programs/agents.py on two questions, each twice, with
    agent.episode_timeout_s=``timeout_s``."""
    rollout = worker.rollout
    rollout.program = rollout.program.__globals__[name]
    rollout.cfg.episode_timeout_s = timeout_s
    return rollout.generate(two_questions(worker), seed=1)


def statuses(batch: Batch) -> list[str]:
    return [info["episode"] for info in batch["agent_info"]]


def test_a_blocking_program_stops_neither_the_endpoint_nor_the_other_episodes(
    worker, monkeypatch
) -> None:
    """Two episodes block their threads past agent.episode_timeout_s: the other two are
    answered meanwhile; the blocked ones are abandoned ("timeout", the fallback score) and
    their requests after unblocking refused (404: their run is over). While abandoned threads
    are at the cap, new episodes are not started (counted, scored the fallback)."""
    from creditrl.agents import episodes

    program = worker.rollout.program.__globals__
    program["RELEASE"].clear()
    events = program["EVENTS"]
    events.clear()
    try:
        batch = run_program(worker, "blocks_on_seven", timeout_s=15)
        assert events == ["answered", "answered"]  # while the other two were still blocked
        assert statuses(batch) == ["timeout", "timeout", "ok", "ok"]
        assert [e["program_reward"] for e in batch["extra_info"]] == [-1.0, -1.0, 1.0, 1.0]
        assert "abandoned" in batch["agent_info"][0]["episode_error"]
        assert episodes.abandoned_threads() == 2
        monkeypatch.setattr(episodes, "MAX_ABANDONED", 2)
        batch = run_program(worker, "two_turns")
        assert statuses(batch) == ["not_started"] * 4
        assert batch["num_turns"].tolist() == [0] * 4
        assert worker.rollout.last_metrics["agent/episodes_not_started"] == 4
    finally:
        program["RELEASE"].set()
    for _ in range(200):  # the released threads ask again, are refused, and end
        if episodes.abandoned_threads() == 0:
            break
        threading.Event().wait(0.05)
    assert sorted(events[2:]) == ["refused 404", "refused 404", "unblocked", "unblocked"]
    assert episodes.abandoned_threads() == 0


def test_a_program_that_catches_the_timeout_is_abandoned(worker) -> None:
    """The timeout's cancellation caught and ignored: "timeout" all the same, not "ok"."""
    from creditrl.agents import episodes

    batch = run_program(worker, "swallows_cancel", timeout_s=1)
    assert statuses(batch) == ["timeout"] * 4
    for _ in range(200):  # its event loop was told to stop: the threads end
        if episodes.abandoned_threads() == 0:
            break
        threading.Event().wait(0.05)
    assert episodes.abandoned_threads() == 0


@pytest.mark.parametrize(
    "name,status,error",
    [
        ("exits", "exit", "SystemExit: 3"),
        ("interrupts", "interrupted", "KeyboardInterrupt"),
        ("cancels", "cancelled", "CancelledError"),
        ("huge_reward", "bad_reward", "out of the float range"),
        ("nan_reward", "bad_reward", "not finite"),
    ],
)
def test_base_exceptions_and_bad_rewards_are_counted_statuses(
    worker, name: str, status: str, error: str
) -> None:
    """SystemExit, KeyboardInterrupt and CancelledError raised by a program, and a reward of
    10**400 or nan, are statuses of their episode (scored the fallback); the next batch runs."""
    batch = run_program(worker, name)
    assert statuses(batch) == [status] * 4
    assert error in batch["agent_info"][0]["episode_error"]
    assert [e["program_reward"] for e in batch["extra_info"]] == [-1.0] * 4
    assert worker.rollout.last_metrics[f"agent/episodes_{status}"] == 4
    assert statuses(run_program(worker, "two_turns")) == ["ok"] * 4


# ---- the endpoint bounds what it serves -----------------------------------------------------


def test_bad_request_content_is_a_counted_400_never_a_500(worker) -> None:
    """tools=5, content or role or name of the wrong type, no messages and a lone surrogate:
    each an OpenAI-style 400, counted; the episode goes on to a good request."""
    program = worker.rollout.program.__globals__
    program["BAD_REQUESTS"].clear()
    endpoint = worker.rollout._endpoint()
    before = sum(endpoint.refused.values())
    batch = run_program(worker, "sends_bad_requests")
    assert statuses(batch) == ["ok"] * 4
    got = {(what, status, code) for what, status, code in program["BAD_REQUESTS"]}
    assert got == {
        ("tools=5", 400, "bad_request"),
        ("content=5", 400, "bad_request"),
        ("role=1", 400, "bad_request"),
        ("name=5", 400, "bad_request"),
        ("no messages", 400, "bad_request"),
        ("lone surrogate", 400, "bad_json"),
    }
    assert sum(endpoint.refused.values()) == before + 6 * 4
    assert endpoint.refused["internal_error"] == 0


def test_after_recording_stops_the_episode_stays_within_its_budget(worker) -> None:
    """History rewritten after the first reply: later requests are still generated, but all
    an episode generates stays within rollout.max_response_length=24 (then budget_exhausted),
    and a context past data.max_prompt_length + rollout.max_response_length is refused (2 kB:
    rendered and counted; 1 MB: refused by its length before rendering)."""
    program = worker.rollout.program.__globals__
    program["SPENT"].clear()
    batch = run_program(worker, "keeps_asking")
    assert statuses(batch) == ["ok"] * 4
    spent = program["SPENT"]
    assert sum(tokens for _, tokens in spent) <= 24 * 4
    codes = [code for code, _ in spent]
    assert codes.count("budget_exhausted") >= 4 and codes.count("context_too_long") == 2 * 4
    assert set(codes) == {"ok", "budget_exhausted", "context_too_long"}


def _raw(port: int, data: bytes) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(data)
    return conn


def _closed(conn: socket.socket) -> bool:
    conn.settimeout(0.01)
    try:
        return conn.recv(65536) == b"" or _closed(conn)
    except TimeoutError:
        return False
    except OSError:
        return True


def test_half_open_connections_are_timed_out_and_limited() -> None:
    """Connections without the key that send half a request: at most max_unkeyed are open
    (the oldest dropped for a new one), each closed after key_timeout_s, and a keyed request
    still gets through; a keyed body that never arrives is answered 408 after idle_timeout_s."""
    from creditrl.agents.endpoint import Endpoint

    async def handler(trajectory, body):
        return {}

    endpoint = Endpoint(handler, lambda t: True, "m", max_connections=4, max_unkeyed=4,
                        key_timeout_s=1.0, idle_timeout_s=3.0)  # fmt: skip
    endpoint.start()
    try:
        head = b"POST /t/x/v1/chat/completions HTTP/1.1\r\nHost: a\r\n"
        half = [_raw(endpoint.port, head) for _ in range(12)]
        for _ in range(200):  # 8 dropped as the 12 arrive (unless the first timed out)
            if endpoint.refused["connection_dropped"] + endpoint.refused["connection_timeout"] >= 8:
                break
            threading.Event().wait(0.05)
        assert endpoint.refused["connection_dropped"] >= 1
        keyed = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=30)
        keyed.request("GET", "/v1/models", headers={"Authorization": f"Bearer {endpoint.key}"})
        assert keyed.getresponse().status == 200
        alive = [c for c in endpoint._runner.server.connections if not c.transport.is_closing()]
        assert len(alive) <= 4 + 1  # the unkeyed pool and the keyed connection
        slow = _raw(endpoint.port, b"POST /t/x/v1/chat/completions HTTP/1.1\r\nHost: a\r\n"
                    b"Authorization: Bearer " + endpoint.key.encode() +
                    b"\r\nContent-Length: 100\r\n\r\n{")  # fmt: skip
        slow.settimeout(30)
        assert slow.recv(65536).startswith(b"HTTP/1.1 408")
        for _ in range(300):
            if all(_closed(c) for c in half):
                break
            threading.Event().wait(0.05)
        assert all(_closed(c) for c in half)
        # dropped for newer ones (the keyed connections too, before their key was seen), or
        # timed out after 1 s
        timed_out = endpoint.refused["connection_timeout"]
        assert timed_out >= 1 and endpoint.refused["connection_dropped"] + timed_out == 12
    finally:
        endpoint.close()


def test_a_port_in_use_is_one_line_naming_the_key() -> None:
    from creditrl.agents.endpoint import Endpoint
    from creditrl.errors import ConfigError

    async def handler(trajectory, body):
        return {}

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        endpoint = Endpoint(handler, lambda t: True, "m", port=port)
        with pytest.raises(ConfigError, match=rf"agent\.endpoint_port={port}: .*in use"):
            endpoint.start()


@pytest.mark.parametrize("host", ["", "0.0.0.0", "::", "10.0.0.1", "example.org"])
def test_a_non_loopback_endpoint_host_needs_the_opt_in(tmp_path: Path, host: str) -> None:
    """'' and 0.0.0.0 would serve every interface in plain HTTP: refused at config load in
    one line naming the key, unless agent.endpoint_allow_remote=true."""
    from creditrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"agent\.endpoint_host=.* not a loopback address"):
        program_config(tmp_path, "two_turns", f"agent.endpoint_host='{host}'")
    cfg = program_config(
        tmp_path, "two_turns", f"agent.endpoint_host='{host}'", "agent.endpoint_allow_remote=true"
    )
    assert cfg.agent.endpoint_host == host
    for loopback in ("127.0.0.1", "::1", "localhost"):
        assert program_config(tmp_path, "two_turns", f"agent.endpoint_host={loopback}")


def test_an_abandoned_episode_coroutine_closes_without_awaiting() -> None:
    """An abandoned episode's loop is stopped and closed with its coroutine unfinished; when
    that coroutine is discarded (GeneratorExit) it must not await the client's close on no
    loop (which raised, and surfaced as an unraisable-exception warning)."""
    import types

    from creditrl.agents.program import ProgramRollout

    blocked = asyncio.Event()

    async def program(row, client):
        await blocked.wait()

    rollout = object.__new__(ProgramRollout)
    rollout.endpoint = types.SimpleNamespace(
        base_url=lambda name: "http://127.0.0.1:9/v1", key="k", http_client=lambda: None
    )
    rollout.cfg = types.SimpleNamespace(episode_timeout_s=5.0)
    rollout.program, rollout.live = program, {}
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(rollout._episode("t0", {}))
        loop.call_soon(loop.stop)
        loop.run_forever()  # the episode now waits on the event, as a blocked program would
        coro = task.get_coro()
    finally:
        loop.close()
    coro.close()  # raised before: the finally block awaited client.close() with no loop

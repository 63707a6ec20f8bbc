"""An OpenEnv server at a URL as an attacker would run it (issue 50, round 5): a tiny fake
server in this file speaks OpenEnv's protocol (``GET /schema``; a WebSocket on ``/ws`` taking
``{"type": "reset"|"step", "data"}`` and answering ``{"type": "observation", "data":
{"observation", "reward", "done"}}``), so these tests run without the openenv package. A step
answers as the reply's text asks: a huge observation, invalid or deeply nested JSON, NaN or
infinite rewards, wrong types, an error, silence, an episode that never ends. Each is bounded
and ends that episode alone, counted with one line, never a hang or a crash; a /schema or
first observation that breaks a bound is one line when the environment loads
(docs/security.md, "Round 5 probes")."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from helpers import tiny_engine_config

from creditrl.errors import UserCodeError
from creditrl.models import load_tokenizer
from creditrl.models.tiny import tiny_model_dir

SCHEMA = {
    "action": {"properties": {"text": {"type": "string"}}, "required": ["text"]},
    "observation": {"properties": {"prompt": {"type": "string"}}},
}


def observation(prompt: Any = "Say a word.", reward: str = "null", done: str = "false") -> str:
    """An observation answer whose observation is ``{"prompt": prompt}`` (a list: the list)."""
    obs = json.dumps(prompt if isinstance(prompt, list) else {"prompt": prompt})
    data = f'{{"observation": {obs}, "reward": {reward}, "done": {done}}}'
    return f'{{"type": "observation", "data": {data}}}'


# the reply's text -> the server's raw answer to that step (None: it never answers)
STEPS: dict[str, str | None] = {
    "ok": observation("Well done.", "1.0", "true"),
    "huge": observation("x" * (5 << 20)),
    "invalid": "{not json",
    "deep": "[" * 100_000 + "]" * 100_000,
    "nan": observation("ok", "NaN", "true"),
    "inf": observation("ok", "1e400", "true"),
    "bigint": observation("ok", "1" + "0" * 400, "true"),
    "text": observation("ok", '"1.0"', "true"),
    "maybe": observation("ok", "1.0", '"yes"'),
    "list": observation(["not", "an", "object"], "1.0", "true"),
    "error": '{"type": "error", "data": {"message": "the game broke", "code": "EXECUTION_ERROR"}}',
    "again": observation("Again.", "0.5", "false"),
    "silent": None,
}
CAPACITY = '{"type": "error", "data": {"message": "full", "code": "CAPACITY_REACHED"}}'


class FakeServer:
    """A tiny OpenEnv server on 127.0.0.1 (aiohttp, on a thread of its own). ``schema`` and
    ``reset`` are its /schema body (bytes, or a coroutine writing it) and its reset answer;
    ``refuse`` sessions are refused for capacity first."""

    def __init__(self, schema: Any = None, reset: str | None = None, refuse: int = 0) -> None:
        self.schema = schema if schema is not None else json.dumps(SCHEMA).encode()
        self.reset = reset if reset is not None else observation("Say a word.")
        self.refuse, self.sessions = refuse, 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner: web.AppRunner | None = None
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_get("/schema", self._schema)
        app.router.add_get("/ws", self._ws)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def _schema(self, request: web.Request) -> web.StreamResponse:
        if callable(self.schema):
            return await self.schema(request)
        return web.Response(body=self.schema, content_type="application/json")

    async def _ws(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=1 << 20)
        await ws.prepare(request)
        if self.refuse > 0:
            self.refuse -= 1
            await ws.send_str(CAPACITY)
            await ws.close()
            return ws
        self.sessions += 1
        async for message in ws:
            request_ = json.loads(message.data)
            if request_["type"] == "close":
                break
            if request_["type"] == "reset":
                answer = self.reset
            else:
                answer = STEPS.get(request_["data"]["text"].strip(), STEPS["ok"])
            if answer is None:
                await asyncio.sleep(3600)
            await ws.send_str(answer)
        return ws

    def close(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def fake():
    servers: list[FakeServer] = []

    def start(**kwargs: Any) -> FakeServer:
        servers.append(FakeServer(**kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def episodes(url: str, replies: list[list[str]], *extra: str) -> Any:
    """The rollout Batch of four episodes (two prompts, each twice) whose turns are forced to
    ``replies[episode]`` (texts, each ended by EOS)."""
    from creditrl.agents.program import ProgramRollout
    from creditrl.agents.scripted import ScriptedTurnGenerator
    from creditrl.data import collate_prompts
    from creditrl.environments.openenv import (
        OpenEnvProgram,
        environment_datasets,
        load_openenv_environment,
    )

    tok = load_tokenizer(tiny_model_dir())
    cfg = tiny_engine_config(
        Path("unused"), f"env.openenv={url}", "reward.num_workers=0", "env.max_steps=3",
        "data.max_prompt_length=256", "rollout.max_response_length=96",
        "agent.max_tokens_per_turn=8", "data.train_size=2", "data.val_size=0", *extra,
    )  # fmt: skip
    train, _ = environment_datasets(cfg, tok)
    eos = tok.eos_token_id
    scripts = [[[*tok.encode(t, add_special_tokens=False), eos] for t in r] for r in replies]
    rollout = ProgramRollout(
        None, tok, cfg.agent, cfg.rollout, fallback_score=-1.0,
        max_prompt_length=cfg.data.max_prompt_length,
        turn_generator=ScriptedTurnGenerator(scripts, [eos]),
        program=OpenEnvProgram(load_openenv_environment(cfg.env), cfg.env.max_steps),
    )  # fmt: skip
    try:
        return rollout.generate(
            collate_prompts([train[0], train[0], train[1], train[1]], tok.pad_token_id), seed=1
        )
    finally:
        rollout.close()


def outcomes(batch: Any) -> list[tuple[str, str]]:
    """(status, first line of the error) of each episode."""
    return [
        (a["episode"], (a.get("episode_error") or "").split("\n")[0]) for a in batch["agent_info"]
    ]


def test_a_server_speaking_the_protocol_trains_without_the_openenv_package(fake) -> None:
    """Rows are the server's first observations; an episode steps until done; a session the
    server refuses for capacity is opened again (before: a URL needed the openenv package
    for its client, so nothing here could run without it)."""
    server = fake(refuse=2)
    batch = episodes(server.url, [["ok"], ["again", "ok"], ["ok"], ["ok"]])
    assert [s for s, _ in outcomes(batch)] == ["ok"] * 4
    rewards = [e["program_reward"] for e in batch["extra_info"]]
    assert [r["score"] for r in rewards] == [1.0, 1.5, 1.0, 1.0]
    assert [r["openenv_done"] for r in rewards] == [1.0] * 4
    assert server.refuse == 0 and server.sessions >= 5  # the rows' session and four episodes


def test_hostile_answers_end_that_episode_alone_with_one_line(fake) -> None:
    """A 5 MiB observation (over MAX_MESSAGE_BYTES, refused before it is buffered), invalid
    JSON, JSON 100,000 deep, an error: each ends its episode as a counted error naming the
    reason in one line; a NaN reward, 1e400 and an int beyond float make its sum not finite
    (bad_reward); a reward or done of the wrong type, an observation that is no object are
    errors. None stops the rollout."""
    server = fake()
    seen: list[tuple[str, str]] = []
    for group in (["huge", "invalid", "deep", "error"], ["nan", "inf", "bigint", "ok"],
                  ["text", "maybe", "list", "ok"]):  # fmt: skip
        seen += outcomes(episodes(server.url, [[reply] for reply in group]))
    statuses = [s for s, _ in seen]
    assert statuses == ["error"] * 4 + ["bad_reward"] * 3 + ["ok"] + ["error"] * 3 + ["ok"]
    errors = [e for _, e in seen]
    assert "over 4194304 bytes" in errors[0]
    assert "invalid JSON" in errors[1] and "invalid JSON" in errors[2]
    assert "the game broke" in errors[3] and "EXECUTION_ERROR" in errors[3]
    assert "reward is str, not a number" in errors[8]
    assert "'done' is str, not a bool" in errors[9]
    assert "observation is not an object" in errors[10]
    assert all("\n" not in e for e in errors)


def test_silence_and_endless_episodes_are_bounded(fake) -> None:
    """A step the server never answers ends at agent.episode_timeout_s as a counted timeout
    (the other episodes go on); an episode that is never done ends after env.max_steps,
    scored as played and counted as not done."""
    server = fake()
    batch = episodes(
        server.url,
        [["silent"], ["again"] * 3, ["ok"], ["again"] * 3],
        "agent.episode_timeout_s=3",
    )
    assert [s for s, _ in outcomes(batch)] == ["timeout", "ok", "ok", "ok"]
    rewards = [e["program_reward"] for e in batch["extra_info"]]
    assert rewards[0] == -1.0  # the fallback score
    assert [rewards[i]["openenv_steps"] for i in (1, 3)] == [3.0, 3.0]
    assert [rewards[i]["openenv_done"] for i in (1, 3)] == [0.0, 0.0]
    assert rewards[1]["score"] == pytest.approx(1.5)


async def _trickle(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    while True:  # a byte every 0.1 s, for ever
        await response.write(b" ")
        await asyncio.sleep(0.1)


def test_a_schema_or_first_observation_past_a_bound_is_one_line(fake, monkeypatch) -> None:
    """/schema of 2 MiB, a /schema trickled for ever (before: read without end), one that is
    not JSON; a first observation over the message limit, or never sent: one UserCodeError
    line when the environment loads or its rows are built."""
    from creditrl.environments import openenv

    monkeypatch.setattr(openenv, "SCHEMA_S", 2.0)
    monkeypatch.setattr(openenv, "RESET_S", 2.0)
    cases = [
        (dict(schema=b" " * (2 << 20)), "over 1048576 bytes"),
        (dict(schema=_trickle), "took over 2 s"),
        (dict(schema=b"{nope"), "gave no /schema"),
        (dict(reset=observation("x" * (5 << 20))), "over 4194304 bytes"),
        (dict(reset=STEPS["deep"]), "invalid JSON"),
        (dict(reset=observation(["x"])), "observation is not an object"),
    ]
    for kwargs, words in cases:
        server = fake(**kwargs)
        with pytest.raises(UserCodeError, match=r"env\.openenv") as err:
            episodes(server.url, [["ok"]] * 4)
        assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
    server = fake()
    server.reset = None  # never answers a reset
    with pytest.raises(UserCodeError, match=r"a reset\(\) took over 2 s"):
        episodes(server.url, [["ok"]] * 4)

"""An OpenEnv environment trained unchanged: ``env.openenv=TARGET``.

``TARGET`` names one of three local kinds (nothing runs in Docker, nothing reaches the network
unless the user's own server does):

- in process: ``file.py:MyEnvironment`` or ``module:MyEnvironment``, an
  ``openenv.core.env_server.Environment`` subclass. Each episode builds its own instance with
  ``env.kwargs``; a class that does not declare ``SUPPORTS_CONCURRENT_SESSIONS = True`` runs
  one episode at a time, as OpenEnv's own server does;
- a local server process: ``file.py:app`` or ``module:app``, the FastAPI app OpenEnv's
  ``create_app`` made (an environment's ``server/app.py``). creditrl serves it with uvicorn in
  a child process on 127.0.0.1 at a free port, for as long as the creditrl process lives; each
  episode opens its own WebSocket session on the server's ``/ws`` (a session the server
  refuses for capacity is retried until one frees up);
- a server already running: ``http://127.0.0.1:8000`` (or ``ws://``), e.g. ``uv run server``.
  Talking to a server needs no openenv package: creditrl speaks OpenEnv's WebSocket protocol
  itself (``{"type": "reset"|"step", "data": ...}`` answered by ``{"type": "observation",
  "data": {"observation", "reward", "done"}}`` or ``{"type": "error", "data": {"message",
  "code"}}``), over aiohttp.

A server's answers are untrusted: ``/schema`` is read within ``SCHEMA_BYTES`` and
``SCHEMA_S``; a WebSocket message is at most ``MAX_MESSAGE_BYTES`` (refused by aiohttp before
it is buffered whole) and decoded within ``MESSAGE_LIMITS``; the observation must be an
object, ``done`` a bool and the reward a number or null, else the episode ends as an error
naming what was wrong (one line). A NaN or infinite reward makes the episode's sum not finite
(``bad_reward``); a server that never answers is bounded by ``agent.episode_timeout_s`` (while
the rows are built, by ``RESET_S``); one that never ends an episode by ``env.max_steps``.

Rows: an OpenEnv environment has no dataset; its prompts are its first observations.
Training row ``i`` is ``reset(seed=data.seed + i)`` for ``i < data.train_size``; validation row
``i`` is ``reset(seed=data.seed + VAL_SEED_OFFSET + i)`` for ``i < data.val_size``. The row's
prompt is that observation's text as the user message (after ``data.system_prompt`` when set).

Episode: ``reset(seed)``, then per turn the policy's reply through creditrl's endpoint
(``creditrl.agents.program``: token-exact, observations masked), the reply's text as the
action, ``step(action)``, the observation's text as the next user message; until the
observation is ``done``, ``env.max_steps`` steps were taken, or the trajectory's token budget
or context is spent (the endpoint's "budget_exhausted" or "context_too_long"). The score is
the sum of the step rewards; ``openenv_steps`` and ``openenv_done`` are metrics
(``reward/openenv_steps_mean``, ...).

Text <-> OpenEnv types: the reply's text fills the action's one string field (the action schema
may have ``metadata`` and optional fields besides); an action with another shape is refused
when the environment loads. An observation's text is its one string field when it has exactly
one (``done``, ``reward`` and ``metadata`` aside), else its fields as JSON.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import logging
import socket
import subprocess
import sys
import threading
import time
import typing
import urllib.request
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from creditrl.bounded_json import JsonLimits, loads_bounded
from creditrl.config.schema import Config, EnvConfig
from creditrl.data.dataset import PromptDataset
from creditrl.data.rows import PromptRow, parse_row
from creditrl.errors import ConfigError, DataError, UserCodeError
from creditrl.usercode import load_user_object, one_line

__all__ = [
    "DATA_SOURCE",
    "INSTALL_HINT",
    "VAL_SEED_OFFSET",
    "OpenEnvProgram",
    "build_openenv_rollout",
    "check_environment",
    "environment_datasets",
    "load_openenv_environment",
    "observation_text",
]

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'creditrl[openenv]'"
DATA_SOURCE = "openenv"
MODEL_NAME = "creditrl-policy"
VAL_SEED_OFFSET = 1_000_000
URL_SCHEMES = ("http://", "https://", "ws://", "wss://")
SERVER_START_S = 60.0  # how long a served app may take to answer /health
RESET_S = 60.0  # how long one reset() may take while the rows are built
CAPACITY_RETRY_S = 0.05  # wait before asking a full server for a session again
LENGTH_CODES = ("budget_exhausted", "context_too_long")  # the endpoint's "no room left"
SCHEMA_BYTES = 1 << 20  # a server's /schema (action and observation JSON schemas)
SCHEMA_LIMITS = JsonLimits(max_bytes=SCHEMA_BYTES, max_depth=32, max_items=1 << 16)
SCHEMA_S = 10.0  # how long reading /schema may take in all
# one message of a server: an observation larger than the endpoint's request limit (4 MiB)
# could not reach the model anyway
MAX_MESSAGE_BYTES = 4 << 20
MESSAGE_LIMITS = JsonLimits(max_bytes=MAX_MESSAGE_BYTES, max_depth=64, max_items=1 << 18)
CONNECT_S = 60.0  # opening a session's WebSocket
CAPACITY = "CAPACITY_REACHED"  # the error code of a server that has no free session
NOT_TEXT = ("done", "reward", "metadata")  # observation fields that are not its text

_lock = threading.Lock()
_loaded: dict[tuple[str, str], OpenEnvTarget] = {}


def _openenv() -> Any:
    """``openenv.core.env_server``; ConfigError naming the extra when it is missing."""
    try:
        from openenv.core import env_server
    except ImportError as e:
        raise ConfigError(
            f"env.openenv needs the openenv package, which is not installed or does not import "
            f"({one_line(e, 120)}): {INSTALL_HINT}"
        ) from None
    return env_server


def observation_text(observation: Mapping[str, Any]) -> str:
    """The text of an observation (as a dict): its one string field, else its fields as JSON."""
    fields = {k: v for k, v in observation.items() if k not in NOT_TEXT}
    texts = [v for v in fields.values() if isinstance(v, str)]
    if len(texts) == 1:
        return texts[0]
    return json.dumps(fields, sort_keys=True, default=str)


def _text_field(schema: Mapping[str, Any], origin: str) -> str:
    """The string field of an action JSON schema that receives the reply's text."""
    properties = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    required = set(schema.get("required") or ()) - {"metadata"}
    strings = [
        k for k, v in properties.items() if isinstance(v, Mapping) and v.get("type") == "string"
    ]
    chosen = [k for k in strings if k in required] or strings
    if len(chosen) != 1 or not required <= set(chosen):
        raise UserCodeError(
            f"env.openenv: {origin}'s action has fields {sorted(properties)} (required "
            f"{sorted(required)}); creditrl puts the reply's text into an action with one "
            "string field (write an agent.program for other actions)"
        )
    return chosen[0]


@dataclass
class StepOutcome:
    """What reset or step returned: the observation (as a dict), its reward and done."""

    observation: dict[str, Any]
    reward: float | None
    done: bool


class OpenEnvTarget:
    """One loaded ``env.openenv``: opens episode sessions (``session()``) whose ``reset`` and
    ``step`` return ``StepOutcome``; ``text_field`` names the action's text field."""

    text_field: str

    def session(self) -> contextlib.AbstractAsyncContextManager[Any]:
        raise NotImplementedError


class InProcessTarget(OpenEnvTarget):
    """An ``Environment`` subclass, one instance per episode, in this process."""

    def __init__(self, env_cls: type, kwargs: dict[str, Any], spec: str) -> None:
        self.env_cls, self.kwargs, self.spec = env_cls, kwargs, spec
        self.action_cls = _action_class(env_cls, spec)
        self.text_field = _text_field(self.action_cls.model_json_schema(), spec)
        concurrent = bool(getattr(env_cls, "SUPPORTS_CONCURRENT_SESSIONS", False))
        self.one_at_a_time = None if concurrent else threading.Lock()

    def build(self) -> Any:
        try:
            return self.env_cls(**self.kwargs)
        except Exception as e:
            raise UserCodeError(
                f"env.openenv: {self.spec}({', '.join(sorted(self.kwargs))}) raised "
                f"{type(e).__name__}: {one_line(e, 200)}"
            ) from None

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Any]:
        lock = self.one_at_a_time
        if lock is not None:
            while not lock.acquire(blocking=False):  # a timed-out episode leaves it free
                await asyncio.sleep(CAPACITY_RETRY_S)
        env = self.build()
        try:
            yield _InProcessSession(env, self.action_cls, self.text_field)
        finally:
            with contextlib.suppress(Exception):
                env.close()
            if lock is not None:
                lock.release()


class _InProcessSession:
    def __init__(self, env: Any, action_cls: type, text_field: str) -> None:
        self.env, self.action_cls, self.text_field = env, action_cls, text_field

    @staticmethod
    def _outcome(obs: Any) -> StepOutcome:
        reward = obs.reward
        return StepOutcome(
            obs.model_dump(), None if reward is None else float(reward), bool(obs.done)
        )

    async def reset(self, seed: int) -> StepOutcome:
        return self._outcome(await self.env.reset_async(seed=seed))

    async def step(self, text: str) -> StepOutcome:
        return self._outcome(await self.env.step_async(self.action_cls(**{self.text_field: text})))


class ServerError(Exception):
    """An OpenEnv server's answer that breaks the protocol or a bound (one line)."""


def _http_base(url: str) -> str:
    return "http" + url[2:] if url.startswith("ws") else url


def _read_schema(base_url: str, origin: str) -> dict[str, Any]:
    """The server's ``/schema``, read within ``SCHEMA_BYTES`` and ``SCHEMA_S`` in all (a
    server trickling an endless body is cut off) and decoded within ``SCHEMA_LIMITS``."""
    deadline = time.monotonic() + SCHEMA_S
    try:
        with urllib.request.urlopen(f"{_http_base(base_url)}/schema", timeout=SCHEMA_S) as answer:
            raw = b""
            while len(raw) <= SCHEMA_BYTES:
                if time.monotonic() > deadline:
                    raise ServerError(f"its /schema took over {SCHEMA_S:g} s")
                chunk = answer.read1(1 << 16)
                if not chunk:
                    break
                raw += chunk
        if len(raw) > SCHEMA_BYTES:
            raise ServerError(f"its /schema is over {SCHEMA_BYTES} bytes")
        schema = loads_bounded(raw, SCHEMA_LIMITS, allow_nan=False)
        if not isinstance(schema, dict):
            raise ServerError("its /schema is not a JSON object")
    except Exception as e:
        raise UserCodeError(
            f"env.openenv: the OpenEnv server of {origin} gave no /schema: "
            f"{type(e).__name__}: {one_line(e, 160)}"
        ) from None
    return schema


class ServerTarget(OpenEnvTarget):
    """An OpenEnv server on this machine (served by creditrl or already running): one
    WebSocket session per episode on its ``/ws`` (module docstring)."""

    def __init__(self, base_url: str, origin: str) -> None:
        self.base_url = base_url.rstrip("/")
        schema = _read_schema(self.base_url, origin)
        self.text_field = _text_field(schema.get("action") or {}, origin)
        http = _http_base(self.base_url)
        self.ws_url = "ws" + http[4:] + "/ws"  # http -> ws, https -> wss

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Any]:
        import aiohttp

        # the episode's own timeout (agent.episode_timeout_s) bounds every wait
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            session = _ServerSession(http, self.ws_url, self.text_field)
            try:
                yield session
            finally:
                await session.close()


class _ServerSession:
    """One episode's WebSocket session (opened at the first call; a session the server
    refuses for capacity is opened again after ``CAPACITY_RETRY_S``)."""

    def __init__(self, http: Any, ws_url: str, text_field: str) -> None:
        self.http, self.ws_url, self.text_field = http, ws_url, text_field
        self.ws: Any = None

    async def close(self) -> None:
        if self.ws is not None and not self.ws.closed:
            with contextlib.suppress(Exception):
                await self.ws.send_str('{"type": "close"}')
            with contextlib.suppress(Exception):
                await self.ws.close()
        self.ws = None

    async def _receive(self) -> dict[str, Any]:
        import aiohttp

        message = await self.ws.receive()
        if message.type == aiohttp.WSMsgType.ERROR:
            if getattr(message.data, "code", None) == aiohttp.WSCloseCode.MESSAGE_TOO_BIG:
                raise ServerError(f"the server sent a message over {MAX_MESSAGE_BYTES} bytes")
            raise ServerError(f"the session failed: {one_line(message.data, 160)}")
        if message.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
            raise ServerError("the server closed the session")
        try:
            reply = loads_bounded(message.data, MESSAGE_LIMITS)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and JsonLimitError too
            raise ServerError(f"the server answered invalid JSON: {one_line(e, 160)}") from None
        if not isinstance(reply, dict):
            raise ServerError("the server answered JSON that is not an object")
        return reply

    async def _call(self, request: dict[str, Any]) -> StepOutcome:
        import aiohttp

        while True:
            if self.ws is None or self.ws.closed:
                self.ws = await self.http.ws_connect(self.ws_url, max_msg_size=MAX_MESSAGE_BYTES)
            with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                # a refused session sends its error, then closes: read the error below
                await self.ws.send_str(json.dumps(request))
            reply = await self._receive()
            if reply.get("type") != "error":
                return _outcome(reply, request["type"])
            data = reply.get("data") if isinstance(reply.get("data"), dict) else {}
            if data.get("code") == CAPACITY:
                await self.close()
                await asyncio.sleep(CAPACITY_RETRY_S)
                continue
            raise ServerError(
                f"{request['type']} failed on the server: {one_line(data.get('message'), 200)} "
                f"(code {one_line(data.get('code'), 40)})"
            )

    async def reset(self, seed: int) -> StepOutcome:
        return await self._call({"type": "reset", "data": {"seed": seed}})

    async def step(self, text: str) -> StepOutcome:
        return await self._call({"type": "step", "data": {self.text_field: text}})


def _outcome(reply: dict[str, Any], kind: str) -> StepOutcome:
    """A server's ``observation`` answer to ``kind`` (reset or step), its types checked."""
    data = reply.get("data")
    if reply.get("type") != "observation" or not isinstance(data, dict):
        raise ServerError(f"the server answered {kind} with no observation message")
    observation, reward, done = data.get("observation"), data.get("reward"), data.get("done")
    if not isinstance(observation, dict):
        raise ServerError(f"the server's {kind} observation is not an object")
    if not isinstance(done, bool):
        raise ServerError(f"the server's {kind} 'done' is {type(done).__name__}, not a bool")
    if reward is not None and (not isinstance(reward, int | float) or isinstance(reward, bool)):
        raise ServerError(f"the server's {kind} reward is {type(reward).__name__}, not a number")
    try:
        value = None if reward is None else float(reward)
    except OverflowError:  # an int beyond float: as infinite as 1e400
        value = float("inf")
    return StepOutcome(observation, value, done)


def _action_class(env_cls: type, spec: str) -> type:
    """The Action subclass ``env_cls.step`` takes (its annotation, else the class's generic
    arguments)."""
    from openenv.core.env_server.types import Action

    candidates: list[Any] = []
    with contextlib.suppress(Exception):
        candidates.append(typing.get_type_hints(env_cls.step).get("action"))
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            candidates.extend(typing.get_args(base))
    for c in candidates:
        if isinstance(c, type) and issubclass(c, Action) and c is not Action:
            return c
    raise UserCodeError(
        f"env.openenv: {spec}'s step() names no Action subclass (annotate `action: MyAction`)"
    )


# ---- the local server ----------------------------------------------------------------------


_servers: list[subprocess.Popen[bytes]] = []


def _stop_servers() -> None:
    for process in _servers:
        process.terminate()
    for process in _servers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)


atexit.register(_stop_servers)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_app(spec: str) -> str:
    """Serve the app ``spec`` names with uvicorn in a child process on 127.0.0.1; its base URL
    once it answers /health (stopped when this process exits)."""
    port = _free_port()
    command = [sys.executable, "-m", "creditrl.environments.openenv", spec, str(port)]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    _servers.append(process)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise UserCodeError(
                f"env.openenv: serving {spec} failed (exit {process.returncode}; its error is "
                "above)"
            )
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2):
            return url
        time.sleep(0.2)
    process.terminate()
    raise UserCodeError(f"env.openenv: {spec} did not answer /health within {SERVER_START_S:.0f} s")


# ---- loading -------------------------------------------------------------------------------


def load_openenv_environment(env_cfg: EnvConfig) -> OpenEnvTarget:
    """The environment ``env_cfg.openenv`` names, loaded (and served, for an app) once per
    process per (target, kwargs); a one-line error when the package is missing or the target
    is none of the three kinds."""
    spec = env_cfg.openenv
    if spec is None:
        raise ConfigError("env.openenv is not set")
    kwargs = dict(env_cfg.kwargs or {})
    key = (spec, json.dumps(kwargs, sort_keys=True, default=repr))
    with _lock:
        if key not in _loaded:
            _loaded[key] = _load(spec, kwargs)
        return _loaded[key]


def _load(spec: str, kwargs: dict[str, Any]) -> OpenEnvTarget:
    if spec.startswith(URL_SCHEMES):  # a running server: no openenv package needed
        if kwargs:
            raise ConfigError(f"env.kwargs: {spec} is a server, which takes no keyword arguments")
        return ServerTarget(spec, spec)
    env_server = _openenv()
    obj = load_user_object(spec, "env.openenv")
    if isinstance(obj, type) and issubclass(obj, env_server.Environment):
        return InProcessTarget(obj, kwargs, spec)
    served = hasattr(obj, "router") and hasattr(obj, "routes")  # an ASGI app
    if served and kwargs:
        raise ConfigError(f"env.kwargs: {spec} is a server, which takes no keyword arguments")
    if served:
        return ServerTarget(serve_app(spec), spec)
    raise UserCodeError(
        f"env.openenv: {spec} is a {type(obj).__name__}, not an OpenEnv Environment subclass "
        "or the app create_app made"
    )


# ---- rows ----------------------------------------------------------------------------------


def _first_observations(target: OpenEnvTarget, seeds: list[int]) -> list[str]:
    """The text of ``reset(seed)`` for each seed, through one session (on a thread of its own,
    so a caller with a running event loop is fine)."""

    async def collect() -> list[str]:
        async with target.session() as session:
            return [
                observation_text((await asyncio.wait_for(session.reset(seed), RESET_S)).observation)
                for seed in seeds
            ]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            return pool.submit(asyncio.run, collect()).result()
        except (ConfigError, DataError, UserCodeError):
            raise
        except TimeoutError:
            raise UserCodeError(f"env.openenv: a reset() took over {RESET_S:.0f} s") from None
        except Exception as e:
            raise UserCodeError(
                f"env.openenv: reset() raised {type(e).__name__}: {one_line(e, 200)}"
            ) from None


def _rows(cfg: Config, target: OpenEnvTarget, split: str, seeds: list[int]) -> list[PromptRow]:
    system = cfg.data.system_prompt
    rows = []
    for i, (seed, text) in enumerate(zip(seeds, _first_observations(target, seeds), strict=True)):
        prompt = [{"role": "user", "content": text}]
        if system:
            prompt.insert(0, {"role": "system", "content": system})
        raw = {
            "prompt": prompt,
            "ground_truth": None,
            "data_source": DATA_SOURCE,
            "extra": {"openenv": {"seed": seed}},
        }
        rows.append(parse_row(raw, f"env.openenv {split} row {i + 1} (seed {seed})"))
    return rows


def environment_datasets(cfg: Config, tokenizer: Any) -> tuple[PromptDataset, PromptDataset | None]:
    """``(train, val)`` prompt datasets of ``env.openenv``: first observations by seed (module
    docstring); ``val`` is None when ``data.val_size`` is 0."""
    target = load_openenv_environment(cfg.env)
    data = cfg.data
    origin = f"env.openenv={cfg.env.openenv!r}"
    train = _rows(cfg, target, "train", [data.seed + i for i in range(data.train_size)])
    val_seeds = [data.seed + VAL_SEED_OFFSET + i for i in range(data.val_size)]
    val = _rows(cfg, target, "val", val_seeds) if val_seeds else []

    def dataset(rows: list[PromptRow], split: str) -> PromptDataset:
        return PromptDataset(
            rows, tokenizer, data.max_prompt_length, data.overlong_prompt, split,
            f"{origin} ({split})",
        )  # fmt: skip

    return dataset(train, "train"), (dataset(val, "val") if val else None)


# ---- episodes ------------------------------------------------------------------------------


def _budget_spent(e: Exception) -> bool:
    """Whether ``e`` is the endpoint saying the trajectory's token budget or context is used
    up (a truncation: the episode ends there, scored)."""
    code = getattr(e, "code", None)
    return code in LENGTH_CODES or any(c in str(e) for c in LENGTH_CODES)


class OpenEnvProgram:
    """The agent program of one OpenEnv environment: ``await program(row, client)`` plays the
    row's episode (module docstring) and returns ``{"score": sum of rewards,
    "openenv_steps": n, "openenv_done": 0 or 1}``."""

    def __init__(self, target: OpenEnvTarget, max_steps: int) -> None:
        self.target, self.max_steps = target, max_steps

    async def __call__(self, row: Mapping[str, Any], client: Any) -> dict[str, Any]:
        import openai

        seed = int(((row.get("extra_info") or {}).get("openenv") or {}).get("seed", 0))
        system = [m for m in row.get("messages") or [] if m.get("role") == "system"]
        async with self.target.session() as env:
            outcome = await env.reset(seed)
            messages = [*system, {"role": "user", "content": observation_text(outcome.observation)}]
            total, steps = 0.0, 0
            while not outcome.done and steps < self.max_steps:
                try:
                    reply = await client.chat.completions.create(
                        model=MODEL_NAME, messages=messages
                    )
                except openai.APIStatusError as e:
                    if _budget_spent(e):
                        break
                    raise
                text = reply.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": text})
                outcome = await env.step(text)
                steps += 1
                total += outcome.reward or 0.0
                if not outcome.done:
                    messages.append(
                        {"role": "user", "content": observation_text(outcome.observation)}
                    )
        return {"score": total, "openenv_steps": float(steps), "openenv_done": float(outcome.done)}


def check_environment(cfg: Config) -> None:
    """The ``openenv`` strategy's preflight: the package, the target and its action's text
    field, before any model is built."""
    load_openenv_environment(cfg.env)


def build_openenv_rollout(engine: Any, tokenizer: Any, cfg: Config) -> Any:
    """The rollout of ``env.openenv``: ``ProgramRollout`` playing the environment's episodes
    through the endpoint."""
    from creditrl.agents.program import ProgramRollout

    target = load_openenv_environment(cfg.env)
    program = OpenEnvProgram(target, cfg.env.max_steps)
    return ProgramRollout.for_run(engine, tokenizer, cfg, program=program)


def _serve(spec: str, port: int) -> None:
    """Run the app ``spec`` names on 127.0.0.1:``port`` (the child process of ``serve_app``)."""
    import uvicorn

    uvicorn.run(
        load_user_object(spec, "env.openenv"), host="127.0.0.1", port=port, log_level="warning"
    )


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))

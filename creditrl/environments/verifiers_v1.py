"""A ``verifiers.v1`` environment trained unchanged: ``env.verifiers=FILE:load_environment``
whose loader returns a ``verifiers.v1.Env`` (verifiers 0.4, and 0.3's ``verifiers.v1``).

An ``Env`` pairs a ``Taskset`` with the agent that plays it: a *harness* program (``null``, the
plain chat loop; ``bash`` and the others call tools) run in a *runtime*, whose model calls go
to verifiers' interception server, which records them on the episode's trace and relays them
to the run's client. creditrl runs the episodes in process (``Env.run_episode(task, ctx)`` on
the environment's one event loop, ``creditrl.environments.event_loop``, inside the
``Env.serving()`` it enters once per process) with the run's client set to creditrl: every
model call reaches the episode's trajectory at creditrl's endpoint
(``creditrl.agents.program``), is generated token-exact from the recorded ids, and its drift is
located per trajectory, as for the classic environments.

- Rows: the taskset's first ``data.max_train_rows`` tasks are the training prompts, its first
  ``data.val_size`` the validation prompts (a v1 taskset has no split of its own). A row's
  prompt is the task's system prompt and prompt as messages; the task's data travels with the
  row (``extra.verifiers.task_data``) and the episode rebuilds the task from it, as verifiers'
  own env server does.
- Routing: the interception names a rollout by its trace id (the ``X-Session-ID`` header) and
  keeps one client per client config, so every episode shares one config: ``Relay``, a
  loopback server on the environment's loop, routes each trace's requests to its episode's
  trajectory from the moment verifiers mints the trace until the episode ends (its key is read
  from a variable whose name holds ``API_KEY``, which verifiers' subprocess runtime keeps from
  harness programs), and serves a streamed request as server-sent events of the whole turn.
- Score: the trace's reward (the weighted sum of the task's ``@reward`` functions) is the
  score; each reward's and metric's value is ``vf_<name>`` (``reward/vf_<name>_mean``). An
  episode that fails (the harness, the task's hooks or scoring raised, a timeout) is an
  error episode, scored ``reward.fallback_score`` and counted. One whose request the endpoint
  refused because the trajectory's budget is spent is a truncation: verifiers ends such a
  rollout as failed, so creditrl stops the trace ``context_length`` (verifiers' own stop for
  an overlong prompt) and scores it with the task's rewards that need no runtime.
- Programs: a harness prepares its program in ``setup()``, by default with
  ``uv sync --script`` (its PEP 723 dependencies from a package index). creditrl prepares
  each harness of the environment once per process, before the first episode
  (``prepare_programs``, from the preflight and when the rollout is built): a program whose
  declared dependencies this interpreter already has runs with this interpreter
  (``sys.executable``), without uv and offline; any other is prepared by verifiers with uv.
  When neither works, one line says which packages are missing and what uv said.
- Supported: one agent role (``SingleAgentEnv`` and the like; the trajectory is the policy's),
  in the ``subprocess`` runtime (harness programs on this machine; docker and the remote
  sandboxes are not prepared by creditrl), with the run's client (a role pinning its own
  client or a container harness is refused when the environment loads).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import hashlib
import hmac
import importlib.metadata
import itertools
import json
import logging
import os
import re
import secrets
import shutil
import sys
import tempfile
import threading
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from creditrl.agents.endpoint import MAX_BODY_BYTES, REQUEST_LIMITS
from creditrl.agents.program import LENGTH_CODES
from creditrl.bounded_json import loads_bounded
from creditrl.data.rows import PromptRow, parse_row
from creditrl.environments.event_loop import loop_of
from creditrl.errors import ConfigError, DataError, UserCodeError
from creditrl.usercode import one_line

__all__ = [
    "KEY_VARIABLE",
    "PREPARE_TIMEOUT_S",
    "Relay",
    "VerifiersV1Program",
    "check_v1_environment",
    "is_v1_environment",
    "prepare_programs",
    "program_requirements",
    "serve",
    "stream_events",
    "v1_rows",
]

log = logging.getLogger(__name__)

DATA_SOURCE = "verifiers"
MODEL_NAME = "creditrl-policy"
KEY_VARIABLE = "CREDITRL_VF_RELAY_API_KEY"  # + a per-key suffix; "API_KEY": kept from programs
PREPARE_TIMEOUT_S = 900.0  # uv resolving and installing a harness program's packages
SERVE_TIMEOUT_S = 60.0  # entering (or leaving) Env.serving(): the interception, shared tools
_PEP723 = re.compile(r"(?m)^# /// (?P<type>[a-zA-Z0-9-]+)$\s(?P<content>(^#(| .*)$\s)+)^# ///$")
_MARK = "__creditrl_own_interpreter__"

_lock = threading.Lock()  # the caches below
_serve_lock = threading.Lock()  # entering serving() (which may prepare tool programs: _lock)
_prepared: dict[int, Any] = {}  # id(env) -> env, once its harnesses are prepared
_served: dict[int, tuple[Any, Any, Any]] = {}  # id(env) -> (env, relay, serving())
_own: dict[str, str | None] = {}  # script digest -> its file, run with this interpreter; or None
_missing: dict[str, list[str]] = {}  # script digest -> what this interpreter lacks
_declined: list[str] = []  # digests left to uv since the current preparation began
_script_dir: list[str] = []


def is_v1_environment(obj: Any) -> bool:
    """True when ``obj`` is a ``verifiers.v1.Env`` (whose making imported ``verifiers.v1``;
    nothing is imported here)."""
    module = sys.modules.get("verifiers.v1")
    return module is not None and isinstance(obj, module.Env)


# ---- the environment -------------------------------------------------------------------------


def _roles(env: Any) -> dict[str, Any]:
    import verifiers.v1 as vf

    return {name: value for name, value in env.config if isinstance(value, vf.AgentConfig)}


def check_v1_environment(env: Any, spec: str) -> None:
    """UserCodeError (one line) unless creditrl can train ``env``: one agent role, in the
    subprocess runtime, with the run's client, whose harness needs no container, and whose
    task data survives a round trip through JSON."""
    import verifiers.v1 as vf

    name = f"env.verifiers: {spec}'s {type(env).__name__}"
    roles = _roles(env)
    if len(roles) != 1:
        raise UserCodeError(
            f"{name} plays {len(roles)} agent roles {sorted(roles)}; creditrl trains one "
            "policy trajectory per episode and runs environments with one role "
            "(SingleAgentEnv and the like)"
        )
    ((role, agent),) = roles.items()
    if agent.client is not None:
        raise UserCodeError(
            f"{name}: its role {role!r} pins a client ({type(agent.client).__name__}); the "
            "run's model is creditrl's endpoint: leave the role's client unset"
        )
    if not isinstance(agent.runtime, vf.SubprocessConfig):
        raise UserCodeError(
            f"{name}: its role {role!r} runs its harness in the {agent.runtime.type!r} "
            "runtime; creditrl runs harness programs on this machine (docker and remote "
            "sandboxes are not prepared): give the role runtime=vf.SubprocessConfig()"
        )
    for harness in _harnesses(env):
        if harness.NEEDS_CONTAINER:
            raise UserCodeError(
                f"{name}: harness {harness.config.id!r} needs a container runtime "
                "(NEEDS_CONTAINER); creditrl runs harnesses in the subprocess runtime "
                "(null, bash, or your own)"
            )
    data_cls = type(env.taskset).task_type().data_type()
    excluded = [key for key, field in data_cls.model_fields.items() if field.exclude]
    if excluded:
        raise UserCodeError(
            f"{name}: its task data ({data_cls.__name__}) excludes {excluded} from "
            "serialization; each episode rebuilds its task from the row's data, so drop "
            "exclude=True"
        )


def _harnesses(env: Any) -> list[Any]:
    """The environment's harnesses, one per distinct harness config."""
    import verifiers.v1 as vf

    configs = {c.model_dump_json(): c for c in env.config.agent_harnesses().values()}
    return [vf.load_harness(c) for c in configs.values()]


# ---- rows ------------------------------------------------------------------------------------


def _prompt_messages(data: Any, where: str) -> list[dict[str, Any]]:
    from verifiers.v1.dialects.chat import message_to_wire

    messages: list[dict[str, Any]] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages.extend(message_to_wire(m) for m in data.prompt)
    if not any(m.get("role") != "system" for m in messages):
        raise DataError(
            f"{where} has no prompt (a task the user opens); creditrl's episodes start from "
            "the task's prompt"
        )
    return messages


def v1_rows(env: Any, limit: int, split: str) -> list[PromptRow]:
    """The first ``limit`` tasks of the environment's taskset as checked prompt rows."""
    rows = []
    try:
        tasks = list(itertools.islice(iter(env.taskset), limit))  # 0.3: head(n), 0.4: take(n)
    except Exception as e:
        raise UserCodeError(
            f"env.verifiers: loading the taskset's tasks raised {type(e).__name__}: "
            f"{one_line(e, 200)}"
        ) from None
    for i, task in enumerate(tasks):
        where = f"env.verifiers {split} row {i + 1}"
        data = task.data
        raw = {
            "prompt": _prompt_messages(data, where),
            "ground_truth": None,
            "data_source": DATA_SOURCE,
            "extra": {"verifiers": {"task_data": data.model_dump(mode="json")}},
        }
        rows.append(parse_row(raw, where))
    return rows


# ---- the harnesses' programs -----------------------------------------------------------------


def program_requirements(script: str) -> tuple[str | None, list[str]]:
    """(``requires-python``, ``dependencies``) of a PEP 723 script; (None, []) without its
    ``script`` block; ValueError when the block cannot be read."""
    blocks = [m for m in _PEP723.finditer(script) if m.group("type") == "script"]
    if not blocks:
        return None, []
    if len(blocks) > 1:
        raise ValueError("more than one script metadata block")
    content = "".join(
        line[2:] if line.startswith("# ") else line[1:]
        for line in blocks[0].group("content").splitlines(keepends=True)
    )
    meta = tomllib.loads(content)  # TOMLDecodeError is a ValueError
    python, deps = meta.get("requires-python"), meta.get("dependencies") or []
    if not isinstance(deps, list) or not isinstance(python, str | None):
        raise ValueError("requires-python must be a string and dependencies a list")
    return python, [str(d) for d in deps]


def _lacks(requirement: str, extra: str | None = None) -> list[str]:
    """What this interpreter lacks of ``requirement`` (its extras too); [] when it has it."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        req = Requirement(requirement)
    except InvalidRequirement:
        return [f"{requirement} (not a requirement)"]
    if req.marker is not None and not req.marker.evaluate({"extra": extra or ""}):
        return []
    try:
        have = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        return [f"{req.name}{req.specifier} (not installed)"]
    if not req.specifier.contains(have, prereleases=True):
        return [f"{req.name}{req.specifier} (this interpreter has {have})"]
    lacking = []
    for name in req.extras:
        for sub in importlib.metadata.requires(req.name) or []:
            needed = Requirement(sub)
            if needed.marker is not None and needed.marker.evaluate({"extra": name}):
                lacking.extend(_lacks(f"{needed.name}{needed.specifier}"))
    return lacking


def interpreter_lacks(script: str) -> list[str]:
    """What this interpreter lacks to run ``script`` (a PEP 723 script): its Python version
    and each declared dependency; [] when it can run it as is."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        python, deps = program_requirements(script)
    except ValueError as e:
        return [f"(its script metadata cannot be read: {one_line(e, 100)})"]
    lacking = []
    if python:
        version = ".".join(map(str, sys.version_info[:3]))
        try:
            if not SpecifierSet(python).contains(version):
                lacking.append(f"python{python} (this is {version})")
        except InvalidSpecifier:
            lacking.append(f"python{python} (not a version specifier)")
    for dep in deps:
        lacking.extend(_lacks(dep))
    return lacking


def _own_argv(script: str | bytes, activate: bool) -> list[str] | None:
    """The argv running ``script`` with this interpreter when it has what the script declares,
    else None (what it lacks recorded in ``_missing``); decided once per script."""
    data = script.encode() if isinstance(script, str) else script
    digest = hashlib.sha256(data).hexdigest()
    with _lock:
        if digest not in _own:
            lacking = interpreter_lacks(data.decode("utf-8", errors="replace"))
            if lacking:
                _own[digest], _missing[digest] = None, lacking
            else:
                if not _script_dir:
                    _script_dir.append(tempfile.mkdtemp(prefix="creditrl-vf-programs-"))
                    atexit.register(shutil.rmtree, _script_dir[0], True)
                path = os.path.join(_script_dir[0], f"{digest}.py")
                Path(path).write_bytes(data)
                _own[digest] = path
        path = _own[digest]
        if path is None:
            _declined.append(digest)
            return None
    argv = [sys.executable, path]
    if activate and sys.prefix != sys.base_prefix:  # as verifiers activates uv's venv
        argv = [
            "sh", "-c", 'export VIRTUAL_ENV="$1" PATH="$1/bin:$PATH"; shift; exec "$@"',
            "creditrl-program", sys.prefix, *argv,
        ]  # fmt: skip
    return argv


def _uv_prepare(runtime: Any, script: Any, env: Any, activate: bool) -> Any:
    """verifiers' own preparation (uv); replaced in tests."""
    return _ORIGINAL[0](runtime, script, env, activate=activate)


_ORIGINAL: list[Any] = []


def _reuse_interpreter() -> None:
    """Have verifiers' subprocess runtime run a PEP 723 program with this interpreter when it
    has the program's declared dependencies (``_own_argv``), and prepare any other with uv as
    before. Installed once per process."""
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    current = SubprocessRuntime.prepare_uv_script
    if getattr(current, _MARK, False):
        return
    _ORIGINAL.append(current)

    @functools.wraps(current)
    async def prepare_uv_script(self, script, env=None, *, activate=True):  # type: ignore[no-untyped-def]
        argv = _own_argv(script, activate)
        if argv is not None:
            return argv
        return await _uv_prepare(self, script, env, activate)

    setattr(prepare_uv_script, _MARK, True)
    SubprocessRuntime.prepare_uv_script = prepare_uv_script  # type: ignore[method-assign]


async def _prepare(harness: Any) -> None:
    import verifiers.v1 as vf
    from verifiers.v1.runtimes import provision_runtime

    async with provision_runtime(vf.SubprocessConfig()) as runtime:
        await harness.setup(runtime)


def _on_loop(env: Any, coro: Any, timeout: float) -> Any:
    """What ``coro`` returns, run on the environment's loop from this (synchronous) thread."""
    future = asyncio.run_coroutine_threadsafe(coro, loop_of(env).loop)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError from None


def prepare_programs(env: Any, spec: str) -> None:
    """Prepare each harness's program once per process (module docstring); ConfigError (one
    line) saying what is missing when it cannot be prepared."""
    with _lock:
        if id(env) in _prepared:
            return
    _reuse_interpreter()
    for harness in _harnesses(env):
        ident = harness.config.id
        _declined.clear()
        try:
            _on_loop(env, _prepare(harness), PREPARE_TIMEOUT_S)
        except TimeoutError:
            raise ConfigError(
                f"env.verifiers: preparing the program of harness {ident!r} took more than "
                f"{PREPARE_TIMEOUT_S:g} s (uv resolving and installing its packages)"
            ) from None
        except Exception as e:
            raise ConfigError(_unprepared(spec, ident, e)) from None
    with _lock:
        _prepared[id(env)] = env


def _unprepared(spec: str, ident: str, error: BaseException) -> str:
    lacking = sorted({item for d in _declined for item in _missing.get(d, [])})
    why = one_line(f"{type(error).__name__}: {error}", 300)
    if not lacking:
        return one_line(
            f"env.verifiers: {spec}: preparing the program of harness {ident!r} failed: {why}", 600
        )
    uv = "uv is not installed" if shutil.which("uv") is None else "uv could not prepare it"
    return one_line(
        f"env.verifiers: the program of harness {ident!r} needs {', '.join(lacking)}, which this "
        f"interpreter lacks, and {uv} ({why}); install them here (pip install), or uv with a "
        "reachable package index (it installs the program's packages once per run)",
        900,
    )


# ---- serving, the relay and episodes ---------------------------------------------------------


def stream_events(completion: Mapping[str, Any], include_usage: bool) -> bytes:
    """A chat completion as the server-sent events of a streamed one: the whole message in one
    chunk, the finish reason in the next, the usage in a last one when asked for, then
    ``[DONE]`` (the turn is generated whole before it is served)."""
    choice = completion["choices"][0]
    head = {k: completion[k] for k in ("id", "created", "model") if k in completion}
    head["object"] = "chat.completion.chunk"
    delta = dict(choice["message"])
    if delta.get("tool_calls"):
        delta["tool_calls"] = [{**c, "index": i} for i, c in enumerate(delta["tool_calls"])]
    first = {"index": 0, "delta": delta, "logprobs": choice.get("logprobs"), "finish_reason": None}
    if "token_ids" in choice:
        first["token_ids"] = choice["token_ids"]
    last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
    chunks = [{**head, "choices": [first]}, {**head, "choices": [last]}]
    if include_usage and "usage" in completion:
        chunks.append({**head, "choices": [], "usage": completion["usage"]})
    events = [f"data: {json.dumps(c, ensure_ascii=False)}\n\n".encode() for c in chunks]
    return b"".join(events) + b"data: [DONE]\n\n"


def _error(status: int, message: str, code: str) -> Any:
    from aiohttp import web

    body = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
    return web.json_response(body, status=status)


class Relay:
    """Where verifiers' interception sends an environment's model calls: a loopback server on
    the environment's loop that routes each request by its ``X-Session-ID`` header (the
    rollout's trace id) to its episode's trajectory at creditrl's endpoint
    (``POST <trajectory base URL>/chat/completions`` with the endpoint's key), and answers a
    streamed request (``stream=true``, which verifiers 0.4's chat program sends) as server-sent
    events of the whole turn. Requests carry the relay's own key; bodies are bounded as the
    endpoint bounds them; an unknown session is a 404."""

    def __init__(self) -> None:
        self.key = secrets.token_urlsafe(24)
        self.sessions: dict[str, tuple[str, str]] = {}  # trace id -> (trajectory URL, key)
        self.url = ""
        self._runner: Any = None
        self._http: Any = None

    async def start(self) -> None:
        import httpx
        from aiohttp import web

        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        if self._runner is not None:
            await self._runner.cleanup()

    def _authorized(self, request: Any) -> bool:
        given = request.headers.get("Authorization", "").encode()
        return hmac.compare_digest(given, f"Bearer {self.key}".encode())

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        if not self._authorized(request):
            return _error(401, "invalid API key", "invalid_api_key")
        model = {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "creditrl"}
        return web.json_response({"object": "list", "data": [model]})

    async def _completions(self, request: Any) -> Any:
        import httpx
        from aiohttp import web

        if not self._authorized(request):
            return _error(401, "invalid API key", "invalid_api_key")
        from verifiers.v1.clients.client import SESSION_ID_HEADER

        target = self.sessions.get(request.headers.get(SESSION_ID_HEADER, ""))
        if target is None:
            return _error(404, "no episode runs this rollout (it has ended?)", "unknown_session")
        try:
            body = loads_bounded(await request.read(), REQUEST_LIMITS, allow_nan=False)
        except ValueError as e:
            return _error(400, f"the body is not acceptable JSON: {str(e)[:200]}", "bad_json")
        if not isinstance(body, dict):
            return _error(400, "the body needs to be an object", "bad_request")
        stream = body.pop("stream", None) is True
        options = body.pop("stream_options", None)
        base, key = target
        try:
            reply = await self._http.post(
                f"{base.rstrip('/')}/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
            )
        except httpx.HTTPError as e:
            return _error(502, f"the endpoint did not answer: {one_line(e, 200)}", "upstream")
        if reply.status_code != 200 or not stream:
            return web.Response(
                body=reply.content, status=reply.status_code, content_type="application/json"
            )
        usage = isinstance(options, Mapping) and options.get("include_usage") is True
        return web.Response(
            body=stream_events(reply.json(), usage), content_type="text/event-stream"
        )


def serve(env: Any) -> Relay:
    """Enter ``env.serving()`` (the interception, the taskset's shared tools) and start the
    relay on the environment's loop, once per process; both end when the process exits."""
    with _serve_lock:
        if id(env) in _served:
            return _served[id(env)][1]
        serving, relay = env.serving(), Relay()

        async def enter() -> None:
            await relay.start()
            try:
                await serving.__aenter__()
            except BaseException:
                await relay.stop()
                raise

        try:
            _on_loop(env, enter(), SERVE_TIMEOUT_S)
        except TimeoutError:
            raise ConfigError(
                f"env.verifiers: the environment's serving() did not start within "
                f"{SERVE_TIMEOUT_S:g} s"
            ) from None
        except Exception as e:
            raise UserCodeError(
                f"env.verifiers: the environment's serving() raised {type(e).__name__}: "
                f"{one_line(e, 200)}"
            ) from None
        _served[id(env)] = (env, relay, serving)
        if len(_served) == 1:
            atexit.register(_leave_all)
        return relay


def _leave_all() -> None:
    for env, relay, serving in list(_served.values()):

        async def leave(relay: Relay = relay, serving: Any = serving) -> None:
            try:
                await serving.__aexit__(None, None, None)
            finally:
                await relay.stop()

        try:
            _on_loop(env, leave(), SERVE_TIMEOUT_S)
        except Exception as e:  # the process is ending: one line
            log.warning("env.verifiers: leaving serving() failed: %s", one_line(e, 200))
    _served.clear()


def _key_variable(key: str) -> str:
    """The environment variable holding the relay's key (set once per key). Its name holds
    "API_KEY", so verifiers' subprocess runtime keeps it from harness programs."""
    name = f"{KEY_VARIABLE}_{hashlib.sha256(key.encode()).hexdigest()[:12].upper()}"
    if os.environ.get(name) != key:
        os.environ[name] = key
    return name


def _error_lines(episode: Any) -> list[str]:
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    return [f"{e.type}: {e.message}" for e in errors]


class EnvironmentEpisodeError(RuntimeError):
    """An episode the environment could not run or score (scored as a fallback)."""


class VerifiersV1Program:
    """The agent program of one ``verifiers.v1`` environment: ``await program(row, client)``
    runs the row's task as one episode whose model calls reach ``client``'s trajectory (through
    the interception and the relay) and returns ``{"score": reward, "vf_<part>": value, ...}``;
    EnvironmentEpisodeError when it failed."""

    def __init__(self, env: Any) -> None:
        self.env = env
        task_cls = type(env.taskset).task_type()
        self.task_cls, self.data_cls = task_cls, task_cls.data_type()

    async def __call__(self, row: Mapping[str, Any], client: Any) -> dict[str, Any]:
        relay = serve(self.env)
        target = (str(client.base_url), str(client.api_key))
        return await loop_of(self.env).run(self._episode(row, relay, target))

    async def _episode(
        self, row: Mapping[str, Any], relay: Relay, target: tuple[str, str]
    ) -> dict[str, Any]:
        import verifiers.v1 as vf

        passed = dict((row.get("extra_info") or {}).get("verifiers") or {})
        try:
            task = self.task_cls(
                self.data_cls.model_validate(passed.get("task_data") or {}),
                self.env.config.taskset.task,
            )
        except Exception as e:
            raise EnvironmentEpisodeError(
                f"the row's task could not be rebuilt: {type(e).__name__}: {one_line(e, 200)}"
            ) from None
        client = vf.EvalClientConfig(
            base_url=f"{relay.url}/v1", api_key_var=_key_variable(relay.key)
        )
        ctx = vf.ModelContext(model=MODEL_NAME, client=client)
        sessions: list[str] = []

        def route(trace: Any) -> None:  # verifiers mints the trace before any model call
            sessions.append(trace.id)
            relay.sessions[trace.id] = target

        try:
            episode = await self.env.run_episode(task, ctx, on_trace=route)
        finally:
            for session in sessions:
                relay.sessions.pop(session, None)
        return await self._scored(task, episode)

    async def _scored(self, task: Any, episode: Any) -> dict[str, Any]:
        if len(episode.traces) > 1:
            raise EnvironmentEpisodeError(
                f"the episode ran its agent {len(episode.traces)} times; creditrl trains one "
                "trajectory per episode"
            )
        trace = episode.traces[0] if episode.traces else None
        if not episode.ok:
            lines = _error_lines(episode)
            if trace is not None and any(c in " ".join(lines) for c in LENGTH_CODES):
                await self._truncated(task, trace)
            else:
                why = lines[0] if lines else f"stopped: {getattr(trace, 'stop_condition', None)}"
                raise EnvironmentEpisodeError(f"the environment's episode failed: {one_line(why)}")
        assert trace is not None
        parts = {f"vf_{k}": float(r.score) for k, r in trace.rewards.items() if r is not None}
        for k, v in trace.metrics.items():
            if v is not None:
                parts.setdefault(f"vf_{k}", float(v))
        return {"score": float(trace.reward), **parts}

    async def _truncated(self, task: Any, trace: Any) -> None:
        """The trajectory's budget ran out (the endpoint refused a request for length): the
        trace stops as verifiers stops an overlong prompt, scored by the task's rewards that
        need no runtime (the runtime is gone)."""
        trace.stop("context_length", override=True)
        try:
            await task.score(trace)
        except Exception as e:
            raise EnvironmentEpisodeError(
                f"the environment's scoring failed: {type(e).__name__}: {one_line(e, 200)}"
            ) from None

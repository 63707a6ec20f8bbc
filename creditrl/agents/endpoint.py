"""An OpenAI-compatible HTTP endpoint (``/v1/chat/completions``, ``/v1/models``) for agent
programs that creditrl trains: aiohttp on its own event-loop thread, loopback by default.

Each trajectory has its own base URL, ``http://HOST:PORT/t/<trajectory>/v1``, so an unmodified
``openai.AsyncOpenAI(base_url=..., api_key=...)`` client talks to one trajectory. Every request
carries the run's key (``Authorization: Bearer <key>``, a fresh random key per run). Requests
are bounded before they are decoded (``MAX_BODY_BYTES``, ``REQUEST_LIMITS``); a request with a
wrong key, an unknown trajectory, an oversized or malformed body or an option the run cannot
honour gets an OpenAI-style error (``{"error": {"message", "type", "code"}}``) and is counted
in ``refused``. A chat completion is answered by ``handler(trajectory, body)``, a coroutine the
program rollout supplies.

Connections are bounded, and a keyed request never loses to keyless connections, whichever
client sends it (the episodes' own, or one an agent framework builds from the base URL and key).
Each TCP connection is watched from its first byte (``_Watch``): it counts as keyed as soon as
the bytes it sent hold the run's key, before its request is parsed. Until then it is one of at
most ``max_unkeyed`` unkeyed connections; past that, a newcomer drops the oldest unkeyed one
that has sent bytes without the key, else the oldest silent one
(``refused["connection_dropped"]``), so a fresh connection is never dropped for the ones that
follow it until ``max_unkeyed`` newer ones have arrived before it could show its key. An
unkeyed connection is closed after ``key_timeout_s`` (``refused["connection_timeout"]``), a
keyed one that sends no complete request head within ``idle_timeout_s`` (or stays idle that
long between requests) too, and a body not received within ``idle_timeout_s`` is refused
(408). Keyed connections are never dropped for unkeyed ones; past ``max_connections`` keyed
ones, the longest idle (no request in progress, nothing received for ``KEYED_IDLE_S``) are
closed. The pools are applied as each connection is set up, so one burst of at most
``BACKLOG`` connections accepted together may pass them until the next.

The episodes' own clients (``http_client()``) connect through a private Unix socket instead
(Linux), in a folder only this user can enter, and a connection there from another process
(``SO_PEERCRED``) is closed at once: their connections are counted in neither pool.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from creditrl.bounded_json import JsonLimits, loads_bounded
from creditrl.errors import ConfigError
from creditrl.hosts import unbracketed, url_host
from creditrl.http_serving import BACKLOG, bounded_runner

__all__ = ["MAX_BODY_BYTES", "REQUEST_LIMITS", "Endpoint", "EndpointError"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20  # one request: the whole conversation so far, as JSON
REQUEST_LIMITS = JsonLimits(max_bytes=MAX_BODY_BYTES, max_depth=32, max_items=200_000)
IDLE_TIMEOUT_S = 30.0  # a request head, a body, or the wait between requests
KEY_TIMEOUT_S = 5.0  # for a new connection's bytes to show the run's key
MAX_UNKEYED = 256  # connections that have not shown the key (several accept bursts)
KEYED_IDLE_S = 1.0  # a keyed connection quiet this long, no request in progress, is idle

Handler = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


class EndpointError(Exception):
    """A request refused with an OpenAI-style error: HTTP ``status``, ``kind`` (the error
    type), ``code``."""

    def __init__(self, status: int, message: str, kind: str, code: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code


def _error(err: EndpointError) -> web.Response:
    body = {"error": {"message": str(err), "type": err.kind, "code": err.code, "param": None}}
    return web.json_response(body, status=err.status)


class _Watch(asyncio.Protocol):
    """A TCP connection: everything goes on to ``inner`` (the HTTP server's protocol), and the
    endpoint hears when it is set up, when its bytes first hold the run's key (scanned as they
    arrive, across chunk boundaries), when it sends bytes without it, and when it ends."""

    def __init__(self, endpoint: Endpoint, inner: asyncio.Protocol) -> None:
        self.endpoint, self.inner = endpoint, inner
        self.keyed = False
        self.tail = b""  # the last bytes received, a key split across chunks
        self.last = 0.0  # when it last received bytes (the loop's clock)
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)
        self.endpoint._arrived(self)

    def data_received(self, data: bytes) -> None:
        self.endpoint._received(self, data)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.endpoint._gone(self)
        self.inner.connection_lost(exc)


class _OwnProcess(asyncio.Protocol):
    """A connection to the private socket: handed to ``inner`` (the HTTP server's protocol)
    if it comes from this process, closed otherwise."""

    def __init__(self, inner: asyncio.Protocol) -> None:
        self.inner: asyncio.Protocol | None = inner

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        pid = -1
        if sock is not None:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid = struct.unpack("3i", creds)[0]
        if pid != os.getpid() or self.inner is None:
            self.inner = None
            transport.close()
            return
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.inner is None else self.inner.eof_received()

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inner is not None:
            self.inner.connection_lost(exc)


class Endpoint:
    """The server; ``start()`` binds ``host:port`` (0: a free port) and serves on a daemon
    thread until ``close()``. ``known(trajectory)`` says which trajectory ids are live;
    ``max_connections`` (keyed), ``max_unkeyed``, ``key_timeout_s`` and ``idle_timeout_s``
    bound the connections (module docstring)."""

    def __init__(
        self,
        handler: Handler,
        known: Callable[[str], bool],
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_connections: int = 64,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_unkeyed: int = MAX_UNKEYED,
        key_timeout_s: float = KEY_TIMEOUT_S,
    ) -> None:
        self.handler = handler
        self.known = known
        self.model_name = model_name
        self.host = unbracketed(host)  # [::1] binds as ::1
        self.port = port
        self.key = secrets.token_urlsafe(24)
        self._key_bytes = self.key.encode()
        self.refused: Counter[str] = Counter()
        self.requests = 0
        self.max_connections = max_connections
        self.max_unkeyed = max_unkeyed
        self.idle_timeout_s = idle_timeout_s
        self.key_timeout_s = min(key_timeout_s, idle_timeout_s)
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        # TCP connections (dicts as ordered sets): silent since they were set up, oldest
        # first; that sent bytes without the key, in the order they did; keyed, least recently
        # active first
        self._silent: dict[_Watch, None] = {}
        self._spoken: dict[_Watch, None] = {}
        self._keyed: dict[_Watch, None] = {}
        self._busy: Counter[Any] = Counter()  # requests in progress per HTTP protocol
        self._private: asyncio.AbstractServer | None = None
        self._socket_dir: str | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def base_url(self, trajectory: str) -> str:
        """The OpenAI base URL of one trajectory."""
        return f"http://{url_host(self.host)}:{self.port}/t/{trajectory}/v1"

    def start(self) -> None:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result(timeout=30)
        except BaseException:
            self.close()
            raise

    async def _serve(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._guard])
        app.router.add_post("/t/{trajectory}/v1/chat/completions", self._completions)
        app.router.add_get("/t/{trajectory}/v1/models", self._models)
        app.router.add_get("/v1/models", self._models)
        self._runner = bounded_runner(app, self.idle_timeout_s)
        await self._runner.setup()
        try:
            self._server = await self.loop.create_server(
                self._accept, self.host, self.port, backlog=BACKLOG
            )
        except OSError as e:
            why = "it is in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
            raise ConfigError(
                f"agent.endpoint_port={self.port}: the endpoint cannot listen on "
                f"{self.host}:{self.port} ({why}); choose another port, or 0 for a free one"
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]
        if hasattr(socket, "SO_PEERCRED"):
            self._socket_dir = tempfile.mkdtemp(prefix="creditrl-endpoint-")  # mode 0700
            # removed by close(), else when the process exits without it (never on SIGKILL)
            weakref.finalize(self, shutil.rmtree, self._socket_dir, True)
            self._private = await self.loop.create_unix_server(
                lambda: _OwnProcess(self._runner.server()),  # type: ignore[union-attr]
                os.path.join(self._socket_dir, "s"),
                backlog=BACKLOG,
            )

    def http_client(self) -> Any:
        """An ``httpx.AsyncClient`` for this process's episodes: through the private socket
        where there is one (module docstring), else the port."""
        import httpx

        if self._socket_dir is None:
            return httpx.AsyncClient()
        uds = os.path.join(self._socket_dir, "s")
        return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=uds))

    def _accept(self) -> asyncio.BaseProtocol:
        """A new TCP connection's protocol: the HTTP server's, watched (module docstring)."""
        assert self._runner is not None and self._runner.server is not None
        return _Watch(self, self._runner.server())

    def _arrived(self, conn: _Watch) -> None:
        """A connection set up: unkeyed until its bytes show the key, within ``key_timeout_s``;
        past ``max_unkeyed``, the oldest that spoke without the key goes, else the oldest
        silent one, never this one."""
        conn.last = self.loop.time()
        self._silent[conn] = None
        conn.deadline = self.loop.call_later(self.key_timeout_s, self._too_late, conn)
        while len(self._silent) + len(self._spoken) > self.max_unkeyed:
            pool = self._spoken or self._silent
            oldest = next(iter(pool))
            if oldest is conn:
                break
            self._drop(oldest, "connection_dropped")

    def _received(self, conn: _Watch, data: bytes) -> None:
        """Bytes on ``conn``: keyed when they hold the key; else it has spoken without it."""
        conn.last = self.loop.time()
        if conn.keyed:
            self._keyed.pop(conn, None)
            self._keyed[conn] = None  # most recently active last
            return
        seen = conn.tail + data
        if self._key_bytes not in seen:
            conn.tail = seen[-len(self._key_bytes) :]
            if conn in self._silent:
                del self._silent[conn]
                self._spoken[conn] = None
            return
        conn.keyed, conn.tail = True, b""
        self._silent.pop(conn, None)
        self._spoken.pop(conn, None)
        if conn.deadline is not None:
            conn.deadline.cancel()
            conn.deadline = None
        self._keyed[conn] = None
        if len(self._keyed) > self.max_connections:
            self._close_idle_keyed()

    def _close_idle_keyed(self) -> None:
        """Past ``max_connections`` keyed connections: close the least recently active of
        those idle (no request in progress, nothing received for ``KEYED_IDLE_S``)."""
        now = self.loop.time()
        idle = [c for c in self._keyed if not self._busy[c.inner] and now - c.last >= KEYED_IDLE_S]
        for conn in idle[: len(self._keyed) - self.max_connections]:
            self._drop(conn, None)

    def _too_late(self, conn: _Watch) -> None:
        conn.deadline = None
        if not conn.keyed:
            self._drop(conn, "connection_timeout")

    def _drop(self, conn: _Watch, counted: str | None) -> None:
        """Close ``conn`` now (counted in ``refused[counted]``) and forget it."""
        self._gone(conn)
        if counted is not None:
            self.refused[counted] += 1
        conn.inner.force_close()  # type: ignore[attr-defined]

    def _gone(self, conn: _Watch) -> None:
        self._silent.pop(conn, None)
        self._spoken.pop(conn, None)
        self._keyed.pop(conn, None)
        if conn.deadline is not None:
            conn.deadline.cancel()
            conn.deadline = None

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Key check first; every refusal as an OpenAI-style error, counted by its code."""
        try:
            if request.headers.get("Authorization") != f"Bearer {self.key}":
                raise EndpointError(
                    401, "invalid API key", "invalid_request_error", "invalid_api_key"
                )
            self._busy[request.protocol] += 1
            try:
                return await handler(request)
            finally:
                self._busy[request.protocol] -= 1
                if not self._busy[request.protocol]:
                    del self._busy[request.protocol]
        except EndpointError as err:
            self.refused[err.code] += 1
            return _error(err)
        except web.HTTPRequestEntityTooLarge:
            self.refused["body_too_large"] += 1
            message = f"request body above {MAX_BODY_BYTES} bytes"
            return _error(EndpointError(413, message, "invalid_request_error", "body_too_large"))
        except web.HTTPNotFound:
            self.refused["not_found"] += 1
            return _error(EndpointError(404, "no such route", "invalid_request_error", "not_found"))
        except web.HTTPException:
            raise
        except Exception as e:  # a failure of ours: one line, never a traceback per request
            self.refused["internal_error"] += 1
            log.warning("endpoint: %s: %s", type(e).__name__, str(e)[:200])
            message = "the endpoint failed on this request"
            return _error(EndpointError(500, message, "server_error", "internal_error"))

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "creditrl"}
        return web.json_response({"object": "list", "data": [model]})

    async def _completions(self, request: web.Request) -> web.Response:
        trajectory = request.match_info["trajectory"]
        try:
            async with asyncio.timeout(self.idle_timeout_s):
                raw = await request.read()  # at most MAX_BODY_BYTES, else 413
        except TimeoutError:
            request.protocol.close()  # after this answer
            message = f"the body did not arrive within {self.idle_timeout_s:g} s"
            raise EndpointError(408, message, "invalid_request_error", "request_timeout") from None
        if not self.known(trajectory):
            message = f"unknown trajectory {trajectory[:64]!r} (its episode has ended?)"
            raise EndpointError(404, message, "invalid_request_error", "unknown_trajectory")
        try:
            body = loads_bounded(raw, REQUEST_LIMITS, allow_nan=False)
        except ValueError as e:
            message = f"the body is not acceptable JSON: {str(e)[:200]}"
            raise EndpointError(400, message, "invalid_request_error", "bad_json") from None
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            message = "the body needs a 'messages' list"
            raise EndpointError(400, message, "invalid_request_error", "bad_request")
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            message = "the body holds a string that is not valid Unicode (a lone surrogate)"
            raise EndpointError(400, message, "invalid_request_error", "bad_json") from None
        self.requests += 1
        return web.json_response(await self.handler(trajectory, body))

    def close(self) -> None:
        if self._server is not None:
            self.loop.call_soon_threadsafe(self._server.close)
            self._server = None
        if self._private is not None:
            self.loop.call_soon_threadsafe(self._private.close)
            self._private = None
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(30)
            self._runner = None
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None

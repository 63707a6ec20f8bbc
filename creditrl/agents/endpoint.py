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

Connections are bounded: one that sends no complete request head within ``idle_timeout_s`` (or
stays idle that long between requests) is closed, a body not received within ``idle_timeout_s``
is refused (408), and at most ``max_connections`` are open: past it, the oldest connections
that have not shown the key are dropped for a new one, and a new one is refused when every open
connection has shown it (``refused["connection_dropped"]``, ``refused["connection_refused"]``).
The limit is applied as each connection is accepted, to those already set up, so one burst of
at most ``BACKLOG`` connections accepted together may pass it until the next accept.

The episodes' own clients (``http_client()``) connect through a private Unix socket instead
(Linux), in a folder only this user can enter, and a connection there from another process
(``SO_PEERCRED``) is closed at once: their connections are neither counted against
``max_connections`` nor dropped, so a local process flooding the port with keyless
connections cannot cost an episode its own, not yet keyed, connection.
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
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from creditrl.bounded_json import JsonLimits, loads_bounded
from creditrl.errors import ConfigError
from creditrl.hosts import unbracketed, url_host

__all__ = ["MAX_BODY_BYTES", "REQUEST_LIMITS", "Endpoint", "EndpointError"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20  # one request: the whole conversation so far, as JSON
REQUEST_LIMITS = JsonLimits(max_bytes=MAX_BODY_BYTES, max_depth=32, max_items=200_000)
IDLE_TIMEOUT_S = 30.0  # a request head, a body, or the wait between requests
MAX_HEAD_BYTES = 8190  # one request line or header field
BACKLOG = 64  # connections waiting to be accepted (and accepted at once before the limit applies)

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


class _Refuse(asyncio.Protocol):
    """A connection over the limit: closed as soon as it is made."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _OwnProcess(asyncio.Protocol):
    """A connection to the private socket: handed to ``inner`` (the HTTP server's protocol)
    if it comes from this process, closed otherwise."""

    def __init__(self, inner: asyncio.Protocol, own: set[Any]) -> None:
        self.inner: asyncio.Protocol | None = inner
        self.own = own

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
        self.own.add(self.inner)
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
            self.own.discard(self.inner)
            self.inner.connection_lost(exc)


class Endpoint:
    """The server; ``start()`` binds ``host:port`` (0: a free port) and serves on a daemon
    thread until ``close()``. ``known(trajectory)`` says which trajectory ids are live;
    ``max_connections`` and ``idle_timeout_s`` bound the connections (module docstring)."""

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
    ) -> None:
        self.handler = handler
        self.known = known
        self.model_name = model_name
        self.host = unbracketed(host)  # [::1] binds as ::1
        self.port = port
        self.key = secrets.token_urlsafe(24)
        self.refused: Counter[str] = Counter()
        self.requests = 0
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._keyed: set[Any] = set()  # connections (protocols) that have shown the key
        self._own: set[Any] = set()  # connections of this process's clients (private socket)
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
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handler_cancellation=True,
            keepalive_timeout=self.idle_timeout_s,
            lingering_time=1.0,
            max_line_size=MAX_HEAD_BYTES,
            max_field_size=MAX_HEAD_BYTES,
            shutdown_timeout=5.0,
        )
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
            self._private = await self.loop.create_unix_server(
                lambda: _OwnProcess(self._runner.server(), self._own),  # type: ignore[union-attr]
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
        """A new connection's protocol, within ``max_connections`` (module docstring)."""
        assert self._runner is not None and self._runner.server is not None
        server = self._runner.server
        open_now = [
            c
            for c in server.connections
            if c.transport and not c.transport.is_closing() and c not in self._own
        ]
        self._keyed &= set(open_now)
        excess = len(open_now) + 1 - self.max_connections
        for conn in [c for c in open_now if c not in self._keyed][: max(excess, 0)]:
            conn.force_close()
            self.refused["connection_dropped"] += 1
            excess -= 1
        if excess > 0:
            self.refused["connection_refused"] += 1
            return _Refuse()
        return server()

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Key check first; every refusal as an OpenAI-style error, counted by its code."""
        try:
            if request.headers.get("Authorization") != f"Bearer {self.key}":
                raise EndpointError(
                    401, "invalid API key", "invalid_request_error", "invalid_api_key"
                )
            self._keyed.add(request.protocol)
            return await handler(request)
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

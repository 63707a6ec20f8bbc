"""The HTTP front door of the Tinker service: Tinker's ``/api/v1`` routes over ``Service``,
served by aiohttp on its own event-loop thread, loopback by default.

The client handshake the SDK does: ``client/config`` (answered with the flags that keep it on
plain API keys, JSON futures and unchunked, uncompressed ``forward_backward`` bodies), then
``create_session``, heartbeats, and requests that return a future id it polls with
``retrieve_future`` (held up to ``POLL_WAIT_S`` here, then a 408 "try again"). With ``api_key`` set
every request must carry it (``X-API-Key``, as the SDK sends ``TINKER_API_KEY``); the SDK
itself insists on a key that starts with ``tml-``.

Bounded: a body is at most ``MAX_BODY_BYTES``; JSON bodies are parsed with
``creditrl.bounded_json``; a refused request is a 4xx JSON ``{"detail": message}``, which the
SDK raises as its own ``BadRequestError`` (400), ``NotFoundError`` (404) and so on; a failed
job is Tinker's ``RequestFailedError`` with the message; a failure of the service's own is a
one-line 500, logged once. A client that disconnects only cancels its own wait; its jobs
finish and their results are dropped in time.

Connections are bounded too (slow or idle clients): a connection that sends no complete
request head within ``IDLE_TIMEOUT_S`` (or stays idle that long between requests) is closed;
a body that does not arrive within ``IDLE_TIMEOUT_S`` is answered 408 and its connection
closed; at most ``max_connections`` are open: past it, the oldest connections that have not
yet had a request served (a half-sent head, a trickled body) are dropped for a new one, and a
new one is refused when every open connection has had one. Each is counted in ``refused``
(``connection_dropped``, ``connection_refused``; a late body as ``http_408``). The SDK is
told to keep at most ``SAMPLE_CONCURRENCY`` sampling requests in flight (each holds a
connection while it polls), so that one client's sampling stays within the limit.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from creditrl.bounded_json import JsonLimitError, JsonLimits, loads_bounded
from creditrl.hosts import unbracketed, url_host
from creditrl.http_serving import BACKLOG, bounded_runner
from creditrl.tinker.futures import Failure, ProtoResult
from creditrl.tinker.messages import BadRequest, parse_forward_backward
from creditrl.tinker.service import Service, Settings

__all__ = ["CLIENT_CONFIG", "MAX_BODY_BYTES", "TinkerServer"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20
JSON_LIMITS = JsonLimits(max_bytes=MAX_BODY_BYTES, max_depth=32, max_items=1 << 21)
POLL_WAIT_S = 10.0
IDLE_TIMEOUT_S = 30.0  # a request head, a body, or the wait between two requests
MAX_CONNECTIONS = 256
SAMPLE_CONCURRENCY = 128  # sampling requests one SDK client keeps in flight
PROTO = "application/x-protobuf"
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False,
    "fwdbwd_max_chunk_bytes_count": 8_000_000,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
    "sample_max_concurrent_requests": SAMPLE_CONCURRENCY,
}
UNSUPPORTED = {
    "save_weights_external": "exporting weights (save_weights_external)",
    "create_custom_loss": "server-side custom losses (forward_backward_custom runs client-side)",
    "copy_weights": "copying weights between projects",
    "join_sampling_session": "joining a sampling session from another process",
    "retrieve_futures": "the session futures poller",
    "weights_info": "weights info lookups",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _detail(message: str, status: int) -> web.Response:
    return web.json_response({"detail": message}, status=status)


class _Refuse(asyncio.Protocol):
    """A connection over the limit: closed as soon as it is made."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class TinkerServer:
    """``start()`` binds ``host:port`` (0: a free port) and serves ``Service`` on a daemon
    thread until ``close()``. ``refused`` counts refused requests and connections by kind;
    ``max_connections`` and ``idle_timeout_s`` bound the connections (module docstring)."""

    def __init__(
        self,
        settings: Settings,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        *,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.settings = settings
        self.host, self.port, self.api_key = unbracketed(host), port, api_key  # [::1]: ::1
        self.max_connections, self.idle_timeout_s = max_connections, idle_timeout_s
        self.loop = asyncio.new_event_loop()
        self.service = Service(settings, self.loop)
        self.refused: Counter[str] = Counter()
        self._served: set[Any] = set()  # connections (protocols) that have had a request served
        self._server: asyncio.AbstractServer | None = None
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result(timeout=60)

    def close(self) -> None:
        if self._server is not None:
            self.loop.call_soon_threadsafe(self._server.close)
            self._server = None
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(timeout=30)
            self._runner = None
        self.service.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)

    async def _serve(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._guard])
        json_routes: dict[str, Callable[[dict], Any]] = {
            "client/config": lambda _: CLIENT_CONFIG,
            "client/dynamic_config": lambda _: {"refresh_interval_sec": 300},
            "create_session": self.service.create_session,
            "session_heartbeat": self._heartbeat,
            "telemetry": lambda _: {"status": "accepted"},
            "create_model": self.service.create_model,
            "get_info": self.service.get_info,
            "optim_step": self.service.optim_step,
            "save_weights": self.service.save_weights,
            "save_weights_for_sampler": self.service.save_weights_for_sampler,
            "load_weights": self.service.load_weights,
            "asample": self.service.sample,
        }
        for name, fn in json_routes.items():
            app.router.add_post(f"/api/v1/{name}", self._json(fn))
        app.router.add_post("/api/v1/create_sampling_session", self._json(self._on_worker))
        app.router.add_post("/api/v1/forward_backward", self._forward_backward)
        app.router.add_post("/api/v1/retrieve_future", self._retrieve)
        app.router.add_post("/api/v1/sessions/{sid}/finish", self._finish)
        app.router.add_get("/api/v1/healthz", self._get(lambda _: {"status": "ok"}))
        app.router.add_get(
            "/api/v1/get_server_capabilities", self._get(lambda _: self.service.capabilities())
        )
        app.router.add_get(
            "/api/v1/samplers/{sid}", self._get(lambda r: self.service.get_sampler(r["sid"]))
        )
        app.router.add_get(
            "/api/v1/training_runs/{run}/checkpoints",
            self._get(lambda r: self.service.list_checkpoints(r["run"])),
        )
        app.router.add_get(
            "/api/v1/checkpoints", self._get(lambda _: self.service.list_checkpoints(None))
        )
        app.router.add_route("*", "/api/v1/{tail:.*}", self._unsupported)
        self._runner = bounded_runner(app, self.idle_timeout_s)
        await self._runner.setup()
        self._server = await self.loop.create_server(
            self._accept, self.host, self.port, backlog=BACKLOG
        )
        self.port = self._server.sockets[0].getsockname()[1]  # the port bound (0: chosen)

    def _accept(self) -> asyncio.BaseProtocol:
        """A new connection's protocol, within ``max_connections`` (module docstring)."""
        assert self._runner is not None and self._runner.server is not None
        server = self._runner.server
        open_now = [c for c in server.connections if c.transport and not c.transport.is_closing()]
        self._served &= set(open_now)
        excess = len(open_now) + 1 - self.max_connections
        for conn in [c for c in open_now if c not in self._served][: max(excess, 0)]:
            conn.force_close()
            self.refused["connection_dropped"] += 1
            excess -= 1
        if excess > 0:
            self.refused["connection_refused"] += 1
            return _Refuse()
        return server()

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The API key (when set), and any refusal as a 4xx with its message."""
        if self.api_key is not None:
            given = request.headers.get("X-API-Key", "")
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                self.refused["api_key"] += 1
                return _detail("wrong or missing API key (TINKER_API_KEY)", 401)
        self._served.add(request.protocol)
        try:
            return await handler(request)
        except BadRequest as err:
            self.refused[f"http_{err.status}"] += 1
            return _detail(str(err), err.status)
        except web.HTTPRequestEntityTooLarge:
            self.refused["body_too_large"] += 1
            return _detail(f"request body over {MAX_BODY_BYTES} bytes", 413)
        except web.HTTPException:
            raise
        except Exception as err:  # a failure of ours: one line, never a traceback per request
            self.refused["internal_error"] += 1
            log.warning("tinker service: %s: %s", type(err).__name__, str(err)[:200])
            return _detail(f"the service failed on this request: {type(err).__name__}", 500)

    async def _read(self, request: web.Request) -> bytes:
        """The body, within ``MAX_BODY_BYTES`` (413) and ``idle_timeout_s`` (408, and the
        connection is closed after the answer)."""
        try:
            async with asyncio.timeout(self.idle_timeout_s):
                return await request.read()
        except TimeoutError:
            request.protocol.close()
            raise BadRequest(
                f"the body did not arrive within {self.idle_timeout_s:g} s", status=408
            ) from None

    async def _body(self, request: web.Request) -> dict:
        if request.headers.get("Content-Encoding", "identity") != "identity":
            raise BadRequest("compressed request bodies are not accepted", status=415)
        raw = await self._read(request)
        try:
            body = loads_bounded(raw or b"{}", JSON_LIMITS, allow_nan=False)
        except (JsonLimitError, ValueError) as err:
            raise BadRequest(f"the body is not valid JSON within limits: {err}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    def _json(self, fn: Callable[[dict], Any]) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            result = fn(await self._body(request))
            if asyncio.iscoroutine(result):
                result = await result
            return web.json_response(result)

        return handle

    def _get(self, fn: Callable[[Any], Any]) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            return web.json_response(fn(request.match_info))

        return handle

    async def _on_worker(self, body: dict) -> dict:
        """create_sampling_session: it may load a model or weights, so it runs on the worker
        thread, after the jobs before it."""
        worker = self.service.futures.worker
        return await self.loop.run_in_executor(worker, self.service.create_sampling_session, body)

    def _heartbeat(self, body: dict) -> dict:
        self.service.session(body.get("session_id"))
        return {"type": "session_heartbeat"}

    async def _finish(self, request: web.Request) -> web.StreamResponse:
        sid = request.match_info["sid"]
        worker = self.service.futures.worker
        await self.loop.run_in_executor(worker, self.service.finish_session, sid)
        return web.json_response({})

    async def _forward_backward(self, request: web.Request) -> web.StreamResponse:
        if PROTO not in request.headers.get("Content-Type", ""):
            raise BadRequest("forward_backward takes a protocol-buffer body", status=415)
        if request.headers.get("Content-Encoding", "identity") != "identity":
            raise BadRequest("compressed request bodies are not accepted", status=415)
        parsed = parse_forward_backward(await self._read(request), self.settings.limits)
        return web.json_response(self.service.forward_backward(parsed))

    async def _retrieve(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or len(request_id) > 128:
            raise BadRequest("request_id must be a string")
        result = await self.service.futures.wait(request_id, POLL_WAIT_S)
        if result is None:  # 408 + try_again: the SDK polls again (quietly)
            return web.json_response(
                {"type": "try_again", "request_id": request_id, "queue_state": "active"},
                status=408,
            )
        if isinstance(result, Failure):
            return web.json_response({"error": result.message, "category": result.category})
        if isinstance(result, ProtoResult):
            return web.Response(body=result.body, content_type=PROTO)
        return web.json_response(result)

    async def _unsupported(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["tail"].split("/")[0]
        what = UNSUPPORTED.get(name)
        if what is not None:
            raise BadRequest(f"{what} is not supported by the local creditrl Tinker service")
        raise BadRequest(
            f"{request.method} /api/v1/{request.match_info['tail']} is not supported by the "
            "local creditrl Tinker service",
            status=404,
        )

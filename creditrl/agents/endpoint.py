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
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from creditrl.bounded_json import JsonLimits, loads_bounded

__all__ = ["MAX_BODY_BYTES", "REQUEST_LIMITS", "Endpoint", "EndpointError"]

MAX_BODY_BYTES = 4 << 20  # one request: the whole conversation so far, as JSON
REQUEST_LIMITS = JsonLimits(max_bytes=MAX_BODY_BYTES, max_depth=32, max_items=200_000)

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


class Endpoint:
    """The server; ``start()`` binds ``host:port`` (0: a free port) and serves on a daemon
    thread until ``close()``. ``known(trajectory)`` says which trajectory ids are live."""

    def __init__(
        self,
        handler: Handler,
        known: Callable[[str], bool],
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.handler = handler
        self.known = known
        self.model_name = model_name
        self.host = host
        self.port = port
        self.key = secrets.token_urlsafe(24)
        self.refused: Counter[str] = Counter()
        self.requests = 0
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def base_url(self, trajectory: str) -> str:
        """The OpenAI base URL of one trajectory."""
        return f"http://{self.host}:{self.port}/t/{trajectory}/v1"

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result(timeout=30)

    async def _serve(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._guard])
        app.router.add_post("/t/{trajectory}/v1/chat/completions", self._completions)
        app.router.add_get("/t/{trajectory}/v1/models", self._models)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Key check first; every refusal as an OpenAI-style error, counted by its code."""
        try:
            if request.headers.get("Authorization") != f"Bearer {self.key}":
                raise EndpointError(
                    401, "invalid API key", "invalid_request_error", "invalid_api_key"
                )
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

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "creditrl"}
        return web.json_response({"object": "list", "data": [model]})

    async def _completions(self, request: web.Request) -> web.Response:
        trajectory = request.match_info["trajectory"]
        raw = await request.read()  # at most MAX_BODY_BYTES, else HTTPRequestEntityTooLarge
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
        self.requests += 1
        return web.json_response(await self.handler(trajectory, body))

    def run(self, coro: Awaitable[Any]) -> Any:
        """Run ``coro`` on the endpoint's loop; the concurrent future of its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def close(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(30)
            self._runner = None
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

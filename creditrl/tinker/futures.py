"""Tinker's futures: a request returns a request id at once; the work runs on one worker
thread, in submission order (a training client's requests arrive in its order); the client
polls ``retrieve_future`` until the result is there.

Bounded: at most ``max_pending`` requests wait or run (past it a request gets 429, which the
SDK retries later) and at most ``max_kept`` finished results are kept (the oldest are dropped;
the SDK fetches each result once). A job that raises ``BadRequest`` fails as a user error, any
other exception as a server error; both reach the client as Tinker's ``RequestFailedError``
with the message, and the service goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from creditrl.tinker.messages import BadRequest

__all__ = ["Failure", "FutureTable", "ProtoResult", "outcome"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProtoResult:
    """A result the SDK reads as protocol buffers."""

    body: bytes


@dataclass(frozen=True)
class Failure:
    """A failed request: the message and Tinker's category (``user`` or ``server``)."""

    message: str
    category: str


def outcome(job: Callable[[], Any]) -> Any:
    """What ``job`` returns, or the ``Failure`` it raised: ``BadRequest`` as a user error, any
    other exception as a server error (logged; the service goes on)."""
    try:
        return job()
    except BadRequest as err:
        return Failure(str(err), "user")
    except Exception as err:  # a job's bug must not stop the service
        log.error("tinker request failed:\n%s", traceback.format_exc())
        return Failure(f"{type(err).__name__}: {err}", "server")


class FutureTable:
    """Request id -> result (a JSON-able dict, a ``ProtoResult`` or a ``Failure``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_pending: int, max_kept: int) -> None:
        self.loop = loop
        self.max_pending = max_pending
        self.max_kept = max_kept
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-worker")
        self.pending: dict[str, asyncio.Event] = {}
        self.done: OrderedDict[str, Any] = OrderedDict()
        self.lock = threading.Lock()

    def reserve(self) -> str:
        """A new pending request id, resolved later by ``resolve``. BadRequest(429) when
        ``max_pending`` are pending."""
        if len(self.pending) >= self.max_pending:
            raise BadRequest(
                f"{self.max_pending} requests are already queued on this service; retry later",
                status=429,
            )
        request_id = uuid.uuid4().hex
        self.pending[request_id] = asyncio.Event()
        return request_id

    def submit(self, job: Callable[[], Any]) -> str:
        """Queue ``job``; its request id, resolved with what ``job`` returns."""
        request_id = self.reserve()
        self.worker.submit(lambda: self.resolve(request_id, outcome(job)))
        return request_id

    def run(self, job: Callable[[], None]) -> None:
        """Queue ``job`` (it resolves the requests it serves itself)."""
        self.worker.submit(job)

    def resolve(self, request_id: str, result: Any) -> None:
        """Set a request's result (from any thread)."""
        self.loop.call_soon_threadsafe(self._finish, request_id, result)

    def _finish(self, request_id: str, result: Any) -> None:
        event = self.pending.pop(request_id, None)
        self.done[request_id] = result
        while len(self.done) > self.max_kept:
            self.done.popitem(last=False)
        if event is not None:
            event.set()

    async def wait(self, request_id: str, timeout: float) -> Any:
        """The result of ``request_id`` (waiting up to ``timeout`` s: None if not done yet);
        BadRequest(404) for an id this service does not know (or no longer keeps)."""
        if request_id in self.done:
            return self.done[request_id]
        event = self.pending.get(request_id)
        if event is None:
            raise BadRequest(f"no request {request_id!r} on this service", status=404)
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return None
        return self.done.get(request_id)

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)

"""Agent program episodes off the endpoint's event loop: each on a thread of its own with an
event loop of its own, at most ``concurrency`` at a time, each within its timeout, so a program
that blocks (``time.sleep``, the synchronous OpenAI client, blocking I/O) or misbehaves cannot
stop the endpoint's server or the other episodes.

``EpisodeRun.run(turns)`` runs in the caller's thread (the engine's): it starts the episodes,
serves their turn requests (when nothing is being generated, the engine runs once every
running episode waits for one, or once a request has waited ``BATCH_WAIT_S``, so an episode
that blocks or works long between turns holds the others back that long at most; requests in
episode order, each with its sample's own seed where the batch has ``sample_seed``) and
returns one
``(status, value)`` per episode: "ok" (value: what the program returned), "error" (an
Exception), "exit" (SystemExit), "interrupted" (KeyboardInterrupt), "cancelled" (a
CancelledError of the program's own), "timeout", or "not_started" (see below); the value of
the others is a one-line reason.

Continuous batching: with a turn generator whose ``chunk_tokens`` > 0, each engine call
samples at most that many tokens per turn; a turn that goes on stays in the running batch, its
KV kept, and the requests that arrived meanwhile join it at the next call, so an episode whose
turn ended does not wait for the longest turn of the others before its next one starts. The
tokens and log-probs are those of whole turns: each row continues its own seed's stream.

Timeouts: the program runs under ``asyncio.wait_for(timeout_s)``. An episode still running
``GRACE_S`` after its timeout (it blocks its thread, or it caught the cancellation) is
abandoned: "timeout", its waiting and later requests refused (``EpisodeEnded``), its event loop
told to stop. Python cannot kill a thread, so an abandoned thread runs until its program gives
control back; at most ``MAX_ABANDONED`` abandoned threads may be alive in the process, and
while that many are, new episodes are not started ("not_started", scored like any failure).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from creditrl.rollout.continuation import TurnGenerator, TurnOutput, TurnRequest

__all__ = ["GRACE_S", "MAX_ABANDONED", "EpisodeEnded", "EpisodeRun", "abandoned_threads"]

log = logging.getLogger(__name__)

GRACE_S = 2.0  # after its timeout, how long an episode may take to stop before it is abandoned
MAX_ABANDONED = 32  # abandoned episode threads alive at once, in this process
BATCH_WAIT_S = 0.5  # the longest a turn request waits for the other episodes' requests

_RUNS = itertools.count()
_abandoned: list[threading.Thread] = []
_abandoned_lock = threading.Lock()

Episode = Callable[[int], Coroutine[Any, Any, Any]]
Outcome = tuple[str, Any]


def abandoned_threads() -> int:
    """Abandoned episode threads still alive in this process."""
    with _abandoned_lock:
        _abandoned[:] = [t for t in _abandoned if t.is_alive()]
        return len(_abandoned)


class EpisodeEnded(Exception):
    """A request of an episode that is no longer running (it timed out or the run ended)."""


def _describe(e: BaseException) -> str:
    """``Type: message`` of an exception, in at most 500 characters, whatever its __str__."""
    try:
        text = str(e)
    except Exception:
        text = "(its message cannot be shown)"
    return f"{type(e).__name__}: {text[:500]}"


class _ProgramExit(Exception):
    """SystemExit or KeyboardInterrupt raised by a program, as an ordinary exception (those
    two would otherwise leave the event loop from the middle of a task)."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome[1])
        self.outcome = outcome


async def _exits_caught(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        return await coro
    except KeyboardInterrupt as e:
        raise _ProgramExit(("interrupted", _describe(e))) from None
    except SystemExit as e:
        raise _ProgramExit(("exit", _describe(e))) from None


def _close(loop: asyncio.AbstractEventLoop) -> None:
    """Close an episode's loop; what is left on it (an abandoned program) is cancelled first
    and given ``GRACE_S`` to finish (its client closed, its ``finally`` blocks run)."""
    try:
        tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.wait(tasks, timeout=GRACE_S))
        loop.run_until_complete(loop.shutdown_asyncgens())
    except BaseException as e:  # the thread ends here whatever the program does
        log.debug("closing an episode's event loop: %s", _describe(e))
    finally:
        loop.close()


@dataclass
class _Turn:
    """A turn being generated: its request, what it has sampled so far, its answer's future."""

    index: int
    request: TurnRequest
    future: concurrent.futures.Future[TurnOutput]
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    kept: list[int] | None = field(default_factory=list)  # None once a chunk had none
    versions: list[int] | None = field(default_factory=list)  # None once a chunk had none

    def next_request(self) -> TurnRequest:
        """The request that continues this turn from what it has sampled."""
        r = self.request
        if not self.ids:
            return r
        return dataclasses.replace(
            r, ids=r.ids + self.ids, max_new_tokens=r.max_new_tokens - len(self.ids),
            sampled=len(self.ids),
        )  # fmt: skip


@dataclass
class _Episode:
    index: int
    deadline: float
    thread: threading.Thread | None = None
    loop: asyncio.AbstractEventLoop | None = None


class EpisodeRun:
    """One batch of episodes (see the module docstring); ``episode(i)`` is episode i's
    coroutine, run on its own thread."""

    def __init__(
        self,
        size: int,
        episode: Episode,
        *,
        concurrency: int,
        timeout_s: float,
        greedy: bool = False,
        temperature: float | None = None,
    ) -> None:
        self.id = f"r{next(_RUNS)}"
        self.size, self.episode = size, episode
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.greedy, self.temperature = greedy, temperature
        self.cond = threading.Condition()
        self.pending: list[tuple[int, TurnRequest, concurrent.futures.Future[TurnOutput]]] = []
        self.running: dict[int, _Episode] = {}
        self.outcomes: list[Outcome | None] = [None] * size
        self.started = 0
        self.oldest = 0.0  # when the oldest waiting request came

    def is_running(self, index: int) -> bool:
        """Episode ``index`` runs (call with ``cond`` held to keep it so)."""
        return index in self.running

    def submit(self, index: int, request: TurnRequest) -> concurrent.futures.Future[TurnOutput]:
        """Queue a turn of episode ``index``; EpisodeEnded when it no longer runs."""
        future: concurrent.futures.Future[TurnOutput] = concurrent.futures.Future()
        with self.cond:
            if index not in self.running:
                raise EpisodeEnded(f"episode {index} has ended")
            if not self.pending:
                self.oldest = time.monotonic()
            self.pending.append((index, request, future))
            self.cond.notify_all()
        return future

    # ---- the episodes' threads -----------------------------------------------------------

    def _start(self, index: int) -> None:
        """Start episode ``index`` (``cond`` held)."""
        ep = _Episode(index, time.monotonic() + self.timeout_s + GRACE_S)
        ep.thread = threading.Thread(
            target=self._thread, args=(ep,), name=f"creditrl-episode-{self.id}-{index}", daemon=True
        )
        self.running[index] = ep
        ep.thread.start()

    def _thread(self, ep: _Episode) -> None:
        loop = asyncio.new_event_loop()
        ep.loop = loop
        outcome: Outcome
        try:
            value = loop.run_until_complete(
                asyncio.wait_for(_exits_caught(self.episode(ep.index)), self.timeout_s)
            )
            outcome = ("ok", value)
        except TimeoutError:
            message = f"the episode ran past agent.episode_timeout_s={self.timeout_s:g}"
            outcome = ("timeout", message)
        except asyncio.CancelledError as e:
            outcome = ("cancelled", _describe(e))
        except _ProgramExit as e:
            outcome = e.outcome
        except KeyboardInterrupt as e:
            outcome = ("interrupted", _describe(e))
        except SystemExit as e:
            outcome = ("exit", _describe(e))
        except BaseException as e:
            outcome = ("error", _describe(e))
        finally:
            _close(loop)
        with self.cond:
            if self.running.pop(ep.index, None) is not None:
                self.outcomes[ep.index] = outcome
                self._refuse_pending(ep.index)
                self.cond.notify_all()

    def _refuse_pending(self, index: int) -> None:
        """Fail the waiting requests of episode ``index`` (``cond`` held)."""
        keep = []
        for item in self.pending:
            if item[0] == index:
                _settle(item[2], error=EpisodeEnded(f"episode {index} has ended"))
            else:
                keep.append(item)
        self.pending = keep

    def _abandon(self, ep: _Episode, outcome: Outcome) -> None:
        """Give up on a running episode (``cond`` held): ``outcome`` stands, its requests are
        refused, its loop is told to stop, its thread is counted until it ends."""
        del self.running[ep.index]
        self.outcomes[ep.index] = outcome
        self._refuse_pending(ep.index)
        loop = ep.loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed in between: the thread has ended
                loop.call_soon_threadsafe(loop.stop)
        if ep.thread is not None:
            with _abandoned_lock:
                _abandoned.append(ep.thread)

    def _abandon_overdue(self, now: float) -> None:
        for ep in [ep for ep in self.running.values() if ep.deadline <= now]:
            message = (
                f"the episode ran past agent.episode_timeout_s={self.timeout_s:g} and did not "
                f"stop within {GRACE_S:g} s (a blocking call, or the cancellation caught): "
                "abandoned"
            )
            log.warning("agent.program episode %d: %s", ep.index, message)
            self._abandon(ep, ("timeout", message))

    def _start_more(self) -> None:
        while len(self.running) < self.concurrency and self.started < self.size:
            index, self.started = self.started, self.started + 1
            if abandoned_threads() >= MAX_ABANDONED:
                self.outcomes[index] = (
                    "not_started",
                    f"{MAX_ABANDONED} abandoned agent.program episodes are still running in "
                    "this process (programs that block past agent.episode_timeout_s)",
                )
            else:
                self._start(index)

    # ---- the engine's side ---------------------------------------------------------------

    def run(self, turns: TurnGenerator) -> list[Outcome]:
        """Run every episode; serve their turns from ``turns`` (module docstring); one
        (status, value) per episode."""
        going: list[_Turn] = []  # turns continued in the next call (chunked generation)
        try:
            while True:
                with self.cond:
                    now = time.monotonic()
                    self._abandon_overdue(now)
                    self._start_more()
                    going = [t for t in going if self._still_wanted(t)]
                    if not self.running and self.started >= self.size:
                        return [o or ("error", "no outcome") for o in self.outcomes]
                    due = self.oldest + BATCH_WAIT_S
                    waiting = len(self.pending) < len(self.running) and now < due
                    if not going and (not self.pending or waiting):
                        soonest = min(ep.deadline for ep in self.running.values())
                        if self.pending:
                            soonest = min(soonest, due)
                        self.cond.wait(timeout=max(soonest - now, 0.01))
                        continue
                    arrived = [_Turn(i, request, future) for i, request, future in self.pending]
                    self.pending = []
                batch = sorted(going + arrived, key=lambda t: (t.index, t.request.turn))
                going = self._generate(turns, batch)
        finally:
            with self.cond:
                for ep in list(self.running.values()):
                    self._abandon(ep, ("error", "the run ended while the episode ran"))

    def _still_wanted(self, turn: _Turn) -> bool:
        """Whether a turn being generated still has an episode to answer (``cond`` held)."""
        if turn.index in self.running and not turn.future.cancelled():
            return True
        _settle(turn.future, error=EpisodeEnded(f"episode {turn.index} has ended"))
        return False

    def _generate(self, turns: TurnGenerator, batch: list[_Turn]) -> list[_Turn]:
        """One engine call over ``batch``: answer the turns that ended, return those that go
        on."""
        try:
            outputs = turns.generate_turns(
                [turn.next_request() for turn in batch],
                greedy=self.greedy,
                temperature=self.temperature,
            )
        except BaseException as e:
            for turn in batch:
                _settle(turn.future, error=EpisodeEnded(f"the engine failed: {_describe(e)}"))
            raise
        going = []
        for turn, out in zip(batch, outputs, strict=True):
            turn.ids += out.ids
            turn.log_probs += out.log_probs
            turn.kept = None if turn.kept is None or out.kept is None else turn.kept + out.kept
            turn.versions = (
                None if turn.versions is None or out.versions is None
                else turn.versions + out.versions
            )  # fmt: skip
            if out.done:
                _settle(
                    turn.future,
                    TurnOutput(turn.ids, turn.log_probs, kept=turn.kept, versions=turn.versions),
                )
            else:
                going.append(turn)
        return going


def _settle(
    future: concurrent.futures.Future[TurnOutput],
    out: TurnOutput | None = None,
    error: BaseException | None = None,
) -> None:
    """Give ``future`` its result or error unless its request was cancelled (the client went
    away)."""
    if not future.set_running_or_notify_cancel():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(out)

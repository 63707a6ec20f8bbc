"""Scoring pool: worker subprocesses speaking JSON lines, fed by one thread each.

Each feeder thread owns one ``python -m creditrl.rewards.worker`` process and takes
``(job, index, line)`` tasks from a shared queue. A sample that runs past ``timeout_s`` gets
status "timeout"; its worker is killed and a fresh one started (it warms up in the background).
A reply line is bounded in length before it is parsed and checked field by field
(``creditrl.rewards.results``); a bad one fails its sample and replaces the worker.

``num_workers=0`` scores a request queued with ``in_process=True`` in this process
(``creditrl.rewards.inprocess``): no process boundary, so a user's closure or runtime-registered
function works, but a scorer past the timeout is only abandoned on its thread. Any other request
(the manager sends the built-in scorers so) goes to one worker process, started on first use
and kept: a built-in scorer may spend minutes in C code holding the GIL (sympy, via math_verify,
expanding a power tower such as ``9^{9^{9^9}}``), which no thread timeout can interrupt, while
a worker is killed at ``timeout_s`` like any pool worker.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from creditrl.rewards.inprocess import InProcessScorer
from creditrl.rewards.results import MAX_LINE_CHARS, check_reply, failure, parse_line

__all__ = ["WORKER_COMMAND", "ScoringJob", "ScoringPool"]

STARTUP_TIMEOUT_S = 120.0
CLOSE_WAIT_S = 2.0
WORKER_COMMAND = [sys.executable, "-m", "creditrl.rewards.worker"]


class ScoringJob:
    """Replies for one batch, filled by the feeder threads; ``wait`` blocks until all are in."""

    def __init__(self, size: int) -> None:
        self.replies: list[dict[str, Any] | None] = [None] * size
        self._left = size
        self._lock = threading.Lock()
        self._done = threading.Event()
        if size == 0:
            self._done.set()

    def set(self, index: int, reply: dict[str, Any]) -> None:
        with self._lock:
            if self.replies[index] is None:
                self._left -= 1
            self.replies[index] = reply
            if self._left == 0:
                self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


class _WorkerDied(RuntimeError):
    pass


class _WorkerProcess:
    """One worker subprocess; a reader thread turns its stdout into a queue of lines."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            WORKER_COMMAND,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            encoding="utf-8",
            errors="replace",
            bufsize=1,
        )
        self.lines: queue.Queue[str | _WorkerDied | None] = queue.Queue()
        self.ready = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        """Queue each line; a line longer than MAX_LINE_CHARS is never held whole: reading stops
        there and the worker is replaced."""
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline(MAX_LINE_CHARS + 1):
            if len(line) > MAX_LINE_CHARS:
                message = f"a line longer than {MAX_LINE_CHARS} characters"
                self.lines.put(_WorkerDied(f"reward worker {self.proc.pid} sent {message}"))
                return
            self.lines.put(line)
        self.lines.put(None)

    def _next(self, deadline: float) -> dict[str, Any]:
        line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.0))
        if line is None:
            code = self.proc.wait()
            raise _WorkerDied(f"reward worker {self.proc.pid} exited with code {code}")
        if isinstance(line, _WorkerDied):
            raise line
        try:
            value = parse_line(line)
        except ValueError as e:
            raise _WorkerDied(f"reward worker {self.proc.pid} sent {e}") from None
        if not isinstance(value, dict):
            raise _WorkerDied(f"reward worker {self.proc.pid} sent a line that is not an object")
        return value

    def wait_ready(self) -> None:
        """Block until the worker's ready line (_WorkerDied if it exits or takes too long)."""
        if self.ready:
            return
        try:
            self._next(time.monotonic() + STARTUP_TIMEOUT_S)
        except queue.Empty:
            raise _WorkerDied(f"reward worker not ready after {STARTUP_TIMEOUT_S}s") from None
        self.ready = True

    def call(self, line: str, request_id: int, timeout_s: float) -> dict[str, Any]:
        """Send one request line; the reply, TimeoutError, or _WorkerDied."""
        self.wait_ready()
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise _WorkerDied(f"reward worker {self.proc.pid} is gone: {e}") from e
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = self._next(deadline)
            except queue.Empty:
                raise TimeoutError from None
            if reply.get("id") == request_id:
                return reply

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close_stdin(self) -> None:
        """End the worker: EOF on its stdin if it is serving, a kill while still starting."""
        if not self.ready:
            self.proc.kill()
            return
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            self.proc.kill()


def _worker_env() -> dict[str, str]:
    """The parent's environment with creditrl's parent directory first on PYTHONPATH."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class ScoringPool:
    """``num_workers`` worker processes with a per-sample timeout; with 0, one worker started
    on first use for requests not queued ``in_process`` (see the module doc)."""

    def __init__(self, num_workers: int, timeout_s: float) -> None:
        if num_workers < 0:
            raise ValueError(f"reward.num_workers must be >= 0, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {timeout_s}")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._tasks: queue.Queue[tuple[ScoringJob, int, int, str, bool] | None] = queue.Queue()
        self._closed = False
        self._env = _worker_env()
        self._workers: list[_WorkerProcess | None] = [None] * max(num_workers, 1)
        self._lock = threading.Lock()
        self.in_process = InProcessScorer(timeout_s) if num_workers == 0 else None
        for slot in range(num_workers):
            self._workers[slot] = _WorkerProcess(self._env)
        self._threads = [
            threading.Thread(target=self._feed, args=(slot,), daemon=True)
            for slot in range(max(num_workers, 1))
        ]
        for t in self._threads:
            t.start()

    def put(
        self, job: ScoringJob, index: int, request_id: int, line: str, in_process: bool = False
    ) -> None:
        """Queue one request line (its reply goes to ``job.replies[index]``); ``in_process``:
        score it in this process when ``num_workers`` is 0 (ignored otherwise)."""
        if self._closed:
            raise RuntimeError("the reward scoring pool is closed")
        self._tasks.put((job, index, request_id, line, in_process))

    def _feed(self, slot: int) -> None:
        """Take a task only once this slot's worker is ready, so a warming worker holds none
        (with num_workers=0 in-process samples do not wait for the worker to warm up)."""
        while True:
            startup_error = self._warm(slot) if self.num_workers else None
            task = self._tasks.get()
            if task is None:
                if self.in_process is not None:
                    self.in_process.close()
                return
            job, index, request_id, line, in_process = task
            try:
                if self.in_process is not None and in_process:
                    reply = self.in_process.score(line)
                elif startup_error is not None:
                    reply = failure("error", startup_error)
                else:
                    reply = self._call(slot, request_id, line)
            except Exception as e:  # e.g. no fork for a fresh worker: fail the sample, not the pool
                reply = failure("error", f"reward scoring pool: {type(e).__name__}: {e}")
            job.set(index, reply)

    def _warm(self, slot: int) -> str | None:
        """Wait for the slot's worker to be ready; the startup failure message, if any."""
        worker = self._workers[slot]
        if worker is None:
            return None
        try:
            worker.wait_ready()
        except _WorkerDied as e:
            self._replace(slot, worker)
            return str(e)
        return None

    def _call(self, slot: int, request_id: int, line: str) -> dict[str, Any]:
        with self._lock:
            if self._workers[slot] is None and not self._closed:
                self._workers[slot] = _WorkerProcess(self._env)  # num_workers=0: on first use
            worker = self._workers[slot]
        if worker is None:
            return failure("error", "the reward scoring pool is closed")
        try:
            return check_reply(worker.call(line, request_id, self.timeout_s))
        except TimeoutError:
            self._replace(slot, worker)
            return failure("timeout", f"scorer exceeded {self.timeout_s}s; its worker was killed")
        except _WorkerDied as e:
            self._replace(slot, worker)
            return failure("error", str(e))

    def _replace(self, slot: int, worker: _WorkerProcess) -> None:
        worker.kill()
        with self._lock:
            if not self._closed:
                self._workers[slot] = _WorkerProcess(self._env)

    def close(self) -> None:
        """Stop the feeders, fail queued tasks, and end the worker processes."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                break
            if task is not None:
                task[0].set(task[1], failure("error", "the reward scoring pool was closed"))
        for _ in self._threads:
            self._tasks.put(None)
        workers = [w for w in self._workers if w is not None]
        self._workers = [None] * len(self._workers)
        for worker in workers:
            worker.close_stdin()
        deadline = time.monotonic() + CLOSE_WAIT_S
        for worker in workers:
            try:
                worker.proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                worker.kill()

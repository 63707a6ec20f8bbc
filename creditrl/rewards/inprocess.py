"""In-process scoring (``reward.num_workers=0``) with ``reward.timeout_s`` enforced.

Samples are scored one at a time on a daemon thread, and the caller waits at most ``timeout_s``
for each. A Python thread cannot be killed, so a scorer past its timeout is abandoned: its
sample gets status "timeout" (as a killed worker's does) and its thread runs on until the
scorer returns; that result is dropped. At most ``MAX_ABANDONED`` abandoned threads may be
running: while that many are, each further sample fails at once with status "error" saying so,
and ``reward.max_failure_rate`` stops the run rather than leak more. A scorer that may hang
belongs in worker processes (``reward.num_workers`` > 0), where a timeout kills it; the built-in
scorers always run in one (``creditrl.rewards.pool``), since a thread stuck in C code holding
the GIL would stop this whole process, timeout included.
"""

from __future__ import annotations

import json
import queue
import threading
from typing import Any

from creditrl.rewards.results import failure
from creditrl.rewards.worker import score_request

__all__ = ["MAX_ABANDONED", "InProcessScorer"]

MAX_ABANDONED = 4


class _ScorerThread:
    """A daemon thread scoring request lines from its queue until it reads None.

    Hand-written rather than a ``concurrent.futures`` pool: that pool's threads are joined at
    interpreter exit, so one hung scorer would keep the process from ever exiting.
    """

    def __init__(self) -> None:
        self.requests: queue.Queue[str | None] = queue.Queue()
        self.replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="reward-scorer")
        self.thread.start()

    def _run(self) -> None:
        while (line := self.requests.get()) is not None:
            try:
                reply = score_request(json.loads(line))
            except BaseException as e:  # a scorer's sys.exit() must not end the thread unheard
                reply = failure("error", f"{type(e).__name__}: {e}")
            self.replies.put(reply)


class InProcessScorer:
    """Scores request lines in this process, each within ``timeout_s``; see the module doc.

    ``abandoned``: the threads given up on that may still be running (pruned as they end).
    Used by one thread at a time.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.abandoned: list[threading.Thread] = []
        self._current: _ScorerThread | None = None

    def score(self, line: str) -> dict[str, Any]:
        """The reply to one request line, or a "timeout" / "error" failure."""
        self.abandoned = [t for t in self.abandoned if t.is_alive()]
        if len(self.abandoned) >= MAX_ABANDONED:
            return failure(
                "error",
                f"not scored: {len(self.abandoned)} in-process scorer threads that ran past "
                f"reward.timeout_s={self.timeout_s:g}s are still running (at most "
                f"{MAX_ABANDONED}); set reward.num_workers > 0 so hung scorers are killed",
            )
        if self._current is None:
            self._current = _ScorerThread()
        scorer = self._current
        scorer.requests.put(line)
        try:
            return scorer.replies.get(timeout=self.timeout_s)
        except queue.Empty:
            scorer.requests.put(None)  # it ends once its scorer returns
            self.abandoned.append(scorer.thread)
            self._current = None
            return failure(
                "timeout",
                f"scorer exceeded {self.timeout_s:g}s; its in-process thread was abandoned "
                f"({len(self.abandoned)} running, at most {MAX_ABANDONED})",
            )

    def close(self) -> None:
        """End the idle scorer thread (abandoned ones end when their scorers return)."""
        if self._current is not None:
            self._current.requests.put(None)
            self._current = None

"""One publication in flight at a time, off the caller's thread, its error kept for later."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class OneInFlight:
    """Runs ``fn(*args)`` on a thread, one at a time; an error it raised is re-raised (as a
    ``RuntimeError`` saying ``what`` failed) by the next ``wait()``, which ``run`` calls first."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        """Wait for the job in flight, then start ``fn(*args)`` in the background."""
        self.wait()
        self._thread = threading.Thread(target=self._logged, args=(fn, *args), daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the job in flight (if any) is done, re-raising its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(self.what) from error

    def _logged(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:  # surfaced by the next run() or wait()
            self._error = e

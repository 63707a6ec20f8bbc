"""Episodes that failed, said on the console: a run that trains on fallback scores says so.

After each training step the loop hands its batch to ``EpisodeFailures.check``: when any of the
step's episodes (agent programs, environments) failed or were refused, one console line says
how many and the first reason (``step 3: 4 of 4 episodes failed (error: BadRequestError: ...
prompt_too_long ...)``); when every episode of ``limit`` steps in a row failed, the run stops
with that line (``NothingToLearnError``): it would only train on placeholders.
"""

from __future__ import annotations

from typing import Any

from creditrl.agents.rollout import failed_episodes
from creditrl.batch import Batch
from creditrl.errors import NothingToLearnError
from creditrl.plain_text import as_text

__all__ = ["EpisodeFailures"]


class EpisodeFailures:
    """Counts steps whose every episode failed; ``limit`` 0 never stops the run."""

    def __init__(self, console: Any, limit: int) -> None:
        self.console = console
        self.limit = limit
        self.streak = 0

    def check(self, step: int, batch: Batch) -> None:
        """Say how many of ``batch``'s episodes failed, and why; stop after ``limit`` steps
        of nothing but failures."""
        failed, total, reason = failed_episodes(batch)
        line = f"step {step}: {failed} of {total} episodes failed ({reason})"
        if failed and self.console is not None:
            self.console.print(as_text(line), style="yellow", soft_wrap=True)
        self.streak = self.streak + 1 if total and failed == total else 0
        if self.limit and self.streak >= self.limit:
            raise NothingToLearnError(
                f"every episode failed in {self.streak} steps in a row, so there is nothing to "
                f"learn from (agent.max_failed_steps={self.limit}); the latest: {line}"
            )

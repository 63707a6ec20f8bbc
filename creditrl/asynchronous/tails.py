"""What the process supervisor (``launcher``) and the Ray actor supervisor (``ray_launch``)
print about a child that failed: its last output lines, then how to resume, unless it refused
to run (exit code ``REFUSED``: one line said what to change, and there is nothing to resume)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from creditrl.plain_text import as_text

__all__ = ["REFUSED", "TAIL_LINES", "print_tail"]

TAIL_LINES = 20  # output lines of a failed child that are shown
REFUSED = 2  # the exit code of a child that refused in one line (a UserError)


def print_tail(console: Any, name: str, lines: Sequence[str], code: int = 1) -> None:
    """The last output lines of a failed process or actor, then how to resume, unless its exit
    ``code`` says it refused (a folder in use, a setting: rerunning would be refused again)."""
    if lines:
        console.print(as_text(f"last {len(lines)} line(s) of {name}:"))
        for line in lines:
            console.print(as_text(f"  | {line}"), soft_wrap=True)
    if code == REFUSED:
        return
    console.print(
        "async: rerun the same command to resume (the learner from its last checkpoint, the "
        "samplers resend their unacknowledged groups)",
        markup=False,
    )

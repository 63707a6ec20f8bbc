"""A run directory's files read as data (a run may come from anyone), with the checks a model
directory's files get (``creditrl.models.model_dir``): a regular file inside the run directory
(a link may point inside it), opened without blocking, so a FIFO never hangs the reader, and
its size bounded before and while it is read, so a link to ``/dev/zero`` never grows memory.

``run_file_text`` reads a whole small file (``config.yaml``, a checkpoint pointer);
``run_file_lines`` streams a line-oriented one (``metrics.jsonl``, ``rollouts/step_*.jsonl``)
within ``LineLimits``: the file's bytes and lines are bounded (past either, one refusal), and
a line over its limit is never held: it is yielded as ``None`` for the reader to count and
say, or to refuse. Every refusal is one line naming the file and what is wrong with it, e.g.
``runs/x/metrics.jsonl is a FIFO, not a regular file``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple

from creditrl.config.limits import MAX_CONFIG_BYTES
from creditrl.errors import ConfigError, DataError

__all__ = [
    "DUMP_LINES",
    "METRICS_LINES",
    "LineLimits",
    "RunLine",
    "open_run_file",
    "run_file_lines",
    "run_file_text",
]

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)
_SKIP_CHUNK = 1 << 20  # the rest of an overlong line is read and dropped this much at a time


@dataclass(frozen=True)
class LineLimits:
    """How much of a line-oriented run file is read: the whole file's bytes, one line's bytes
    (its newline not counted) and the lines (blank ones too)."""

    max_bytes: int
    max_line_bytes: int
    max_lines: int


# metrics.jsonl: one record a step, a few KiB (a run of 50,000 steps of 5 KiB fits).
METRICS_LINES = LineLimits(max_bytes=256 << 20, max_line_bytes=1 << 20, max_lines=1 << 20)
# rollouts/step_*.jsonl: one row a sample; a row's per-token dump of a 32k-token response holds
# ~0.5M values (the line limit is bounded_json.RUN_RECORD_LIMITS.max_bytes).
DUMP_LINES = LineLimits(max_bytes=2 << 30, max_line_bytes=1 << 26, max_lines=1 << 20)


class RunLine(NamedTuple):
    """Line ``number`` (from 1) of a run file: its bytes without the newline, or None when it
    is over the line limit (not read into memory); ``ended``: a newline ends it (a last line
    without one may still be being written)."""

    number: int
    data: bytes | None
    ended: bool


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


@contextmanager
def open_run_file(
    path: str | os.PathLike[str],
    max_bytes: int,
    *,
    inside: str | os.PathLike[str] | None = None,
    error: type[Exception] = DataError,
) -> Iterator[BinaryIO]:
    """``path`` opened for reading (binary), once it is a regular file inside the run directory
    ``inside`` (default: its own folder) of at most ``max_bytes``; else ``error``, one line
    naming it: a link outside, a FIFO, socket, device or directory, too large, unreadable."""
    path = Path(path)
    root = Path(inside) if inside is not None else path.parent
    target = Path(os.path.realpath(path))
    if not target.is_relative_to(os.path.realpath(root)):
        raise error(
            f"{path}: a link to {target}, outside the run directory; creditrl reads only files "
            "inside it"
        )
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{path} is {_kind(mode)}, not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise error(f"{path}: cannot be read ({err.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # replaced since the stat above
            raise error(f"{path} is {_kind(info.st_mode)}, not a regular file")
        if info.st_size > max_bytes:
            raise error(
                f"{path}: {info.st_size} bytes, above the limit of {max_bytes} bytes "
                f"({_size(max_bytes)})"
            )
        yield f


def run_file_text(
    path: Path, max_bytes: int = MAX_CONFIG_BYTES, *, error: type[Exception] = ConfigError
) -> str:
    """The UTF-8 text of ``path``, a file of the run directory ``path.parent``; one-line
    ``error`` (``ConfigError``) naming it when it is a link outside the directory, not a
    regular file (a device, pipe or socket), over ``max_bytes``, unreadable or not UTF-8."""
    with open_run_file(path, max_bytes, error=error) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew since it was opened
        raise error(f"{path}: above the limit of {max_bytes} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{path}: not UTF-8 text ({err.reason})") from None


def run_file_lines(
    path: str | os.PathLike[str],
    limits: LineLimits,
    *,
    inside: str | os.PathLike[str] | None = None,
    error: type[Exception] = DataError,
) -> Iterator[RunLine]:
    """The lines of ``path`` (checked by ``open_run_file``), read one at a time: at most
    ``limits.max_line_bytes + 1`` bytes of a line are ever held, and a longer line comes as
    ``RunLine(n, None, ...)``. More than ``limits.max_lines`` lines, or a file that grows past
    ``limits.max_bytes`` while it is read, is ``error``, one line naming it."""
    cap = limits.max_line_bytes
    with open_run_file(path, limits.max_bytes, inside=inside, error=error) as f:
        total = number = 0
        while line := f.readline(cap + 1):
            number += 1
            if number > limits.max_lines:
                raise error(f"{path}: more than {limits.max_lines} lines, above the limit")
            total += len(line)
            ended = line.endswith(b"\n")
            if ended or len(line) <= cap:
                data: bytes | None = line[:-1] if ended else line
            else:  # over the limit: drop the rest of it unread into memory
                data, line = None, b""
                while not ended and (rest := f.readline(_SKIP_CHUNK)):
                    total += len(rest)
                    ended = rest.endswith(b"\n")
                    if total > limits.max_bytes:
                        break
            if total > limits.max_bytes:
                raise error(f"{path}: grew above the limit of {limits.max_bytes} bytes as read")
            yield RunLine(number, data, ended)

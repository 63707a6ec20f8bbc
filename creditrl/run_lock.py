"""One run per output folder.

``RunLock.acquire(out)`` takes an exclusive ``fcntl.flock`` on ``<out>/run.lock`` and writes
who holds it (pid, host, start time, command) into the file. The kernel drops the lock when
the holding process ends, however it ends, so a crashed run never leaves the folder locked
(the file stays, naming its last holder, and the next run simply takes it). A second run into
a folder in use is refused with ``RunInUseError``: one line naming the run that holds it.

``creditrl async`` holds the lock in the launcher and hands the open descriptor to learner
rank 0 (``pass_fds`` and ``LOCK_FD_ENV``): the child adopts it when the descriptor is that
very lock file, so the run's own learner is not refused.

``check_output_dir`` makes the folder, or says in one line (``ConfigError`` naming
``trainer.output_dir``) why it cannot be one: a file there or above it, no permission.

Another folder a run writes into (the async learner's ``asynchronous.weight_dir``) is locked
the same way, ``RunLock.acquire(folder, key)``; the refusals then name ``key``.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import shlex
import socket
import stat
import sys
from pathlib import Path
from types import TracebackType

from creditrl.errors import ConfigError, UserError

__all__ = [
    "LOCK_FD_ENV",
    "LOCK_NAME",
    "RunInUseError",
    "RunLock",
    "check_output_dir",
    "check_output_dir_free",
]

LOCK_NAME = "run.lock"
LOCK_FD_ENV = "CREDITRL_RUN_LOCK_FD"
HOLDER_MAX_BYTES = 4096  # what is read of a lock file's holder record
COMMAND_MAX_CHARS = 160  # of the holder's command line, in the refusal


class RunInUseError(UserError):
    """Another run holds the output folder's lock."""


def check_output_dir(out: Path, key: str = "trainer.output_dir") -> Path:
    """Create ``out`` (and its parents) if needed and return it; ``ConfigError`` naming
    ``key`` when it is a file, lies below one, or cannot be made."""
    out = Path(out)
    for path in (out, *out.parents):
        with contextlib.suppress(OSError):
            if not stat.S_ISDIR(os.stat(path).st_mode):
                what = "is a file" if path == out else f"lies below the file {path}"
                raise ConfigError(f"{key}={out} {what}, not a folder; choose another {key}")
            break
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"{key}={out}: cannot create it ({err.strerror}); choose another {key}"
        ) from None
    return out


def _printable(text: str, limit: int) -> str:
    """``text`` with control characters as spaces, cut at ``limit`` characters."""
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _holder(fd: int) -> str:
    """Who holds the lock, from the record in its file: 'pid 12 on host, started ...: cmd'."""
    try:
        data = os.pread(fd, HOLDER_MAX_BYTES, 0)
        record = json.loads(data.decode("utf-8"))
    except (OSError, ValueError):
        return "holder unknown"
    if not isinstance(record, dict):
        return "holder unknown"
    pid, host = record.get("pid"), record.get("host")
    started, command = record.get("started"), record.get("command")
    parts = []
    if isinstance(pid, int) and not isinstance(pid, bool):
        parts.append(f"pid {pid}")
    if isinstance(host, str):
        parts.append(f"on {_printable(host, 64)}")
    if isinstance(started, str):
        parts.append(f"started {_printable(started, 40)}")
    text = " ".join(parts[:2]) + "".join(f", {part}" for part in parts[2:]) or "holder unknown"
    if isinstance(command, str) and command:
        text += f": {_printable(command, COMMAND_MAX_CHARS)}"
    return text


def _record() -> bytes:
    """This process's holder record."""
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": started,
        "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else "",
    }
    return json.dumps(record).encode("utf-8") + b"\n"


def _open(path: Path, key: str) -> int:
    """The lock file's descriptor (created if missing; a planted link is never followed)."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as err:
        raise ConfigError(
            f"{key}={path.parent}: cannot open its lock file {path.name} "
            f"({err.strerror}); remove it or choose another {key}"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(
            f"{key}={path.parent}: {path.name} is not a regular file; remove it or choose "
            f"another {key}"
        )
    return fd


def _inherited(path: Path) -> int | None:
    """The descriptor named by ``LOCK_FD_ENV`` when it is open on ``path`` itself (handed
    over by the launcher that holds the lock), else None."""
    value = os.environ.get(LOCK_FD_ENV, "")
    if not value.isdigit():
        return None
    fd = int(value)
    try:
        mine, theirs = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
        return None
    try:  # flock on the same open file description: succeeds iff it is the held lock
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return None
    return fd


class RunLock:
    """The held lock of one output folder; ``release()`` (or leaving the ``with`` block, or
    the process ending) frees it."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, out: Path, key: str = "trainer.output_dir") -> RunLock:
        """Make ``out`` (``check_output_dir``) and lock it; ``RunInUseError`` (one line naming
        the holder and ``key``, the setting that chose the folder) when another run holds it."""
        path = check_output_dir(out, key) / LOCK_NAME
        inherited = _inherited(path)
        if inherited is not None:
            return cls(inherited, path)
        fd = _open(path, key)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunInUseError(
                f"{key}={out} is in use by another run ({holder}); wait for it to end or stop "
                f"it, or choose another {key}"
            ) from None
        except OSError as err:
            os.close(fd)
            raise ConfigError(f"{key}={out}: cannot lock {LOCK_NAME} ({err.strerror})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, _record(), 0)
        return cls(fd, path)

    def release(self) -> None:
        """Free the lock (idempotent); the file and its record stay."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()


def check_output_dir_free(out: Path) -> None:
    """``RunInUseError`` when a run holds ``out``; the lock is freed again at once (for a
    launcher whose learner, in another process, takes it for the run)."""
    RunLock.acquire(out).release()

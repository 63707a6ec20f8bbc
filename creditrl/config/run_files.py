"""A run directory's files read as data (a run may come from anyone), with the checks a model
directory's files get (``creditrl.models.model_dir``): a regular file inside the directory (a
link may point inside it), opened without blocking, so a FIFO never hangs the reader, and its
size bounded before and while it is read, so a link to ``/dev/zero`` never grows memory.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from creditrl.config.limits import MAX_CONFIG_BYTES
from creditrl.errors import ConfigError

__all__ = ["run_file_text"]


def run_file_text(path: Path, max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """The UTF-8 text of ``path``, a file of the run directory ``path.parent``; one-line
    ``ConfigError`` naming it when it is a link outside the directory, not a regular file (a
    device, pipe or socket), over ``max_bytes``, unreadable or not UTF-8."""
    path = Path(path)
    target = Path(os.path.realpath(path))
    if not target.is_relative_to(os.path.realpath(path.parent)):
        raise ConfigError(
            f"{path}: a link to {target}, outside the run directory; creditrl reads only files "
            "inside it"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{path}: not a regular file (a device, pipe or socket)")
        data = f.read(max_bytes + 1) if info.st_size <= max_bytes else b""
    if info.st_size > max_bytes or len(data) > max_bytes:
        raise ConfigError(f"{path}: above the limit of {max_bytes} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason})") from None

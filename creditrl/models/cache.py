"""The on-disk cache: where built model directories live, and how each is built exactly once."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

__all__ = ["build_once", "cache_root"]


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``cache_dir`` if given, else ``$CREDITRL_CACHE``, else ``~/.cache/creditrl``."""
    root = cache_dir or os.environ.get("CREDITRL_CACHE") or Path.home() / ".cache" / "creditrl"
    return Path(root).expanduser()


def build_once(target: Path, build: Callable[[Path], None], message: str | None = None) -> Path:
    """Return ``target``, first building it with ``build(tmp_dir)`` if it does not exist.

    The build writes into a fresh temporary directory beside ``target`` which is then renamed
    into place, so ``target`` either does not exist or is complete. A file lock beside it makes
    concurrent callers (threads, processes, pytest workers) wait for one build instead of racing.
    ``message`` is printed to stderr when a build actually starts.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if target.is_dir():
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # left by a killed build
            shutil.rmtree(stale, ignore_errors=True)
        if message:
            print(message, file=sys.stderr, flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
            build(tmp)
            for path in tmp.rglob("*"):  # some writers create files private (0600)
                path.chmod(0o755 if path.is_dir() else 0o644)
            os.rename(tmp, target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if target.is_dir():  # built by a process that does not share our lock file
                return target
            raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target

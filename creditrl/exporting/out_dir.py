"""Where an export goes (OUT_DIR): checked before anything is written, and written in one step.

- A folder of the user's is never written into or deleted: ``/``, the home directory, the
  current directory, the run directory and the folders above it, anything inside the run's
  ``checkpoints/``, a symbolic link, and a path below a file are refused.
- An existing, non-empty OUT_DIR is replaced only with ``overwrite``, and only when it is an
  earlier export: it holds ``MARKER`` (written into every export, listing its files) and no
  file or folder that the marker does not list. Anything else is refused, in one line naming it.
- Everything is written into a temporary sibling, which is renamed into place; an earlier
  export is moved aside first and removed only once the new one is in place. A failed write
  (a full disk, no permission) is one line naming OUT_DIR and leaves nothing behind, also when
  the safetensors writer reports it (a ``SafetensorError`` whose text holds the OS error).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from safetensors import SafetensorError

from creditrl.bounded_json import JsonLimits, loads_bounded
from creditrl.config.run_files import open_run_file
from creditrl.errors import UserError

__all__ = ["MARKER", "check_out_dir", "staged_dir", "write_marker"]

MARKER = "creditrl_export.json"
MARKER_LIMITS = JsonLimits(max_bytes=1 << 16, max_depth=3, max_items=10_000)
SHOWN = 5  # names listed in an error line
# the OS error inside a SafetensorError's text: "message: \"...\"" or "(os error 28)"
_OS_MESSAGE = re.compile(r'message: "([^"]{1,200})"')
_OS_CODE = re.compile(r"os error (\d{1,4})\)")


def _write_failure(err: BaseException) -> str | None:
    """Why writing failed, when ``err`` is an ``OSError`` or a safetensors writer error (it
    carries the OS error in its text); None for any other error."""
    if isinstance(err, OSError):
        return err.strerror or str(err)
    if not isinstance(err, SafetensorError):
        return None
    text = str(err)
    if message := _OS_MESSAGE.search(text):
        return message.group(1)
    if code := _OS_CODE.search(text):
        return os.strerror(int(code.group(1)))
    return " ".join(text.split())[:200]


def write_marker(out: Path, files: Sequence[str], step: int, version: str) -> None:
    """``out/MARKER``: this directory is an export of creditrl ``version`` holding ``files``."""
    record = {"creditrl_export": 1, "creditrl_version": version, "step": step}
    (out / MARKER).write_text(json.dumps({**record, "files": sorted(files)}, indent=1) + "\n")


def _marked_files(out: Path) -> set[str] | None:
    """The files ``out``'s marker lists, or None when there is no readable marker."""
    marker = out / MARKER
    if not os.path.lexists(marker):
        return None
    # a regular file inside OUT_DIR, opened without blocking: a FIFO or a link is one line
    with open_run_file(marker, MARKER_LIMITS.max_bytes, error=UserError) as f:
        data = f.read(MARKER_LIMITS.max_bytes + 1)
    try:
        record = loads_bounded(data, MARKER_LIMITS)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("creditrl_export") != 1:
        return None
    files = record.get("files")
    if not isinstance(files, list):
        return None
    names = {f for f in files if isinstance(f, str) and f == Path(f).name and f not in ("..", ".")}
    return names if len(names) == len(files) else None


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def _check_replaceable(out: Path) -> None:
    """UserError unless ``out`` is an earlier export holding only what it lists."""
    files = _marked_files(out)
    if files is None:
        raise UserError(
            f"OUT_DIR {out} is not an earlier export (it has no {MARKER}); --overwrite "
            "replaces only a directory creditrl export wrote: choose a new or empty directory"
        )
    other = sorted(
        p.name
        for p in out.iterdir()
        if p.name != MARKER and (p.name not in files or (p.is_dir() and not p.is_symlink()))
    )
    if other:
        raise UserError(
            f"OUT_DIR {out} holds {_listed(other)}, which creditrl export did not write; "
            "move them out or choose another directory (nothing was changed)"
        )


def _protected(here: Path, run_dir: Path) -> str | None:
    """Why the absolute path ``here`` may not be an export's directory, or None."""
    run = run_dir.resolve()
    home = Path(os.path.expanduser("~")).resolve()
    named = {Path(here.anchor): "the file system's root", home: "your home directory"}
    named[Path.cwd().resolve()] = "the current directory"
    if here in named:
        return named[here]
    if here == run or run.is_relative_to(here):
        return f"the run directory {run_dir} or a folder above it"
    if here.is_relative_to(run / "checkpoints"):
        return f"inside the run's checkpoints/ folder ({run / 'checkpoints'})"
    return None


def check_out_dir(out: Path, run_dir: Path, overwrite: bool) -> None:
    """One-line UserError unless an export of ``run_dir`` may be written to ``out`` (see the
    module's docstring)."""
    why = _protected(out.resolve(), run_dir)
    if why is not None:
        raise UserError(f"OUT_DIR {out} is {why}; name a new directory for the export")
    if out.is_symlink():
        raise UserError(f"OUT_DIR {out} is a symbolic link; name the directory itself")
    above = Path(os.path.abspath(out))
    while not os.path.lexists(above):
        above = above.parent
    if not above.is_dir():
        where = "a file" if above == Path(os.path.abspath(out)) else f"below the file {above}"
        raise UserError(f"OUT_DIR {out} is {where}; choose a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UserError(
                f"OUT_DIR {out} is not empty; choose a new or empty directory, or pass "
                "--overwrite (overwrite=True) to replace an earlier export"
            )
        _check_replaceable(out)


def _make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and the folders above it that are missing; those created, deepest
    first."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        path.mkdir()
    return missing


def _put_in_place(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``; an existing ``target`` is moved aside first, put back if
    the rename fails, and removed once ``tmp`` is in place."""
    if not target.exists():
        os.rename(tmp, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    try:
        os.rename(target, old / target.name)
    except OSError:
        old.rmdir()
        raise
    try:
        os.rename(tmp, target)
    except OSError:
        os.rename(old / target.name, target)
        old.rmdir()
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_dir(out: Path, run_dir: Path, overwrite: bool = False) -> Iterator[Path]:
    """A temporary directory beside ``out`` to write into: on success it replaces ``out``, on
    any error it is removed (with the folders made for it), so ``out`` is never half-written.
    An ``OSError`` or ``SafetensorError`` while writing becomes a one-line UserError naming
    ``out``."""
    check_out_dir(out, run_dir, overwrite)
    target = Path(os.path.abspath(out))
    created: list[Path] = []
    tmp: Path | None = None
    try:
        created = _make_parents(target.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.export-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; an export is meant to be shared
        yield tmp
        for path in tmp.rglob("*"):  # some writers create files private (0600)
            path.chmod(0o755 if path.is_dir() else 0o644)
        check_out_dir(out, run_dir, overwrite)  # unless someone else wrote there meanwhile
        _put_in_place(tmp, target)
    except BaseException as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for path in created:
            with suppress(OSError):  # not empty: someone else wrote there
                path.rmdir()
        reason = _write_failure(err)
        if reason is not None:
            raise UserError(f"cannot write OUT_DIR {out}: {reason}; nothing was written") from None
        raise

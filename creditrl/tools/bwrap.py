"""Bubblewrap (``bwrap``) command lines that run the Python interpreter in a throwaway sandbox.

The sandbox sees only: the interpreter and its standard library (read-only), the shared
libraries under ``/usr/lib`` and ``/usr/lib64`` (read-only), its own ``/proc`` (its own PID
namespace), a minimal ``/dev``, and a private writable ``/work`` on a tmpfs of a fixed size.
The root and ``/dev`` are remounted read-only, so ``/work`` is the only writable place. It
runs as uid/gid 65534 in its own user namespace with no capabilities and no further user
namespaces (``--disable-userns``: no private mounts that could dodge the size of ``/work``),
its own network (loopback only), IPC, UTS and cgroup namespaces, a new session, and an empty
environment but for ``ENV``. The interpreter is the PID namespace's init (``--as-pid-1``): when
it exits or is killed, the kernel kills every other process of the namespace before bwrap
sees the exit, so nothing of a call outlives it. A seccomp filter
(``creditrl.tools.seccomp_filter``), which bwrap loads with ``--seccomp`` after setting
no_new_privs, binds the interpreter and every process it starts.

The user namespace maps the sandbox's uid to the invoking user. For root that would be root,
whom the kernel exempts from ``RLIMIT_NPROC``; so a root caller first enters an outer bwrap
that shows only what the sandbox needs and drops to uid/gid 65534, then starts the sandbox.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from creditrl.tools.seccomp_filter import seccomp_program

__all__ = [
    "ENV",
    "NOT_FOUND",
    "SANDBOX_ID",
    "WORKDIR",
    "bwrap_command",
    "bwrap_problem",
    "read_init_pid",
    "sandbox_python",
    "seccomp_file",
]

SANDBOX_ID = 65534
WORKDIR = "/work"
ENV = {
    "PATH": "/usr/bin",
    "HOME": WORKDIR,
    "TMPDIR": WORKDIR,
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
}
_UNSAFE = (
    "or set isolation: none in the tool's config (unsafe: model-written code then runs as you)"
)
NOT_FOUND = (
    "python tool: bubblewrap (bwrap) not found; install it with `apt-get install bubblewrap`, "
    + _UNSAFE
)
_NEEDED_OPTIONS = ("--size", "--disable-userns", "--info-fd", "--remount-ro", "--seccomp")
_LIB_DIRS = ("/usr/lib", "/usr/lib64")
_LIB_LINKS = ("/lib", "/lib64")
# The outer layer (root callers only) drops to SANDBOX_ID, then execs the sandbox's bwrap.
_DROP = (
    f"import os, sys; i = {SANDBOX_ID}; os.setgroups([]); os.setresgid(i, i, i); "
    "os.setresuid(i, i, i); os.execv(sys.argv[1], sys.argv[1:])"
)


def sandbox_python() -> str:
    """The real interpreter binary (not a venv's link to it)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _python_sources() -> list[str]:
    """Host paths to bind read-only for the interpreter: its installation prefix (its
    standard library and libpython), or only the binary when the prefix is ``/usr``, whose
    ``lib`` directories are bound anyway. Raises ValueError for a prefix that holds the home
    or working directory (binding it would show them)."""
    prefix = os.path.realpath(sys.base_prefix)
    exe = sandbox_python()
    if prefix == "/usr":
        return [exe]
    for name, path in (("home", Path.home()), ("working", Path.cwd())):
        if prefix == "/" or Path(os.path.realpath(path)).is_relative_to(prefix):
            raise ValueError(
                f"python tool: the interpreter's prefix {prefix} holds your {name} directory, "
                "which bwrap would then show to the code; use a Python installed elsewhere, "
                + _UNSAFE
            )
    return [prefix] if Path(exe).is_relative_to(prefix) else [prefix, exe]


def _lib_dirs() -> list[str]:
    """Read-only binds of the library directories under ``/usr``."""
    return [arg for path in _LIB_DIRS if os.path.isdir(path) for arg in ("--ro-bind", path, path)]


def _lib_links() -> list[str]:
    """``/lib`` and ``/lib64``: links where the host has links, else read-only binds."""
    args: list[str] = []
    for path in _LIB_LINKS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


@contextlib.contextmanager
def seccomp_file() -> Iterator[int]:
    """The descriptor of a temporary file holding the seccomp filter's BPF program, read from
    its start (for ``bwrap_command``); ValueError (one line) where libseccomp is missing."""
    program = seccomp_program()
    with tempfile.TemporaryFile() as file:
        file.write(program)
        file.flush()
        file.seek(0)
        yield file.fileno()


def _inner(
    bwrap: str,
    python_argv: list[str],
    disk_bytes: int,
    code_fd: int,
    info_fd: int,
    seccomp_fd: int,
) -> list[str]:
    """The sandbox's own bwrap command line (see the module docstring)."""
    ids = str(SANDBOX_ID)
    args = [bwrap, "--unshare-user", "--disable-userns", "--uid", ids, "--gid", ids]
    args += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
    args += ["--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent", "--as-pid-1"]
    args += ["--new-session", "--cap-drop", "ALL", "--clearenv"]
    for key, value in ENV.items():
        args += ["--setenv", key, value]
    args += _lib_dirs() + _lib_links()
    for path in _python_sources():
        args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--perms", "0700", "--size", str(disk_bytes), "--tmpfs", WORKDIR]
    args += ["--perms", "0600", "--file", str(code_fd), f"{WORKDIR}/main.py"]
    args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORKDIR]
    args += ["--info-fd", str(info_fd), "--seccomp", str(seccomp_fd), "--", *python_argv]
    return args


def _outer(bwrap: str) -> list[str]:
    """The root caller's outer bwrap: shows ``/usr``, ``/proc`` (for the inner ``--proc``),
    ``/dev`` and the interpreter (with every directory above it made traversable), keeps only
    the capabilities to change uid and gid, then runs ``_DROP``."""
    args = [bwrap, "--die-with-parent", "--clearenv", "--cap-drop", "ALL"]
    args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    args += ["--ro-bind", "/usr", "/usr", *_lib_links()]
    args += ["--dev", "/dev", "--bind", "/proc", "/proc", "--perms", "0755", "--dir", "/tmp"]
    made: set[str] = set()
    for source in {*_python_sources(), os.path.realpath(bwrap)}:
        if Path(source).is_relative_to("/usr"):
            continue
        for parent in reversed(Path(source).parents[:-1]):
            if str(parent) not in made:
                made.add(str(parent))
                args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", source, source]
    return [*args, "--", sandbox_python(), "-I", "-S", "-c", _DROP]


def bwrap_command(
    python_argv: list[str], disk_bytes: int, code_fd: int, info_fd: int, seccomp_fd: int
) -> list[str]:
    """The command that runs ``python_argv`` (absolute interpreter path first) in the sandbox.

    ``code_fd`` is read into ``/work/main.py``; bwrap writes ``{"child-pid": ...}`` (the
    sandbox's init, as seen from here) to ``info_fd`` and loads the filter from ``seccomp_fd``
    (a ``seccomp_file()``). All three must be passed to the child.
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise ValueError(NOT_FOUND)
    inner = _inner(bwrap, python_argv, disk_bytes, code_fd, info_fd, seccomp_fd)
    return [*_outer(bwrap), *inner] if os.geteuid() == 0 else inner


def read_init_pid(info_fd: int) -> int | None:
    """The sandbox init's pid from bwrap's ``--info-fd`` pipe (non-blocking read end), or
    None when bwrap has not written it (yet)."""
    try:
        data = os.read(info_fd, 4096)
        pid = json.JSONDecoder().raw_decode(data.decode("utf-8").strip())[0]["child-pid"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if isinstance(pid, int) and pid > 1 else None


@functools.cache
def bwrap_problem() -> str | None:
    """Why the sandbox cannot run here (one line, what to do), or None when it can: bwrap is
    missing or too old, libseccomp is missing, or bwrap fails to start a sandbox (with the
    seccomp filter) that prints from Python."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return NOT_FOUND
    try:
        seccomp_program()
    except ValueError as e:
        return str(e)
    helptext = subprocess.run([bwrap, "--help"], capture_output=True, text=True, check=False)
    missing = [opt for opt in _NEEDED_OPTIONS if opt not in helptext.stdout + helptext.stderr]
    if missing:
        return (
            f"python tool: {bwrap} lacks {', '.join(missing)} (bubblewrap 0.8.0 or later "
            f"has them); upgrade it, " + _UNSAFE
        )
    try:
        argv = [sandbox_python(), "-I", "-S", "-c", "print(open('main.py').read())"]
        with tempfile.TemporaryFile() as code, seccomp_file() as seccomp_fd:
            code.write(b"ok")
            code.flush()
            code.seek(0)
            read_end, write_end = os.pipe()
            try:
                fds = (code.fileno(), write_end, seccomp_fd)
                result = subprocess.run(
                    bwrap_command(argv, 1 << 20, *fds),
                    env={},
                    capture_output=True,
                    text=True,
                    timeout=30,
                    pass_fds=fds,
                    check=False,
                )
            finally:
                os.close(read_end)
                os.close(write_end)
    except ValueError as e:
        return str(e)
    except subprocess.TimeoutExpired:
        return f"python tool: {bwrap} did not start a sandbox within 30 s; " + _UNSAFE
    if result.returncode != 0 or result.stdout != "ok\n":
        reason = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
        return (
            f"python tool: {bwrap} cannot start a sandbox here ({reason}); allow unprivileged "
            "user namespaces (sysctl kernel.unprivileged_userns_clone=1, or on Ubuntu "
            "kernel.apparmor_restrict_unprivileged_userns=0), " + _UNSAFE
        )
    return None

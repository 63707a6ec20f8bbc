"""The ``python`` tool: run model-written code in a throwaway sandbox.

Threat model: the code is untrusted; it may be written to read secrets, change or delete files,
reach the network, spawn processes that outlive the call, or exhaust the machine. With the
default ``isolation: bwrap`` each call runs ``python -I -S`` (standard library only) inside a
bubblewrap sandbox (``creditrl.tools.bwrap``) where, as tests/test_security.py shows:

- the host's files are absent: only the interpreter, its standard library and the shared
  libraries are there, read-only; ``/work`` (the working directory) is a private tmpfs of
  ``max_disk_mb``, gone after the call, and the only writable place;
- the environment is empty but for a few fixed variables, and other processes are invisible
  (own PID namespace);
- there is no network (own network namespace: loopback only);
- limits per process: ``RLIMIT_CPU`` of ``timeout_s``, ``RLIMIT_AS`` = ``memory_mb``,
  ``RLIMIT_FSIZE`` = ``max_file_bytes``; at most ``max_processes`` processes and threads in all
  (the interpreter included);
- the per-uid kernel counts it shares with the host uid that owns its user namespace cannot be
  used up: inotify, fanotify and epoll (instances, watches) and POSIX message queues are
  refused by the filter (asyncio then polls), ``RLIMIT_MSGQUEUE`` and ``RLIMIT_MEMLOCK`` are
  0, at most ``SIGPENDING_MAX`` signals are queued, and processes are capped as above;
  namespaces and keys are refused;
- every process of the call is gone when the call returns: the interpreter is the init of the
  sandbox's PID namespace, so when it ends (or the wall-clock timeout kills it) the kernel
  kills the rest of the namespace before bwrap reports the exit;
- output is capped at ``max_output_chars`` (stdout, then stderr; the sandbox is killed when
  the cap is passed);
- the caller's kernel keyrings are out of reach: the bootstrap joins a fresh anonymous session
  keyring, and a seccomp filter (``creditrl.tools.seccomp_filter``) refuses every other keyring
  call, and the system calls the code has no use for (mounts, namespaces, ptrace, bpf, ...).

The sandbox shares the host kernel: a kernel exploit is out of scope, and so is contention
(a call may use up to ``max_processes`` × ``memory_mb`` of memory plus ``max_disk_mb``).
Where bubblewrap cannot run, the tool refuses to start (``bwrap_problem`` says why) unless the
config sets ``isolation: none``: the code then runs as you in a plain subprocess with the same
limits and an audit hook that code can remove. That is for trusted code only.

The limits are set by a bootstrap that runs first in the child, not by a ``preexec_fn``:
Python code between fork and exec can deadlock when the parent has other threads (torch's).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from creditrl.errors import ConfigError, UserError
from creditrl.tools.base import Tool, register_tool
from creditrl.tools.bwrap import (
    bwrap_command,
    bwrap_problem,
    read_init_pid,
    sandbox_python,
    seccomp_file,
)
from creditrl.tools.seccomp_filter import KEYCTL_JOIN_SESSION_KEYRING, syscall_number

__all__ = ["ISOLATIONS", "PythonSandbox", "python_tool"]

ERR_CAP = 1 << 16
ISOLATIONS = ("bwrap", "none")
KILL_GRACE_S = 1.0
SIGPENDING_MAX = 64  # queued signals in the sandbox (the host uid's budget is shared)

# isolation "bwrap": a fresh anonymous session keyring (so the caller's session keyring and
# its keys are not possessed; ENOSYS: a kernel without keyrings), the limits, then the user's
# code. Formatted with the keyctl numbers and [(resource, limits)].
_LIMITS = r"""
import ctypes as _c, resource as _r
if _c.CDLL(None, use_errno=True).syscall(_c.c_long({keyctl}), _c.c_long({join}), None) < 0:
    if _c.get_errno() != {enosys}:
        raise SystemExit(f"sandbox: cannot join a fresh session keyring (errno {{_c.get_errno()}})")
for _k, _v in {limits!r}:
    _r.setrlimit(_k, _v)
del _c, _r, _k, _v
_code = open("main.py", encoding="utf-8").read()
exec(compile(_code, "main.py", "exec"), {{"__name__": "__main__"}})
"""

# isolation "none": runs first in the child (after exec, so no fork-with-threads hazard):
# resource limits, a private network namespace if the kernel allows it, then an audit hook that
# refuses sockets, new processes, ctypes, raising the limits, and writes or deletions outside the
# temporary directory, then the user's code. Formatted with the limits.
_UNISOLATED_PRELUDE = r"""
import os as _os, sys as _sys, resource as _resource
_cpu, _mem, _fsize = {cpu}, {mem}, {fsize}
_resource.setrlimit(_resource.RLIMIT_CPU, (_cpu, _cpu + 1))
if _mem > 0:
    _resource.setrlimit(_resource.RLIMIT_AS, (_mem, _mem))
_resource.setrlimit(_resource.RLIMIT_FSIZE, (_fsize, _fsize))
try:
    import ctypes as _ctypes
    _ctypes.CDLL(None, use_errno=True).unshare(0x40000000)
except Exception:
    pass
for _name in [m for m in _sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
    del _sys.modules[_name]
_ctypes = None
_ROOT = _os.path.realpath(_os.getcwd())
_DENY = {{"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
         "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
         "os.forkpty", "os.kill", "os.killpg", "ctypes.dlopen", "ctypes.dlsym", "pty.spawn",
         "sys.addaudithook", "os.chdir", "os.chmod", "os.chown", "os.symlink", "os.link",
         "resource.setrlimit", "resource.prlimit"}}
_PATHS = {{"os.remove", "os.rename", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.truncate"}}
def _inside(path):
    try:
        full = _os.path.realpath(_os.fsdecode(path))
    except Exception:
        return False
    return full == _ROOT or full.startswith(_ROOT + _os.sep)
def _hook(event, args):
    if event in _DENY:
        raise PermissionError(f"sandbox: {{event}} is not allowed")
    if event == "open" and args and isinstance(args[0], (str, bytes)):
        mode, flags = args[1] or "r", args[2] or 0
        writing = any(c in str(mode) for c in "wax+") or flags & (_os.O_WRONLY | _os.O_RDWR)
        if writing and not _inside(args[0]):
            raise PermissionError(f"sandbox: writing {{args[0]!r}} is not allowed")
    if event in _PATHS and args and not all(
        _inside(a) for a in args[:2] if isinstance(a, (str, bytes, _os.PathLike))
    ):
        raise PermissionError(f"sandbox: {{event}} outside the working directory")
_sys.addaudithook(_hook)
del _hook
_code = open("main.py", encoding="utf-8").read()
exec(compile(_code, "main.py", "exec"), {{"__name__": "__main__"}})
"""


def _cpu_seconds(timeout_s: float) -> int:
    """The RLIMIT_CPU soft limit for a wall-clock timeout: whole seconds, at least 1."""
    return max(1, int(timeout_s + 0.999))


def _unisolated_prelude(seconds: float, memory_mb: int, max_file_bytes: int) -> str:
    """The ``isolation: none`` bootstrap with its limits: CPU seconds, address space, files."""
    return _UNISOLATED_PRELUDE.format(
        cpu=_cpu_seconds(seconds), mem=max(memory_mb, 0) * 1024 * 1024, fsize=max_file_bytes
    )


def _limits_bootstrap(sandbox: PythonSandbox) -> str:
    """The ``isolation: bwrap`` bootstrap: ``setrlimit`` of each limit, then ``main.py``."""
    cpu = _cpu_seconds(sandbox.timeout_s)
    limits = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_FSIZE, (sandbox.max_file_bytes,) * 2),
        (resource.RLIMIT_NPROC, (sandbox.max_processes,) * 2),
        (resource.RLIMIT_NOFILE, (256, 256)),
        (resource.RLIMIT_CORE, (0, 0)),
        # counted per host uid as well: queued signals, message-queue bytes, locked shm
        (resource.RLIMIT_SIGPENDING, (SIGPENDING_MAX,) * 2),
        (resource.RLIMIT_MSGQUEUE, (0, 0)),
        (resource.RLIMIT_MEMLOCK, (0, 0)),
    ]
    if sandbox.memory_mb > 0:
        limits.append((resource.RLIMIT_AS, (sandbox.memory_mb * 1024 * 1024,) * 2))
    return _LIMITS.format(
        keyctl=syscall_number("keyctl"),
        join=KEYCTL_JOIN_SESSION_KEYRING,
        enosys=errno.ENOSYS,
        limits=limits,
    )


def _check_int(name: str, value: object, least: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigError(f"python tool: {name} must be an integer >= {least}, got {value!r}")
    return value


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """Up to ``cap`` bytes of ``stream`` and whether more followed."""
    data = b""
    while len(data) <= cap:
        chunk = await stream.read(65536)
        if not chunk:
            return data, False
        data += chunk
    return data[:cap], True


class PythonSandbox:
    """Runs code strings in sandboxed child processes; see the module docstring.

    ``isolation``: ``"bwrap"`` (the sandbox; refuses to start where bubblewrap cannot run) or
    ``"none"`` (unsafe: a plain subprocess). Raises ConfigError for a bad setting and
    UserError (one line: why, and what to do) where bubblewrap is missing or fails.
    """

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        max_output_chars: int = 4000,
        max_file_bytes: int = 1 << 20,
        isolation: str = "bwrap",
        max_disk_mb: int = 64,
        max_processes: int = 16,
    ) -> None:
        if not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool) or timeout_s <= 0:
            raise ConfigError(f"python tool: timeout_s must be a number > 0, got {timeout_s!r}")
        if isolation not in ISOLATIONS:
            raise ConfigError(
                f"python tool: isolation {isolation!r} is not one of {list(ISOLATIONS)}"
            )
        self.timeout_s = float(timeout_s)
        self.memory_mb = _check_int("memory_mb", memory_mb, 0)
        self.max_output_chars = _check_int("max_output_chars", max_output_chars, 1)
        self.max_file_bytes = _check_int("max_file_bytes", max_file_bytes, 1)
        self.max_disk_mb = _check_int("max_disk_mb", max_disk_mb, 1)
        self.max_processes = _check_int("max_processes", max_processes, 1)
        self.isolation = isolation
        if isolation == "bwrap" and (problem := bwrap_problem()) is not None:
            raise UserError(problem)

    async def run(self, code: str) -> str:
        """Execute Python code and return what it printed (stdout, then stderr on failure).

        Args:
            code: a Python program; print() the values you want to see
        """
        run = self._run_bwrap if self.isolation == "bwrap" else self._run_unisolated
        returncode, out, more_out, err = await run(code)
        if self.isolation == "bwrap" and returncode > 128:
            returncode = 128 - returncode  # bwrap reports "killed by signal N" as 128 + N
        cap = self.max_output_chars
        text = out.decode("utf-8", errors="replace")
        if more_out:
            text += f"\n...[output cut at {cap} bytes]"
        if returncode == -signal.SIGXCPU:
            raise TimeoutError(f"python code used more than {self.timeout_s:g}s of CPU time")
        if returncode != 0 and not more_out:
            tail = err.decode("utf-8", errors="replace").strip()
            if returncode < 0:
                tail += f"\n(killed by signal {-returncode}: time, memory or output limit)"
            raise RuntimeError(f"exit code {returncode}\n{text}{tail}".strip()[-cap:])
        return text

    async def _run_bwrap(self, code: str) -> tuple[int, bytes, bool, bytes]:
        """``code`` as ``/work/main.py`` in the bubblewrap sandbox; stopping it kills the
        sandbox's init, which takes every other process of the call with it."""
        argv = [sandbox_python(), "-I", "-S", "-c", _limits_bootstrap(self)]
        with tempfile.TemporaryFile() as code_file, seccomp_file() as seccomp_fd:
            code_file.write(code.encode("utf-8"))
            code_file.flush()
            code_file.seek(0)
            read_end, write_end = os.pipe()
            os.set_blocking(read_end, False)
            init_pid: list[int] = []

            def target() -> int | None:
                if not init_pid and (pid := read_init_pid(read_end)) is not None:
                    init_pid.append(pid)
                return init_pid[0] if init_pid else None

            try:
                fds = (code_file.fileno(), write_end, seccomp_fd)
                cmd = bwrap_command(argv, self.max_disk_mb * 1024 * 1024, *fds)
                return await self._execute(cmd, target, env={}, pass_fds=fds)
            finally:
                os.close(read_end)
                os.close(write_end)

    async def _run_unisolated(self, code: str) -> tuple[int, bytes, bool, bytes]:
        """``isolation: none``: ``code`` in a temporary directory, as the current user."""
        with tempfile.TemporaryDirectory(prefix="creditrl-py-") as tmp:
            Path(tmp, "main.py").write_text(code, encoding="utf-8")
            prelude = _unisolated_prelude(self.timeout_s, self.memory_mb, self.max_file_bytes)
            return await self._execute(
                [sys.executable, "-I", "-S", "-c", prelude],
                lambda: None,
                cwd=tmp,
                env={"PATH": "/usr/bin:/bin", "HOME": tmp, "PYTHONIOENCODING": "utf-8"},
            )

    async def _execute(
        self, argv: list[str], target: Callable[[], int | None], **popen: object
    ) -> tuple[int, bytes, bool, bytes]:
        """Run ``argv`` in a new session; (exit code, stdout, more stdout followed, stderr).
        Stopping it SIGKILLs ``target()`` when that gives a pid, else the session's process
        group; a process still there after KILL_GRACE_S gets the group kill too."""
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            **popen,
        )

        def stop() -> None:
            pid = target()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if pid is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)

        try:
            out, more_out, err, _ = await self._collect(proc, self.max_output_chars, stop)
        finally:
            if proc.returncode is None:
                stop()
                try:
                    await asyncio.wait_for(proc.wait(), KILL_GRACE_S)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
            await proc.communicate()  # drain the pipes so their transport closes
        return proc.returncode, out, more_out, err

    async def _collect(
        self, proc: asyncio.subprocess.Process, cap: int, stop: Callable[[], None]
    ) -> tuple:
        try:
            return await _watch(proc, cap, self.timeout_s, stop)
        except TimeoutError:
            raise TimeoutError(f"python code ran past {self.timeout_s:g}s") from None


async def _watch(
    proc: asyncio.subprocess.Process, cap: int, timeout: float, stop: Callable[[], None]
) -> tuple:
    """Read stdout (up to ``cap`` bytes) and stderr (up to ``ERR_CAP``, whose tail is kept for
    the error text) until the process ends; ``stop`` it when a pipe passes its cap, and again
    every 0.1 s while it runs on (the sandbox init's pid may not be known at the first
    attempt, and nothing reads the capped pipe any more); TimeoutError after ``timeout``
    seconds."""
    tasks = [
        asyncio.ensure_future(_read_capped(proc.stdout, cap)),
        asyncio.ensure_future(_read_capped(proc.stderr, max(cap, ERR_CAP))),
    ]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        pending = set(tasks)
        stopping = False
        while pending:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError
            wait = min(remaining, 0.1) if stopping else remaining
            done, pending = await asyncio.wait(
                pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED
            )
            if not stopping and any(task.result()[1] for task in done):
                stopping = True
                _close_pipes(proc)  # a writer past its cap gets EPIPE even if the kill misses
            if stopping and proc.returncode is None:
                stop()
        await asyncio.wait_for(proc.wait(), max(deadline - loop.time(), 0.1))
    finally:
        for task in tasks:
            task.cancel()
    (out, more_out), (err, more_err) = (task.result() for task in tasks)
    return out, more_out, err, more_err


def _close_pipes(proc: asyncio.subprocess.Process) -> None:
    """Close this end of the child's stdout and stderr: nothing more is read from them once a
    cap is passed, and a process still writing (one the kill has not reached yet, or one that
    holds a copy of the pipe) then fails with EPIPE instead of blocking on a full pipe."""
    transport = getattr(proc, "_transport", None)
    for fd in (1, 2):
        pipe = transport.get_pipe_transport(fd) if transport is not None else None
        if pipe is not None:
            pipe.close()


@register_tool("python")
def python_tool(
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_chars: int = 4000,
    isolation: str = "bwrap",
    max_disk_mb: int = 64,
    max_processes: int = 16,
) -> Tool:
    """The ``python`` Tool (its own timeout; the registry's is set a second above it).

    YAML: ``{name: python, kwargs: {isolation: bwrap, max_disk_mb: 64, ...}}``; see
    PythonSandbox for the refusals.
    """
    sandbox = PythonSandbox(
        timeout_s,
        memory_mb,
        max_output_chars,
        isolation=isolation,
        max_disk_mb=max_disk_mb,
        max_processes=max_processes,
    )
    tool = Tool.from_function(sandbox.run, name="python")
    tool.timeout_s = sandbox.timeout_s + 1.0
    return tool

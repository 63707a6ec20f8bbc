"""The ``python`` tool: run a snippet in a separate, limited Python process.

Each call writes the code to a fresh temporary directory and runs ``python -I -S`` there (no
environment, no user or site packages: the standard library only) with:

- a wall-clock timeout (the process group is killed) and an ``RLIMIT_CPU`` of the same length;
- ``RLIMIT_AS`` = ``memory_mb`` and ``RLIMIT_FSIZE`` = ``max_file_bytes``;
- no network: a fresh network namespace where the kernel allows it (``unshare``), and in every
  case an audit hook installed before the code runs that refuses sockets, new processes
  (``subprocess``, ``os.system``, ``exec``, ``fork``, ``posix_spawn``), ``ctypes``, raising the
  resource limits, and writes or deletions outside the temporary directory;
- output capped at ``max_output_chars`` (stdout, then stderr; the process is killed when the cap
  is passed).

The limits are set by a bootstrap that runs first in the child, not by a ``preexec_fn``:
Python code between fork and exec can deadlock when the parent has other threads (torch's).

This confines honest mistakes and casual misuse of model-written code; it is not a security
boundary against code crafted to escape (use a container or VM for that).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
from pathlib import Path

from creditrl.tools.registry import Tool

__all__ = ["PythonSandbox", "python_tool"]

ERR_CAP = 1 << 16

# Runs first in the child (after exec, so no fork-with-threads hazard): resource limits, a
# private network namespace if the kernel allows it, then the audit hook that refuses the
# events listed in the module docstring, then the user's code. Formatted with the limits.
_PRELUDE = r"""
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


def _prelude(seconds: float, memory_mb: int, max_file_bytes: int) -> str:
    """The child's bootstrap with its limits: CPU seconds (at least 1), address space, files."""
    cpu = max(1, int(seconds + 0.999))
    return _PRELUDE.format(cpu=cpu, mem=max(memory_mb, 0) * 1024 * 1024, fsize=max_file_bytes)


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
    """Runs code strings in limited child processes; see the module docstring."""

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        max_output_chars: int = 4000,
        max_file_bytes: int = 1 << 20,
    ) -> None:
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_output_chars = max_output_chars
        self.max_file_bytes = max_file_bytes

    async def _collect(self, proc: asyncio.subprocess.Process, cap: int) -> tuple:
        try:
            return await _watch(proc, cap, self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"python code ran past {self.timeout_s:g}s") from None

    async def run(self, code: str) -> str:
        """Execute Python code and return what it printed (stdout, then stderr on failure).

        Args:
            code: a Python program; print() the values you want to see
        """
        with tempfile.TemporaryDirectory(prefix="creditrl-py-") as tmp:
            Path(tmp, "main.py").write_text(code, encoding="utf-8")
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-S",
                "-c",
                _prelude(self.timeout_s, self.memory_mb, self.max_file_bytes),
                cwd=tmp,
                env={"PATH": "/usr/bin:/bin", "HOME": tmp, "PYTHONIOENCODING": "utf-8"},
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
            cap = self.max_output_chars
            try:
                out, more_out, err, _ = await self._collect(proc, cap)
            finally:
                if proc.returncode is None:
                    _kill(proc)
                await proc.communicate()  # drain the pipes so their transport closes
            returncode = proc.returncode
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


async def _watch(proc: asyncio.subprocess.Process, cap: int, timeout: float) -> tuple:
    """Read stdout (up to ``cap`` bytes) and stderr (up to ``ERR_CAP``, whose tail is kept for
    the error text) until the process ends; kill it when a pipe passes its cap; TimeoutError
    after ``timeout`` seconds."""
    tasks = [
        asyncio.ensure_future(_read_capped(proc.stdout, cap)),
        asyncio.ensure_future(_read_capped(proc.stderr, max(cap, ERR_CAP))),
    ]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        pending = set(tasks)
        while pending:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError
            done, pending = await asyncio.wait(
                pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
            if any(task.result()[1] for task in done):
                _kill(proc)
        await asyncio.wait_for(proc.wait(), max(deadline - loop.time(), 0.1))
    finally:
        for task in tasks:
            task.cancel()
    (out, more_out), (err, more_err) = (task.result() for task in tasks)
    return out, more_out, err, more_err


def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def python_tool(timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 4000) -> Tool:
    """The ``python`` Tool (its own timeout; the registry's is set a second above it)."""
    sandbox = PythonSandbox(timeout_s, memory_mb, max_output_chars)
    tool = Tool.from_function(sandbox.run, name="python")
    tool.timeout_s = timeout_s + 1.0
    return tool

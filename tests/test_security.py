"""Security: untrusted input is contained.

Sandbox section: escape attempts against the ``python`` tool's default bubblewrap sandbox, each
asserting that nothing got out (files, environment, processes, network, disk, memory), and the
refusal to start where bubblewrap cannot run. The attempts print ``name: OK ...`` or
``name: ERR <exception>`` for every operation, so a test can tell a refusal from a success.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from creditrl.errors import ConfigError, UserError
from creditrl.tools import ToolResult, build_registry
from creditrl.tools import bwrap as bwrap_module
from creditrl.tools import python_sandbox as python_sandbox_module
from creditrl.tools.bwrap import ENV, NOT_FOUND, bwrap_problem
from creditrl.tools.python_sandbox import PythonSandbox, python_tool
from creditrl.tools.seccomp_filter import seccomp_program, syscall_number

# ---------------------------------------------------------------------------------------------
# Sandbox: the python tool's bubblewrap sandbox against escape attempts
# ---------------------------------------------------------------------------------------------

SANDBOX_REPO = Path(__file__).resolve().parents[1]
SANDBOX_SECRET = f"creditrl-secret-{os.getpid()}-{time.time_ns()}"
SANDBOX_MARKER = f"creditrl-marker-{os.getpid()}"


def _bwrap_skip_reason() -> str:
    """Empty when a bubblewrap sandbox starts here, else why not (tries to run one)."""
    return bwrap_problem() or ""


_BWRAP_MISSING = _bwrap_skip_reason()
needs_bwrap = pytest.mark.skipif(bool(_BWRAP_MISSING), reason=_BWRAP_MISSING)

# Prepended to every attempt: attempt(name, fn) prints "name: OK <value>" or "name: ERR <type>".
_ESCAPE_HELPER = """
import os, sys
def attempt(name, fn):
    try:
        value = fn()
    except BaseException as e:
        print(f"{name}: ERR {type(e).__name__}")
    else:
        print(f"{name}: OK {value!r}"[:2000])
"""

ESCAPE_READ_FILES = """
for path in ARGS["paths"]:
    attempt(path, lambda: open(path, errors="replace").read())
attempt("listdir /", lambda: sorted(os.listdir("/")))
"""

ESCAPE_READ_ENVIRON = """
attempt("os.environ", lambda: dict(os.environ))
for name, pid in ARGS["pids"].items():
    attempt(f"{name} environ", lambda: open(f"/proc/{pid}/environ", "rb").read())
    attempt(f"{name} cmdline", lambda: open(f"/proc/{pid}/cmdline", "rb").read())
pids = [p for p in os.listdir("/proc") if p.isdigit()]
attempt("pids", lambda: pids)
for p in pids:
    attempt(f"/proc/{p}/environ", lambda: open(f"/proc/{p}/environ", "rb").read())
    attempt(f"/proc/{p}/cmdline", lambda: open(f"/proc/{p}/cmdline", "rb").read())
"""

ESCAPE_WRITE_OUTSIDE = """
import pathlib, shutil
victim, folder = ARGS["victim"], ARGS["folder"]
attempt("inside write", lambda: open("inside.txt", "w").write("x"))
attempt("open w", lambda: open(victim, "w").write("owned"))
attempt("open a", lambda: open(victim, "a").write("owned"))
attempt("new file", lambda: open(folder + "/new.txt", "x").write("owned"))
attempt("pathlib write", lambda: pathlib.Path(victim).write_text("owned"))
attempt("os.open", lambda: os.write(os.open(victim, os.O_WRONLY | os.O_TRUNC), b"owned"))
attempt("os.truncate", lambda: os.truncate(victim, 0))
attempt("os.chmod", lambda: os.chmod(victim, 0o777))
attempt("os.rename", lambda: os.rename(victim, folder + "/moved.txt"))
attempt("os.remove", lambda: os.remove(victim))
attempt("pathlib unlink", lambda: pathlib.Path(victim).unlink())
attempt("shutil.rmtree", lambda: shutil.rmtree(folder))
attempt("symlink", lambda: os.symlink(victim, "link"))
attempt("write via symlink", lambda: open("link", "w").write("owned"))
attempt("hard link", lambda: os.link(victim, "hard"))
attempt("stdlib remove", lambda: os.remove(os.__file__))
attempt("stdlib append", lambda: open(os.__file__, "a").write("#"))
attempt("write /", lambda: open("/owned", "w").write("x"))
attempt("write /dev/shm", lambda: open("/dev/shm/owned", "w").write("x"))
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    attempt("ctypes unlink", lambda: libc.unlink(victim.encode()) or ctypes.get_errno())
    attempt("ctypes rmdir", lambda: libc.rmdir(folder.encode()) or ctypes.get_errno())
    flags = os.O_WRONLY | os.O_TRUNC
    attempt("ctypes open", lambda: libc.open(victim.encode(), flags) or ctypes.get_errno())
except Exception as e:
    print("ctypes: ERR", type(e).__name__)
"""

# The old audit hook's own state, found through the garbage collector and emptied.
ESCAPE_CLEAR_AUDIT_HOOK = """
import gc
for obj in gc.get_objects():
    if callable(obj) and getattr(obj, "__name__", "") == "_hook":
        found = obj.__globals__
        found["_DENY"].clear()
        found["_PATHS"].clear()
        found["_inside"] = lambda path: True
        print("hook: cleared")
attempt("write after clearing", lambda: open(ARGS["victim"], "w").write("owned"))
import subprocess
attempt("subprocess after clearing", lambda: subprocess.run(["true"]).returncode)
"""

ESCAPE_SPAWN = """
import subprocess, time
attempt("subprocess", lambda: subprocess.run(["/bin/sh", "-c", "echo hi"]).returncode)
attempt("subprocess python", lambda: subprocess.run([sys.executable, "-c", "print(1)"]).returncode)
attempt("os.system", lambda: os.system("echo hi"))
attempt("kill test's child", lambda: os.kill(ARGS["sleeper"], 9))
forked = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            time.sleep(2)
            os._exit(0)
        forked += 1
except OSError as e:
    print(f"fork bomb: stopped after {forked} errno {e.errno}")
"""

ESCAPE_NETWORK = """
import socket
attempt("tcp connect", lambda: socket.create_connection(("127.0.0.1", ARGS["port"]), timeout=2))
attempt("resolve", lambda: socket.getaddrinfo("example.com", 80))
attempt("interfaces", lambda: [name for _, name in socket.if_nameindex()])
"""

# A daemon: double fork, setsid, stdio to /dev/null (so the call need not wait for it), then
# exec a process whose command line holds the marker, that says it is ready and writes a host
# file a bit later. The main process returns once the daemon is ready (after ARGS["sleep"]).
ESCAPE_OUTLIVE = """
import time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        later = f"time.sleep(1.0); open({ARGS['marker_file']!r}, 'w').write('x')"
        code = f"import time; open('ready', 'w').close(); {later}"
        os.execv(sys.executable, [sys.executable, "-c", code, ARGS["marker"]])
    os._exit(0)
while not os.path.exists("ready"):
    time.sleep(0.01)
time.sleep(ARGS["sleep"])
print("main: done in", os.readlink("/proc/self/ns/pid"))
"""

ESCAPE_FILL_DISK = """
written = 0
try:
    with open("big.bin", "wb") as f:
        for _ in range(ARGS["mb"]):
            f.write(b"x" * (1 << 20))
            f.flush()
            written += 1
except OSError as e:
    print(f"disk: stopped at {written} MB errno {e.errno}")
else:
    print(f"disk: wrote {written} MB")
"""

ESCAPE_NEST = """
import resource, ctypes
attempt("raise RLIMIT_AS", lambda: resource.setrlimit(resource.RLIMIT_AS, (-1, -1)))
attempt("raise RLIMIT_NPROC", lambda: resource.setrlimit(resource.RLIMIT_NPROC, (-1, -1)))
libc = ctypes.CDLL(None, use_errno=True)
attempt("unshare user", lambda: libc.unshare(0x10000000) or "succeeded")
attempt("unshare mount", lambda: libc.unshare(0x00020000) or "succeeded")
attempt("mount tmpfs", lambda: libc.mount(b"none", b"/work", b"tmpfs", 0, None) or "succeeded")
"""

# Raw system calls by name (numbers in ARGS["nr"]): call(name, *args) is the result, or -errno.
_SYSCALL_HELPER = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(name, *args):
    args = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    result = libc.syscall(ctypes.c_long(ARGS["nr"][name]), *args)
    return result if result >= 0 else -ctypes.get_errno()
"""

# The caller's keys (ids and descriptions in ARGS): read, find, plant, then revoke.
ESCAPE_KEYRINGS = """
SESSION, USER, buf = -3, -4, ctypes.create_string_buffer(4096)
for name, key in ARGS["keys"].items():
    desc = ARGS["descs"][name]
    print(f"read {name}: {call('keyctl', 11, key, buf, 4096)} {buf.raw[:64]!r}")
    print(f"describe {name}: {call('keyctl', 6, key, buf, 4096)}")
    print(f"search {name}: {call('keyctl', 10, SESSION, b'user', desc, 0)}")
    print(f"request_key {name}: {call('request_key', b'user', desc, None, 0)}")
for ring, ring_id in (("session", SESSION), ("user", USER)):
    print(f"keyring id {ring}: {call('keyctl', 0, ring_id, 0)}")
    print(f"plant in {ring}: {call('add_key', b'user', b'planted', b'x', 1, ring_id)}")
    print(f"clear {ring}: {call('keyctl', 7, ring_id)}")
print(f"join named: {call('keyctl', 1, b'creditrl-planted')}")
for name, key in ARGS["keys"].items():
    print(f"setperm {name}: {call('keyctl', 5, key, 0x3F3F3F3F)}")
    print(f"unlink {name}: {call('keyctl', 9, key, SESSION)}")
    print(f"invalidate {name}: {call('keyctl', 21, key)}")
    print(f"revoke {name}: {call('keyctl', 3, key)}")
"""

# Each named system call with harmless arguments (ARGS["args"]), then the filter state.
ESCAPE_SYSCALLS = """
for name in ARGS["names"]:
    result = call(name, *ARGS["args"][name])
    if result == 0 and name == "clone":
        os._exit(0)  # a clone that went through: the child leaves at once
    print(f"{name}: {result}")
status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines())
print(f"filter: {status['Seccomp']} {status['NoNewPrivs']}")
"""

# Ordinary standard-library work under the filter, in the interpreter and in a child of it.
NORMAL_CODE = """
import json, math, subprocess, threading, socket, asyncio, hashlib, shutil, concurrent.futures
print("json:", json.dumps({"root": math.sqrt(16)}))
child = "import os; print(open('/proc/self/status').read().count('Seccomp:\\t2'))"
print("child:", subprocess.run([sys.executable, "-c", child], capture_output=True).stdout)
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    print("threads:", sum(pool.map(lambda x: x * x, range(10))))
open("/work/notes.txt", "w").write("kept")
shutil.copy("notes.txt", "copy.txt")
print("files:", open("copy.txt").read(), sorted(os.listdir("/work")))
server = socket.create_server(("127.0.0.1", 0))
client = socket.create_connection(server.getsockname())
server.accept()[0].sendall(b"pong")
print("loopback:", client.recv(4))
async def later():
    await asyncio.sleep(0.01)
    return hashlib.sha256(b"x").hexdigest()[:8]
print("asyncio:", asyncio.run(later()))
pid = os.fork()
if pid == 0:
    os._exit(3)
print("fork:", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(f"clone3: {call('clone3', None, 0)}")
try:
    print("vsock:", socket.socket(40, socket.SOCK_STREAM))
except OSError as e:
    print(f"vsock: ERR {e.errno}")
"""


def escape_code(body: str, **args: object) -> str:
    """An attempt program: the ``attempt`` helper, ``ARGS``, then ``body``."""
    return f"{_ESCAPE_HELPER}\nARGS = {args!r}\n{body}"


def sandbox_run(sandbox: PythonSandbox, *codes: str) -> list[str | BaseException]:
    """Each code's observation (text, or the exception the tool raised), run concurrently."""

    async def runs():
        return await asyncio.gather(*(sandbox.run(c) for c in codes), return_exceptions=True)

    return asyncio.run(runs())


def registry_run(*codes: str) -> list[ToolResult]:
    """Each code's result from the default python tool, called as the agent loop calls it."""
    registry = build_registry(["python"])

    async def runs():
        return await asyncio.gather(*(registry.call("python", {"code": c}) for c in codes))

    return asyncio.run(runs())


def host_call(name: str, *args: int | bytes | None) -> int:
    """The system call ``name`` made by this (the caller's) process: its result, or -errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    values = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    result = libc.syscall(ctypes.c_long(syscall_number(name)), *values)
    return result if result >= 0 else -ctypes.get_errno()


def keyring_ids(keyring: int) -> list[int]:
    """The ids of the keys in one of this process's keyrings (``-3``: session, ``-4``: user)."""
    buf = ctypes.create_string_buffer(1 << 16)
    size = max(host_call("keyctl", 11, keyring, ctypes.addressof(buf), len(buf)), 0)
    return list(struct.unpack(f"{size // 4}i", buf.raw[:size]))


def keyring_descriptions(keyring: int) -> list[str]:
    """The descriptions of the keys in one of this process's keyrings that it may view."""
    found = []
    for key in keyring_ids(keyring):
        text = ctypes.create_string_buffer(4096)
        if host_call("keyctl", 6, key, ctypes.addressof(text), len(text)) > 0:
            found.append(text.value.decode().rsplit(";", 1)[-1])
    return found


def sandbox_text(result: str | BaseException) -> str:
    return result if isinstance(result, str) else f"{type(result).__name__}: {result}"


def escape_results(output: str) -> dict[str, str]:
    """``{name: "OK ..." | "ERR ..."}`` from an attempt program's output."""
    pairs = (line.split(": ", 1) for line in output.splitlines() if ": " in line)
    return {name: outcome for name, outcome in pairs}


def processes_in_namespace(pid_namespace: str) -> list[int]:
    """Host pids in the PID namespace ``pid_namespace`` (``pid:[inode]``)."""
    pids = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and os.readlink(f"/proc/{entry}/ns/pid") == pid_namespace:
                pids.append(int(entry))
    return pids


def marked_processes(marker: str = SANDBOX_MARKER) -> list[int]:
    """Host pids whose command line holds ``marker``."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                pids.append(int(entry))
        except OSError:
            continue
    return pids


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    return PythonSandbox(timeout_s=10.0, max_output_chars=20000)


@needs_bwrap
def test_sandbox_hides_host_files(tmp_path: Path, sandbox: PythonSandbox) -> None:
    """Pins: a secret file, /etc, /root, the home directory and the repo's files cannot be
    read from the sandbox (they are not there), and / holds no /etc, /home or /tmp."""
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(SANDBOX_SECRET)
    paths = [
        str(secret_file),
        "/etc/passwd",
        "/etc/shadow",
        "/root/.bashrc",
        str(Path.home() / ".bashrc"),
        str(SANDBOX_REPO / "pyproject.toml"),
        str(SANDBOX_REPO / "creditrl" / "tools" / "bwrap.py"),
    ]
    (output,) = sandbox_run(sandbox, escape_code(ESCAPE_READ_FILES, paths=paths))
    found = escape_results(sandbox_text(output))
    assert all(found[path].startswith("ERR") for path in paths), found
    assert SANDBOX_SECRET not in output and "build-system" not in output
    top = found["listdir /"]
    assert top.startswith("OK") and not {"'etc'", "'home'", "'tmp'"} & set(
        re.findall(r"'\w+'", top)
    )


@needs_bwrap
def test_sandbox_hides_environment_and_processes(
    monkeypatch: pytest.MonkeyPatch, sandbox: PythonSandbox
) -> None:
    """Pins: a secret in the caller's environment and in a host process's initial environment
    reaches no os.environ, environ or cmdline the sandbox can read; its os.environ holds only
    bwrap.ENV (plus PWD); it sees only its own few pids, not the test process or its child."""
    monkeypatch.setenv("CREDITRL_TEST_SECRET", SANDBOX_SECRET)
    sleeper = subprocess.Popen(["sleep", "30"], env={"CREDITRL_TEST_SECRET": SANDBOX_SECRET})
    try:
        pids = {"test": os.getpid(), "child": sleeper.pid}
        (output,) = sandbox_run(sandbox, escape_code(ESCAPE_READ_ENVIRON, pids=pids))
    finally:
        sleeper.kill()
        sleeper.wait()
    output = sandbox_text(output)
    found = escape_results(output)
    assert SANDBOX_SECRET not in output and "pytest" not in output
    assert all(
        found[f"{name} {part}"].startswith("ERR")
        for name in pids
        for part in ("environ", "cmdline")
    )
    environ = ast.literal_eval(found["os.environ"].removeprefix("OK "))
    assert set(environ) <= {*ENV, "PWD"} and environ["HOME"] == "/work"
    visible = ast.literal_eval(found["pids"].removeprefix("OK "))
    assert 1 <= len(visible) <= 3 and not {str(pid) for pid in pids.values()} & set(visible)


@needs_bwrap
def test_sandbox_cannot_write_or_delete_outside(tmp_path: Path, sandbox: PythonSandbox) -> None:
    """Pins: every path API (open, os.open, pathlib, truncate, chmod, rename, remove, rmtree,
    symlink and hard link, ctypes syscalls) fails on a host file, the interpreter's own files
    and the read-only root and /dev; the host file and folder are untouched; /work is writable."""
    folder = tmp_path / "victim"
    folder.mkdir()
    victim = folder / "keep.txt"
    victim.write_text("keep")
    code = escape_code(ESCAPE_WRITE_OUTSIDE, victim=str(victim), folder=str(folder))
    (output,) = sandbox_run(sandbox, code)
    found = escape_results(sandbox_text(output))
    assert found.pop("inside write") == "OK 1"
    assert found.pop("symlink") == "OK None"  # a link inside /work, to a path not there
    assert all(outcome.startswith("ERR") or outcome == "OK -1" for outcome in found.values()), found
    assert {"write via symlink", "ctypes unlink", "stdlib remove", "write /dev/shm"} <= set(found)
    assert victim.read_text() == "keep" and sorted(p.name for p in folder.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim"]


@needs_bwrap
def test_sandbox_clearing_the_old_audit_hook_escapes_nothing(
    tmp_path: Path, sandbox: PythonSandbox
) -> None:
    """Pins: code that empties the old in-process audit hook's deny lists (which let it write
    anywhere under isolation: none) finds no hook and still cannot write a host file or run
    a program."""
    victim = tmp_path / "escaped.txt"
    (output,) = sandbox_run(sandbox, escape_code(ESCAPE_CLEAR_AUDIT_HOOK, victim=str(victim)))
    found = escape_results(sandbox_text(output))
    assert "hook" not in found
    assert found["write after clearing"].startswith("ERR")
    assert found["subprocess after clearing"].startswith("ERR")
    assert not victim.exists()


@needs_bwrap
def test_sandbox_processes_stay_inside_and_limited() -> None:
    """Pins: no shell or program besides the interpreter exists to run, a host process cannot
    be signalled, and a fork bomb stops at max_processes (the interpreter included)."""
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        sandbox = PythonSandbox(timeout_s=10.0, max_processes=8)
        (output,) = sandbox_run(sandbox, escape_code(ESCAPE_SPAWN, sleeper=sleeper.pid))
        output = sandbox_text(output)
        found = escape_results(output)
        assert found["subprocess"] == "ERR FileNotFoundError"
        assert found["subprocess python"] == "OK 0"  # the interpreter itself, inside
        assert found["os.system"] == "OK 32512"  # exit status 127: no shell
        assert found["kill test's child"] == "ERR ProcessLookupError"
        assert sleeper.poll() is None
        assert f"fork bomb: stopped after 7 errno {errno.EAGAIN}" in output  # 8 with itself
    finally:
        sleeper.kill()
        sleeper.wait()


@needs_bwrap
def test_sandbox_has_no_network(sandbox: PythonSandbox) -> None:
    """Pins: a TCP server on the host's 127.0.0.1 gets no connection from the sandbox, names
    do not resolve, and the only interface is the sandbox's own loopback."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        (output,) = sandbox_run(sandbox, escape_code(ESCAPE_NETWORK, port=server.getsockname()[1]))
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # a connection would be waiting in the backlog
    found = escape_results(sandbox_text(output))
    assert found["tcp connect"].startswith("ERR") and found["resolve"].startswith("ERR")
    assert found["interfaces"] == "OK ['lo']"


@needs_bwrap
def test_sandbox_leaves_no_process_behind(tmp_path: Path) -> None:
    """Pins: a daemon (double fork, setsid, stdio closed) is gone when the call returns: when
    the code ends right after starting it, no host process is left in the call's PID
    namespace; on the wall-clock timeout (within timeout + 1 s) no process with the daemon's
    marker is left, though one was visible while the call ran; its later write to a host path
    never happens. The call that ends by itself gets 60 s (a loaded machine's slow start-up is no
    timeout); the daemon's call times out after 3 s and is watched for as long as it runs."""
    short = PythonSandbox(timeout_s=3.0)
    marker_file = tmp_path / "marker"
    seen_during: set[int] = set()
    running = {"daemon": True}

    async def call(sleep: float, sandbox: PythonSandbox) -> tuple:
        marker = f"{SANDBOX_MARKER}-{sleep}"
        code = escape_code(ESCAPE_OUTLIVE, marker=marker, marker_file=str(marker_file), sleep=sleep)
        start = time.monotonic()
        try:
            result: str | BaseException = await sandbox.run(code)
        except Exception as e:
            result = e
        if sleep:
            running["daemon"] = False
        seconds, marked = time.monotonic() - start, marked_processes(marker)
        namespace = re.search(r"pid:\[\d+\]", sandbox_text(result))
        in_namespace = processes_in_namespace(namespace[0]) if namespace else []
        return result, seconds, marked, in_namespace

    async def watch() -> None:
        while running["daemon"]:
            await asyncio.sleep(0.05)
            seen_during.update(marked_processes(f"{SANDBOX_MARKER}-60.0"))

    async def runs():
        quick = PythonSandbox(timeout_s=60.0)
        return await asyncio.gather(call(0.0, quick), call(60.0, short), watch())

    ended, timed_out, _ = asyncio.run(runs())
    assert ended[0].startswith("main: done in pid:[")
    assert ended[2] == ended[3] == []
    assert isinstance(timed_out[0], TimeoutError) and "ran past 3s" in str(timed_out[0])
    assert timed_out[2] == []
    assert len(seen_during) == 1  # the daemon of the call that timed out, while it ran
    time.sleep(1.2)
    assert marked_processes() == [] and not marker_file.exists()


@needs_bwrap
def test_sandbox_disk_is_bounded() -> None:
    """Pins: writing 200 MB into /work stops with ENOSPC at max_disk_mb (a tmpfs of that size,
    not the host disk), and one file stops with EFBIG at max_file_bytes."""
    roomy = PythonSandbox(timeout_s=20.0, max_disk_mb=16, max_file_bytes=1 << 30)
    default = PythonSandbox(timeout_s=20.0)
    full, big = sandbox_run(roomy, escape_code(ESCAPE_FILL_DISK, mb=200)) + sandbox_run(
        default, escape_code(ESCAPE_FILL_DISK, mb=2)
    )
    match = re.search(r"disk: stopped at (\d+) MB errno (\d+)", sandbox_text(full))
    assert match and int(match[1]) <= 16 and int(match[2]) == errno.ENOSPC, full
    assert f"disk: stopped at 1 MB errno {errno.EFBIG}" in sandbox_text(big)


@needs_bwrap
def test_sandbox_memory_bomb_is_an_error_observation(sandbox: PythonSandbox) -> None:
    """Pins: allocating past memory_mb, at once or bit by bit, ends the call with a
    MemoryError observation, and the next call runs normally."""
    at_once, growing = sandbox_run(
        sandbox,
        "x = bytearray(4 * 1024**3)",
        "x = []\nwhile True:\n    x.append(bytearray(1 << 20))",
    )
    for result in (at_once, growing):
        assert isinstance(result, RuntimeError) and "MemoryError" in str(result), result
    assert sandbox_run(sandbox, "print(6 * 7)") == ["42\n"]


@needs_bwrap
def test_sandbox_cannot_raise_limits_or_nest_namespaces(sandbox: PythonSandbox) -> None:
    """Pins: the code cannot raise its resource limits, create a user or mount namespace, or
    mount a filesystem of its own (which could bypass the disk bound)."""
    (output,) = sandbox_run(sandbox, escape_code(ESCAPE_NEST))
    found = escape_results(sandbox_text(output))
    assert found["raise RLIMIT_AS"] == found["raise RLIMIT_NPROC"] == "ERR ValueError"
    assert found["unshare user"] == found["unshare mount"] == found["mount tmpfs"] == "OK -1"


@needs_bwrap
def test_sandbox_observations() -> None:
    """Pins: the agent loop's observations under bwrap: stdout, the output cap marker, the
    exit code with stderr, and the timeout error. The calls that end by themselves get 60 s,
    so a loaded machine's slow sandbox start-up is no timeout; only the spin times out."""
    sandbox = PythonSandbox(timeout_s=60.0, max_output_chars=200)
    ok, flood, failed = sandbox_run(
        sandbox,
        "print(sum(range(10)))",
        "while True: print('a' * 100)",
        "import sys; print('partial'); sys.exit('bad input')",
    )
    (spin,) = sandbox_run(PythonSandbox(timeout_s=1.5), "while True: pass")
    assert ok == "45\n"
    assert isinstance(flood, str) and flood.endswith("...[output cut at 200 bytes]")
    assert isinstance(failed, RuntimeError) and str(failed) == "exit code 1\npartial\nbad input"
    assert isinstance(spin, TimeoutError) and "1.5s" in str(spin)


def keyring_attempts() -> dict[str, Any]:
    """ESCAPE_KEYRINGS against a secret in this (the caller's) session keyring and one in its
    user keyring, linked into the session keyring as at login and both readable only by a
    possessor: the tool's result, whether each key still holds the secret afterwards, and
    the descriptions in the caller's keyrings and their ids then. Skips where keyrings cannot
    be used."""
    session, user, secret = -3, -4, SANDBOX_SECRET.encode()
    descs = {name: f"{SANDBOX_MARKER}-{name}".encode() for name in ("session", "user")}
    keys = {
        name: host_call("add_key", b"user", descs[name], secret, len(secret), ring)
        for name, ring in (("session", session), ("user", user))
    }
    linked = host_call("keyctl", 0, user, 0) not in keyring_ids(session)
    try:
        if min(keys.values()) < 0:
            pytest.skip(f"this process cannot use kernel keyrings (add_key: {keys})")
        if linked:
            host_call("keyctl", 8, user, session)  # KEYCTL_LINK
        for key in keys.values():
            host_call("keyctl", 5, key, 0x3F000000)  # KEYCTL_SETPERM: possessor only
        nr = {name: syscall_number(name) for name in ("keyctl", "add_key", "request_key")}
        code = escape_code(_SYSCALL_HELPER + ESCAPE_KEYRINGS, nr=nr, keys=keys, descs=descs)
        (result,) = registry_run(code)
        buf = ctypes.create_string_buffer(4096)
        kept = {
            name: host_call("keyctl", 11, key, ctypes.addressof(buf), len(buf)) == len(secret)
            and buf.raw[: len(secret)] == secret
            for name, key in keys.items()
        }
        descriptions = keyring_descriptions(session) + keyring_descriptions(user)
        rings = {
            name: host_call("keyctl", 0, ring, 0) for name, ring in (("s", session), ("u", user))
        }
    finally:
        for key in keys.values():
            if key > 0:
                host_call("keyctl", 21, key)  # KEYCTL_INVALIDATE
        if linked:
            host_call("keyctl", 9, user, session)  # KEYCTL_UNLINK
    assert result.status == "ok", result.output
    assert SANDBOX_SECRET not in result.output
    found = escape_results(result.output)
    return {"found": found, "kept": kept, "descriptions": descriptions, "rings": rings}


@needs_bwrap
def test_sandbox_cannot_reach_callers_keyrings() -> None:
    """Pins: model code cannot read, find, describe or request the caller's keys (in its
    session keyring, and in its user keyring linked there), learn its keyrings' ids, plant a
    key in either keyring, join a named keyring, or revoke, invalidate, unlink,
    re-permission or clear anything: each call fails with EPERM; afterwards the caller's keys
    hold their secret and no planted key is in its keyrings."""
    outcome = keyring_attempts()
    found = outcome["found"]
    assert len(found) == 23 and all(v.split()[0] == str(-errno.EPERM) for v in found.values())
    assert outcome["kept"] == {"session": True, "user": True}
    assert not {"planted", "creditrl-planted"} & set(outcome["descriptions"])


@contextlib.contextmanager
def _seccomp_file_allowing_all() -> Iterator[int]:
    """In place of ``bwrap.seccomp_file``: a filter that allows every system call."""
    import pyseccomp

    with tempfile.TemporaryFile() as file:
        pyseccomp.SyscallFilter(pyseccomp.ALLOW).export_bpf(file)
        file.seek(0)
        yield file.fileno()


@needs_bwrap
def test_sandbox_joins_a_fresh_session_keyring(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pins: the second layer: with a filter that allows every call, model code still does not
    possess the caller's keys: its session keyring is a fresh one (another id than the
    caller's keyrings), reading, describing, revoking, invalidating or re-permissioning the
    caller's keys fails with EACCES, searching for them finds nothing, and afterwards they
    hold their secret and nothing planted is in the caller's keyrings."""
    monkeypatch.setattr(python_sandbox_module, "seccomp_file", _seccomp_file_allowing_all)
    outcome = keyring_attempts()
    found = outcome["found"]
    assert int(found["keyring id session"]) > 0
    assert int(found["keyring id session"]) not in outcome["rings"].values()
    for name in ("session", "user"):
        for op in ("read", "describe", "setperm", "invalidate", "revoke"):
            assert found[f"{op} {name}"].split()[0] == str(-errno.EACCES), found
        assert found[f"unlink {name}"] == str(-errno.ENOENT)  # not in its session keyring
        assert found[f"search {name}"] == found[f"request_key {name}"] == str(-errno.ENOKEY)
    assert outcome["kept"] == {"session": True, "user": True}
    assert not {"planted", "creditrl-planted"} & set(outcome["descriptions"])


# The families of system calls the filter refuses with EPERM, each with the calls to try
# (with all-zero arguments unless REFUSED_ARGS says otherwise).
REFUSED_FAMILIES = {
    "keyrings": ["keyctl", "add_key", "request_key"],
    "ptrace": ["ptrace", "process_vm_readv", "process_vm_writev"],
    "bpf": ["bpf"],
    "perf_event_open": ["perf_event_open"],
    "userfaultfd": ["userfaultfd"],
    "io_uring": ["io_uring_setup", "io_uring_enter", "io_uring_register"],
    "kexec": ["kexec_load", "kexec_file_load"],
    "mount": [
        *("mount", "umount2", "pivot_root", "fsopen", "fsmount", "fsconfig", "move_mount"),
        *("open_tree", "mount_setattr"),
    ],
    "namespaces": ["unshare", "setns", "clone"],
    "modules": ["init_module", "finit_module", "delete_module"],
    "swap": ["swapon", "swapoff"],
    "reboot": ["reboot"],
    "acct": ["acct"],
    "quotactl": ["quotactl"],
    "syslog": ["syslog"],
    "personality": ["personality"],
}
CLONE_NEWUSER = 0x10000000
REFUSED_ARGS = {
    "personality": [0xFFFFFFFF],  # a query: it would succeed without the filter
    "unshare": [CLONE_NEWUSER],
    "clone": [CLONE_NEWUSER | signal.SIGCHLD, 0, 0, 0, 0],
}


@needs_bwrap
@pytest.mark.parametrize("family", sorted(REFUSED_FAMILIES))
def test_sandbox_refuses_system_call_family(family: str) -> None:
    """Pins: model code that calls a refused system call through ctypes gets EPERM (a normal
    Python error, not a killed process), one test per family; its process runs under a seccomp
    filter (Seccomp: 2) with no_new_privs set."""
    names = REFUSED_FAMILIES[family]
    nr = {name: syscall_number(name) for name in names}
    args = {name: REFUSED_ARGS.get(name, [0] * 6) for name in names}
    code = escape_code(_SYSCALL_HELPER + ESCAPE_SYSCALLS, nr=nr, names=names, args=args)
    (result,) = registry_run(code)
    assert result.status == "ok", result.output
    found = escape_results(result.output)
    assert found.pop("filter") == "2 1"
    assert found == {name: str(-errno.EPERM) for name in names}


# Per-uid kernel limits the sandbox's processes share with every process of the host uid that
# owns its user namespace: 200 inotify instances (the default max_user_instances is 128), a
# watch, a fanotify group, a POSIX message queue, and queued realtime signals.
ESCAPE_HOST_LIMITS = """
import resource, signal
fds = [call("inotify_init1", 0) for _ in range(200)]
print(f"inotify_init1: {len([f for f in fds if f >= 0])} {sorted({f for f in fds if f < 0})}")
print(f"inotify_init: {call('inotify_init')}")
print(f"inotify_add_watch: {call('inotify_add_watch', 0, b'/work', 0xFFF)}")
print(f"fanotify_init: {call('fanotify_init', 0, 0)}")
print(f"epoll_create1: {call('epoll_create1', 0)}")
print(f"mq_open: {call('mq_open', b'creditrl-q', os.O_CREAT | os.O_RDWR, 0o600, None)}")
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
queued = sum(libc.sigqueue(os.getpid(), signal.SIGRTMIN, 0) == 0 for _ in range(1000))
print(f"queued signals: {queued}")
print(f"msgqueue: {resource.getrlimit(resource.RLIMIT_MSGQUEUE)}")
print(f"memlock: {resource.getrlimit(resource.RLIMIT_MEMLOCK)}")
"""


def host_inotify_instance() -> int:
    """An inotify instance made (and closed) here, as the caller: its fd, or -errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC)
    if fd < 0:
        return -ctypes.get_errno()
    os.close(fd)
    return fd


@needs_bwrap
def test_sandbox_cannot_use_up_per_uid_limits_of_the_host() -> None:
    """Pins: inotify, fanotify and epoll are refused (EPERM: the kernel counts their instances
    and watches per host uid, so 128 inotify instances in the sandbox left every other process
    of that uid with EMFILE); POSIX message queues are refused and RLIMIT_MSGQUEUE is 0 (their
    bytes count per uid too); queued signals stop at RLIMIT_SIGPENDING (64), and RLIMIT_MEMLOCK
    is 0. After the call the caller still makes an inotify instance."""
    names = ("inotify_init1", "inotify_init", "inotify_add_watch", "fanotify_init", "mq_open")
    names += ("epoll_create1",)
    code = escape_code(
        _SYSCALL_HELPER + ESCAPE_HOST_LIMITS, nr={n: syscall_number(n) for n in names}
    )
    (result,) = registry_run(code)
    assert result.status == "ok", result.output
    eperm = str(-errno.EPERM)
    assert escape_results(result.output) == {
        "inotify_init1": f"0 [{-errno.EPERM}]",
        "inotify_init": eperm,
        "inotify_add_watch": eperm,
        "fanotify_init": eperm,
        "epoll_create1": eperm,
        "mq_open": eperm,
        "queued signals": "64",
        "msgqueue": "(0, 0)",
        "memlock": "(0, 0)",
    }
    assert host_inotify_instance() >= 0


@needs_bwrap
def test_sandbox_normal_code_runs_under_the_filter() -> None:
    """Pins: ordinary code works under the filter: json and math, a child interpreter (also
    under the filter), a thread pool, file writes and copies in /work, a loopback socket
    inside the sandbox, asyncio, fork; clone3 fails with ENOSYS (glibc then uses clone) and a
    socket family beyond unix, inet, inet6 and netlink with EAFNOSUPPORT."""
    code = escape_code(_SYSCALL_HELPER + NORMAL_CODE, nr={"clone3": syscall_number("clone3")})
    (result,) = registry_run(code)
    assert result.status == "ok", result.output
    assert escape_results(result.output) == {
        "json": '{"root": 4.0}',
        "child": "b'1\\n'",
        "threads": "285",
        "files": "kept ['copy.txt', 'main.py', 'notes.txt']",
        "loopback": "b'pong'",
        "asyncio": "2d711642",
        "fork": "3",
        "clone3": str(-errno.ENOSYS),
        "vsock": f"ERR {errno.EAFNOSUPPORT}",
    }


def test_sandbox_refuses_to_start_without_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pins: with no bwrap on PATH the tool refuses with the one-line install-or-opt-out
    message, and isolation: none still builds the tool."""
    monkeypatch.setattr(bwrap_module.shutil, "which", lambda name: None)
    bwrap_problem.cache_clear()
    try:
        with pytest.raises(UserError, match=re.escape(NOT_FOUND)):
            python_tool()
        with pytest.raises(UserError, match=re.escape(NOT_FOUND)):
            PythonSandbox(isolation="bwrap")
        assert "\n" not in NOT_FOUND and "isolation: none" in NOT_FOUND
        assert python_tool(isolation="none").name == "python"
    finally:
        bwrap_problem.cache_clear()


def test_sandbox_refuses_to_start_without_libseccomp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pins: where libseccomp cannot be found (so the system-call filter cannot be built) the
    tool refuses with one line saying what to install, and isolation: none still builds."""
    find_library = ctypes.util.find_library
    monkeypatch.setattr(
        ctypes.util, "find_library", lambda name: None if name == "seccomp" else find_library(name)
    )
    monkeypatch.delitem(sys.modules, "pyseccomp", raising=False)  # imported again, without it
    monkeypatch.setattr(bwrap_module.shutil, "which", lambda name: "/usr/bin/bwrap")
    bwrap_problem.cache_clear()
    seccomp_program.cache_clear()
    try:
        with pytest.raises(UserError) as refused:
            python_tool()
        message = str(refused.value)
        assert message.startswith("python tool: cannot build the sandbox's system-call filter")
        assert "Unable to find libseccomp" in message and "apt-get install libseccomp2" in message
        assert "\n" not in message and "isolation: none" in message
        assert python_tool(isolation="none").name == "python"
    finally:
        bwrap_problem.cache_clear()
        seccomp_program.cache_clear()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"isolation": "docker"}, r"isolation 'docker' is not one of \['bwrap', 'none'\]"),
        ({"max_disk_mb": 0}, "max_disk_mb must be an integer >= 1, got 0"),
        ({"max_processes": "8"}, "max_processes must be an integer >= 1, got '8'"),
        ({"timeout_s": -1}, "timeout_s must be a number > 0, got -1"),
    ],
)
def test_sandbox_settings_are_checked(kwargs: dict, match: str) -> None:
    """Pins: each bad tool setting is a one-line ConfigError naming it and what is allowed."""
    with pytest.raises(ConfigError, match=match):
        python_tool(**{"isolation": "none", **kwargs})


def test_sandbox_isolation_none_from_yaml(tmp_path: Path) -> None:
    """Pins: a tool config's ``kwargs: {isolation: none}`` reaches the python tool, which then
    runs code as a plain subprocess (no bwrap needed)."""
    config = tmp_path / "tools.yaml"
    config.write_text("tools:\n  - name: python\n    kwargs: {isolation: none, timeout_s: 5}\n")
    registry = build_registry([], str(config))
    result = asyncio.run(registry.call("python", {"code": "import sys; print(sys.flags.isolated)"}))
    assert (result.status, result.output) == ("ok", "1\n")
    config.write_text("tools:\n  - name: python\n    kwargs: {isolation: off}\n")
    with pytest.raises(ConfigError, match="isolation False is not one of"):
        build_registry([], str(config))


def test_sandbox_skip_reason_is_one_line() -> None:
    """Pins: the reason the bwrap tests skip (if they do) is one line saying what to do."""
    assert "\n" not in _BWRAP_MISSING
    assert not _BWRAP_MISSING or "isolation: none" in _BWRAP_MISSING

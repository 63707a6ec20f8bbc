"""``creditrl async``: one learner (or ``asynchronous.learners`` ranks) and
``asynchronous.num_samplers`` samplers as local subprocesses of one command.

Each child runs ``python -m creditrl.cli learner|sampler`` with the same config file and
overrides, plus the chosen ports. Each child's stdout and stderr are shown as they come and
copied to ``<output>/async/logs/<role>-<index>.log``. ``supervise`` polls every child: the run
ends when learner rank 0 finishes (it has told the samplers to stop; stragglers are terminated
after ``grace_s``), and within a poll interval of any child (learner rank or sampler) exiting
with an error, at start-up or later: the launcher names its role, index and exit code, prints
the last lines of its output, terminates the others (each by its own pid) and exits non-zero.
A sampler killed by a signal other than SIGINT/SIGTERM is restarted instead, with the same
command, at most ``asynchronous.max_sampler_restarts`` times each (``fleet.SamplerRestarts``:
one line each time; its outbox resends what was never acknowledged). Ctrl-C terminates every
child. ``asynchronous.launcher=ray`` starts them as Ray actors
instead (``creditrl.asynchronous.ray_launch``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from creditrl.asynchronous.fleet import SamplerRestarts
from creditrl.asynchronous.settings import sampler_id_of
from creditrl.asynchronous.tails import TAIL_LINES, print_tail
from creditrl.config import Config
from creditrl.config.loader import async_default_notes, load_config_with_sources
from creditrl.plain_text import as_markup, as_text
from creditrl.run_lock import LOCK_FD_ENV, RunLock, check_output_dir_free
from creditrl.workers.placement import check_device

__all__ = [
    "Child",
    "child_commands",
    "free_port",
    "launch",
    "load_from_args",
    "start_child",
    "supervise",
]


def load_from_args(
    items: list[str], warnings: list[str] | None = None, notes: list[str] | None = None
) -> tuple[Config, Path | None, list[str]]:
    """``[CONFIG.yaml] [key=value ...]`` -> (config, config file, overrides), loaded with the
    async defaults (``mode="async"``: spec 003's ``seq-mean-token-mean`` aggregation unless
    the preset, file or overrides say otherwise); the config's warnings are appended to
    ``warnings`` and the lines naming settings the async defaults decided
    (``async_default_notes``) to ``notes``, when given."""
    config_file = Path(items[0]) if items and "=" not in items[0] else None
    overrides = items[1:] if config_file is not None else list(items)
    loaded = load_config_with_sources(config_file, overrides, mode="async")
    if warnings is not None:
        warnings.extend(loaded.warnings)
    if notes is not None:
        notes.extend(async_default_notes(loaded))
    return loaded.config, config_file, overrides


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def child_commands(
    cfg: Config, config_file: Path | None, overrides: list[str]
) -> tuple[list[list[str]], list[list[str]]]:
    """(learner commands, sampler commands), with free ports filled in where the config
    says 0."""
    a = cfg.asynchronous
    extra = [f"asynchronous.port={a.port or free_port()}"]
    if a.learners > 1:
        extra.append(f"asynchronous.dist_port={a.dist_port or free_port()}")
    args = [*([str(config_file)] if config_file else []), *overrides, *extra]
    base = [sys.executable, "-m", "creditrl.cli"]
    learners = [[*base, "learner", *args, "--rank", str(r)] for r in range(a.learners)]
    samplers = [[*base, "sampler", *args, "--index", str(i)] for i in range(a.num_samplers)]
    return learners, samplers


_TAIL_BYTES = 16384  # output kept per child for the report


@dataclass
class Child:
    """One child process, its role (``learner`` rank / ``sampler`` index), its log and the
    tail of its output."""

    role: str
    index: int
    proc: subprocess.Popen
    log_path: Path
    tail: bytearray = field(default_factory=bytearray)
    lock: threading.Lock = field(default_factory=threading.Lock)
    readers: list[threading.Thread] = field(default_factory=list)

    @property
    def name(self) -> str:
        """``learner rank 0`` / ``sampler 1 (s1)``."""
        if self.role == "learner":
            return f"learner rank {self.index}"
        return f"sampler {self.index} ({sampler_id_of(self.index)})"

    def last_lines(self, count: int = TAIL_LINES) -> list[str]:
        """The last ``count`` lines of its output (progress-bar redraws collapsed)."""
        for reader in self.readers:
            reader.join(timeout=2.0)  # what it wrote just before exiting
        with self.lock:
            text = bytes(self.tail).decode("utf-8", errors="replace")
        lines = [line.rsplit("\r", 1)[-1].rstrip() for line in text.splitlines()]
        return [line for line in lines if line][-count:]


def _pump(child: Child, stream: BinaryIO, echo: BinaryIO | None) -> None:
    """Copy one output stream of a child to ``echo`` as it comes, and whole lines of it to its
    log file and tail (so stdout and stderr interleave by line there)."""
    partial = b""
    with child.log_path.open("ab") as log_file:
        while True:
            chunk = os.read(stream.fileno(), 65536)
            if echo is not None and chunk:
                try:
                    echo.write(chunk)
                    echo.flush()
                except (OSError, ValueError):  # the terminal went away: keep logging
                    echo = None
            partial += chunk
            cut = max(partial.rfind(b"\n"), partial.rfind(b"\r")) + 1
            if not chunk or len(partial) > _TAIL_BYTES:  # the end, or a very long line
                cut = len(partial)
            if cut:
                with child.lock:
                    log_file.write(partial[:cut])
                    log_file.flush()
                    child.tail += partial[:cut]
                    del child.tail[:-_TAIL_BYTES]
                partial = partial[cut:]
            if not chunk:
                break
    stream.close()


def start_child(
    role: str,
    index: int,
    cmd: Sequence[str],
    log_dir: Path,
    echo: tuple[BinaryIO | None, BinaryIO | None] | None = None,
    lock_fd: int | None = None,
) -> Child:
    """Start ``cmd``; its stdout and stderr are shown on ``echo`` (the launcher's own by
    default) and appended to ``log_dir/<role>-<index>.log``. ``lock_fd``: the output folder's
    held lock, handed to the child (``creditrl.run_lock``)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # live output, and all of it at a crash
    env.pop(LOCK_FD_ENV, None)
    if role == "learner":  # learner rank r takes this machine's GPU r (workers.placement)
        env["LOCAL_RANK"] = str(index)
    if lock_fd is not None:
        env[LOCK_FD_ENV] = str(lock_fd)
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        pass_fds=() if lock_fd is None else (lock_fd,),
    )
    child = Child(role, index, proc, log_dir / f"{role}-{index}.log")
    if echo is None:
        echo = (getattr(sys.stdout, "buffer", None), getattr(sys.stderr, "buffer", None))
    for stream, target in zip((proc.stdout, proc.stderr), echo, strict=True):
        reader = threading.Thread(target=_pump, args=(child, stream, target), daemon=True)
        reader.start()
        child.readers.append(reader)
    return child


def _terminate(children: Sequence[Child], grace_s: float) -> None:
    for c in children:
        if c.proc.poll() is None:
            c.proc.terminate()
    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def _exit_status(code: int) -> tuple[int, str]:
    """(the launcher's exit code, words) for a child's return code (negative: a signal)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return 128 - code, f"was killed by {name}"
    return code, f"exited with code {code}"


def _report(child: Child, console: Any) -> int:
    code, words = _exit_status(int(child.proc.returncode))
    console.print(
        f"[red]async:[/red] {child.name} {words}; stopping the run "
        f"(log: {as_markup(child.log_path)})",
        markup=True,
    )
    print_tail(console, child.name, child.last_lines(), code)
    return code


def _died(child: Child) -> bool:
    """Killed by a signal other than SIGINT and SIGTERM (which ask it to stop)."""
    code = child.proc.poll()
    return code is not None and code < 0 and -code not in (signal.SIGINT, signal.SIGTERM)


def _restart_dead(
    samplers: list[Child],
    restarts: SamplerRestarts,
    restart: Callable[[Child], Child],
    console: Any,
) -> None:
    """Restart (or leave out, while others run) each sampler that died (``_died``); one that
    may not be restarted is left to the caller, which ends the run."""
    for k, child in enumerate(samplers):
        if child.index in restarts.left_out or not _died(child):
            continue
        others = sum(c.proc.poll() is None for c in samplers)
        what = _exit_status(int(child.proc.returncode))[1]
        action, line = restarts.decide(child.index, child.name, what, others)
        if action != "stop":
            console.print(as_text(line), soft_wrap=True)
        if action == "restart":
            samplers[k] = restart(child)


def supervise(
    learners: Sequence[Child],
    samplers: Sequence[Child],
    console: Any,
    grace_s: float = 60.0,
    poll_s: float = 0.2,
    restart: Callable[[Child], Child] | None = None,
    max_restarts: int = 0,
) -> int:
    """Wait for learner rank 0; end the run as soon as any child exits with an error (see the
    module docstring), but with ``restart`` (a new child for a sampler's) restart samplers
    that die, ``max_restarts`` times each. Returns 0, the failed child's exit code, or 128 +
    signal number."""
    samplers = list(samplers)
    restarts = SamplerRestarts(max_restarts if restart is not None else 0)
    everyone = [*learners, *samplers]
    try:
        while True:
            if restart is not None:
                _restart_dead(samplers, restarts, restart, console)
                everyone = [*learners, *samplers]
            left_out = [c for c in samplers if c.index in restarts.left_out]
            failed = [c for c in everyone if c.proc.poll() not in (None, 0) and c not in left_out]
            if failed:
                code = _report(failed[0], console)
                _terminate(everyone, 10.0)
                return code
            if learners[0].proc.poll() == 0:
                break
            time.sleep(poll_s)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(c.proc.poll() is None for c in everyone):
            time.sleep(poll_s)
        _terminate(everyone, 10.0)
        return 0
    except KeyboardInterrupt:
        _terminate(everyone, 10.0)
        return 130


def launch(
    cfg: Config,
    config_file: Path | None,
    overrides: list[str],
    console: Any,
    grace_s: float = 60.0,
) -> int:
    """Run the learner(s) and samplers to completion under ``supervise`` (or as Ray actors
    under ``ray_launch.supervise_actors`` with ``asynchronous.launcher=ray``); returns its code."""
    check_device(cfg)  # CUDA asked for and not here: one line before any process starts
    if cfg.asynchronous.launcher == "ray":
        from creditrl.asynchronous.ray_launch import launch_ray

        check_output_dir_free(Path(cfg.trainer.output_dir))  # learner rank 0 then locks it
        return launch_ray(cfg, console, grace_s)
    learner_cmds, sampler_cmds = child_commands(cfg, config_file, overrides)
    log_dir = Path(cfg.trainer.output_dir) / "async" / "logs"
    with RunLock.acquire(Path(cfg.trainer.output_dir)) as lock:  # learner rank 0 shares it
        console.print(
            as_text(
                f"async: {len(learner_cmds)} learner rank(s) + {len(sampler_cmds)} sampler(s), "
                f"output in {cfg.trainer.output_dir}, process logs in {log_dir}"
            )
        )
        learners = [
            start_child("learner", r, cmd, log_dir, lock_fd=lock.fd if r == 0 else None)
            for r, cmd in enumerate(learner_cmds)
        ]
        samplers = [start_child("sampler", i, cmd, log_dir) for i, cmd in enumerate(sampler_cmds)]

        def restart(child: Child) -> Child:
            return start_child("sampler", child.index, sampler_cmds[child.index], log_dir)

        limit = cfg.asynchronous.max_sampler_restarts
        return supervise(learners, samplers, console, grace_s, restart=restart, max_restarts=limit)

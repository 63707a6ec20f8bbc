"""``creditrl async``: one learner (or ``asynchronous.learners`` ranks) and
``asynchronous.num_samplers`` samplers as local subprocesses of one command.

Each child runs ``python -m creditrl.cli learner|sampler`` with the same config file and
overrides, plus the chosen ports. The launcher waits for learner rank 0; when it finishes it has
told the samplers to stop, and stragglers are terminated after ``grace_s``. A learner rank
failing stops everything; Ctrl-C terminates every child (each by its own pid).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from creditrl.config import Config
from creditrl.config.loader import load_config

__all__ = ["child_commands", "free_port", "launch", "load_from_args"]


def load_from_args(items: list[str]) -> tuple[Config, Path | None, list[str]]:
    """``[CONFIG.yaml] [key=value ...]`` -> (config, config file, overrides)."""
    config_file = Path(items[0]) if items and "=" not in items[0] else None
    overrides = items[1:] if config_file is not None else list(items)
    return load_config(config_file, overrides), config_file, overrides


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


def _terminate(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(
    cfg: Config,
    config_file: Path | None,
    overrides: list[str],
    console: Any,
    grace_s: float = 60.0,
) -> int:
    """Run the learner(s) and samplers to completion; returns learner rank 0's exit code."""
    learner_cmds, sampler_cmds = child_commands(cfg, config_file, overrides)
    console.print(
        f"async: {len(learner_cmds)} learner rank(s) + {len(sampler_cmds)} sampler(s), "
        f"output in {cfg.trainer.output_dir}"
    )
    learners = [subprocess.Popen(cmd) for cmd in learner_cmds]
    samplers = [subprocess.Popen(cmd) for cmd in sampler_cmds]
    try:
        while learners[0].poll() is None:
            failed = [p for p in learners if p.poll() not in (None, 0)]
            if failed:
                console.print(
                    f"[red]async:[/red] a learner rank exited with {failed[0].returncode}"
                )
                _terminate(learners + samplers, 10.0)
                return int(failed[0].returncode)
            time.sleep(0.5)
        code = int(learners[0].returncode)
        if code != 0:
            _terminate(learners + samplers, 10.0)
            return code
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in learners + samplers):
            time.sleep(0.5)
        _terminate(learners + samplers, 10.0)
        return code
    except KeyboardInterrupt:
        _terminate(learners + samplers, 10.0)
        return 130

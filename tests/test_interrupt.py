"""Ctrl-C: one line naming the step reached and how to resume, exit code 130, no traceback,
and the checkpoints on disk whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import tiny_trainer_config

from creditrl import cli
from creditrl.config.loader import save_resolved_config
from creditrl.trainers.checkpoint import CheckpointManager
from creditrl.trainers.rl_trainer import RLTrainer


def test_ctrl_c_in_a_step_is_one_line_and_exit_130(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KeyboardInterrupt during step 2 (step 1 saved): exit 130 and one warning line that names
    step 2 of 3 and the checkpoint a rerun resumes from; rerunning finishes the run."""
    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    save_resolved_config(
        tiny_trainer_config(out, "trainer.total_steps=3", "trainer.test_freq=0"), config
    )
    real = RLTrainer.train_step

    def interrupted_at_two(self: RLTrainer) -> dict:
        if self.step == 2:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(RLTrainer, "train_step", interrupted_at_two)
    capsys.readouterr()
    assert cli.main(["train", str(config)]) == 130
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    lines = [line for line in captured.out.splitlines() if line.startswith("warning: interrupt")]
    root = out / "checkpoints"
    assert lines == [
        f"warning: interrupted at step 2 of 3; rerun the same command to resume from the "
        f"latest checkpoint in {root} (step_000001)"
    ]
    assert CheckpointManager(root).latest() == root / "step_000001"
    monkeypatch.setattr(RLTrainer, "train_step", real)
    assert cli.main(["train", str(config)]) == 0
    assert "resuming" in capsys.readouterr().out


def _default_sigint() -> None:
    """A shell without job control starts background commands with SIGINT ignored, and Python
    keeps an inherited SIG_IGN; a terminal's foreground command has the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_to_the_process_group_of_a_real_run(tmp_path: Path) -> None:
    """SIGINT to the whole process group (what a terminal's Ctrl-C does: the reward workers
    get it too) once step 1 is logged: exit 130, one `interrupted at step` line, no
    traceback from the trainer or its workers."""
    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    save_resolved_config(
        tiny_trainer_config(
            out, "trainer.total_steps=100000", "trainer.save_freq=50", "trainer.test_freq=0"
        ),
        config,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "creditrl.cli", "train", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=_default_sigint,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300  # a hang guard for a loaded machine, not a measure
        metrics = out / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stdout[-2000:] + stderr[-2000:]
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    assert "KeyboardInterrupt" not in stdout + stderr
    assert len([line for line in stdout.splitlines() if "interrupted at step" in line]) == 1

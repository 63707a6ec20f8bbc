"""One run per output folder (creditrl.run_lock): a second run into a folder in use is
refused in one line naming the running one; the lock dies with its holder; an output_dir that
is a file is one line naming the key."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import read_metrics, tiny_learner_config, tiny_trainer_config

from creditrl import cli
from creditrl.asynchronous.learner import Learner
from creditrl.config.loader import save_resolved_config
from creditrl.errors import ConfigError
from creditrl.run_lock import LOCK_FD_ENV, LOCK_NAME, RunInUseError, RunLock
from creditrl.trainers.rl_trainer import RLTrainer

HOLD = (
    "import sys; from creditrl.run_lock import RunLock; "
    "lock = RunLock.acquire(sys.argv[1]); print('held', flush=True); sys.stdin.read()"
)


def start_holder(out: Path) -> subprocess.Popen:
    """Another process that holds ``out``'s lock until its stdin closes or it is killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "held\n"
    return proc


def cli_lines(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, list[str]]:
    """``creditrl ARGS``: (exit code, the lines it printed); never a traceback."""
    capsys.readouterr()
    code = cli.main(list(args))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out.strip().splitlines()


def test_second_train_into_a_folder_in_use_is_refused_until_the_holder_dies(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """While another process holds the folder, `creditrl train` into it exits 2 with one line
    naming that process (pid, command) and writes nothing; once the holder is killed (no
    clean-up of its own), the same command trains."""
    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    save_resolved_config(tiny_trainer_config(out, "trainer.total_steps=1"), config)
    holder = start_holder(out)
    try:
        code, lines = cli_lines(capsys, "train", str(config))
    finally:
        holder.kill()
        holder.wait()
    assert code == 2
    assert [line for line in lines if line.startswith("error")] == lines[-1:]  # one line
    assert lines[-1].startswith(f"error: trainer.output_dir={out} is in use by another run (")
    assert f"pid {holder.pid} on " in lines[-1] and f": -c {out}); wait" in lines[-1]
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    code, _ = cli_lines(capsys, "train", str(config))
    assert code == 0
    assert sorted(read_metrics(out)) == [0, 1]


def test_lock_record_names_this_process_and_is_freed_on_release(tmp_path: Path) -> None:
    with RunLock.acquire(tmp_path) as lock:
        record = json.loads((tmp_path / LOCK_NAME).read_text())
        assert record["pid"] == os.getpid() and isinstance(record["started"], str)
        with pytest.raises(RunInUseError, match=rf"pid {os.getpid()} on "):
            RunLock.acquire(tmp_path)
    assert lock.fd is None
    RunLock.acquire(tmp_path).release()  # free again


def test_a_damaged_lock_record_still_refuses(tmp_path: Path) -> None:
    """The holder's record is data: unparseable or hostile text is 'holder unknown' or shown
    cut and without control characters."""
    with RunLock.acquire(tmp_path):
        record = '{"pid": "x", "command": "a\\u001b[2Jb' + "c" * 500 + '"}'
        (tmp_path / LOCK_NAME).write_text(record)
        with pytest.raises(RunInUseError) as err:
            RunLock.acquire(tmp_path)
    message = str(err.value)
    assert "\x1b" not in message and "\n" not in message and len(message) < 400
    assert ": a [2Jbccc" in message
    with RunLock.acquire(tmp_path):
        (tmp_path / LOCK_NAME).write_bytes(b"\xff" * 10_000)
        with pytest.raises(RunInUseError, match=r"another run \(holder unknown\);"):
            RunLock.acquire(tmp_path)


def test_a_refused_trainer_frees_the_folder(tmp_path: Path) -> None:
    """RLTrainer refused while it is built (resume=never into a used folder) releases the
    lock, so the next attempt is not refused as 'in use'."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match="already holds a run"):
        RLTrainer(tiny_trainer_config(tmp_path, "trainer.resume=never"))
    RunLock.acquire(tmp_path).release()


def test_the_async_learner_holds_its_folder_as_train_does(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The async learner (rank 0, as built by creditrl learner, the Ray launcher or the Python
    API) locks trainer.output_dir for its run, as creditrl train does: a learner into a folder
    that a train run or another learner holds is refused in one line naming the holder, as is a
    train run into a learner's folder; closing the learner frees it. Before, the Learner took no
    lock, so a second learner or a train run wrote the same metrics and checkpoints."""
    out = tmp_path / "run"
    refused = pytest.raises(RunInUseError, match=f"trainer.output_dir={out} is in use by another")
    with RunLock.acquire(out), refused:  # as a running creditrl train holds it
        Learner(tiny_learner_config(out))
    assert not (out / "metrics.jsonl").exists()
    learner = Learner(tiny_learner_config(out))
    try:
        with pytest.raises(RunInUseError, match="is in use by another run"):
            Learner(tiny_learner_config(out))
        with pytest.raises(RunInUseError, match="is in use by another run"):
            RLTrainer(tiny_trainer_config(out))
        config = tmp_path / "run.yaml"
        save_resolved_config(tiny_learner_config(out), config)
        code, lines = cli_lines(capsys, "learner", str(config))
        assert code == 2
        assert len(lines) == 1 and lines[0].startswith(f"error: trainer.output_dir={out} is in use")
    finally:
        learner.close()
    RunLock.acquire(out).release()


def test_the_launcher_hands_its_lock_to_learner_rank_0(tmp_path: Path) -> None:
    """`creditrl async` holds the folder and passes the descriptor to learner rank 0, which
    adopts it; a process without it (a second run) is refused; a stale variable naming a
    descriptor that is not the lock file is ignored."""
    child = (
        "import sys; from creditrl.run_lock import RunLock\n"
        "try:\n    RunLock.acquire(sys.argv[1]); print('adopted')\n"
        "except Exception as e:\n    print(type(e).__name__)\n"
    )
    with RunLock.acquire(tmp_path) as lock:

        def run(fd: int | None, env_fd: str | None) -> str:
            env = {k: v for k, v in os.environ.items() if k != LOCK_FD_ENV}
            if env_fd is not None:
                env[LOCK_FD_ENV] = env_fd
            result = subprocess.run(
                [sys.executable, "-c", child, str(tmp_path)],
                env=env,
                pass_fds=() if fd is None else (fd,),
                capture_output=True,
                text=True,
                check=True,
            )
            return result.stdout.strip()

        assert run(lock.fd, str(lock.fd)) == "adopted"
        assert run(None, None) == "RunInUseError"
        assert run(None, str(lock.fd)) == "RunInUseError"  # not passed: not open there
        with open(tmp_path / "other", "w") as other:
            assert run(other.fileno(), str(other.fileno())) == "RunInUseError"
        assert lock.fd is not None


def test_async_into_a_folder_in_use_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    save_resolved_config(tiny_trainer_config(out), config)
    with RunLock.acquire(out):
        code, lines = cli_lines(capsys, "async", str(config))
    assert code == 2
    assert [line for line in lines if line.startswith("error")] == lines[-1:]
    assert lines[-1].startswith(f"error: trainer.output_dir={out} is in use by another run (pid ")
    assert not (out / "async").exists()


@pytest.mark.parametrize("where", ["file", "below"])
def test_output_dir_that_is_a_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, where: str
) -> None:
    file = tmp_path / "taken"
    file.write_text("not a folder")
    out = file if where == "file" else file / "run"
    config = tmp_path / "run.yaml"
    save_resolved_config(tiny_trainer_config(out), config)
    for command in ("train", "async"):
        code, lines = cli_lines(capsys, command, str(config))
        assert code == 2
        assert [line for line in lines if line.startswith("error")] == lines[-1:]
        what = "is a file" if where == "file" else f"lies below the file {file}"
        assert lines[-1] == (
            f"error: trainer.output_dir={out} {what}, not a folder; choose another "
            "trainer.output_dir"
        )
    assert file.read_text() == "not a folder"

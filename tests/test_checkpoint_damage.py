"""Checkpoints survive damage: a damaged newest checkpoint is named and the previous complete one
used, ``latest`` is not trusted, saves are fsync'd before each rename, ``trainer.resume=never``
does not mix two runs, and a rerun leaves each step once in metrics.jsonl (sync trainer and
async learner)."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_async_learner import tiny_config as learner_config
from test_trainer import read_metrics, tiny_config

from creditrl.asynchronous.learner import Learner
from creditrl.errors import ConfigError, DataError
from creditrl.tracking import truncate_jsonl
from creditrl.trainers import checkpoint as checkpoint_module
from creditrl.trainers.checkpoint import CheckpointManager, prepare_output_dir
from creditrl.trainers.rl_trainer import RLTrainer

LOGGER = "creditrl.trainers.checkpoint"


def write_parts(directory: str) -> dict:
    """A stand-in worker group: one model and one optimizer file."""
    save_file({"w": torch.arange(600, dtype=torch.float32)}, f"{directory}/actor.model.safetensors")
    save_file({"m": torch.zeros(300)}, f"{directory}/actor.optim.safetensors")
    return {"actor": {"format": "full"}}


def saved(root: Path, *steps: int) -> CheckpointManager:
    manager = CheckpointManager(root, max_keep=5)
    for step in steps:
        manager.save(step, write_parts, {"note": step})
    return manager


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def truncate(path: Path, size: int) -> None:
    with path.open("r+b") as f:
        f.truncate(size)


def garble_header(path: Path) -> None:
    """Same size, broken safetensors header."""
    data = bytearray(path.read_bytes())
    data[8:16] = b"\xff" * 8
    path.write_bytes(bytes(data))


def garble_json(path: Path) -> None:
    """Same size, not JSON."""
    path.write_text("{" * path.stat().st_size)


DAMAGE = {
    "truncated model": (
        lambda d: truncate(d / "actor.model.safetensors", 100),
        "actor.model.safetensors: truncated to 100 of {size} bytes",
    ),
    "missing optimizer": (
        lambda d: (d / "actor.optim.safetensors").unlink(),
        "actor.optim.safetensors: missing",
    ),
    "corrupt state": (
        lambda d: (d / "state.json").write_text('{"step": 2, "sta'),
        "state.json: truncated to 16 of {state} bytes",
    ),
    "rewritten state": (
        lambda d: garble_json(d / "state.json"),
        "state.json: content differs from what was written (sha256)",
    ),
    "missing manifest": (lambda d: (d / "manifest.json").unlink(), "manifest.json: missing"),
    "garbled manifest": (
        lambda d: (d / "manifest.json").write_text("[1, 2"),
        "manifest.json: not a readable manifest",
    ),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_newest_checkpoint_is_named_and_the_previous_one_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """Each kind of damage to the newest checkpoint is detected, logged as one line naming the
    file and problem, and the previous complete checkpoint is returned (the old code returned
    the damaged one: it only looked for state.json)."""
    manager = saved(tmp_path, 1, 2)
    newest = tmp_path / "step_000002"
    size = (newest / "actor.model.safetensors").stat().st_size
    state = (newest / "state.json").stat().st_size
    damage, reason = DAMAGE[kind]
    damage(newest)
    assert manager.latest() == tmp_path / "step_000001"
    reason = reason.format(size=size, state=state)
    assert warnings(caplog) == [
        f"checkpoint step_000002 is damaged ({reason}); resuming from step_000001"
    ]
    step, state_dict = manager.load(manager.latest(report=False), lambda d, m: None)
    assert (step, state_dict) == (1, {"note": 1})


def test_same_size_damage_to_large_files_is_caught_by_parsing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files too large to hash are still checked: a broken safetensors header of the right
    size, and a state.json that is not JSON, each make the checkpoint damaged."""
    monkeypatch.setattr(checkpoint_module, "HASH_MAX_BYTES", 0)
    manager = saved(tmp_path, 1, 2, 3)
    garble_header(tmp_path / "step_000003" / "actor.model.safetensors")
    garble_json(tmp_path / "step_000002" / "state.json")
    assert manager.latest() == tmp_path / "step_000001"
    lines = warnings(caplog)
    assert len(lines) == 2
    assert lines[0].startswith(
        "checkpoint step_000003 is damaged (actor.model.safetensors: unreadable safetensors "
        "header ("
    )
    assert lines[0].endswith("); resuming from step_000001")
    assert lines[1] == (
        "checkpoint step_000002 is damaged (state.json: not valid JSON); resuming from step_000001"
    )


@pytest.mark.parametrize(
    "pointer,note",
    [
        (None, "is missing"),
        ("step_000009", "names 'step_000009', which is not a checkpoint here"),
        ("../../etc", "names '../../etc', which is not a checkpoint here"),
        ("step_000001", "names step_000001, older than the newest complete checkpoint"),
    ],
)
def test_missing_or_dangling_latest_resumes_from_the_newest_complete(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, pointer: str | None, note: str
) -> None:
    """``latest`` missing, dangling, hostile or stale (a crash between the rename and the
    pointer): the newest complete step directory is used and the pointer's state is logged
    (the old code returned None, i.e. started over, for a missing or dangling pointer)."""
    manager = saved(tmp_path, 1, 2)
    if pointer is None:
        (tmp_path / "latest").unlink()
    else:
        (tmp_path / "latest").write_text(pointer)
    assert manager.latest() == tmp_path / "step_000002"
    assert warnings(caplog) == [f"{tmp_path / 'latest'} {note}; resuming from step_000002"]


def test_every_checkpoint_damaged_stops_with_one_line(tmp_path: Path) -> None:
    """When step directories exist but none is complete the run stops (DataError naming the
    directory, each problem and what to do) instead of silently starting over."""
    manager = saved(tmp_path, 1)
    (tmp_path / "step_000001" / "rng.safetensors").unlink()
    with pytest.raises(DataError) as err:
        manager.latest()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        f"no complete checkpoint in {tmp_path} (step_000001: rng.safetensors: missing)"
    )
    assert "trainer.resume=never trainer.overwrite=true" in message
    assert CheckpointManager(tmp_path / "empty").latest() is None


def test_saving_after_resume_removes_the_abandoned_checkpoints(tmp_path: Path) -> None:
    """Resuming from step 1 past a damaged step 3, the next save (step 2) removes step 3 so
    it can never be mistaken for a later state; ``latest`` names step 2."""
    manager = saved(tmp_path, 1, 3)
    truncate(tmp_path / "step_000003" / "actor.model.safetensors", 10)
    assert manager.latest(report=False) == tmp_path / "step_000001"
    manager.save(2, write_parts, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001", "step_000002"]
    assert (tmp_path / "latest").read_text() == "step_000002"
    assert manager.latest(report=False) == tmp_path / "step_000002"


def test_save_fsyncs_files_and_directories_before_each_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file of the checkpoint (manifest included) and its directory are fsync'd before
    the directory is renamed into place; the parent after it; the ``latest`` temp file before
    it replaces ``latest``, and the parent after that (the old code never called fsync)."""
    root = tmp_path.resolve() / "checkpoints"
    events: list[tuple[str, ...]] = []
    fsync, rename, replace = os.fsync, os.rename, os.replace

    def record_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def record(kind: str, real):
        def wrapper(src, dst, *args, **kwargs):
            events.append((kind, str(src), str(dst)))
            return real(src, dst, *args, **kwargs)

        return wrapper

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to name file descriptors")
    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "rename", record("rename", rename))
    monkeypatch.setattr(os, "replace", record("replace", replace))
    final = CheckpointManager(root).save(1, write_parts, {"note": 1})
    [move] = [i for i, e in enumerate(events) if e[0] == "rename"]
    tmp = Path(events[move][1])
    assert events[move][2] == str(final) and tmp.parent == root
    [swap] = [i for i, e in enumerate(events) if e[0] == "replace"]
    assert events[swap][1:] == (str(root / ".latest.tmp"), str(root / "latest"))
    synced = [e[1] for e in events[:move] if e[0] == "fsync"]
    names = sorted(p.name for p in final.iterdir())
    assert names == [
        "actor.model.safetensors",
        "actor.optim.safetensors",
        "manifest.json",
        "rng.safetensors",
        "state.json",
    ]
    assert all(str(tmp / name) in synced for name in names)
    assert synced[-1] == str(tmp)  # the directory, after its files
    between = [e for e in events[move + 1 : swap] if e[0] == "fsync"]
    assert between == [("fsync", str(root)), ("fsync", str(root / ".latest.tmp"))]
    assert events[swap + 1 :] == [("fsync", str(root))]


def test_truncate_keeps_each_step_once(tmp_path: Path) -> None:
    """metrics.jsonl after truncation holds each step at most once (its last record), none
    after the resumed step, and nothing at all for ``-1`` (a run starting over)."""
    path = tmp_path / "metrics.jsonl"
    rows = [(0, "a"), (1, "a"), (2, "a"), (0, "b"), (1, "b"), (3, "b")]
    path.write_text("".join(json.dumps({"step": s, "run": r}) + "\n" for s, r in rows))
    assert truncate_jsonl(path, 1) == 4
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        {"step": 0, "run": "b"},
        {"step": 1, "run": "b"},
    ]
    assert truncate_jsonl(path, -1) == 2 and path.read_text() == ""


def test_prepare_output_dir_refuses_or_moves_a_previous_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """resume=never into a used directory: a one-line ConfigError naming trainer.output_dir and
    the three ways on; with overwrite the run's files move to overwritten/<time>/ (the user's
    and the async launcher's live logs stay); an unused directory, or resume=auto, is left
    alone."""
    out = tmp_path / "run"
    saved(out / "checkpoints", 1)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "notes.txt").write_text("mine")
    (out / "async" / "logs").mkdir(parents=True)
    (out / "async" / "acks.jsonl").write_text("{}\n")
    (out / "async" / "logs" / "learner-0.log").write_text("live")
    assert prepare_output_dir(out, "auto", False) is None
    with pytest.raises(ConfigError) as err:
        prepare_output_dir(out, "never", False)
    assert str(err.value) == (
        f"trainer.output_dir={out} already holds a run (checkpoints up to step_000001; "
        "metrics.jsonl) and trainer.resume=never: set trainer.resume=auto to continue it, "
        f"trainer.overwrite=true to start over (its files move to {out / 'overwritten'}/), or "
        "choose another trainer.output_dir"
    )
    aside = prepare_output_dir(out, "never", True)
    assert aside is not None and aside.parent == out / "overwritten"
    assert sorted(p.name for p in aside.iterdir()) == ["async", "checkpoints", "metrics.jsonl"]
    assert (aside / "async" / "acks.jsonl").read_text() == "{}\n"
    assert sorted(p.name for p in out.iterdir()) == ["async", "notes.txt", "overwritten"]
    assert [p.name for p in (out / "async").iterdir()] == ["logs"]  # the launcher's, live
    assert prepare_output_dir(out, "never", False) is None
    assert warnings(caplog) == [
        "trainer.overwrite=true: the earlier run's checkpoints, metrics.jsonl, async/acks.jsonl "
        f"moved to {aside}"
    ]


# ---- end to end: the sync trainer -------------------------------------------------------------


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run with checkpoints at steps 1 and 2."""
    out = tmp_path_factory.mktemp("base") / "run"
    RLTrainer(tiny_config(out)).fit()
    return out


def test_trainer_resumes_past_a_truncated_model_file(
    two_steps: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The newest checkpoint's model file cut short: the trainer logs it, resumes from step 1,
    trains step 2 again and leaves steps 0, 1, 2 once each and a complete step 2."""
    out = tmp_path / "run"
    shutil.copytree(two_steps, out)
    model = out / "checkpoints" / "step_000002" / "actor.model.safetensors"
    size = model.stat().st_size
    truncate(model, 64)
    trainer = RLTrainer(tiny_config(out))
    trainer.fit()
    assert trainer.step == 2
    assert warnings(caplog) == [
        f"checkpoint step_000002 is damaged (actor.model.safetensors: truncated to 64 of {size} "
        "bytes); resuming from step_000001"
    ]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    assert model.stat().st_size == size
    assert CheckpointManager(out / "checkpoints").latest() == out / "checkpoints" / "step_000002"


def test_resume_never_into_a_used_dir_refuses_and_overwrite_starts_over(
    two_steps: Path, tmp_path: Path
) -> None:
    """trainer.resume=never on a directory holding a run: refused before anything is built or
    written; with trainer.overwrite=true the old run moves aside and a fresh one runs (the old
    code appended a second step 0.. to the old metrics.jsonl)."""
    out = tmp_path / "run"
    shutil.copytree(two_steps, out)
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"trainer.output_dir=.* already holds a run"):
        RLTrainer(tiny_config(out, "trainer.resume=never"))
    assert (out / "metrics.jsonl").read_text() == before
    RLTrainer(tiny_config(out, "trainer.resume=never", "trainer.overwrite=true",
                          "trainer.total_steps=1")).fit()  # fmt: skip
    assert sorted(read_metrics(out)) == [0, 1]
    assert (out / "checkpoints" / "latest").read_text() == "step_000001"
    [aside] = (out / "overwritten").iterdir()
    assert (aside / "metrics.jsonl").read_text() == before
    assert (aside / "checkpoints" / "step_000002" / "manifest.json").is_file()


def test_rerun_after_a_kill_before_the_first_checkpoint_logs_each_step_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed at step 2 with no checkpoint yet, the rerun starts from step 0 and metrics.jsonl
    holds steps 0, 1, 2 once each (the old code kept the first attempt's rows: 0, 1, 0, 1, 2)."""
    cfg = tiny_config(tmp_path, "trainer.save_freq=0")
    step = RLTrainer.train_step

    def killed_at_two(self: RLTrainer) -> dict:
        if self.step == 2:
            raise RuntimeError("killed")
        return step(self)

    monkeypatch.setattr(RLTrainer, "train_step", killed_at_two)
    with pytest.raises(RuntimeError, match="killed"):
        RLTrainer(cfg).fit()
    assert not (tmp_path / "checkpoints").exists()
    first = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert first == [0, 1]
    monkeypatch.setattr(RLTrainer, "train_step", step)
    RLTrainer(cfg).fit()
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]


# ---- end to end: the async learner ------------------------------------------------------------


def test_learner_resume_skips_a_damaged_checkpoint_and_reruns_start_clean(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The async learner uses the same checks: a learner whose newest checkpoint lost its model
    file resumes from the previous one (logged once), and a learner rerun without any
    checkpoint drops the earlier attempt's metrics rows."""
    out = tmp_path / "learner"
    learner = Learner(learner_config(out))
    learner.tracker.log({"x": 1.0}, step=1)
    learner.tracker.close()
    rerun = Learner(learner_config(out))
    assert rerun.maybe_resume() is False
    rerun.tracker.close()
    assert (out / "metrics.jsonl").read_text() == ""
    for step in (1, 2):
        rerun.step = step
        rerun.save_checkpoint()
    (out / "checkpoints" / "step_000002" / "actor.model.safetensors").unlink()
    resumed = Learner(learner_config(out))
    assert resumed.maybe_resume() is True and resumed.step == 1
    resumed.tracker.close()
    assert warnings(caplog) == [
        "checkpoint step_000002 is damaged (actor.model.safetensors: missing); resuming from "
        "step_000001"
    ]
    with pytest.raises(ConfigError, match="already holds a run"):
        Learner(learner_config(out, "trainer.resume=never"))

"""Checkpoints survive damage: a damaged newest checkpoint is named and the previous complete one
used, ``latest`` is not trusted, saves are fsync'd before each rename, ``trainer.resume=never``
does not mix two runs, and a rerun leaves each step once in metrics.jsonl (sync trainer and
async learner). Tensors that do not fit the model, a full disk, an interrupted save and
symbolic links are each one line, never a traceback or a partial checkpoint."""

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import read_metrics, tiny_learner_config, tiny_trainer_config
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import GenerationConfig, LlamaForCausalLM

from creditrl import cli
from creditrl.asynchronous.learner import Learner
from creditrl.config.loader import save_resolved_config
from creditrl.errors import ConfigError, DataError, UserError
from creditrl.models.embedded import copy_tokenizer_files, embedded_tokenizer_dir
from creditrl.models.tiny import tiny_config as tiny_architecture
from creditrl.tracking import truncate_jsonl
from creditrl.trainers import checkpoint as checkpoint_module
from creditrl.trainers.checkpoint import (
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointWriteError,
    prepare_output_dir,
)
from creditrl.trainers.rl_trainer import RLTrainer
from creditrl.workers.checkpoint_io import checkpoint_mismatch, load_trainable, save_trainable

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
        f"no usable checkpoint in {tmp_path} (step_000001: rng.safetensors: missing)"
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
    RLTrainer(tiny_trainer_config(out)).fit()
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
    trainer = RLTrainer(tiny_trainer_config(out))
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
        RLTrainer(tiny_trainer_config(out, "trainer.resume=never"))
    assert (out / "metrics.jsonl").read_text() == before
    RLTrainer(tiny_trainer_config(out, "trainer.resume=never", "trainer.overwrite=true",
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
    cfg = tiny_trainer_config(tmp_path, "trainer.save_freq=0")
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
    learner = Learner(tiny_learner_config(out))
    learner.tracker.log({"x": 1.0}, step=1)
    learner.close()  # frees the folder (the learner locks it)
    rerun = Learner(tiny_learner_config(out))
    assert rerun.maybe_resume() is False
    rerun.close()
    assert (out / "metrics.jsonl").read_text() == ""
    for step in (1, 2):
        rerun.step = step
        rerun.save_checkpoint()
    (out / "checkpoints" / "step_000002" / "actor.model.safetensors").unlink()
    resumed = Learner(tiny_learner_config(out))
    assert resumed.maybe_resume() is True and resumed.step == 1
    resumed.close()
    assert warnings(caplog) == [
        "checkpoint step_000002 is damaged (actor.model.safetensors: missing); resuming from "
        "step_000001"
    ]
    with pytest.raises(ConfigError, match="already holds a run"):
        Learner(tiny_learner_config(out, "trainer.resume=never"))


# ---- tensors that do not fit the model ---------------------------------------------------------


def linear(width: int, seed: int = 0) -> dict[str, tuple]:
    """A stand-in trainable "actor": nn.Linear(4, width) and an AdamW that took one step."""
    torch.manual_seed(seed)
    model = nn.Linear(4, width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    return {"actor": (model, optimizer, None)}


def writer(trainables: dict[str, tuple]):
    return lambda d: {name: save_trainable(Path(d), name, *t) for name, t in trainables.items()}


def reader(trainables: dict[str, tuple]):
    """What ``HybridWorker.load_checkpoint`` does: check every part, then load them all."""

    def read(directory: str, meta: dict) -> str | None:
        problem = checkpoint_mismatch(Path(directory), meta, trainables)
        if problem is None:
            for name, parts in trainables.items():
                load_trainable(Path(directory), name, meta[name], *parts)
        return problem

    return read


def rewrite(directory: Path, name: str, change) -> None:
    """Rewrite the tensors of ``name`` with ``change`` and recompute the manifest: a checkpoint
    whose sha256 list holds although its tensors changed."""
    save_file(change(load_file(str(directory / name))), str(directory / name))
    (directory / "manifest.json").unlink()
    checkpoint_module._seal(directory)
    assert checkpoint_module.checkpoint_damage(directory) is None


MODEL, OPTIM = "actor.model.safetensors", "actor.optim.safetensors"
MISFITS = {
    "reshaped": (
        MODEL,
        lambda t: {**t, "weight": torch.zeros(5, 4)},
        f"{MODEL}: 'weight' has shape [5, 4] in the checkpoint, [3, 4] in the model",
    ),
    "renamed": (
        MODEL,
        lambda t: {"w": t["weight"], "bias": t["bias"]},
        f"{MODEL}: 'weight' is missing (shape [3, 4] in the model)",
    ),
    "extra key": (
        MODEL,
        lambda t: {**t, "extra\n\x1b[2J": torch.zeros(1)},
        f"{MODEL}: 'extra\\n\\x1b[2J' (shape [1]) is not in the model",
    ),
    "optimizer state": (
        OPTIM,
        lambda t: {**t, "weight::exp_avg": torch.zeros(2, 4)},
        f"{OPTIM}: 'weight::exp_avg' has shape [2, 4] in the checkpoint, [3, 4] in the model",
    ),
}


@pytest.mark.parametrize("kind", sorted(MISFITS))
def test_tensors_that_do_not_fit_the_model_make_a_checkpoint_damaged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """A newest checkpoint whose manifest holds but whose tensors were rewritten (another
    shape, a renamed or extra key, optimizer state of another shape) is named as damaged in one
    line (the key escaped) and the previous one loaded whole (the old code's load_trainable
    raised torch's multi-line size-mismatch or KeyError traceback)."""
    ours = linear(3)
    manager = CheckpointManager(tmp_path, max_keep=5)
    manager.save(1, writer(ours), {"note": 1})
    first = ours["actor"][0].weight.detach().clone()
    with torch.no_grad():
        ours["actor"][0].weight.add_(1.0)
    manager.save(2, writer(ours), {"note": 2})
    name, change, reason = MISFITS[kind]
    rewrite(tmp_path / "step_000002", name, change)
    fresh = linear(3, seed=1)
    path, step, state = manager.restore(reader(fresh))
    assert (path.name, step, state) == ("step_000001", 1, {"note": 1})
    assert torch.equal(fresh["actor"][0].weight, first)
    assert warnings(caplog) == [
        f"checkpoint step_000002 is damaged ({reason}); resuming from step_000001"
    ]


def test_checkpoints_of_another_model_are_one_line_naming_both_shapes(tmp_path: Path) -> None:
    """Every checkpoint misfits the same way: it was written for another model. One line names
    the newest, the first differing tensor and both shapes; nothing is loaded. ``load`` (the
    async learner's) refuses the same way."""
    manager = CheckpointManager(tmp_path, max_keep=5)
    for step in (1, 2):
        manager.save(step, writer(linear(3)), {})
    ours = linear(2, seed=1)
    before = ours["actor"][0].weight.detach().clone()
    with pytest.raises(CheckpointMismatchError) as err:
        manager.restore(reader(ours))
    assert isinstance(err.value, UserError)
    assert str(err.value) == (
        f"checkpoint {tmp_path / 'step_000002'} was written for another model ({MODEL}: "
        "'weight' has shape [3, 4] in the checkpoint, [2, 4] in the model): resume with the "
        "model it was trained with, or start over with trainer.resume=never "
        "trainer.overwrite=true or another trainer.output_dir"
    )
    assert torch.equal(ours["actor"][0].weight, before)
    with pytest.raises(CheckpointMismatchError, match="step_000001 was written for another"):
        manager.load(tmp_path / "step_000001", reader(ours))


def test_no_checkpoint_fitting_the_model_is_one_line(tmp_path: Path) -> None:
    """Checkpoints that each fail differently (two misfits, one truncated) leave none to use:
    one DataError lists each, not the another-model error."""
    ours = linear(3)
    manager = CheckpointManager(tmp_path, max_keep=5)
    for step in (1, 2, 3):
        manager.save(step, writer(ours), {})
    for step, kind in ((3, "reshaped"), (2, "renamed")):
        name, change, _ = MISFITS[kind]
        rewrite(tmp_path / f"step_00000{step}", name, change)
    size = (tmp_path / "step_000001" / OPTIM).stat().st_size
    truncate(tmp_path / "step_000001" / OPTIM, 10)
    with pytest.raises(DataError) as err:
        manager.restore(reader(ours))
    assert not isinstance(err.value, CheckpointMismatchError)
    assert str(err.value) == (
        f"no usable checkpoint in {tmp_path} (step_000003: {MISFITS['reshaped'][2]}; "
        f"step_000002: {MISFITS['renamed'][2]}; step_000001: {OPTIM}: truncated to 10 of "
        f"{size} bytes): set trainer.resume=never trainer.overwrite=true to start over, or "
        "choose another trainer.output_dir"
    )


# ---- a full disk, an interrupted save ------------------------------------------------------


def no_space(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def parts_then(error: BaseException):
    def write(directory: str) -> dict:
        write_parts(directory)
        raise error

    return write


SAFETENSORS_ENOSPC = "Error while serializing: I/O error: No space left on device (os error 28)"
FULL_DISK = {  # where the disk fills: (write_parts, file whose write fails, the reason shown)
    "model files": (parts_then(OSError(errno.ENOSPC, "No space left on device")), None, None),
    "safetensors": (parts_then(SafetensorError(SAFETENSORS_ENOSPC)), None, SAFETENSORS_ENOSPC),
    "manifest": (write_parts, "manifest.json", None),
    "latest": (write_parts, ".latest.tmp", None),
}


@pytest.mark.parametrize("where", sorted(FULL_DISK))
def test_full_disk_during_a_save_is_one_line_and_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """ENOSPC anywhere in a save: a one-line CheckpointWriteError naming the directory and
    the newest complete checkpoint; no temporary files left; the previous checkpoint still
    loads (the old code raised the bare OSError and left the half-written directory)."""
    manager = saved(tmp_path, 1)
    parts, failing, reason = FULL_DISK[where]
    real = checkpoint_module._write_synced

    def write_synced(path: Path, text: str) -> None:
        (no_space if path.name == failing else real)(path, text)

    monkeypatch.setattr(checkpoint_module, "_write_synced", write_synced)
    with pytest.raises(CheckpointWriteError) as err:
        manager.save(2, parts, {"note": 2})
    newest = "step_000002" if where == "latest" else "step_000001"  # renamed in before latest
    assert str(err.value) == (
        f"could not write checkpoint step_000002 in {tmp_path} "
        f"({reason or '[Errno 28] No space left on device'}); its partial files were removed "
        f"and the newest complete checkpoint is {newest}: free space (or fix the directory), "
        "then rerun the same command to resume"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"latest", "step_000001", newest})
    assert (tmp_path / "latest").read_text() == "step_000001"
    assert manager.load(tmp_path / "step_000001", lambda d, m: None) == (1, {"note": 1})


def test_ctrl_c_during_a_save_leaves_no_partial_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An interrupted save removes its temporary directory and re-raises; a temporary
    directory left by a hard kill is never taken for a checkpoint and the next save removes
    it (the old code left the interrupted save's files behind)."""
    manager = saved(tmp_path, 1)
    shutil.copytree(tmp_path / "step_000001", tmp_path / ".step_000002.killed")
    with pytest.raises(KeyboardInterrupt):
        manager.save(2, parts_then(KeyboardInterrupt()), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".step_000002.killed",
        "latest",
        "step_000001",
    ]
    assert manager.latest() == tmp_path / "step_000001" and warnings(caplog) == []
    manager.save(2, write_parts, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001", "step_000002"]


# ---- symbolic links ---------------------------------------------------------------------------


def test_step_links_are_not_followed_and_the_next_save_replaces_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``step_*`` entries that are links to (complete) checkpoints elsewhere are ignored and
    named without their target; the next save writes a real directory in place of one and
    removes the other, leaving both targets untouched (the old code resumed from the link)."""
    elsewhere = tmp_path / "elsewhere-\x1b[2J"
    saved(elsewhere, 3, 9)
    root = tmp_path / "checkpoints"
    manager = saved(root, 1, 2)
    for step in (3, 9):
        (root / f"step_00000{step}").symlink_to(elsewhere / f"step_00000{step}")
    assert manager.latest() == root / "step_000002"
    assert warnings(caplog) == [
        f"{root / f'step_00000{step}'} is a symbolic link, not followed; the next save removes it"
        for step in (3, 9)
    ]
    manager.save(3, write_parts, {"note": "ours"})
    assert not (root / "step_000003").is_symlink() and not (root / "step_000009").exists()
    assert manager.load(root / "step_000003", lambda d, m: None) == (3, {"note": "ours"})
    assert checkpoint_module.checkpoint_damage(elsewhere / "step_000003") is None
    assert checkpoint_module.checkpoint_damage(elsewhere / "step_000009") is None


def test_latest_and_files_that_are_links_are_not_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``latest`` link is named without reading its target, a planted ``.latest.tmp`` link
    is not written through, and a checkpoint file that is a link (to an identical copy) makes
    its checkpoint damaged (the old code printed the target's text, wrote "step_000003" into
    the planted link's target and resumed from the linked file)."""
    secret = tmp_path / "secret.txt"
    secret.write_text("token-1234")
    root = tmp_path / "checkpoints"
    manager = saved(root, 1, 2)
    (root / "latest").unlink()
    (root / "latest").symlink_to(secret)
    model = root / "step_000002" / MODEL
    shutil.copy(model, tmp_path / "copy.safetensors")
    model.unlink()
    model.symlink_to(tmp_path / "copy.safetensors")
    assert manager.latest() == root / "step_000001"
    assert warnings(caplog) == [
        f"checkpoint step_000002 is damaged ({MODEL}: not a regular file (a symbolic link, not "
        "followed)); resuming from step_000001",
        f"{root / 'latest'} is a symbolic link, not followed; resuming from step_000001",
    ]
    (root / ".latest.tmp").symlink_to(secret)
    manager.save(3, write_parts, {})
    assert secret.read_text() == "token-1234"
    assert not (root / "latest").is_symlink() and (root / "latest").read_text() == "step_000003"


# ---- end to end: misfits, a full disk ---------------------------------------------------------


@pytest.fixture(scope="module")
def narrow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's architecture at half its width (hidden 32), same tokenizer."""
    out = tmp_path_factory.mktemp("narrow")
    config = tiny_architecture()
    config.hidden_size, config.intermediate_size = 32, 64
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(str(out))
    copy_tokenizer_files(embedded_tokenizer_dir(), out)
    return out


def error_lines(capsys: pytest.CaptureFixture) -> list[str]:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return [line for line in captured.out.splitlines() if line.startswith("error:")]


def test_cli_resuming_a_checkpoint_of_another_model_is_one_line(
    narrow_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`creditrl train` on a run directory whose checkpoint came from a narrower model: exit 2
    and one line naming the checkpoint, the first tensor and both shapes (the old code ended
    in torch's traceback listing every size mismatch)."""
    out = tmp_path / "run"
    RLTrainer(tiny_trainer_config(out, f"model.path={narrow_model}", "trainer.total_steps=1")).fit()
    config = tmp_path / "run.yaml"
    save_resolved_config(tiny_trainer_config(out), config)
    capsys.readouterr()
    assert cli.main(["train", str(config)]) == 2
    assert error_lines(capsys) == [
        f"error: checkpoint {out / 'checkpoints' / 'step_000001'} was written for another model "
        f"({MODEL}: 'model.embed_tokens.weight' has shape [49152, 32] in the checkpoint, "
        "[49152, 64] in the model): resume with the model it was trained with, or start over "
        "with trainer.resume=never trainer.overwrite=true or another trainer.output_dir"
    ]


def test_trainer_resumes_past_a_checkpoint_rewritten_with_other_shapes(
    two_steps: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The newest checkpoint's model file rewritten with another shape under a recomputed
    manifest: the trainer names it, resumes from step 1 and trains step 2 again."""
    out = tmp_path / "run"
    shutil.copytree(two_steps, out)
    rewrite(
        out / "checkpoints" / "step_000002",
        MODEL,
        lambda t: {**t, "model.norm.weight": torch.ones(32)},
    )
    trainer = RLTrainer(tiny_trainer_config(out))
    trainer.fit()
    assert trainer.step == 2
    assert warnings(caplog) == [
        f"checkpoint step_000002 is damaged ({MODEL}: 'model.norm.weight' has shape [32] in the "
        "checkpoint, [64] in the model); resuming from step_000001"
    ]
    assert sorted(read_metrics(out)) == [0, 1, 2]


def test_cli_full_disk_during_a_save_stops_the_run_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills while step 2's checkpoint is written: the run stops (exit 2) with one
    line naming the directory and the checkpoint it can resume from; step 1 is intact."""
    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    save_resolved_config(tiny_trainer_config(out), config)
    real = checkpoint_module.save_file

    def fills_at_step_two(tensors: dict, path: str, *args, **kwargs) -> None:
        if Path(path).parent.name.startswith(".step_000002."):
            no_space()
        real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "save_file", fills_at_step_two)
    capsys.readouterr()
    assert cli.main(["train", str(config)]) == 2
    root = out / "checkpoints"
    assert error_lines(capsys) == [
        f"error: could not write checkpoint step_000002 in {root} ([Errno 28] No space left on "
        "device); its partial files were removed and the newest complete checkpoint is "
        "step_000001: free space (or fix the directory), then rerun the same command to resume"
    ]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    assert CheckpointManager(root).latest() == root / "step_000001"


@pytest.mark.parametrize(
    "name,text,reason",
    [
        ("manifest.json", '{"files": ' + "[" * 100_000 + "]" * 100_000 + "}",
         "manifest.json: not a readable manifest"),
        ("state.json", '{"step": 2, "state": ' + "[" * 100_000 + "]" * 100_000 + "}",
         "state.json: not valid JSON"),
    ],
    ids=["manifest", "state"],
)  # fmt: skip
def test_deeply_nested_checkpoint_json_is_damage_not_a_recursion_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str, text: str, reason: str
) -> None:
    """manifest.json or state.json nested 100,000 deep (a RecursionError before): the newest
    checkpoint is named damaged in one line and the previous one used. state.json is resealed
    so that only its nesting is wrong."""
    ours = linear(3)
    manager = CheckpointManager(tmp_path, max_keep=5)
    manager.save(1, writer(ours), {"note": 1})
    manager.save(2, writer(ours), {"note": 2})
    newest = tmp_path / "step_000002"
    (newest / name).write_text(text)
    if name == "state.json":
        (newest / "manifest.json").unlink()
        checkpoint_module._seal(newest)
    path, step, _ = manager.restore(reader(linear(3, seed=1)))
    assert (path.name, step) == ("step_000001", 1)
    assert warnings(caplog) == [
        f"checkpoint step_000002 is damaged ({reason}); resuming from step_000001"
    ]

"""The learner's weight folder (``asynchronous.weight_dir``): nothing of the user's is deleted,
and one run at a time publishes into it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import tiny_learner_config

from creditrl.asynchronous.learner import Learner
from creditrl.errors import ConfigError
from creditrl.run_lock import RunInUseError
from creditrl.weights import WeightPublisher


def test_a_weight_folder_holding_the_users_dot_folders_is_refused_and_nothing_deleted(
    tmp_path: Path,
) -> None:
    """Before, building the publisher removed every ``.v*`` entry: with weight_dir=. or ~, the
    user's .venv, .vscode, .vim were deleted silently."""
    project = tmp_path / "project"
    for name in (".venv", ".vscode", ".virtualenvs"):
        (project / name).mkdir(parents=True)
    (project / ".vim").write_text("set nu\n")
    with pytest.raises(ConfigError, match=r"asynchronous\.weight_dir=.* holds '\.v") as err:
        WeightPublisher(project)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in project.iterdir()) == [".venv", ".vim", ".virtualenvs",
                                                         ".vscode"]  # fmt: skip
    own = tmp_path / "weights"
    publisher = WeightPublisher(own)
    publisher.publish(torch.nn.Linear(2, 2), 1)
    publisher.lock.release()
    (own / ".v00000002.ab_12cd3").mkdir()  # what a crash mid-publication leaves
    (own / ".latest.x1y2z3w4.tmp").write_text("{}")
    WeightPublisher(own).lock.release()
    assert sorted(p.name for p in own.iterdir()) == ["latest", "run.lock", "v00000001"]
    (own / "v00000001" / "notes.txt").write_text("")  # inside a version: pruned with it
    (own / "v00000009").write_text("not a folder")
    with pytest.raises(ConfigError, match="holds 'v00000009'"):
        WeightPublisher(own)


def test_two_runs_cannot_share_one_weight_folder(tmp_path: Path) -> None:
    """Before, two async runs with different output folders and one weight_dir both started,
    pruned each other's versions and loaded each other's weights."""
    shared = f"asynchronous.weight_dir={tmp_path / 'shared'}"
    first = Learner(tiny_learner_config(tmp_path / "a", shared))
    try:
        with pytest.raises(RunInUseError, match=r"asynchronous\.weight_dir=.*in use by another"):
            Learner(tiny_learner_config(tmp_path / "b", shared))
    finally:
        first.release_folder()
    Learner(tiny_learner_config(tmp_path / "b", shared)).release_folder()


def test_a_new_run_starts_the_weight_folders_versions_clean(tmp_path: Path) -> None:
    """Issue 50, item 3: two runs in sequence with one weight_dir. Before, the second continued
    the first's versions (it ended at v19 after the first's v12), and a sampler that started
    before its learner loaded the first run's last weights. Now the second run's learner
    removes them, says so in one line, and starts at v0; its sampler holds its own initial
    weights; a rerun in the second run's own output folder continues its versions."""
    import copy
    import io

    from rich.console import Console

    from creditrl.asynchronous.sampler import Sampler

    extra = (f"asynchronous.weight_dir={tmp_path / 'shared'}", "data.train_size=8")
    out = io.StringIO()
    console = Console(file=out, width=400)
    first = Learner(tiny_learner_config(tmp_path / "a", *extra), port=0, console=console)
    trained = copy.deepcopy(first.actor.model)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)
    first.publisher.publish(trained, 12)  # where the first run ended
    first.release_folder()

    second_cfg = tiny_learner_config(tmp_path / "b", *extra)
    sampler = Sampler(second_cfg, 0)  # before its learner starts: the folder holds v12
    second = Learner(second_cfg, port=0, console=console)
    try:
        initial = {k: v.clone() for k, v in second.actor.model.state_dict().items()}
        assert sampler.version == 0  # nothing is loaded before the learner answers
        second.begin(resumed=False)
        line, listening = out.getvalue().splitlines()  # one line, then where it listens
        assert "held weight versions up to v12 of another run; removed 1 of them" in line
        assert "start clean at v0" in line and listening.startswith("learner: listening on")
        assert second.version == 0 and second.publisher.newest() is None
        assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["run.lock"]
        assert not sampler.weights.refresh() and sampler.version == 0
        held = sampler.model.state_dict()
        assert all(torch.equal(held[k], v) for k, v in initial.items())
        assert not torch.equal(held["lm_head.weight"], trained.state_dict()["lm_head.weight"])
        second.publisher.publish(second.actor.model, 1)
    finally:
        sampler.close()
        second.socket.close()
        second.release_folder()
    rerun = Learner(second_cfg, port=0, console=Console(file=io.StringIO()))
    try:
        rerun.begin(resumed=False)  # the same output folder: its versions continue
        assert rerun.version == 2 and rerun.publisher.newest() == 2
    finally:
        rerun.socket.close()
        rerun.release_folder()

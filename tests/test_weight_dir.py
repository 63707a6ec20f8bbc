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

"""`explain` shows the distillation teacher's log-prob and the per-token distillation term."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import tiny_trainer_config

from creditrl.config import load_config
from creditrl.inspect.columns import COLUMNS
from creditrl.inspect.from_run import views_from_run
from creditrl.inspect.from_text import views_from_text
from creditrl.models.tiny import tiny_model_dir
from creditrl.trainers.rl_trainer import RLTrainer


def test_columns_are_catalogued() -> None:
    assert COLUMNS["teacher_log_prob"].header == "logp_T"
    assert COLUMNS["distill"].header == "d_t"


def test_run_dump_views_show_the_teacher_and_the_term(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = tiny_trainer_config(
        out, "trainer.total_steps=1", "trainer.test_freq=0", "trainer.val_before_train=false",
        "trainer.save_freq=0", f"distill.teacher={tiny_model_dir(seed=1)}", "distill.coef=0.5",
        "distill.teacher_prompt=ground_truth",
    )  # fmt: skip
    RLTrainer(cfg).fit()
    views = views_from_run(out)
    assert views
    for view in views:
        c = view.columns
        for k, mask in enumerate(c["mask"]):
            d = (c["teacher_log_prob"][k] - c["old_log_prob"][k]) * mask
            assert c["distill"][k] == pytest.approx(d, abs=1e-5)
            assert c["reward"][k] == pytest.approx(c["score"][k] + 0.5 * d, abs=1e-5)
        assert not any("stored rewards differ" in note for note in view.notes)
        assert view.settings["distill"] == "coef 0.5, add the task reward"


def test_text_views_compute_the_teacher() -> None:
    cfg = load_config(None, [f"model.path={tiny_model_dir()}", "distill.teacher=self"])
    (view,) = views_from_text("What is 2+3?", ["<answer>5</answer>"], cfg)
    # the student's own initial weights on the same prompt: the term is 0 on every token
    assert view.columns["distill"] == pytest.approx([0.0] * len(view.tokens), abs=1e-5)
    other = load_config(
        None,
        [f"model.path={tiny_model_dir()}", f"distill.teacher={tiny_model_dir(seed=1)}",
         "distill.teacher_prompt=ground_truth"],
    )  # fmt: skip
    (view,) = views_from_text("What is 2+3?", ["<answer>5</answer>"], other, ground_truth="5",
                              data_source="reasoning_gym/chain_sum")  # fmt: skip
    assert any(v != 0 for v in view.columns["distill"])
    assert "sees the prompt with the ground truth added" in " ".join(view.notes)

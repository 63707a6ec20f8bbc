"""``creditrl report``: every plot of a 3-step tiny run with no missing series, a run still
being written, missing series reported, and the SVG charts themselves."""

import html
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from creditrl.cli import main
from creditrl.models.tiny import tiny_model_dir
from creditrl.report.metrics_log import read_metrics
from creditrl.report.page import render_report, write_report
from creditrl.report.plots import PLOTS
from creditrl.report.svg import Series, line_chart, nice_ticks, tick_labels

STEPS = 3


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step PPO run (critic, KL in the reward) validating at every step, on one torch
    thread (two threads on this shared 2-core machine made it take 28 s instead of 13 s)."""
    out = tmp_path_factory.mktemp("report") / "run"
    threads = torch.get_num_threads()  # trainer.num_threads=1 below sets it process-wide
    code = main([
        "train", f"model.path={tiny_model_dir()}", "preset=ppo", f"trainer.total_steps={STEPS}",
        f"trainer.output_dir={out}", "trainer.test_freq=1", "trainer.logger=[jsonl]",
        "trainer.save_freq=0", "data.train_size=12", "data.val_size=2",
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
        "rollout.max_response_length=8", "reward.num_workers=1",
        "trainer.num_threads=1",
    ])  # fmt: skip
    torch.set_num_threads(threads)
    assert code == 0
    return out


def series_points(page: str, plot_id: str) -> dict[str, int]:
    """{series name: number of points} of one plot in a report page."""
    block = re.search(rf'data-plot="{plot_id}".*?</svg>', page, re.S)
    assert block, f"plot {plot_id} is not in the page"
    found = re.findall(r'class="series" data-series="([^"]*)" data-points="(\d+)"', block.group())
    return {html.unescape(name): int(n) for name, n in found}


def test_report_of_a_tiny_run_has_every_plot_and_no_missing_series(tiny_run: Path) -> None:
    files = write_report(tiny_run)
    page = files.html.read_text()
    assert files.html == tiny_run / "report" / "index.html"
    assert [p.spec.id for p in files.plots] == [spec.id for spec in PLOTS]
    assert 'data-missing=""' in page and not re.search(r'data-missing="[^"]', page)
    assert [n for n in files.notes if "missing" in n] == []
    for spec in PLOTS:
        points = series_points(page, spec.id)
        assert points, f"{spec.id} has no series"
        for name, n in points.items():
            expected = STEPS + 1 if name == "validation score" else STEPS
            assert n == expected, f"{spec.id}/{name}: {n} points, expected {expected}"
        labels = {s.label for s in spec.series if not s.key.endswith("/*")}
        optional_absent = {s.label for s in spec.series if not s.required} - set(points)
        assert labels - optional_absent <= set(points)
    # the PPO run logs every optional series but the KL loss (use_kl_loss is off)
    absent = [a for p in files.plots for a in p.absent]
    assert len(absent) == 1 and "actor/kl_loss" in absent[0]
    timing = series_points(page, "timing")
    assert {"gen", "old_log_prob", "ref", "values", "update_actor", "update_critic"} <= set(timing)
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//|<link|@import", page)
    if importlib.util.find_spec("matplotlib") is None:
        assert files.pngs == [] and "PNGs skipped" in " ".join(files.notes)
        return
    pngs = sorted(p.name for p in files.pngs)
    assert pngs == sorted(f"{spec.id}.png" for spec in PLOTS)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in files.pngs)


def test_report_of_a_run_still_being_written(tiny_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "running"
    run.mkdir()
    lines = (tiny_run / "metrics.jsonl").read_text().splitlines()
    text = "\n".join([lines[0], "not json", *lines[1:3]]) + "\n" + lines[3][:40]
    (run / "metrics.jsonl").write_text(text)
    log = read_metrics(run / "metrics.jsonl")
    assert log.partial_last_line and log.bad_lines == [2]
    assert [r["step"] for r in log.records] == [0, 1, 2]
    page, plots = render_report(run)
    assert "the last line is being written" in page and "unreadable lines left out: [2]" in page
    assert series_points(page, "entropy") == {"policy entropy": 2}
    assert all(not p.missing for p in plots)


def test_missing_series_are_reported(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = [{"step": s, "time": 1.0, "critic/score/mean": 0.5 * s} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(tmp_path), "--no-png"]) == 0
    out = capsys.readouterr().out
    assert "Entropy: missing actor/entropy" in out
    page = (tmp_path / "report" / "index.html").read_text()
    assert 'data-plot="entropy" data-missing="actor/entropy"' in page
    assert series_points(page, "reward") == {"train score (mean)": 2}


def test_report_of_a_missing_run_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().out


def test_line_chart_breaks_at_gaps_and_labels_ticks() -> None:
    svg = line_chart(
        [Series("a", [1, 2, 3, 4, 5], [1.0, 2.0, None, 4.0, float("nan")]), Series("b", [1], [0])],
        title="T",
        x_label="step",
        shade=[(2.5, 3.5)],
        marks=[(3.5, "turn 2")],
    )
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert 'data-series="a" data-points="3"' in svg and 'data-series="b" data-points="1"' in svg
    assert svg.count("<path") == 1  # a: 1-2 joined, 4 alone; b: one point
    assert svg.count("<circle") == 4 and 'class="shade"' in svg and "turn 2" in svg
    assert nice_ticks(0, 1) == [0.0, 0.5, 1.0]
    assert tick_labels(nice_ticks(10.7764, 10.7782)) == ["10.7765", "10.7770", "10.7775", "10.7780"]
    assert tick_labels([-1e-6, 0.0, 1e-6]) == ["-1.0e-06", "0", "1.0e-06"]


def test_report_keeps_the_last_record_of_a_resumed_step(tmp_path: Path) -> None:
    rows = [{"step": 1, "x": 1.0}, {"step": 2, "x": 2.0}, {"step": 2, "x": 3.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_metrics(tmp_path / "metrics.jsonl").series("x") == ([1, 2], [1.0, 3.0])
    shutil.rmtree(tmp_path)

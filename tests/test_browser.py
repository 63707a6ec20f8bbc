"""The explain page and the run report in headless Chromium: the token table and every plot
render, hovering a token shows its values, observation spans and turn marks are drawn, and the
pages work offline with no script error. Screenshots go to the test's tmp_path.

Needs Debian's ``chromium`` (/usr/bin/chromium) and the ``playwright`` package, both installed
by ``scripts/install_chromium.sh`` (the test set-up runs it); skipped, saying which is missing,
otherwise. Playwright drives the system Chromium (``executable_path``); no browser is
downloaded.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from creditrl.core import place_sequence_scores
from creditrl.inspect.compute import Settings, derive, rewards_from_scores, run_estimator, to_views
from creditrl.inspect.example import example_view
from creditrl.inspect.html import write_html
from creditrl.inspect.view import TokenView
from creditrl.report.page import write_report
from creditrl.report.plots import PLOTS

CHROMIUM = os.environ.get("CREDITRL_CHROMIUM", "/usr/bin/chromium")


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file() and shutil.which("chromium") is None:
        pytest.skip(f"no Chromium at {CHROMIUM}: run scripts/install_chromium.sh (apt chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed: run scripts/install_chromium.sh")
    executable = CHROMIUM if Path(CHROMIUM).is_file() else shutil.which("chromium")
    with sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        except Exception as e:
            pytest.skip(f"Chromium at {executable} does not start under playwright: {e}")
        yield b
        b.close()


def open_page(browser, path: Path, errors: list[str]):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("request", lambda r: errors.append(f"request {r.url}") if r.url[:4] == "http" else 0)
    page.goto(path.as_uri())
    return page


def multi_turn_view() -> TokenView:
    """A two-turn response with a tool observation (mask 0) between the turns, GAE on it."""
    s = Settings(adv_estimator="gae", gamma=1.0, lam=0.9)
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1]])
    t = {
        "mask": mask,
        "turn": torch.tensor([[1, 1, 1, 1, 1, 2, 2]]),
        "value": torch.tensor([[0.1, 0.2, 0.3, 0.0, 0.0, 0.5, 0.6]], dtype=torch.float64),
        "score": place_sequence_scores(torch.tensor([1.0], dtype=torch.float64), mask),
    }
    t["reward"], _ = rewards_from_scores(t, s)
    t["advantage"], t["return"] = run_estimator(t, s, ["u"])
    derive(t, s)
    tokens = ["call", " tool", "\n", "obs:", " 42", "answer", " 42"]
    return to_views(t, [7], [tokens], ["multi-turn"], settings=s.describe())[0]


def test_explain_page_renders_and_hover_shows_values(browser, tmp_path: Path) -> None:
    views = [example_view(), multi_turn_view()]
    path = write_html(views, tmp_path / "explain.html", color_by="advantage")
    errors: list[str] = []
    page = open_page(browser, path, errors)
    tables = page.locator("table.token-table")
    assert tables.count() == 2
    assert tables.nth(0).locator("tr").count() == 1 + 6
    assert tables.nth(1).locator("tr").count() == 1 + 7
    assert page.locator(".tok").count() == 13
    charts = page.locator(".qchart:not([hidden]) svg")
    assert charts.count() == 2
    for i in range(2):
        box = charts.nth(i).bounding_box()
        assert box and box["width"] > 300 and box["height"] > 100
        assert charts.nth(i).locator(".series circle").count() > 0
    # observation span and turn boundary are drawn, and shaded in the chart
    assert page.locator("#view-1 .obs-span .tok").count() == 2
    assert page.locator("#view-1 .turn-mark").all_inner_texts() == ["turn 1", "turn 2"]
    assert page.locator("#view-1 .qchart:not([hidden]) .shade").count() == 2
    # tokens are coloured on a diverging scale: positive red, negative blue
    first = page.locator("#view-0 .tok").nth(0).evaluate("e => getComputedStyle(e).background")
    last = page.locator("#view-0 .tok").nth(5).evaluate("e => getComputedStyle(e).background")
    assert "rgb(31, 119, 180)" in last and "rgb(" in first and first != last
    # hover the third token of the example: every value of it shows
    page.locator("#view-0 .tok").nth(2).hover()
    tip = page.locator("#tip")
    assert tip.is_visible()
    text = tip.inner_text()
    for expected in ["+0.005000", "+0.300000", "+0.596488", "+0.896488", "+0.055000", "A_raw"]:
        assert expected in text, expected
    assert page.locator("#view-0 tr.hl td[data-col='return']").inner_text() == "+0.896488"
    page.screenshot(path=str(tmp_path / "explain.png"), full_page=True)
    # switching the quantity recolours the tokens and swaps the chart
    page.select_option("#color-by", "reward")
    assert page.locator("#view-0 .qchart:not([hidden])").get_attribute("data-q") == "reward"
    assert page.inner_text("#scale-hi") == "+1.000000"  # max |r_t| over the page
    assert errors == []
    assert (tmp_path / "explain.png").stat().st_size > 10_000


def test_report_page_renders_every_plot(browser, tmp_path: Path) -> None:
    keys = [s.key for spec in PLOTS for s in spec.series if not s.key.endswith("/*")]
    keys += ["timing_s/gen", "timing_s/update_actor", "timing_s/step"]
    rows = [{"step": 0, "time": 1.0, "val/score": 0.1}]
    rows += [{"step": s, "time": 1.0 + s, **{k: 0.1 * s + i for i, k in enumerate(keys)}}
             for s in (1, 2, 3)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = write_report(tmp_path, png=False)
    errors: list[str] = []
    page = open_page(browser, files.html, errors)
    plots = page.locator(".plot")
    assert plots.count() == len(PLOTS)
    for i, spec in enumerate(PLOTS):
        plot = plots.nth(i)
        assert plot.get_attribute("data-plot") == spec.id
        assert plot.get_attribute("data-missing") == ""
        box = plot.locator("svg").bounding_box()
        assert box and box["width"] > 400 and box["height"] > 200
        series = plot.locator(".series")
        assert series.count() == (3 if spec.id == "timing" else len(spec.series))
        for k in range(series.count()):
            assert series.nth(k).locator("circle").count() >= 3
    page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
    assert errors == []
    assert (tmp_path / "report.png").stat().st_size > 10_000

"""Text is data on every view: model output, prompts, ground truths, data_source names and paths
holding rich markup, terminal escape sequences, HTML or a lone surrogate are shown literally
(control characters as visible escapes) by explain (table, TSV, HTML page), eval, report, the
trainer's run summary, the CLI's errors and check-tokenization; none of them fails on it."""

import io
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import tiny_learner_config, tiny_trainer_config
from rich.console import Console

from creditrl.asynchronous.messages import decode, encode
from creditrl.asynchronous.sampler import Sampler
from creditrl.asynchronous.tails import print_tail
from creditrl.cli import log_plainly, main, print_error
from creditrl.commands.check_tokenization import _describe
from creditrl.config.loader import save_resolved_config
from creditrl.models.tiny import tiny_model_dir
from creditrl.plain_text import as_html, plain
from creditrl.tracking import print_summary

HOSTILE = ["[/bold]", "[red]x[/red]", "\x1b]0;pwned\x07", "\x1b[2J", "<script>", "\ud800"]
# raw bytes a terminal would act on, or that cannot be written as UTF-8
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def on_disk(text: str) -> str:
    """``text`` as a file name: "/" stays (a subfolder), a lone surrogate becomes the one a
    file name holding the byte 0xff decodes to."""
    return text.replace("\ud800", "\udcff")


def flat(out: str) -> str:
    """Console output with line breaks, table borders and padding taken out."""
    return re.sub(r"[\s│┃║|]+", "", out)


def assert_shown(out: str, text: str) -> None:
    """``text`` is in ``out`` as plain text (controls escaped) and ``out`` holds no raw control
    character or surrogate."""
    assert RAW.search(out) is None, repr(RAW.search(out))
    assert flat(plain(text)) in flat(out)


def test_plain_escapes_controls_and_keeps_the_rest() -> None:
    assert plain("\x1b]0;pwned\x07") == "\\x1b]0;pwned\\x07"
    assert plain("\x1b[2J\r\x08\x9b") == "\\x1b[2J\\r\\x08\\x9b"
    assert plain("a\u202eb\ud800") == "a\\u202eb\\ud800"
    assert plain("[/bold] <script> é 中\n\t") == "[/bold] <script> é 中\n\t"
    assert plain("a\nb", keep="") == "a\\nb"
    assert as_html("<b>\x1b") == "&lt;b&gt;\\x1b"


# ---- explain ----------------------------------------------------------------------------------


def _dump_run(root: Path, text: str) -> Path:
    """A run folder named after ``text`` whose one dumped row has ``text`` as its prompt,
    data_source, ground truth and first token."""
    run = root / on_disk(f"run{text}")
    (run / "rollouts").mkdir(parents=True)
    row = {
        "step": 1, "row": 0, "uid": "u", "traj_id": 0, "data_source": text,
        "ground_truth": text, "prompt": text, "response": text, "response_length": 2,
        "score": 1.0, "reward_extra": {},
        "per_token": {
            "ids": [5, 6], "prompt_ids": [1], "tokens": [text, "x"],
            "response_mask": [1, 1], "token_level_scores": [0.0, 1.0],
            "token_level_rewards": [0.0, 1.0],
        },
    }  # fmt: skip
    (run / "rollouts" / "step_000001.jsonl").write_text(json.dumps(row) + "\n")
    return run


@pytest.mark.parametrize("text", HOSTILE)
def test_explain_of_a_run_dump_shows_its_text(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _dump_run(tmp_path, text)
    page = run / "page.html"
    assert main(["explain", str(run), "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert_shown(out, json.dumps(text, ensure_ascii=False))  # the prompt, quoted
    assert_shown(out, f"(score 1.0, {text})")  # data_source in the title
    assert_shown(out, str(run))  # the run folder in the settings
    html = page.read_text(encoding="utf-8")
    assert RAW.search(html) is None
    assert f"<h2>step 1, row 0 (score 1.0, {as_html(text)})</h2>" in html
    assert main(["explain", str(run), "--tsv"]) == 0
    tsv = capsys.readouterr().out
    assert_shown(tsv, json.dumps(text, ensure_ascii=False))  # the token


@pytest.mark.parametrize("text", HOSTILE)
def test_explain_errors_show_the_path(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    missing = tmp_path / on_disk(f"gone{text}")
    assert main(["explain", str(missing)]) == 2
    assert_shown(capsys.readouterr().out, str(missing))


def test_explain_prompt_text_is_shown_as_given(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    text = "".join(t for t in HOSTILE if t != "\ud800")
    page = tmp_path / "page.html"
    args = ["explain", "--prompt", text, "--response", text, "--ground-truth", text,
            "--raw-prompt", "--html", str(page), f"model.path={tiny_model_dir()}"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert_shown(out, json.dumps(text, ensure_ascii=False))
    assert_shown(out, repr(text))  # the ground truth in the scorer's note
    html = page.read_text(encoding="utf-8")
    assert RAW.search(html) is None
    assert f"<pre>{as_html(text)}</pre>" in html


def test_explain_prompt_that_is_not_text_is_one_line(capsys: pytest.CaptureFixture) -> None:
    """An argument that was not valid UTF-8 (a lone surrogate): one line naming the option,
    not a tokenizer traceback."""
    args = ["explain", "--prompt", "hi", "--response", "a\udcffb", "--score", "1"]
    assert main([*args, f"model.path={tiny_model_dir()}"]) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert_shown(out, "explain: --response holds \\udcff at character 1")


# ---- eval, report, run summary ----------------------------------------------------------------


def test_eval_prints_each_data_source(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + 1?", "ground_truth": str(i + 1),
                        "data_source": f"src{i}{text}"}) + "\n"
            for i, text in enumerate(HOSTILE)
        )
    )  # fmt: skip
    args = ["eval", f"model.path={tiny_model_dir()}", f"data.train_files={rows}",
            f"data.val_files={rows}", "rollout.max_response_length=4", "reward.num_workers=0",
            "reward.scorer=gsm8k", "actor.autocast=none"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    for i, text in enumerate(HOSTILE):
        assert_shown(out, f"val/src{i}{text}/score: 0.0000")


@pytest.mark.parametrize("text", HOSTILE)
def test_report_on_a_folder_with_any_name(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / on_disk(f"r{text}")
    run.mkdir(parents=True)
    records = [{"step": s, "critic/score/mean": 0.5, f"timing_s/{text}": 1.0} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["report", str(run), "--no-png"]) == 0
    assert_shown(capsys.readouterr().out, f"wrote {run / 'report' / 'index.html'}")
    html = (run / "report" / "index.html").read_text(encoding="utf-8")
    assert RAW.search(html) is None
    assert f"<h1>creditrl report: {as_html(run)}</h1>" in html
    assert f'data-series="{as_html(text)}"' in html


@pytest.mark.parametrize("text", HOSTILE)
def test_run_summary_shows_the_real_paths(text: str, tmp_path: Path) -> None:
    out = tmp_path / on_disk(f"exp{text}")
    console = Console(file=io.StringIO(), width=200)
    print_summary(console, {"steps": 1, "output_dir": str(out)})
    shown = console.file.getvalue()
    for name in ("metrics.jsonl", "rollouts/", "checkpoints/"):
        assert_shown(shown, f"{out / name}{'/' if name.endswith('/') else ''}  (not written)")


@pytest.mark.parametrize("name", ["exp[lr=0.1]", "exp[/x]"])
def test_a_finished_train_names_its_real_output_dir(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / name
    config = tmp_path / "config.yaml"
    save_resolved_config(
        tiny_trainer_config(out, "trainer.total_steps=1", "trainer.test_freq=0"), config
    )
    torch.manual_seed(0)
    assert main(["train", str(config)]) == 0
    shown = capsys.readouterr().out
    assert_shown(shown, f"metrics {out / 'metrics.jsonl'}")
    assert_shown(shown, f"checkpoints {out / 'checkpoints'}/")


# ---- CLI errors, check-tokenization -----------------------------------------------------------


@pytest.mark.parametrize("text", HOSTILE)
def test_cli_errors_show_the_text(text: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / on_disk(f"c{text}.yaml")
    assert main(["train", str(config)]) == 2
    assert_shown(capsys.readouterr().out, f"error: config file {config}")
    assert main(["config", f"k{text}=1"]) == 2
    assert_shown(capsys.readouterr().out, f"k{text}")


@pytest.mark.parametrize("text", HOSTILE)
def test_check_tokenization_shows_the_text(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    config = tmp_path / on_disk(f"c{text}.yaml")
    assert main(["check-tokenization", str(config)]) == 2
    assert_shown(capsys.readouterr().out, f"config error: config file {config}")
    console = Console(file=io.StringIO(), width=200)
    found = {"index": 3, "retokenize_tokens": [text, "a"], "sampled_tokens": ["b"]}
    console.print(_describe(found))
    assert_shown(console.file.getvalue(), f"mismatch at id 3: {[text, 'a']} vs ['b']")


@pytest.mark.parametrize("text", HOSTILE)
def test_cli_log_warnings_are_plain(
    text: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """With logging not configured (pytest configures it, so its handlers are set aside here),
    the CLI prints the warnings a run logs (a reward failure quoting a response) as plain
    text, as Python would print them otherwise."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    log_plainly()
    logging.getLogger("creditrl.rewards.manager").warning("first: sample %d: %s", 0, text)
    err = capsys.readouterr().err
    assert_shown(err, f"first: sample 0: {text}")
    assert err.endswith("\n") and err.count("\n") == 1


def test_user_text_is_neither_highlighted_nor_given_emoji() -> None:
    """On a colour terminal whose console highlights and replaces emoji codes (rich's
    defaults), an error's text comes out exactly as it was."""
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system="truecolor", width=200)
    text = "value 1.5 in /tmp/x.yaml :warning: True None 'q' http://a.b/c"
    print_error(console, ValueError(text))
    assert text in out.getvalue()


# ---- async: what the learner sends and a failed child's output --------------------------------


@pytest.fixture(scope="module")
def sampler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sampler]:
    out = tmp_path_factory.mktemp("sampler")
    cfg = tiny_learner_config(
        out, "data.train_size=8", "data.val_size=0", "reward.num_workers=0",
        "trainer.rollout_dump_rows=0",
    )  # fmt: skip
    made = Sampler(cfg, 0)
    yield made
    made.close()


@pytest.mark.parametrize("text", HOSTILE)
def test_a_learners_disconnect_reason_is_shown_as_text(
    text: str, sampler: Sampler, monkeypatch: pytest.MonkeyPatch
) -> None:
    console = Console(file=io.StringIO(), width=300)
    monkeypatch.setattr(sampler, "console", console)
    monkeypatch.setattr(sampler, "stopped", False)
    sampler._on_message(decode(encode("disconnected", {"reason": f"bad {text}"})))
    assert sampler.stopped
    assert_shown(console.file.getvalue(), f"the learner disconnected this sampler: bad {text};")


@pytest.mark.parametrize("text", HOSTILE)
def test_a_failed_childs_last_lines_are_shown_as_text(text: str) -> None:
    console = Console(file=io.StringIO(), width=300)
    print_tail(console, f"learner-{text}", [f"line {text}"])
    assert_shown(console.file.getvalue(), f"last 1 line(s) of learner-{text}:")
    assert_shown(console.file.getvalue(), f"| line {text}")


def test_a_long_explain_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """rich wraps at the console's width (160 columns when not a terminal) unless told not to."""
    missing = tmp_path / ("d" * 200) / ("e" * 200)
    assert main(["explain", str(missing)]) == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1 and str(missing) in lines[0]


@pytest.mark.parametrize("command", ["explain", "report", "eval"])
def test_a_path_the_system_refuses_is_one_line(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A name longer than the file system allows was an OSError traceback in every command."""
    too_long = tmp_path / ("d" * 300)
    assert main([command, str(too_long)]) == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1 and "File name too long" in lines[0] and str(too_long) in lines[0]

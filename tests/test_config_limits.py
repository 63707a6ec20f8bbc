"""Config sizes bounded before parsing (creditrl.config.limits): deep YAML, deep or long
overrides, alias bombs and huge files are one error line and exit 2; printing a config runs no
highlighter over user strings."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import refused
from rich.highlighter import ReprHighlighter

from creditrl.cli import main
from creditrl.config.limits import MAX_CONFIG_BYTES, MAX_DEPTH, MAX_NODES

DEEP_FLOW = "[" * 20_000 + "]" * 20_000  # a RecursionError in PyYAML's composer before


def _block(depth: int) -> str:
    """``reward.scorer_kwargs`` holding mappings nested ``depth`` deep, block style."""
    lines = ["reward:", "  scorer_kwargs:"]
    lines += [" " * (4 + 2 * i) + f"k{i}:" for i in range(depth)]
    return "\n".join(lines) + " 1\n"


LAUGHS = "a: &a [1,1,1,1,1,1,1,1,1,1]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 10)}]\n" for a, b in zip("abcd", "bcde", strict=True)
)


@pytest.mark.parametrize(
    "text,message",
    [
        (
            f"reward:\n  scorer_kwargs:\n    a: {DEEP_FLOW}\n",
            f"nested deeper than the limit of {MAX_DEPTH}",
        ),
        (_block(MAX_DEPTH + 5), f"nested deeper than the limit of {MAX_DEPTH}"),
        (LAUGHS, f"more than {MAX_NODES} values (aliases counted as what they name)"),
        ("a: '" + "x" * MAX_CONFIG_BYTES + "'\n", f"above the limit of {MAX_CONFIG_BYTES}"),
    ],
    ids=["deep-flow", "deep-block", "alias-bomb", "huge-file"],
)
def test_oversized_yaml_files_are_one_line(tmp_path: Path, capsys, text: str, message: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    line = refused(capsys, str(path))
    assert line.startswith(f"error: {path}") and message in line


def test_a_deep_value_within_the_limit_loads(tmp_path: Path, capsys) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(_block(MAX_DEPTH - 3))
    assert main(["config", str(path)]) == 0
    assert "k28: 1" in capsys.readouterr().out


@pytest.mark.parametrize(
    "override,message",
    [
        (
            f"reward.scorer_kwargs={{a: {DEEP_FLOW}}}",
            f"nested deeper than the limit of {MAX_DEPTH}",
        ),
        ("reward.scorer_kwargs={a: " + "[" * 40 + "]" * 40 + "}", "nested deeper than the limit"),
        (".".join(["a"] * 5000) + "=1", "its key has more than 16 parts"),
        ("reward.scorer_kwargs={a: '" + "x" * 100_000 + "'}", "longer than the limit of 65536"),
    ],
    ids=["deep-flow", "deep", "deep-key", "long"],
)
def test_oversized_overrides_are_one_short_line(capsys, override: str, message: str) -> None:
    """The error names the override by its first 80 characters and its length, never whole."""
    line = refused(capsys, override)
    assert message in line and len(line) < 400 and f"({len(override)} characters)" in line


def test_a_long_wrong_value_is_named_short(capsys) -> None:
    line = refused(capsys, "actor.optim.lr=" + "x" * 5000)
    assert "is not a float" in line and len(line) < 400


def test_printing_a_config_runs_no_highlighter(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """`creditrl config` with a long user string prints it as it is: rich's highlighter (regular
    expressions over the whole text) is never run, for the config or for an error line."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("the highlighter ran over user text")

    monkeypatch.setattr(ReprHighlighter, "highlight", refuse)
    value = "(1, 2) [x] " * 2000
    assert main(["config", f"reward.scorer_kwargs={{note: '{value}'}}"]) == 0
    assert capsys.readouterr().out.count("[x]") == 2000  # printed whole, unstyled
    refused(capsys, "actor.optim.lr=" + "x" * 5000)

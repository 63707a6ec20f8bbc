"""The config documents itself: field docs, ``creditrl config --doc``, docs/config.md."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from creditrl.cli import main
from creditrl.config.doc import field_docs, render_markdown, section_docs
from creditrl.config.schema import ActorConfig, Config
from creditrl.core import ADV_ESTIMATORS, POLICY_LOSSES

ROOT = Path(__file__).resolve().parent.parent
KEY_LINE = re.compile(r"^  (\S+): ")


def _config_classes(cls: type = Config) -> list[type]:
    """``cls`` and every section dataclass below it."""
    out = [cls]
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        if dataclasses.is_dataclass(value):
            out += _config_classes(type(value))
    return out


def test_committed_markdown_is_current() -> None:
    """docs/config.md is exactly what `creditrl config --doc --markdown` prints (run in a fresh
    process, so only the built-in registrations count)."""
    generated = subprocess.run(
        [sys.executable, "-m", "creditrl.cli", "config", "--doc", "--markdown"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    committed = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert committed == generated, (
        "docs/config.md is stale: run creditrl config --doc --markdown > docs/config.md"
    )


def test_every_field_has_a_one_line_doc() -> None:
    """Every setting of every section has a non-empty one-line attribute docstring, every
    section a docstring, and each doc belongs to its own field (not its neighbour's)."""
    missing, multiline = [], []
    for cls in _config_classes():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            value = getattr(cls(), f.name)
            if dataclasses.is_dataclass(value):
                continue
            doc = docs.get(f.name, "").strip()
            if not doc:
                missing.append(f"{cls.__name__}.{f.name}")
            elif "\n" in doc:
                multiline.append(f"{cls.__name__}.{f.name}")
    assert missing == [] and multiline == []
    assert all(section.doc.strip() for section in section_docs())
    assert "dual clip" in field_docs(ActorConfig)["clip_ratio_c"]
    assert "null: clip_ratio" in field_docs(ActorConfig)["clip_ratio_low"]


def test_defaults_come_from_the_config_instance() -> None:
    """actor.optim and critic.optim share OptimConfig but show their own lr defaults."""
    keys = {key.key: key for section in section_docs() for key in section.keys}
    assert keys["actor.optim.lr"].default == 5e-6
    assert keys["critic.optim.lr"].default == 1e-5
    assert keys["actor.optim.lr"].allowed == ">= 0"
    assert keys["trainer.logger"].allowed.startswith("each one of console, jsonl")


def test_doc_actor_prints_actor_keys_only(capsys) -> None:
    """`creditrl config --doc actor` exits 0 and lists actor's keys (actor.optim included),
    each with its type, default, doc and allowed values, and no other section's."""
    assert main(["config", "--doc", "actor"]) == 0
    out = capsys.readouterr().out
    keys = [m.group(1) for line in out.splitlines() if (m := KEY_LINE.match(line))]
    assert keys and all(key.startswith("actor.") for key in keys)
    assert {"actor.clip_ratio_c", "actor.ppo_mini_batch_size", "actor.optim.lr"} <= set(keys)
    assert "  actor.ppo_mini_batch_size: int = 4\n      Prompts per optimizer step" in out
    assert "  actor.grad_clip: float | None = 1\n" in out
    assert "allowed: > 0 (or null: no clipping" in out
    assert "critic." not in out


def test_doc_one_key(capsys) -> None:
    """`--doc KEY` prints that key alone."""
    assert main(["config", "--doc", "algorithm.rollout_is.mode"]) == 0
    out = capsys.readouterr().out
    keys = [m.group(1) for line in out.splitlines() if (m := KEY_LINE.match(line))]
    assert keys == ["algorithm.rollout_is.mode"]
    assert "allowed: one of truncate, mask" in out


def test_unknown_section_is_one_line_exit_2(capsys) -> None:
    """An unknown section exits 2 with one line naming it, the sections and the nearest."""
    assert main(["config", "--doc", "actr"]) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    assert "unknown config section 'actr'" in lines[0]
    assert "algorithm.rollout_is" in lines[0] and "did you mean 'actor'?" in lines[0]


def test_doc_loads_overrides_but_documents_the_defaults(capsys) -> None:
    """--doc with overrides loads them (for their trainer.extensions: a bad value is a one-line
    error) and still prints the defaults."""
    assert main(["config", "rollout.n=0", "--doc", "rollout.n"]) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "rollout.n=0" in lines[0]
    assert main(["config", "rollout.n=3", "--doc", "rollout.n"]) == 0
    assert "rollout.n: int = 4" in capsys.readouterr().out


def test_registered_choices_appear(capsys) -> None:
    """Choice keys list what the registries hold: every policy loss and estimator name."""
    assert main(["config", "--doc", "actor.policy_loss"]) == 0
    out = capsys.readouterr().out
    assert "gspo" in POLICY_LOSSES.names()
    assert all(name in out for name in POLICY_LOSSES.names())
    markdown = render_markdown("algorithm")
    row = next(line for line in markdown.splitlines() if "`algorithm.adv_estimator`" in line)
    assert all(name in row for name in ADV_ESTIMATORS.names())
    assert "or user code as path/to/file.py:name" in row


def test_markdown_tables_are_well_formed() -> None:
    """Every table row has five cells: pipes inside cells (`float | None`) are escaped."""
    rows = [line for line in render_markdown().splitlines() if line.startswith("|")]
    assert any(r"`float \| None`" in row for row in rows)
    for row in rows:
        cells = re.split(r"(?<!\\)\|", row)[1:-1]
        assert len(cells) == 5, row

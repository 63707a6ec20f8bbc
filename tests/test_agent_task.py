"""One answer to "are this config's prompts an agent task's?" (``creditrl.config.agent_task.
is_agent_task``): the datasets a run builds, its preflight (data sources, tool checks), its
distillation check and check-tokenization read it, and no module tests the agent-task
registry on its own."""

from __future__ import annotations

from pathlib import Path

import pytest

import creditrl
from creditrl.agents.registries import AGENT_TASKS, register_agent_task
from creditrl.config.agent_task import agent_task_names, is_agent_task
from creditrl.config.loader import load_config
from creditrl.config.schema import DataConfig
from creditrl.data import PromptRow
from creditrl.errors import ConfigError
from creditrl.models.tiny import tiny_model_dir


@register_agent_task("test_one_row_agent_task")
def _one_row(cfg, tools) -> tuple[list[PromptRow], list[PromptRow]]:
    row = PromptRow(
        messages=[{"role": "user", "content": "What is 1 + 1?"}],
        ground_truth="2",
        data_source="test_one_row_agent_task",
    )
    return [row], []


@pytest.mark.parametrize(
    ("task", "train_files", "expected"),
    [
        ("calc_multiturn", [], True),
        ("kgqa", [], True),
        ("test_one_row_agent_task", [], True),  # registered by user code: counts the same
        ("calc_multiturn", ["rows.jsonl"], False),  # data.train_files replace data.task
        ("chain_sum", [], False),  # a reasoning-gym task
        (None, ["rows.jsonl"], False),
        ("", [], False),
    ],
)
def test_is_agent_task(task: str | None, train_files: list[str], expected: bool) -> None:
    assert is_agent_task(DataConfig(task=task, train_files=train_files)) is expected


def test_the_names_are_the_registrys() -> None:
    """The config layer names the registry by kind and reads the same entries."""
    assert set(agent_task_names()) == set(AGENT_TASKS.names())
    assert {"calc_multiturn", "kgqa", "test_one_row_agent_task"} <= set(agent_task_names())


def test_no_other_module_reads_the_agent_task_registry_for_the_decision() -> None:
    """Only the registry's own modules (which build the tasks) name ``AGENT_TASKS``; every
    other module asks ``is_agent_task``."""
    root = Path(creditrl.__file__).parent
    allowed = {root / "agents" / "registries.py", root / "agents" / "tasks.py"}
    offenders = [
        str(path.relative_to(root.parent))
        for path in sorted(root.rglob("*.py"))
        if path not in allowed and "AGENT_TASKS" in path.read_text()
    ]
    assert offenders == []


def test_the_run_and_its_preflight_agree(tokenizer) -> None:
    """The datasets a run builds, the data sources its preflight checks and its tool checks
    follow ``is_agent_task``: an agent task's rows (and tools, even with agent.enable=false)
    unless data.train_files replace it."""
    from creditrl.pipeline.step import build_run_datasets
    from creditrl.preflight import _uses_tools, data_sources

    base = [f"model.path={tiny_model_dir()}", "data.train_size=4", "data.val_size=1"]
    cfg = load_config(overrides=[*base, "data.task=test_one_row_agent_task"])
    train, val = build_run_datasets(cfg, tokenizer)
    assert len(train) == 1 and val is None
    assert train[0]["data_source"] == "test_one_row_agent_task"
    assert list(data_sources(cfg.data)) == ["test_one_row_agent_task"]
    assert _uses_tools(cfg)
    plain = load_config(overrides=[*base, "data.task=chain_sum"])
    assert not _uses_tools(plain)
    assert list(data_sources(plain.data)) == ["reasoning_gym/chain_sum"]
    assert build_run_datasets(plain, tokenizer)[0][0]["data_source"] == "reasoning_gym/chain_sum"


def test_distillation_sees_an_agent_task(tmp_path: Path) -> None:
    """distill.teacher_prompt other than 'same' is refused for an agent task (it builds its own
    prompts), through the same decision."""
    args = [
        f"model.path={tiny_model_dir()}", f"distill.teacher={tiny_model_dir()}",
        "distill.teacher_prompt=ground_truth",
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="test_one_row_agent_task"):
        load_config(overrides=[*args, "data.task=test_one_row_agent_task"])

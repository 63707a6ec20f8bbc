"""TRL's config names are answered with creditrl's key (creditrl/config/trl_names.py), or with
what differs where creditrl has no exact equivalent; docs/naming.md agrees with that map."""

import re
from pathlib import Path

import pytest
from helpers import refused

from creditrl.config.loader import ConfigError, all_keys, load_config
from creditrl.config.trl_names import TRL_NAMES, trl_names_markdown

NAMING = Path(__file__).resolve().parents[1] / "docs" / "naming.md"
# the sections of docs/naming.md whose tables hold config names (the others: tensors, metrics)
CONFIG_SECTIONS = ("Batch sizes", "KL:", "Clipping", "Advantages")

EXACT = [
    ("learning_rate", "actor.optim.lr"),
    ("max_completion_length", "rollout.max_response_length"),
    ("max_prompt_length", "data.max_prompt_length"),
    ("num_generations", "rollout.n"),
    ("num_iterations", "actor.ppo_epochs"),
    ("beta", "actor.kl_loss_coef"),
    ("epsilon", "actor.clip_ratio"),
    ("epsilon_high", "actor.clip_ratio_high"),
    ("temperature", "rollout.temperature"),
    ("top_p", "rollout.top_p"),
    ("max_steps", "trainer.total_steps"),
    ("seed", "trainer.seed"),
    ("output_dir", "trainer.output_dir"),
    ("save_steps", "trainer.save_freq"),
    ("max_grad_norm", "actor.grad_clip"),
]
NEAREST = [
    ("per_device_train_batch_size", "actor.ppo_micro_batch_size", "completions per device"),
    ("gradient_accumulation_steps", "actor.ppo_mini_batch_size", "accumulates"),
    ("num_train_epochs", "trainer.total_steps", "not passes over the data"),
    ("loss_type", "actor.loss_agg_mode", "dr_grpo is seq-mean-token-sum-norm"),
    ("scale_rewards", "algorithm.norm_adv_by_std_in_grpo", '"batch"'),
]
# what the nearest-spelling guess said before the map (each pointed at another knob)
MISLEADING = [
    ("learning_rate", "reward.max_failure_rate"),
    ("beta", "data"),
    ("gradient_accumulation_steps", "trainer.total_steps"),
    ("num_train_epochs", "critic.ppo_epochs"),
    ("loss_type", "actor.kl_loss_type"),
    ("per_device_train_batch_size", "data.train_batch_size"),
    ("logging_steps", "trainer.total_steps"),
    ("scale_rewards", "reward"),
    ("max_completion_length", "data.max_prompt_length"),
]


@pytest.mark.parametrize("name,ours", EXACT)
def test_trl_names_point_to_creditrl_keys(capsys, name: str, ours: str) -> None:
    line = refused(capsys, f"{name}=1")
    assert line.startswith(f"error: unknown key '{name}' (TRL's name, from override '{name}=1'); ")
    assert f"creditrl calls it '{ours}'" in line and "did you mean" not in line


@pytest.mark.parametrize("name,ours,why", NEAREST)
def test_trl_names_without_an_equivalent_say_so(capsys, name: str, ours: str, why: str) -> None:
    line = refused(capsys, f"{name}=1")
    assert f"creditrl's nearest is '{ours}', not the same knob: " in line and why in line
    assert "calls it" not in line and "did you mean" not in line


def test_trl_names_creditrl_lacks_are_named_as_such(capsys) -> None:
    line = refused(capsys, "logging_steps=10")
    assert line.endswith(
        "(TRL's name, from override 'logging_steps=10'); creditrl has no such setting: "
        "creditrl logs every step's metrics to metrics.jsonl"
    )


@pytest.mark.parametrize("name,old", MISLEADING)
def test_the_misleading_guesses_are_gone(capsys, name: str, old: str) -> None:
    assert f"'{old}'" not in refused(capsys, f"{name}=1")


def test_a_trl_name_in_a_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "trl.yaml"
    path.write_text("learning_rate: 1.0e-6\nnum_generations: 8\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"unknown key 'learning_rate' (TRL's name, from {path}); creditrl calls it 'actor.optim.lr'"
    )


def test_trl_map_names_only_keys_that_exist() -> None:
    """Every key the map or its notes name is a schema key (or a section of them), and no
    TRL name is itself a creditrl key."""
    keys = set(all_keys())
    assert not [name for name in TRL_NAMES if name in keys]
    named = {e.key for e in TRL_NAMES.values() if e.key}
    for entry in TRL_NAMES.values():
        named |= set(re.findall(r"\b[a-z_]+(?:\.[a-z_]+)+\b", entry.note))
    named = {k.removesuffix(".*") for k in named if k != "metrics.jsonl"}
    assert sorted(named - keys) == []


def _config_rows() -> list[tuple[str, str]]:
    """(creditrl cell, TRL cell) of each row of the config tables of docs/naming.md."""
    rows = []
    for section in NAMING.read_text().split("\n## ")[1:]:
        if not section.startswith(CONFIG_SECTIONS):
            continue
        header: list[str] = []
        for line in section.splitlines():
            if not line.startswith("|"):
                header = []
                continue
            cells = [c.strip() for c in line.strip("|").split("|")]
            if not header:
                header = cells
            elif not set(line) <= set("|-"):
                columns = dict(zip(header, cells, strict=False))
                trl = next((v for k, v in columns.items() if k.startswith("TRL")), "")
                rows.append((columns.get("creditrl", ""), trl))
    return rows


def test_naming_doc_tables_agree_with_the_map() -> None:
    """A TRL name in a config table of docs/naming.md sits in a row whose creditrl column
    holds the map's key (or its section as ``section.*``)."""
    rows = _config_rows()
    assert len(rows) > 20
    disagree = []
    for name, entry in TRL_NAMES.items():
        cells = [ours for ours, trl in rows if re.search(rf"`{name}\b", trl)]
        if not cells or entry.key is None:
            continue
        sections = {entry.key.rsplit(".", i)[0] + ".*" for i in range(1, entry.key.count(".") + 1)}
        if not any(entry.key in c or any(s in c for s in sections) for c in cells):
            disagree.append((name, entry.key, cells))
    assert disagree == []


def test_naming_doc_lists_every_trl_name() -> None:
    """docs/naming.md holds the table made from the map; regenerate it with
    python -c 'from creditrl.config.trl_names import trl_names_markdown as m; print(m())'"""
    assert trl_names_markdown() in NAMING.read_text()

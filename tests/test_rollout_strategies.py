"""Rollout strategies, registered: single-turn sampling, the built-in agent loop and the agent
program are entries of one registry; ``agent.enable``/``agent.program`` resolve to one in one
place (``creditrl.rollout.strategies.rollout_strategy``)."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
from helpers import restore_registries, tiny_engine_config

import creditrl
from creditrl.batch import Batch
from creditrl.config import load_config, load_config_with_sources
from creditrl.errors import ConfigError
from creditrl.rewards import SCORERS
from creditrl.rollout import register_rollout_strategy
from creditrl.rollout.strategies import (
    ROLLOUT_STRATEGIES,
    StrategyTraits,
    rollout_strategy,
    strategy_traits,
)
from creditrl.trainers.rl_trainer import RLTrainer

ROOT = Path(creditrl.__file__).parent
PROGRAM = f"{Path(__file__).parent / 'programs' / 'agents.py'}:two_turns"
# the one resolver, and the files that read agent.program's value (not to choose what runs):
# the program entry loads it, and a run's config lists it as code the run names
READERS = {"rollout/strategies.py", "agents/program.py", "config/run_config.py"}


def test_the_registry_lists_the_strategies_and_what_each_declares() -> None:
    built_in = ["openenv", "verifiers", "agent_program", "agent_loop", "single_turn"]
    assert list(ROLLOUT_STRATEGIES)[:5] == built_in  # in the order chosen (then tests' ones)
    traits = {name: ROLLOUT_STRATEGIES.info(name)["traits"] for name in built_in}
    program = {"multi_turn": True, "runs_program": True}

    def hub(name: str) -> dict[str, str]:
        module = f"creditrl.environments.{name}"
        return {
            "selected_by": f"env.{name}",
            "datasets": f"{module}:environment_datasets",
            "preflight": f"{module}:check_environment",
        }

    assert traits == {
        "openenv": StrategyTraits(**program, **hub("openenv")),
        "verifiers": StrategyTraits(**program, **hub("verifiers")),
        "agent_program": StrategyTraits(**program, selected_by="agent.program"),
        "agent_loop": StrategyTraits(multi_turn=True, uses_tools=True, selected_by="agent.enable"),
        "single_turn": StrategyTraits(),
    }
    assert traits["agent_program"].needed() == ("agent.program",)
    assert traits["agent_loop"].needed() == ()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], "single_turn"),
        (["agent.enable=false"], "single_turn"),
        (["agent.enable=true"], "agent_loop"),
        (["agent.enable=true", f"agent.program={PROGRAM}"], "agent_program"),
        ([f"agent.program={PROGRAM}"], "agent_program"),
        (["agent.enable=false", f"agent.program={PROGRAM}"], "agent_program"),
    ],
)
def test_the_keys_resolve_to_one_strategy(overrides: list[str], expected: str) -> None:
    cfg = load_config(overrides=overrides)
    assert rollout_strategy(cfg) == expected
    assert strategy_traits(cfg) == ROLLOUT_STRATEGIES.info(expected)["traits"]


def test_agent_only_keys_are_reported_unused_by_the_strategy_selected() -> None:
    program, loop = "agent.episode_timeout_s=9", "agent.max_turns=2"
    single = load_config_with_sources(overrides=[loop, program]).warnings
    assert single == [f"{program}, {loop} are set but agent.enable=false"]
    alone = load_config_with_sources(overrides=[f"agent.program={PROGRAM}", loop, program])
    assert alone.warnings == [
        f"{loop} is set but agent.program runs its own loop and tools (these are the built-in "
        "loop's)"
    ]
    built_in = load_config_with_sources(overrides=["agent.enable=true", loop, program])
    assert built_in.warnings == [
        f"{program} is set but agent.program is not set (these are its settings)"
    ]


def test_agent_program_alone_trains_a_step(tmp_path: Path) -> None:
    """``agent.program`` without ``agent.enable`` (refused before) runs the program."""
    cfg = tiny_engine_config(
        tmp_path, f"agent.program={PROGRAM}", "rollout.max_response_length=24",
        "reward.num_workers=0",
    )  # fmt: skip
    assert not cfg.agent.enable
    RLTrainer(cfg).fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) > 0]
    assert [r["step"] for r in steps] == [1]
    assert steps[0]["agent/episodes_ok"] == 4 and steps[0]["critic/score/mean"] == 1.0


class Recorded:
    """A user's strategy: the engine samples, and every prompt batch is recorded."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.calls = engine, []

    @property
    def last_stats(self) -> Any:
        return self.engine.last_stats

    def generate(self, prompts: Batch, **kwargs: Any) -> Batch:
        self.calls.append(len(prompts))
        return self.engine.generate(prompts, **kwargs)


@register_rollout_strategy("test_recorded")
def recorded(engine: Any, tokenizer: Any, cfg: Any) -> Recorded:
    return Recorded(engine)


def test_a_registered_strategy_is_chosen_by_rollout_strategy(tmp_path: Path) -> None:
    """register_rollout_strategy (exported by creditrl.rollout) adds an entry with its traits
    (default: single-turn); rollout.strategy chooses it and a step generates through it; an
    unregistered name is one ConfigError naming the choices."""
    assert ROLLOUT_STRATEGIES.info("test_recorded")["traits"] == StrategyTraits()
    cfg = tiny_engine_config(tmp_path, "rollout.strategy=test_recorded", "trainer.test_freq=0")
    assert rollout_strategy(cfg) == "test_recorded"
    trainer = RLTrainer(cfg)
    try:
        trainer.step = 1
        metrics = trainer.train_step()
        assert trainer.workers.worker.rollout.calls == [4]  # 2 prompts x rollout.n=2
        assert "critic/score/mean" in metrics
    finally:
        trainer.close()
    with pytest.raises(ConfigError, match=r"rollout.strategy='nope' is not a registered .*"
                                          r"agent_loop, agent_program, .*single_turn"):  # fmt: skip
        load_config(overrides=["rollout.strategy=nope"])


@pytest.mark.parametrize(
    ("strategy", "key"), [("agent_program", "agent.program"), ("verifiers", "env.verifiers")]
)
def test_a_strategy_without_the_key_it_runs_is_one_line_at_config_load(
    strategy: str, key: str
) -> None:
    """rollout.strategy=agent_program without agent.program (verifiers without env.verifiers)
    was a ValueError traceback when the rollout was built; the strategy's entry declares the
    keys it needs and the config is refused at load, in one line naming both."""
    with pytest.raises(ConfigError) as raised:
        load_config(overrides=[f"rollout.strategy={strategy}"])
    message = str(raised.value)
    assert "\n" not in message and f"rollout.strategy={strategy}" in message
    assert f"needs {key}" in message


def _agent_key_reads(tree: ast.AST) -> list[int]:
    """Lines reading ``<x>.agent.enable``/``.program``, or those of a name bound to
    ``<x>.agent`` or called ``agent_cfg``."""
    aliases = {"agent_cfg"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.value, "attr", None) == "agent":
            aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("enable", "program"):
            base = node.value
            if (isinstance(base, ast.Attribute) and base.attr == "agent") or (
                isinstance(base, ast.Name) and base.id in aliases
            ):
                found.append(node.lineno)
    return sorted(found)


def test_only_the_resolver_reads_agent_enable_and_agent_program() -> None:
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name not in READERS:
            lines = _agent_key_reads(ast.parse(path.read_text()))
            offenders += [f"{name}:{line}" for line in lines]
    assert offenders == []


def test_the_read_finder_catches_the_forms() -> None:
    source = (
        "if cfg.agent.enable: pass\nx = self.cfg.agent.program\na = cfg.agent\ny = a.enable\n"
        "z = agent_cfg.program\nw = cfg.reward.reward_model.enable\n"
    )
    assert _agent_key_reads(ast.parse(source)) == [1, 2, 4, 5]


OWN_PROMPTS = """
from creditrl.data.dataset import PromptDataset
from creditrl.data.rows import PromptRow
from creditrl.rewards import register_scorer
from creditrl.rollout import StrategyTraits, register_rollout_strategy


def prompts(cfg, tokenizer):
    rows = [
        PromptRow([{"role": "user", "content": f"Own prompt {i}: say hi."}], "hi", "own")
        for i in range(4)
    ]
    data = cfg.data
    train = PromptDataset(rows, tokenizer, data.max_prompt_length, data.overlong_prompt)
    return train, None


@register_rollout_strategy("own_prompts", StrategyTraits(datasets=prompts))
def build(engine, tokenizer, cfg):
    return engine


@register_scorer("own_length")
def own_length(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 0.1 * (len(solution_str) % 3) if data_source == "own" else -1.0
"""


def test_a_users_strategy_brings_its_own_prompts_and_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A strategy in one file named by ``trainer.extensions`` declares ``datasets``: the run
    samples its prompts (not the data section's), scores them and takes an update step; the
    pipeline and preflight name no strategy to get there."""
    restore_registries(monkeypatch, ROLLOUT_STRATEGIES)
    saved = dict(SCORERS)
    extension = tmp_path / "own_prompts.py"
    extension.write_text(OWN_PROMPTS)
    cfg = tiny_engine_config(
        tmp_path / "run",
        f"trainer.extensions=[{extension}]",
        "rollout.strategy=own_prompts",
        "reward.scorer=own_length",
        "reward.num_workers=0",
    )
    assert callable(strategy_traits(cfg).datasets)
    trainer = RLTrainer(cfg)
    try:
        assert len(trainer.train_data) == 4 and trainer.val_data is None
        trainer.step = 1
        metrics = trainer.train_step()
        batch = trainer.last_batch
        prompts = trainer.tokenizer.batch_decode(batch["prompts"], skip_special_tokens=True)
        assert all("Own prompt" in text for text in prompts)
        assert list(batch.non_tensors["data_source"]) == ["own"] * 4  # 2 prompts x rollout.n=2
        assert metrics["reward/score_min"] >= 0.0  # each score is own_length's
        assert "actor/pg_loss" in metrics
    finally:
        trainer.close()
        SCORERS.clear()
        SCORERS.update(saved)

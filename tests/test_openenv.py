"""env.openenv: an OpenEnv environment trained unchanged, token-exact, through creditrl's
endpoint (first observations by seed as prompts, reset/step per episode, rewards summed), in
process and as a local server."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import tiny_engine_config, train_async_in_process

from creditrl.config import load_config
from creditrl.errors import ConfigError, UserCodeError
from creditrl.models import load_tokenizer
from creditrl.models.tiny import tiny_model_dir

ROOT = Path(__file__).resolve().parent.parent
GUESS = ROOT / "examples" / "openenv_guess.py"
needs_openenv = pytest.mark.skipif(
    importlib.util.find_spec("openenv") is None,
    reason="needs openenv: make install puts it in without gradio (openenv-headless, then "
    "openenv with --no-deps), or pip install 'creditrl[openenv]'",
)


def env_config(out: Path, target: str, *extra: str):
    """The tiny model on the guessing game: 2 prompts x 2 episodes a step, 3 guesses each."""
    return tiny_engine_config(
        out, f"env.openenv={target}", "reward.num_workers=0", "data.max_prompt_length=256",
        "rollout.max_response_length=48", "env.max_steps=3", "agent.max_tokens_per_turn=8",
        *extra,
    )  # fmt: skip


def step_metrics(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("step", 0) > 0]


def scripted_episodes(target: str, replies: list[list[str]], *extra: str) -> Any:
    """The rollout Batch of four episodes (two prompts, each twice) whose turns are forced to
    ``replies[episode]`` (texts, each ended by EOS)."""
    from creditrl.agents.program import ProgramRollout
    from creditrl.agents.scripted import ScriptedTurnGenerator
    from creditrl.data import collate_prompts
    from creditrl.environments.openenv import (
        OpenEnvProgram,
        environment_datasets,
        load_openenv_environment,
    )

    tok = load_tokenizer(tiny_model_dir())
    cfg = env_config(Path("unused"), target, "rollout.max_response_length=96", *extra)
    train, _ = environment_datasets(cfg, tok)
    eos = tok.eos_token_id
    scripts = [[[*tok.encode(t, add_special_tokens=False), eos] for t in r] for r in replies]
    rollout = ProgramRollout(
        None, tok, cfg.agent, cfg.rollout, fallback_score=-1.0,
        max_prompt_length=cfg.data.max_prompt_length,
        turn_generator=ScriptedTurnGenerator(scripts, [eos]),
        program=OpenEnvProgram(load_openenv_environment(cfg.env), cfg.env.max_steps),
    )  # fmt: skip
    try:
        return rollout.generate(
            collate_prompts([train[0], train[0], train[1], train[1]], tok.pad_token_id), seed=1
        )
    finally:
        rollout.close()


# ---- the settings ---------------------------------------------------------------------------


def test_the_key_selects_the_strategy_and_is_documented(capsys) -> None:
    from creditrl.cli import main
    from creditrl.config.run_config import run_code
    from creditrl.rollout.strategies import rollout_strategy

    spec = f"{GUESS}:GuessEnvironment"
    cfg = load_config(overrides=[f"env.openenv={spec}", "env.kwargs.high=3"])
    assert rollout_strategy(cfg) == "openenv" and cfg.env.kwargs == {"high": 3}
    assert run_code(cfg) == [f"env.openenv='{spec}'"]
    with pytest.raises(ConfigError, match=r"env\.openenv and agent\.program both choose"):
        load_config(overrides=[f"env.openenv={spec}", f"agent.program={spec}"])
    assert main(["config", "--doc", "env"]) == 0
    assert "env.openenv" in capsys.readouterr().out


def test_a_missing_package_is_one_line_naming_the_extra(monkeypatch) -> None:
    from creditrl.preflight import preflight

    monkeypatch.setitem(sys.modules, "openenv", None)  # import openenv -> ImportError
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    cfg = load_config(overrides=[f"env.openenv={GUESS}:GuessEnvironment", "env.kwargs.high=5"])
    with pytest.raises(
        ConfigError, match=r"^env\.openenv needs the openenv package.*creditrl\[openenv\]'$"
    ):
        preflight(cfg)


@needs_openenv
def test_make_install_brings_openenv_without_gradio() -> None:
    """The openenv-headless extra is the installed openenv's own requirements but gradio (its
    web UI; gradio 6.31.0 pins pillow<13), the Makefile puts openenv beside it with
    --no-deps, and what creditrl imports of openenv imports (with gradio or without)."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement

    def named(requirements: list[str]) -> dict[str, Any]:
        reqs = [Requirement(r) for r in requirements]
        return {r.name.lower().replace("_", "-"): r.specifier for r in reqs if r.marker is None}

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    headless = named(extras["optional-dependencies"]["openenv-headless"])
    theirs = named(importlib.metadata.requires("openenv") or [])
    assert headless == {k: v for k, v in theirs.items() if k != "gradio"}
    version = importlib.metadata.version("openenv")
    assert f"--no-deps 'openenv=={version}'" in (ROOT / "Makefile").read_text()
    from openenv.core import GenericEnvClient, env_server  # with gradio or without

    assert GenericEnvClient is not None and env_server.create_app is not None


def test_observation_text_is_its_one_string_field_else_json() -> None:
    from creditrl.environments.openenv import observation_text

    assert observation_text({"prompt": "hi", "done": False, "reward": 1.0, "metadata": {}}) == "hi"
    assert observation_text({"a": "x", "b": 2, "done": True}) == "x"
    assert observation_text({"a": "x", "b": "y"}) == '{"a": "x", "b": "y"}'


# ---- the kinds -------------------------------------------------------------------------------


@needs_openenv
@pytest.mark.parametrize("target", ["GuessEnvironment", "app"])
def test_an_episode_is_reset_then_steps_until_done(target: str) -> None:
    """In process and served: the secret of seeds 0 and 1 (high=4) is 4 and 2; a right guess
    ends the episode with reward 1, a wrong one gets a hint as the next (masked) user turn."""
    batch = scripted_episodes(f"{GUESS}:{target}", [["4"], ["2", "3", "1"], ["2"], ["1", "3", "4"]])
    infos, extra = batch["agent_info"], batch["extra_info"]
    assert [a["episode"] for a in infos] == ["ok"] * 4
    rewards = [e["program_reward"] for e in extra]
    assert [r["score"] for r in rewards] == [1.0, 0.0, 1.0, 0.0]
    assert [r["openenv_steps"] for r in rewards] == [1.0, 3.0, 1.0, 3.0]
    assert [r["openenv_done"] for r in rewards] == [1.0, 0.0, 1.0, 0.0]
    assert [m["content"] for m in batch["messages"][1][-2:]] == ["Higher. Guess again.", "1"]
    mask = batch["response_mask"][1]
    assert 0 < int(mask.sum()) < int(batch["attention_mask"][1, -mask.shape[0] :].sum())


@needs_openenv
def test_a_wrong_action_shape_is_one_line(tmp_path: Path) -> None:
    from creditrl.environments.openenv import load_openenv_environment

    env_file = tmp_path / "two_fields.py"
    env_file.write_text(
        "from openenv.core.env_server import Action, Observation, Environment, State\n"
        "class A(Action):\n    x: str\n    y: int\n"
        "class E(Environment):\n"
        "    def reset(self, seed=None, episode_id=None, **kw): return Observation()\n"
        "    def step(self, action: A, timeout_s=None, **kw): return Observation(done=True)\n"
        "    @property\n    def state(self): return State()\n"
    )
    cfg = load_config(overrides=[f"env.openenv={env_file}:E"])
    with pytest.raises(UserCodeError, match=r"action has fields \['x', 'y'\].*one string field"):
        load_openenv_environment(cfg.env)


@needs_openenv
def test_the_example_trains_a_step_in_process(tmp_path: Path) -> None:
    from creditrl.trainers.rl_trainer import RLTrainer

    cfg = env_config(tmp_path, f"{GUESS}:GuessEnvironment", "env.max_steps=2")
    RLTrainer(cfg).fit()
    (step,) = step_metrics(tmp_path)
    assert step["agent/episodes_ok"] == 4 and 1.0 <= step["reward/openenv_steps_mean"] <= 2.0


@needs_openenv
def test_a_step_that_raises_is_a_counted_fallback_episode(tmp_path: Path) -> None:
    """The environment's error ends that episode alone: scored reward.fallback_score,
    ``agent_info["episode"] == "error"`` naming the exception; the others are scored as usual."""
    env_file = tmp_path / "fragile.py"
    env_file.write_text(
        "from openenv.core.env_server import Action, Observation, Environment, State\n"
        "class Say(Action):\n    text: str\n"
        "class Heard(Observation):\n    prompt: str = ''\n"
        "class Fragile(Environment):\n"
        "    SUPPORTS_CONCURRENT_SESSIONS = True\n"
        "    def reset(self, seed=None, episode_id=None, **kw): return Heard(prompt='Say hi.')\n"
        "    def step(self, action: Say, timeout_s=None, **kw):\n"
        "        if 'boom' in action.text: raise ValueError('the game broke')\n"
        "        return Heard(prompt='ok', done=True, reward=1.0)\n"
        "    @property\n    def state(self): return State()\n"
    )
    batch = scripted_episodes(f"{env_file}:Fragile", [["hi"], ["boom"], ["hi"], ["hi"]])
    infos = batch["agent_info"]
    assert [a["episode"] for a in infos] == ["ok", "error", "ok", "ok"]
    assert "the game broke" in infos[1]["episode_error"]
    assert batch["extra_info"][1]["program_reward"] == -1.0
    assert batch["extra_info"][0]["program_reward"]["score"] == 1.0


@needs_openenv
def test_the_served_example_trains_async(tmp_path: Path) -> None:
    """The learner and one sampler (their loops, in this process) on the served game: the
    sampler plays the episodes, the learner trains a step on them and logs the program's
    parts."""
    from creditrl.asynchronous.launcher import free_port, load_from_args
    from creditrl.asynchronous.learner import Learner

    args = [f"model.path={tiny_model_dir()}", f"env.openenv={GUESS}:app", "env.max_steps=2",
            "actor.autocast=none", "data.train_size=8", "data.val_size=0",
            "data.train_batch_size=2", "rollout.n=2", "rollout.max_response_length=24",
            "agent.max_tokens_per_turn=8", "actor.ppo_mini_batch_size=1",
            "reward.num_workers=0", "trainer.total_steps=1", "trainer.save_freq=0",
            "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
            f"trainer.output_dir={tmp_path}", "asynchronous.num_samplers=1"]  # fmt: skip
    cfg, _, _ = load_from_args(args)
    train_async_in_process(Learner(cfg, port=free_port()), cfg)
    (step,) = step_metrics(tmp_path)
    assert step["agent/episodes_ok"] == 4 and 1.0 <= step["reward/openenv_steps_mean"] <= 2.0


@needs_openenv
def test_a_spent_budget_ends_the_episode_scored_not_as_an_error() -> None:
    """rollout.max_response_length runs out after the first guess and its hint: the episode
    ends there (the endpoint refuses or answers empty), is scored and trained on, never an
    error."""
    wrong = " ".join(["3"] * 12)
    batch = scripted_episodes(
        f"{GUESS}:GuessEnvironment", [[wrong, "4"]] * 4, "rollout.max_response_length=16"
    )
    assert [a["episode"] for a in batch["agent_info"]] == ["ok"] * 4
    rewards = [e["program_reward"] for e in batch["extra_info"]]
    assert all(r["score"] == 0.0 and r["openenv_steps"] >= 1.0 for r in rewards)
    assert int(batch["response_mask"].sum()) > 0

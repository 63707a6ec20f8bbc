"""env.verifiers: a verifiers environment trained unchanged, token-exact, through creditrl's
endpoint (its rows as prompts, its rollout per trajectory, its rubric as the score)."""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import tiny_engine_config, train_async_in_process

from creditrl.config import load_config
from creditrl.errors import ConfigError, DataError, UserCodeError
from creditrl.models import load_tokenizer
from creditrl.models.tiny import tiny_model_dir

ROOT = Path(__file__).resolve().parent.parent
ENVS = Path(__file__).parent / "programs" / "verifiers_envs.py"
V1 = Path(__file__).parent / "programs" / "verifiers_v1_envs.py"
CHAIN_SUM = ROOT / "examples" / "verifiers_chain_sum.py"
CALCULATOR = ROOT / "examples" / "verifiers_calculator.py"
V1_SUM = ROOT / "examples" / "verifiers_v1_chain_sum.py"


def _verifiers_version() -> tuple[int, ...] | None:
    """The installed verifiers' (major, minor), read without importing it."""
    try:
        return tuple(int(p) for p in importlib.metadata.version("verifiers").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


VF = _verifiers_version()
needs_verifiers = pytest.mark.skipif(  # the classic API: verifiers 0.3 (make install's)
    VF is None or VF >= (0, 4),
    reason="needs verifiers 0.3, whose classic API these environments use (0.4 keeps only "
    "verifiers.v1): pip install 'creditrl[verifiers]' 'verifiers<0.4'",
)
needs_v1 = pytest.mark.skipif(
    VF is None or not (0, 3) <= VF < (0, 5),
    reason="needs the verifiers extra (verifiers.v1, in 0.3 and 0.4): "
    "pip install 'creditrl[verifiers]'",
)


def env_config(out: Path, spec: str, *extra: str):
    """The tiny model on ``spec``'s environment: 2 prompts x 2 episodes a step."""
    return tiny_engine_config(
        out, f"env.verifiers={spec}", "reward.num_workers=0", "data.max_prompt_length=1024",
        "rollout.max_response_length=32", *extra,
    )  # fmt: skip


def step_metrics(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("step", 0) > 0]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(tiny_model_dir())


def forced(scripts: list, eos: int, unrecorded: list[int]) -> Any:
    """``ScriptedTurnGenerator`` that answers requests past the recorded trajectory (after a
    rewritten history) with ``unrecorded``."""
    from creditrl.agents.scripted import ScriptedTurnGenerator

    class Forced(ScriptedTurnGenerator):
        def _ids(self, request: Any) -> list[int]:
            return unrecorded if request.sample < 0 else super()._ids(request)

    return Forced(scripts, [eos])


def scripted(tok, spec: str, replies: list[list[str]], *extra: str):
    """(rollout, prompts): the environment's rollouts through the endpoint with each episode's
    turns forced to ``replies[episode]`` (texts, each ended by EOS); two prompts, each twice."""
    from creditrl.agents.program import ProgramRollout
    from creditrl.data import collate_prompts
    from creditrl.environments.verifiers import (
        VerifiersProgram,
        environment_datasets,
        load_verifiers_environment,
    )

    cfg = env_config(Path("unused"), spec, "rollout.max_response_length=96", *extra)
    train, _ = environment_datasets(cfg, tok)
    eos = tok.eos_token_id
    scripts = [[[*tok.encode(t, add_special_tokens=False), eos] for t in r] for r in replies]
    rollout = ProgramRollout(
        None, tok, cfg.agent, cfg.rollout, fallback_score=-1.0,
        max_prompt_length=cfg.data.max_prompt_length,
        turn_generator=forced(scripts, eos, [*tok.encode("ok", add_special_tokens=False), eos]),
        program=VerifiersProgram(load_verifiers_environment(cfg.env)),
    )  # fmt: skip
    rows = [train[0], train[0], train[1], train[1]]
    return rollout, collate_prompts(rows, tok.pad_token_id)


def run(rollout, prompts):
    try:
        return rollout.generate(prompts, seed=1)
    finally:
        rollout.close()


# ---- the package ---------------------------------------------------------------------------


def test_a_missing_package_is_one_line_naming_the_extra(monkeypatch) -> None:
    from creditrl.preflight import preflight

    monkeypatch.setitem(sys.modules, "verifiers", None)  # import verifiers -> ImportError
    cfg = load_config(overrides=[f"env.verifiers={ENVS}:load_environment", "env.kwargs.bonus=3"])
    with pytest.raises(ConfigError) as err:
        preflight(cfg)
    assert str(err.value) == (
        "env.verifiers needs the verifiers package, which is not installed: "
        "pip install 'creditrl[verifiers]'"
    )


def test_the_settings_select_the_strategy_and_are_documented(capsys) -> None:
    from creditrl.cli import main
    from creditrl.config.run_config import run_code
    from creditrl.rollout.strategies import rollout_strategy

    spec = f"{ENVS}:load_environment"
    cfg = load_config(overrides=[f"env.verifiers={spec}", "env.kwargs.bonus=0.5"])
    assert rollout_strategy(cfg) == "verifiers" and cfg.env.kwargs == {"bonus": 0.5}
    assert run_code(cfg) == [f"env.verifiers='{spec}'"]
    with pytest.raises(ConfigError, match=r"env\.verifiers and agent\.program both choose"):
        load_config(overrides=[f"env.verifiers={spec}", f"agent.program={spec}"])
    assert main(["config", "--doc", "env"]) == 0
    doc = capsys.readouterr().out
    assert "env.verifiers" in doc and "env.kwargs" in doc and "creditrl[verifiers]" in doc


# ---- the examples and a user's file train --------------------------------------------------


@needs_verifiers
def test_the_chain_sum_example_trains_two_steps(tmp_path: Path) -> None:
    """make run's chain_sum rows as a single-turn environment scored with math-verify: two
    steps, every episode run by the environment, its rubric's parts logged."""
    from creditrl.trainers.rl_trainer import RLTrainer

    cfg = env_config(
        tmp_path, f"{CHAIN_SUM}:load_environment", "env.kwargs.train_size=8",
        "env.kwargs.val_size=2", "trainer.total_steps=2",
    )  # fmt: skip
    RLTrainer(cfg).fit()
    steps = step_metrics(tmp_path)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["agent/episodes_ok"] == 4
        assert 0.0 <= s["reward/vf_correct_answer_mean"] <= 1.0
        assert s["reward/vf_answer_format_mean"] in (0.0, 0.25, 0.5, 0.75, 1.0)


@needs_verifiers
def test_the_calculator_example_trains_two_steps(tmp_path: Path) -> None:
    from creditrl.trainers.rl_trainer import RLTrainer

    cfg = env_config(
        tmp_path, f"{CALCULATOR}:load_environment", "env.kwargs.train_size=8",
        "env.kwargs.val_size=2", "trainer.total_steps=2",
    )  # fmt: skip
    RLTrainer(cfg).fit()
    steps = step_metrics(tmp_path)
    assert [s["step"] for s in steps] == [1, 2]
    assert all(
        s["agent/episodes_ok"] == 4 and "reward/vf_calculator_calls_mean" in s for s in steps
    )


@needs_verifiers
def test_a_tool_call_runs_the_environments_tool_as_an_observation(tok) -> None:
    """The calculator environment: a call, the tool's result appended as an observation (mask
    0), then the answer; the rubric's total is the reward and its parts ride along."""
    from creditrl.environments.verifiers import environment_datasets

    cfg = env_config(Path("unused"), f"{CALCULATOR}:load_environment", "env.kwargs.train_size=4")
    train, _ = environment_datasets(cfg, tok)
    replies = []
    for i in (0, 0, 1, 1):
        question = train[i]["raw_prompt"][-1]["content"]
        expression = question.removeprefix("What is ").removesuffix("?")
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        answer = train[i]["ground_truth"] if i == 0 else "0"
        replies.append([f"<tool_call>{call}</tool_call>", f"<answer>{answer}</answer>"])
    rollout, prompts = scripted(tok, f"{CALCULATOR}:load_environment", replies)
    batch = run(rollout, prompts)
    rewards = [e["program_reward"] for e in batch["extra_info"]]
    assert [r["score"] for r in rewards] == [1.2, 1.2, 0.2, 0.2]
    assert [r["vf_correct_answer"] for r in rewards] == [1.0, 1.0, 0.0, 0.0]
    assert all(r["vf_calculator_calls"] == 1.0 and r["vf_num_turns"] == 2.0 for r in rewards)
    for i in range(len(batch)):
        info = batch["agent_info"][i]
        assert info["episode"] == "ok" and info["endpoint_drift"] == []
        mask = batch["response_mask"][i].bool()
        real = batch["attention_mask"][i, -mask.shape[0] :].bool()
        observation = batch["responses"][i][real & ~mask].tolist()
        result = train[0 if i < 2 else 1]["ground_truth"]
        assert result in tok.decode(observation) and batch["num_turns"][i] == 2


@needs_verifiers
def test_a_users_single_file_environment_trains_a_step_and_scores_with_its_rubric(
    tmp_path: Path, tok
) -> None:
    from creditrl.trainers.rl_trainer import RLTrainer

    spec = f"{ENVS}:load_environment"
    long = "It is 7, I think, though I would like to check it again."
    replies = [["7"], [long], ["4"], ["5"]]
    rollout, prompts = scripted(tok, spec, replies, "env.kwargs.bonus=0.25")
    rewards = [e["program_reward"] for e in run(rollout, prompts)["extra_info"]]
    assert rewards == [
        {"score": 1.25, "vf_says_answer": 1.0, "vf_short": 1.0, "vf_num_turns": 1.0},
        {"score": 1.0, "vf_says_answer": 1.0, "vf_short": 0.0, "vf_num_turns": 1.0},
        {"score": 1.25, "vf_says_answer": 1.0, "vf_short": 1.0, "vf_num_turns": 1.0},
        {"score": 0.25, "vf_says_answer": 0.0, "vf_short": 1.0, "vf_num_turns": 1.0},
    ]
    RLTrainer(env_config(tmp_path, spec)).fit()
    (step,) = step_metrics(tmp_path)
    assert step["agent/episodes_ok"] == 4 and "reward/vf_says_answer_mean" in step


@needs_verifiers
def test_creditrl_eval_runs_the_environment(tmp_path: Path, capsys) -> None:
    """Without an eval_dataset, validation is the first data.val_size rows."""
    from creditrl.cli import main

    code = main(["eval", f"model.path={tiny_model_dir()}", f"env.verifiers={ENVS}:load_environment",
                 "data.val_size=2", "data.max_prompt_length=1024", "reward.num_workers=0",
                 "rollout.max_response_length=16"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "val/score:" in out
    code = main(["eval", f"model.path={tiny_model_dir()}", f"env.verifiers={ENVS}:load_environment",
                 "data.val_size=0", "data.max_prompt_length=1024"])  # fmt: skip
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 2 and "give env.verifiers's environment an eval_dataset" in last


@needs_verifiers
def test_the_environment_trains_async(tmp_path: Path) -> None:
    """The learner and one sampler (their loops, in this process) on the environment."""
    from creditrl.asynchronous.launcher import free_port, load_from_args
    from creditrl.asynchronous.learner import Learner

    args = [f"model.path={tiny_model_dir()}", f"env.verifiers={ENVS}:load_environment",
            "actor.autocast=none", "data.train_batch_size=2", "rollout.n=2",
            "rollout.max_response_length=16", "data.max_prompt_length=1024",
            "actor.ppo_mini_batch_size=1", "reward.num_workers=0", "trainer.total_steps=2",
            "trainer.save_freq=0", "trainer.test_freq=0", "trainer.val_before_train=false",
            "trainer.logger=[jsonl]", f"trainer.output_dir={tmp_path}",
            "asynchronous.num_samplers=1"]  # fmt: skip
    cfg, _, _ = load_from_args(args)
    port = free_port()
    learner = Learner(cfg, port=port)
    train_async_in_process(learner, cfg)
    steps = step_metrics(tmp_path)
    assert [s["step"] for s in steps] == [1, 2]
    # the rubric's total (says_answer + 0.5 x short) is the score the learner trains on
    assert all(0.0 <= s["critic/score/mean"] <= 1.5 for s in steps)
    # its named parts, scored on the sampler, are the learner's metrics as in creditrl train
    assert all(0.0 <= s["reward/vf_says_answer_mean"] <= 1.0 for s in steps)


# ---- drift and broken environments ---------------------------------------------------------


@needs_verifiers
def test_a_rewritten_history_is_located_per_trajectory(tok) -> None:
    """An environment that re-sends the conversation with its first reply rewritten: the
    trajectory keeps what was recorded and the drift is located at the rewritten turn."""
    rollout, prompts = scripted(tok, f"{ENVS}:rewrites_history", [["7", "yes"]] * 4)
    batch = run(rollout, prompts)
    for info in batch["agent_info"]:
        assert info["episode"] == "ok" and info["stop_reason"] == "rewritten"
        (drift,) = info["endpoint_drift"]
        assert drift["turn"] == 1 and drift["recorded_text"] == "7<|im_end|>"
        assert drift["rendered_text"].startswith("rewritten<|im_end|>")
    assert rollout.last_metrics["tokenization/endpoint_rewritten"] == 4
    assert rollout.last_metrics["tokenization/endpoint_drift_rate"] == 1.0


@needs_verifiers
def test_a_two_turn_environment_records_its_message_as_an_observation(tok) -> None:
    rollout, prompts = scripted(tok, f"{ENVS}:two_turns", [["8", "7"]] * 4)
    batch = run(rollout, prompts)
    assert all(i["episode"] == "ok" and i["endpoint_drift"] == [] for i in batch["agent_info"])
    assert [e["program_reward"]["score"] for e in batch["extra_info"]] == [1.0, 1.0, 0.0, 0.0]
    mask = batch["response_mask"][0].bool()
    real = batch["attention_mask"][0, -mask.shape[0] :].bool()
    assert "Are you sure?" in tok.decode(batch["responses"][0][real & ~mask].tolist())


@needs_verifiers
@pytest.mark.parametrize(
    ("name", "error", "message"),
    [
        ("raises_in_load", UserCodeError,
         "raises_in_load raised RuntimeError: cannot build 3 rows (called with env.kwargs [])"),
        ("not_an_environment", UserCodeError,
         "not_an_environment returned a builtins.dict, not a verifiers Environment"),
        ("no_prompts", UserCodeError, "no_prompts raised KeyError: 'question'"),
        ("empty_prompt", DataError, "env.verifiers train row 1 has an empty prompt"),
        ("missing", UserCodeError, "has no function 'missing'"),
        ("group_rubric", UserCodeError, "group_rubric's rubric has group reward functions"),
    ],
)  # fmt: skip
def test_an_environment_that_cannot_load_is_one_line(
    tmp_path: Path, capsys, name: str, error: type, message: str
) -> None:
    from creditrl.cli import main
    from creditrl.environments.verifiers import environment_datasets

    cfg = env_config(tmp_path, f"{ENVS}:{name}")
    with pytest.raises(error) as raised:
        environment_datasets(cfg, load_tokenizer(tiny_model_dir()))
    assert message in str(raised.value)
    code = main(["train", f"model.path={tiny_model_dir()}", f"env.verifiers={ENVS}:{name}",
                 f"trainer.output_dir={tmp_path}/cli", "data.max_prompt_length=1024"])  # fmt: skip
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 2 and last.startswith("error: ") and message in last


@needs_verifiers
@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("raises_in_rollout", "KeyError: 'missing tool server'"),
        ("raises_in_rubric", "the environment's rubric failed: reward function fails raised "
         "ZeroDivisionError: judge is down"),
    ],
)  # fmt: skip
def test_a_failing_rollout_or_rubric_is_a_counted_fallback_episode(
    tok, name: str, why: str
) -> None:
    rollout, prompts = scripted(tok, f"{ENVS}:{name}", [["7"]] * 4)
    batch = run(rollout, prompts)
    assert [e["program_reward"] for e in batch["extra_info"]] == [-1.0] * 4
    for info in batch["agent_info"]:
        assert info["episode"] == "error" and why in info["episode_error"]
    assert rollout.last_metrics["agent/episodes_error"] == 4


@pytest.mark.parametrize(
    "endpoint",
    [{"requests": "4"}, {"requests": True}, {"seconds": float("nan")}, {"requests": [1]}, [1.0]],
)
def test_the_learner_takes_an_endpoint_rollouts_counts_only_as_numbers(endpoint: Any) -> None:
    """meta['endpoint'] (an agent program's or environment's rollout counts) reaches the
    learner as a dict of finite numbers or the group is rejected."""
    from creditrl.asynchronous.validation import MessageError, _check_non_tensors
    from creditrl.batch import Batch

    def group(counts: Any) -> Batch:
        return Batch({"input_ids": torch.zeros(1, 2, dtype=torch.long)}, {}, {"endpoint": counts})

    _check_non_tensors(group({"requests": 8.0, "refused": 0.0, "seconds": 0.5}), "group")
    with pytest.raises(MessageError, match=r"meta\['endpoint'\]") as err:
        _check_non_tensors(group(endpoint), "group")
    assert err.value.reason == "non_tensor"


@needs_verifiers
def test_a_spent_budget_ends_the_rollout_scored_by_the_rubric(tmp_path: Path) -> None:
    """Two turns in a budget of 8 tokens (the tiny model never ends a reply): the first reply
    spends it, the second request is refused as past the context length, and verifiers ends the
    rollout there as truncated: the rubric scores it and the episode trains, never an error."""
    from creditrl.trainers.rl_trainer import RLTrainer

    cfg = env_config(tmp_path, f"{ENVS}:two_turns", "rollout.max_response_length=8")
    RLTrainer(cfg).fit()
    (step,) = step_metrics(tmp_path)
    assert step["agent/episodes_ok"] == 4 and "agent/episodes_error" not in step
    assert step["agent/stop_length"] == 1.0
    assert step["endpoint/refused"] >= 4
    assert 0.0 <= step["reward/vf_says_answer_mean"] <= 1.0
    assert step["response_length/mean"] == 8


# ---- verifiers.v1 (0.4's API, also in 0.3): a Taskset played by a harness ------------------


def v1_scripted(tok, spec: str, replies: list[list[str]], *extra: str, unrecorded: str = "ok"):
    """(rollout, prompts) as ``scripted`` for a verifiers.v1 environment: its episodes run
    through the interception and the relay to the endpoint, each turn forced to ``replies``."""
    from creditrl.agents.program import ProgramRollout
    from creditrl.data import collate_prompts
    from creditrl.environments.verifiers import (
        check_environment,
        environment_datasets,
        environment_program,
        load_verifiers_environment,
    )

    cfg = env_config(Path("unused"), spec, "rollout.max_response_length=96", *extra)
    check_environment(cfg)  # prepares the harnesses' programs
    train, _ = environment_datasets(cfg, tok)
    eos = tok.eos_token_id
    scripts = [[[*tok.encode(t, add_special_tokens=False), eos] for t in r] for r in replies]
    rollout = ProgramRollout(
        None, tok, cfg.agent, cfg.rollout, fallback_score=-1.0,
        max_prompt_length=cfg.data.max_prompt_length,
        turn_generator=forced(scripts, eos, [*tok.encode(unrecorded, add_special_tokens=False),
                                             eos]),
        program=environment_program(load_verifiers_environment(cfg.env)),
    )  # fmt: skip
    rows = [train[0], train[0], train[1], train[1]]
    return rollout, collate_prompts(rows, tok.pad_token_id)


@needs_v1
def test_a_v1_env_with_the_null_harness_trains_two_steps(tmp_path: Path, monkeypatch) -> None:
    """make run's chain_sum as a v1 Taskset played by verifiers' own null harness (its chat
    program, in the subprocess runtime, with this interpreter: prepared once, without uv): two
    steps, every episode ok, the task's rewards logged, the endpoint's drift counters as for
    the classic path."""
    from creditrl.environments import verifiers_v1
    from creditrl.trainers.rl_trainer import RLTrainer

    async def no_uv(*_: Any) -> None:
        raise AssertionError("the null program was to run with this interpreter")

    checked = []
    lacks = verifiers_v1.interpreter_lacks
    monkeypatch.setattr(verifiers_v1, "_uv_prepare", no_uv)
    monkeypatch.setattr(verifiers_v1, "interpreter_lacks", lambda s: checked.append(s) or lacks(s))
    cfg = env_config(
        tmp_path, f"{V1_SUM}:load_environment", "env.kwargs.size=8", "trainer.total_steps=2",
        "rollout.max_response_length=24",
    )  # fmt: skip
    RLTrainer(cfg).fit()
    steps = step_metrics(tmp_path)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["agent/episodes_ok"] == 4 and "agent/episodes_error" not in s
        assert 0.0 <= s["reward/vf_correct_answer_mean"] <= 1.0
        assert s["reward/vf_answer_format_mean"] in (0.0, 0.25, 0.5, 0.75, 1.0)
        assert s["tokenization/endpoint_drift_rate"] == 0.0 and s["endpoint/refused"] == 0
        assert s["num_turns/mean"] == 1.0 and s["endpoint/requests"] >= 4
        assert sum(v for k, v in s.items() if k.startswith("agent/stop_")) == pytest.approx(1.0)
    assert len(checked) <= 1  # decided once per process (0: an earlier test did), not per episode


@needs_v1
@pytest.mark.parametrize("mode", ["plain", "stream"])
def test_a_v1_episode_is_token_exact_and_scored_by_its_task(tok, mode: str) -> None:
    """Two turns of the file's in-process harness (streamed or not): the environment's user
    turn is an observation (mask 0), the task's reward is the score, its reward and metric are
    the parts, nothing drifts."""
    spec = f"{V1}:chat"
    rollout, prompts = v1_scripted(tok, spec, [["8", "7"], ["9", "1"], ["4", "4"], ["4", "5"]],
                                   f"env.kwargs.mode={mode}")  # fmt: skip
    batch = run(rollout, prompts)
    rewards = [e["program_reward"] for e in batch["extra_info"]]
    assert rewards == [
        {"score": 1.0, "vf_says_answer": 1.0, "vf_turns": 2.0},
        {"score": 0.0, "vf_says_answer": 0.0, "vf_turns": 2.0},
        {"score": 1.0, "vf_says_answer": 1.0, "vf_turns": 2.0},
        {"score": 0.0, "vf_says_answer": 0.0, "vf_turns": 2.0},
    ]
    for i in range(len(batch)):
        info = batch["agent_info"][i]
        assert info["episode"] == "ok" and info["endpoint_drift"] == [] and info["requests"] == 2
        assert info["stop_reason"] == "done" and batch["num_turns"][i] == 2
        mask = batch["response_mask"][i].bool()
        real = batch["attention_mask"][i, -mask.shape[0] :].bool()
        assert "Are you sure?" in tok.decode(batch["responses"][i][real & ~mask].tolist())
    assert rollout.last_metrics["agent/episodes_ok"] == 4
    assert rollout.last_metrics["tokenization/endpoint_drift_rate"] == 0.0


@needs_v1
def test_a_v1_environment_trains_async(tmp_path: Path) -> None:
    """The learner and one sampler (their loops, in this process): the sampler runs the v1
    episodes, the learner trains on them and logs the task's parts."""
    from creditrl.asynchronous.launcher import free_port, load_from_args
    from creditrl.asynchronous.learner import Learner

    args = [f"model.path={tiny_model_dir()}", f"env.verifiers={V1}:chat", "env.kwargs.turns=1",
            "actor.autocast=none", "data.train_batch_size=2", "rollout.n=2",
            "rollout.max_response_length=16", "data.max_prompt_length=1024",
            "actor.ppo_mini_batch_size=1", "reward.num_workers=0", "trainer.total_steps=1",
            "trainer.save_freq=0", "trainer.test_freq=0", "trainer.val_before_train=false",
            "trainer.logger=[jsonl]", f"trainer.output_dir={tmp_path}",
            "asynchronous.num_samplers=1"]  # fmt: skip
    cfg, _, _ = load_from_args(args)
    train_async_in_process(Learner(cfg, port=free_port()), cfg)
    (step,) = step_metrics(tmp_path)
    assert 0.0 <= step["critic/score/mean"] <= 1.0
    assert 0.0 <= step["reward/vf_says_answer_mean"] <= 1.0 and step["reward/vf_turns_mean"] == 1.0


@needs_v1
def test_a_v1_rewritten_history_is_located_per_trajectory(tok) -> None:
    rollout, prompts = v1_scripted(tok, f"{V1}:chat", [["7", "yes"]] * 4, "env.kwargs.mode=rewrite")
    batch = run(rollout, prompts)
    for info in batch["agent_info"]:
        assert info["episode"] == "ok" and info["stop_reason"] == "rewritten"
        (drift,) = info["endpoint_drift"]
        assert drift["turn"] == 1 and drift["recorded_text"] == "7<|im_end|>"
        assert drift["rendered_text"].startswith("rewritten<|im_end|>")
    assert rollout.last_metrics["tokenization/endpoint_rewritten"] == 4


@needs_v1
def test_a_v1_spent_budget_is_a_truncation_scored_by_the_task(tok) -> None:
    """The first reply spends the budget; the second request is refused for length, so
    verifiers fails the rollout: creditrl stops it as truncated and the task scores it."""
    long = " ".join(["7"] * 40)
    rollout, prompts = v1_scripted(tok, f"{V1}:chat", [[long, "7"]] * 4,
                                   "rollout.max_response_length=16")  # fmt: skip
    batch = run(rollout, prompts)
    rewards = [e["program_reward"] for e in batch["extra_info"]]
    assert [r["score"] for r in rewards] == [1.0, 1.0, 0.0, 0.0]
    assert all(r["vf_turns"] == 1.0 for r in rewards)
    assert [a["episode"] for a in batch["agent_info"]] == ["ok"] * 4
    assert all(a["stop_reason"] == "length" for a in batch["agent_info"])
    assert rollout.last_metrics["endpoint/refused"] >= 4


@needs_v1
@pytest.mark.parametrize(
    ("kwarg", "why"),
    [
        ("env.kwargs.mode=raise", "HarnessError: harness 'creditrl_user_"),
        ("env.kwargs.fail_scoring=true", "task SumTask scoring: ZeroDivisionError: judge is down"),
    ],
)
def test_a_failing_v1_harness_or_task_is_a_counted_fallback_episode(
    tok, kwarg: str, why: str
) -> None:
    rollout, prompts = v1_scripted(tok, f"{V1}:chat", [["7", "7"]] * 4, kwarg)
    batch = run(rollout, prompts)
    assert [e["program_reward"] for e in batch["extra_info"]] == [-1.0] * 4
    for info in batch["agent_info"]:
        assert info["episode"] == "error" and why in info["episode_error"]
        assert "the environment's episode failed" in info["episode_error"]
    assert rollout.last_metrics["agent/episodes_error"] == 4


@needs_v1
@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("remote_runtime", "its role 'agent' runs its harness in the 'docker' runtime"),
        ("pinned_client", "its role 'agent' pins a client (EvalClientConfig)"),
        ("two_roles", "plays 2 agent roles ['judge', 'solver']"),
    ],
)
def test_a_v1_env_creditrl_cannot_run_is_one_line(tmp_path: Path, capsys, name, message) -> None:
    from creditrl.cli import main

    code = main(["train", f"model.path={tiny_model_dir()}", f"env.verifiers={V1}:{name}",
                 f"trainer.output_dir={tmp_path}", "data.max_prompt_length=1024"])  # fmt: skip
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 2 and last.startswith("error: env.verifiers: ") and message in last


@needs_v1
def test_a_program_that_cannot_be_prepared_is_one_line(tmp_path: Path, capsys, monkeypatch):
    """A harness program needing a package this interpreter lacks goes to verifiers' uv
    preparation; when that fails too, the preflight says what is missing, in one line."""
    from creditrl.cli import main
    from creditrl.environments import verifiers_v1

    async def no_uv(runtime, script, env, activate):
        raise RuntimeError("failed to prepare uv script: sh: 1: uv: not found")

    monkeypatch.setattr(verifiers_v1, "_uv_prepare", no_uv)
    code = main(["train", f"model.path={tiny_model_dir()}", f"env.verifiers={V1}:chat",
                 "env.kwargs.needs=no-such-package>=1", f"trainer.output_dir={tmp_path}",
                 "data.max_prompt_length=1024"])  # fmt: skip
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 2, last
    assert "program of harness 'creditrl_user_" in last
    assert "needs no-such-package>=1 (not installed), which this interpreter lacks" in last
    assert "uv: not found" in last and "once per run" in last


def test_a_programs_declared_requirements_decide_its_interpreter() -> None:
    """PEP 723 metadata against this interpreter: what it lacks, or nothing."""
    from creditrl.environments.verifiers_v1 import interpreter_lacks, program_requirements

    def script(deps: str, python: str = ">=3.10") -> str:
        return f'# /// script\n# requires-python = "{python}"\n# dependencies = [{deps}]\n# ///\n'

    assert program_requirements(script('"httpx"')) == (">=3.10", ["httpx"])
    assert program_requirements("print(1)\n") == (None, [])
    assert interpreter_lacks(script('"httpx", "packaging>=20"')) == []
    assert interpreter_lacks(script('"httpx<0.1"')) == [
        f"httpx<0.1 (this interpreter has {importlib.metadata.version('httpx')})"
    ]
    assert interpreter_lacks(script('"no-such-package"')) == ["no-such-package (not installed)"]
    assert interpreter_lacks(script("\"httpx; python_version < '3.0'\"")) == []
    assert interpreter_lacks(script('"httpx"', python=">=4"))[0].startswith("python>=4 (this is")
    unreadable = interpreter_lacks('# /// script\n# dependencies = "httpx"\n# ///\n')
    assert unreadable[0].startswith("(its script metadata cannot be read")


def test_a_streamed_turn_is_served_as_events_the_openai_client_reads() -> None:
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from creditrl.environments.verifiers_v1 import stream_events

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    completion = {
        "id": "chatcmpl-x-1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None,
                     "message": {"role": "assistant", "content": "hi", "tool_calls": [call]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }  # fmt: skip
    events = stream_events(completion, include_usage=True).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    state = ChatCompletionStreamState()
    for event in events[:-2]:
        state.handle_chunk(ChatCompletionChunk.model_validate(json.loads(event[6:])))
    final = state.get_final_completion()
    message = final.choices[0].message
    assert message.content == "hi" and message.tool_calls[0].function.name == "f"
    assert final.choices[0].finish_reason == "tool_calls" and final.usage.total_tokens == 5


@needs_v1
def test_an_unsupported_verifiers_version_is_one_line(monkeypatch) -> None:
    import verifiers

    from creditrl.preflight import preflight

    monkeypatch.setattr(verifiers, "__version__", "0.5.0")
    cfg = load_config(overrides=[f"env.verifiers={V1}:chat", "env.kwargs.turns=5"])
    with pytest.raises(ConfigError, match=r"^env\.verifiers: verifiers 0\.5\.0 is installed; "
                       r"creditrl runs verifiers >=0\.3,<0\.5 \(0\.3's classic"):  # fmt: skip
        preflight(cfg)


@needs_v1
def test_the_relay_refuses_a_wrong_key_an_unknown_rollout_and_a_bad_body() -> None:
    """What reaches the relay's loopback port without its key, for a rollout no episode runs,
    or with a body that is not a JSON object is an OpenAI-style error; nothing is forwarded."""
    import asyncio

    import httpx

    from creditrl.environments.verifiers_v1 import Relay

    async def attempts() -> list[tuple[int, str]]:
        relay = Relay()
        await relay.start()
        relay.sessions["known"] = ("http://127.0.0.1:9/t/x/v1", "k")
        key = {"Authorization": f"Bearer {relay.key}"}
        body = {"messages": [{"role": "user", "content": "hi"}]}
        url = f"{relay.url}/v1/chat/completions"
        try:
            async with httpx.AsyncClient() as client:
                replies = [
                    await client.post(url, json=body, headers={"X-Session-ID": "known"}),
                    await client.post(url, json=body, headers={**key, "X-Session-ID": "other"}),
                    await client.post(url, content=b"[1", headers={**key, "X-Session-ID": "known"}),
                    await client.post(url, json=[1], headers={**key, "X-Session-ID": "known"}),
                    await client.post(url, json=body, headers={**key, "X-Session-ID": "known"}),
                ]
        finally:
            await relay.stop()
        return [(r.status_code, r.json()["error"]["code"]) for r in replies]

    assert asyncio.run(attempts()) == [
        (401, "invalid_api_key"),
        (404, "unknown_session"),
        (400, "bad_json"),
        (400, "bad_request"),
        (502, "upstream"),  # the trajectory's endpoint (port 9) does not answer
    ]

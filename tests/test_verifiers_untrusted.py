"""env.verifiers environments that misbehave as users' environments do: a loader that exits,
rows whose info is hostile JSON, a rubric whose failures are not logged, a client shared by
every episode (issue 40)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import tiny_engine_config

from creditrl.errors import DataError, UserCodeError
from creditrl.models import load_tokenizer
from creditrl.models.tiny import tiny_model_dir

pytest.importorskip("verifiers")

ENVS = Path(__file__).parent / "programs" / "verifiers_untrusted_envs.py"


def env_config(spec: str, *extra: str):
    return tiny_engine_config(
        Path("unused"), f"env.verifiers={spec}", "reward.num_workers=0",
        "data.max_prompt_length=1024", "rollout.max_response_length=96", *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(tiny_model_dir())


def scripted(tok, spec: str, answer: str, *extra: str):
    """(rollout, prompts): the environment's rollouts through the endpoint, each episode
    answering ``answer``; two prompts, each twice."""
    from creditrl.agents.program import ProgramRollout
    from creditrl.agents.scripted import ScriptedTurnGenerator
    from creditrl.data import collate_prompts
    from creditrl.environments.verifiers import (
        VerifiersProgram,
        environment_datasets,
        load_verifiers_environment,
    )

    cfg = env_config(spec, *extra)
    train, _ = environment_datasets(cfg, tok)
    eos = tok.eos_token_id
    reply = [*tok.encode(answer, add_special_tokens=False), eos]

    class Always(ScriptedTurnGenerator):
        def _ids(self, request):
            return reply

    rollout = ProgramRollout(
        None, tok, cfg.agent, cfg.rollout, fallback_score=-1.0,
        max_prompt_length=cfg.data.max_prompt_length, turn_generator=Always([], [eos]),
        program=VerifiersProgram(load_verifiers_environment(cfg.env)),
    )  # fmt: skip
    rows = [train[0], train[0], train[1], train[1]]
    return rollout, collate_prompts(rows, tok.pad_token_id)


@pytest.mark.parametrize(
    ("name", "says"),
    [("exits", "exits raised SystemExit: 0"), ("raises_base", "raises_base raised Stop: stopped")],
)
def test_a_loader_that_exits_is_one_line_naming_env_verifiers(
    tmp_path: Path, capsys, name: str, says: str
) -> None:
    from creditrl.cli import main
    from creditrl.environments.verifiers import environment_datasets

    with pytest.raises(UserCodeError) as raised:
        environment_datasets(env_config(f"{ENVS}:{name}"), load_tokenizer(tiny_model_dir()))
    assert str(raised.value).startswith("env.verifiers: ") and says in str(raised.value)
    code = main(["train", f"model.path={tiny_model_dir()}", f"env.verifiers={ENVS}:{name}",
                 f"trainer.output_dir={tmp_path}", "data.max_prompt_length=1024"])  # fmt: skip
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 2 and last.startswith("error: env.verifiers: ") and says in last


@pytest.mark.parametrize(
    ("name", "says"),
    [("deep_info", "'info' is nested 100000 deep"), ("nan_info", "'info' holds NaN")],
)
def test_an_info_string_is_decoded_within_the_data_row_bounds(tok, name: str, says: str) -> None:
    from creditrl.environments.verifiers import environment_datasets

    with pytest.raises(DataError) as raised:
        environment_datasets(env_config(f"{ENVS}:{name}"), tok)
    assert "env.verifiers train row 1" in str(raised.value) and says in str(raised.value)
    train, _ = environment_datasets(env_config(f"{ENVS}:json_info"), tok)
    assert train[0]["extra_info"]["verifiers"]["info"] == {"x": 1}


def test_a_failing_reward_function_is_detected_without_the_verifiers_logger(tok) -> None:
    rollout, prompts = scripted(tok, f"{ENVS}:quiet_failing_rubric", "7")
    try:
        batch = rollout.generate(prompts, seed=1)
    finally:
        rollout.close()
    assert [e["program_reward"] for e in batch["extra_info"]] == [-1.0] * 4
    for info in batch["agent_info"]:
        assert info["episode"] == "error"
        assert (
            "reward function fails raised ZeroDivisionError: judge is down"
            in (info["episode_error"])
        )


def test_a_client_made_in_load_environment_serves_every_step(tok) -> None:
    """The judge's AsyncOpenAI client, made once in load_environment, keeps pooled connections
    across steps: each step's episodes run on the environment's one event loop."""
    from creditrl.agents.endpoint import Endpoint

    async def unused(trajectory, body):
        raise AssertionError

    judge = Endpoint(unused, lambda t: True, "judge")
    judge.start()
    try:
        url = f"http://127.0.0.1:{judge.port}/v1"
        kwargs = f'env.kwargs={{"base_url": "{url}", "api_key": "{judge.key}"}}'
        rollout, prompts = scripted(tok, f"{ENVS}:judged", "7", kwargs)
        try:
            steps = [rollout.generate(prompts, seed=step) for step in range(3)]
        finally:
            rollout.close()
    finally:
        judge.close()
    for batch in steps:
        assert [i["episode"] for i in batch["agent_info"]] == ["ok"] * 4, batch["agent_info"]
        assert [e["program_reward"]["score"] for e in batch["extra_info"]] == [1.0] * 4

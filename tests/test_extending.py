"""docs/architecture.md, "Extending creditrl": an estimator, a policy loss, a rollout engine, a
tool and a reward scorer, each registered from this test module through the public registries
and selected by its config key, then used by one training step on the tiny model. Every test
asserts something the built-in in its place would not produce. The registries are restored
after each test, so nothing leaks into other test modules."""

import json
import threading
from pathlib import Path

import pytest
import torch
from helpers import read_metrics, restore_registries, tiny_trainer_config

from creditrl.agents.scripted import ScriptedTurnGenerator
from creditrl.config.loader import load_config
from creditrl.core import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    compute_gae_advantage_return,
    compute_policy_loss_ppo,
    register_adv_est,
    register_policy_loss,
)
from creditrl.models import load_tokenizer
from creditrl.models.tiny import tiny_model_dir
from creditrl.rewards import SCORERS, register_scorer
from creditrl.rewards.text import decode_responses
from creditrl.rollout import ROLLOUT_ENGINES, HFRolloutEngine, register_rollout_engine
from creditrl.trainers.rl_trainer import RLTrainer
from creditrl.workers.plan import Plan

ONE_STEP = ("trainer.total_steps=1", "trainer.val_before_train=false", "trainer.test_freq=0")


@pytest.fixture(autouse=True)
def registries(monkeypatch: pytest.MonkeyPatch):
    """Every registry as it was before the test, afterwards."""
    for registry in (ADV_ESTIMATORS, POLICY_LOSSES, ROLLOUT_ENGINES):
        restore_registries(monkeypatch, registry)
    saved = dict(SCORERS)
    yield
    SCORERS.clear()
    SCORERS.update(saved)


def test_a_registered_estimator_that_requires_values_gets_a_critic(tmp_path: Path) -> None:
    """An estimator declaring ``requires=("values",)`` makes the run build and train a critic:
    the estimator receives the critic's values, and the critic's loss is in the metrics."""
    received: list[torch.Tensor] = []

    @register_adv_est("my_gae_like", requires=("values",), options=("gamma", "lam"))
    def my_gae_like(token_level_rewards, response_mask, index=None, *, values=None, **options):
        if values is None:
            raise AssertionError("my_gae_like requires values, but no critic computed them")
        received.append(values.clone())
        return compute_gae_advantage_return(
            token_level_rewards, values, response_mask, options["gamma"], options["lam"]
        )

    cfg = tiny_trainer_config(tmp_path, "algorithm.adv_estimator=my_gae_like", *ONE_STEP)
    assert Plan.from_config(cfg).needs_critic
    trainer = RLTrainer(cfg)
    trainer.fit()
    assert len(received) == 1
    torch.testing.assert_close(received[0], trainer.last_batch["values"])
    assert "critic/vf_loss" in read_metrics(tmp_path)[1]


def test_a_registered_policy_loss_is_the_one_the_actor_optimises(tmp_path: Path) -> None:
    """``actor.policy_loss`` selects a loss registered here: every micro-batch's loss comes
    from it, and what it adds to the PPO loss shows in ``actor/pg_loss``."""
    calls: list[tuple[int, ...]] = []
    offset = 7.0

    @register_policy_loss("ppo_plus_seven")
    def ppo_plus_seven(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
        config=None, rollout_is_weights=None, **agg_kwargs,
    ):  # fmt: skip
        calls.append(tuple(log_prob.shape))
        loss, metrics = compute_policy_loss_ppo(
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
            rollout_is_weights, **agg_kwargs,
        )  # fmt: skip
        return loss + offset, metrics

    cfg = tiny_trainer_config(tmp_path, "actor.policy_loss=ppo_plus_seven", *ONE_STEP)
    RLTrainer(cfg).fit()
    # 2 prompts x n=2, mini-batches of 1 prompt (2 trajectories), micro-batches of 2: 2 calls
    assert len(calls) == 2 and all(shape[0] == 2 for shape in calls)
    assert read_metrics(tmp_path)[1]["actor/pg_loss"] > offset - 1.0


def test_a_registered_rollout_engine_generates_the_step(tmp_path: Path) -> None:
    """``rollout.engine`` selects an engine registered here: the step's responses come from
    its ``generate``, and what it adds to the batch reaches the trained batch."""
    prompts_seen: list[int] = []

    @register_rollout_engine("tagged_hf")
    class TaggedEngine(HFRolloutEngine):
        def generate(self, prompts, **kwargs):
            prompts_seen.append(len(prompts))
            batch = super().generate(prompts, **kwargs)
            batch["engine_tag"] = ["tagged_hf"] * len(batch)
            return batch

    cfg = tiny_trainer_config(tmp_path, "rollout.engine=tagged_hf", *ONE_STEP)
    trainer = RLTrainer(cfg)
    trainer.fit()
    assert sum(prompts_seen) == 4
    assert list(trainer.last_batch["engine_tag"]) == ["tagged_hf"] * 4


def test_a_registered_scorer_selected_by_reward_scorer_scores_the_step(tmp_path: Path) -> None:
    """``reward.scorer`` names a scorer registered here: the step's sequence scores are its
    values on the decoded responses (0.25 or 0.75; the task's own scorer gives 0 or 1)."""

    @register_scorer("length_parity")
    def length_parity(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return 0.25 + 0.5 * (len(solution_str) % 2)

    cfg = tiny_trainer_config(
        tmp_path, "reward.scorer=length_parity", "reward.num_workers=0", *ONE_STEP
    )
    trainer = RLTrainer(cfg)
    trainer.fit()
    batch = trainer.last_batch
    texts = decode_responses(batch, trainer.tokenizer)
    expected = torch.tensor([0.25 + 0.5 * (len(text) % 2) for text in texts])
    torch.testing.assert_close(batch["token_level_scores"].sum(-1), expected)
    assert read_metrics(tmp_path)[1]["reward/score_min"] >= 0.25


WORD_COUNT_CALLS: list[str] = []
_calls_lock = threading.Lock()


def word_count(text: str) -> str:
    """Count the words in a text.

    Args:
        text: the text whose words are counted
    """
    with _calls_lock:
        WORD_COUNT_CALLS.append(text)
    return f"{len(text.split())} words"


def test_a_tool_from_the_tool_config_is_called_by_the_agent_loop(tmp_path: Path) -> None:
    """A tool defined in this module and listed in ``agent.tool_config`` is in the agent's
    tool registry; a turn that calls it gets its output as the observation."""
    WORD_COUNT_CALLS.clear()
    tools = tmp_path / "tools.yaml"
    tools.write_text(
        f"tools:\n  - name: calculator\n  - name: word_count\n    function: {__name__}:word_count\n"
    )
    out = tmp_path / "run"
    cfg = load_config(
        overrides=[
            "preset=calculator_agent",
            f"agent.tool_config={tools}",
            f"model.path={tiny_model_dir()}",
            "data.train_size=8",
            "data.val_size=2",
            "data.train_batch_size=2",
            "rollout.n=2",
            "rollout.temperature=1.0",
            "rollout.max_response_length=64",
            "actor.ppo_mini_batch_size=1",
            "actor.ppo_micro_batch_size=2",
            "trainer.logger=[jsonl]",
            f"trainer.output_dir={out}",
            *ONE_STEP,
        ]
    )
    trainer = RLTrainer(cfg)
    rollout = trainer.workers.worker.rollout
    assert set(rollout.tools.names()) == {"calculator", "word_count"}
    tok = load_tokenizer(tiny_model_dir())
    call = tok.encode(
        '<tool_call>{"name": "word_count", "arguments": {"text": "one two three"}}</tool_call>',
        add_special_tokens=False,
    )
    answer = tok.encode("<answer>3</answer>", add_special_tokens=False)
    script = [[*call, tok.eos_token_id], [*answer, tok.eos_token_id]]
    forced = ScriptedTurnGenerator([script] * 4, [tok.eos_token_id])
    rollout.turns = rollout.loop.generator = forced
    trainer.fit()

    assert WORD_COUNT_CALLS == ["one two three"] * 4
    step = read_metrics(out)[1]
    assert (step["tools/calls"], step["tools/errors"]) == (4, 0)
    dump = [json.loads(line) for line in (out / "rollouts" / "step_000001.jsonl").open()]
    record = dump[0]["reward_extra"]["tool_calls"][0]
    assert (record["name"], record["output"]) == ("word_count", "3 words")


# --- Extensions that bring their own config keys, each from one file -------------------------

ENGINE_FILE = '''
from creditrl.config import Option, Range
from creditrl.rollout import HFRolloutEngine, register_rollout_engine


@register_rollout_engine("stamped_hf")
class StampedEngine(HFRolloutEngine):
    """The HF engine, stamping every response with its own option; cannot sample from LoRA."""

    supports_lora = False
    options = (Option("stamp", 7, "The number written on every response.", range=Range(1)),)

    def generate(self, prompts, **kwargs):
        batch = super().generate(prompts, **kwargs)
        batch["engine_stamp"] = [self.cfg.engine_kwargs["stamp"]] * len(batch)
        return batch
'''

LOSS_FILE = """
from creditrl.config import Option, Range
from creditrl.core import compute_policy_loss_ppo, register_policy_loss


@register_policy_loss(
    "ppo_shifted",
    options=("clip_ratio", Option("shift", 0.0, "Added to the loss.", range=Range(-10, 10))),
)
def ppo_shifted(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                config=None, rollout_is_weights=None, **agg_kwargs):
    loss, metrics = compute_policy_loss_ppo(old_log_prob, log_prob, advantages, response_mask,
                                            loss_agg_mode, config, rollout_is_weights,
                                            **agg_kwargs)
    return loss + config.kwargs["shift"], metrics
"""


def _extension(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return f"trainer.extensions=[{path}]"


def _doc(capsys: pytest.CaptureFixture[str], ext: str, section: str) -> str:
    """What `creditrl config EXTENSIONS --doc SECTION` prints (it must exit 0)."""
    from creditrl.cli import main

    assert main(["config", ext, "--doc", section]) == 0
    return capsys.readouterr().out


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    from creditrl.cli import main

    assert main(argv) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_an_engine_file_brings_its_option_and_trait(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An engine registered in one file (named by trainer.extensions) with an Option and the
    supports_lora trait: `config --doc` lists rollout.engine_kwargs.stamp, `config` refuses a
    bad stamp, an undeclared option and LoRA with one line each, and a training step's
    responses carry the stamp the config gave."""
    ext = _extension(tmp_path, "stamped_engine.py", ENGINE_FILE)
    doc = _doc(capsys, ext, "rollout.engine_kwargs.stamp")
    assert "rollout.engine_kwargs.stamp: int = 7" in doc
    assert "allowed: >= 1" in doc and "with rollout.engine=stamped_hf" in doc
    base = ["config", ext, "rollout.engine=stamped_hf"]
    error = _one_line_error(capsys, [*base, "rollout.engine_kwargs.stamp=0"])
    assert "rollout.engine_kwargs.stamp=0 must be >= 1" in error
    error = _one_line_error(capsys, [*base, "rollout.engine_kwargs.stamp=two"])
    assert "rollout.engine_kwargs.stamp='two' is not an int" in error
    error = _one_line_error(capsys, [*base, "rollout.engine_kwargs.stmp=3"])
    assert "rollout.engine_kwargs.stmp: not an option of rollout.engine=stamped_hf" in error
    assert "declares stamp" in error
    error = _one_line_error(capsys, [*base, "model.lora_rank=8"])
    assert "rollout.engine=stamped_hf with model.lora_rank > 0" in error
    error = _one_line_error(capsys, ["config", ext, "rollout.engine_kwargs.stamp=3"])
    assert "not an option of rollout.engine=hf (it declares decode_cache, sample_dtype)" in error

    cfg = tiny_trainer_config(tmp_path / "run", ext, "rollout.engine=stamped_hf", *ONE_STEP)
    assert cfg.rollout.engine_kwargs == {"stamp": 7}  # the declared default, filled in
    cfg = tiny_trainer_config(
        tmp_path / "run", ext, "rollout.engine=stamped_hf", "rollout.engine_kwargs.stamp=3",
        *ONE_STEP,
    )  # fmt: skip
    trainer = RLTrainer(cfg)
    trainer.fit()
    assert list(trainer.last_batch["engine_stamp"]) == [3] * 4


def test_a_loss_file_brings_its_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A loss registered in one file with an Option of its own: listed by `config --doc`,
    refused out of range or mistyped with one line, and read by the loss at every micro-batch
    (the shift shows in actor/pg_loss)."""
    ext = _extension(tmp_path, "shifted_loss.py", LOSS_FILE)
    doc = _doc(capsys, ext, "actor")
    assert "actor.policy_loss_kwargs.shift: float = 0" in doc
    assert "allowed: in [-10, 10]" in doc and "with actor.policy_loss=ppo_shifted" in doc
    base = ["config", ext, "actor.policy_loss=ppo_shifted"]
    error = _one_line_error(capsys, [*base, "actor.policy_loss_kwargs.shift=11"])
    assert "actor.policy_loss_kwargs.shift=11 must be in [-10, 10]" in error
    error = _one_line_error(capsys, [*base, "actor.policy_loss_kwargs.shift=true"])
    assert "actor.policy_loss_kwargs.shift=true is not a number" in error

    cfg = tiny_trainer_config(
        tmp_path / "run", ext, "actor.policy_loss=ppo_shifted",
        "actor.policy_loss_kwargs.shift=5", *ONE_STEP,
    )  # fmt: skip
    assert cfg.actor.policy_loss_kwargs == {"shift": 5.0}
    RLTrainer(cfg).fit()
    assert read_metrics(tmp_path / "run")[1]["actor/pg_loss"] > 4.0


NEW_KEY = '''    total_steps: int = field(default=30, metadata=meta(range=AT_LEAST_1))
    """Training steps, each over data.train_batch_size prompts."""
    warm_prompts: int = field(default=3, metadata=meta(range=AT_LEAST_1))
    """Prompts to warm up on (a key added for tests/test_extending.py)."""
'''


def test_a_config_key_is_added_in_schema_py_alone(tmp_path: Path) -> None:
    """A copy of the package with one field added to config/schema.py (its type, default,
    range and doc in that one place): `config --doc` lists it, `config` refuses a bad value
    with one line, and a good one reaches the resolved config."""
    import shutil
    import subprocess
    import sys

    import creditrl

    package = Path(creditrl.__file__).parent
    copy = tmp_path / "creditrl"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    schema = copy / "config" / "schema.py"
    old = NEW_KEY.split("    warm_prompts")[0]
    text = schema.read_text()
    assert text.count(old) == 1
    schema.write_text(text.replace(old, NEW_KEY))

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        code = f"import sys; from creditrl.cli import main; sys.exit(main({list(argv)!r}))"
        env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "COLUMNS": "100"}
        return subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
        )

    doc = cli("config", "--doc", "trainer.warm_prompts")
    assert doc.returncode == 0, doc.stderr
    assert "trainer.warm_prompts: int = 3" in doc.stdout and "allowed: >= 1" in doc.stdout
    assert "Prompts to warm up on" in doc.stdout
    bad = cli("config", "trainer.warm_prompts=0")
    assert bad.returncode == 2
    lines = bad.stdout.strip().splitlines()
    assert len(lines) == 1 and "trainer.warm_prompts=0 must be >= 1" in lines[0]
    good = cli("config", "trainer.warm_prompts=5")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "warm_prompts: 5" in good.stdout

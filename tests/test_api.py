"""``creditrl.train``, the Python API: the README's example runs as written (only the model path,
the output dir and the sizes swapped for the tiny test model), with a list of dicts and with a
``datasets.Dataset``; mistakes in rows, reward functions and config are one-line errors raised
before any model is built."""

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import creditrl
import creditrl.api
from creditrl.errors import ConfigError, DataError, UserCodeError
from creditrl.models.tiny import tiny_model_dir
from creditrl.rewards import SCORERS

README = Path(__file__).resolve().parents[1] / "README.md"
TINY = {
    "data.train_batch_size": 2,
    "rollout.n": 2,
    "rollout.max_response_length": 8,
    "actor.ppo_mini_batch_size": 1,
    "actor.ppo_micro_batch_size": 2,
    "actor.use_rollout_log_probs": False,
    "trainer.total_steps": 1,
    "trainer.val_before_train": False,
    "trainer.test_freq": 1,
    "trainer.logger": ["jsonl"],
}


def readme_example() -> str:
    """The python block of the README's "Python API" section."""
    section = README.read_text(encoding="utf-8").split("\n## Python API\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README's Python API section has no python block"
    return match.group(1)


def run_readme(
    monkeypatch: pytest.MonkeyPatch, out: Path, as_data: Callable[[Any], Any] = lambda rows: rows
) -> tuple[dict[str, Any], dict[str, Any], list[tuple[str, Any]]]:
    """Execute the README example with ``creditrl.train`` wrapped: the tiny model, ``out`` and
    TINY's sizes replace the example's, ``as_data`` converts its rows, and every reward call is
    recorded. Returns the example's namespace, the arguments it passed, and the calls."""
    real = creditrl.api.train
    passed: dict[str, Any] = {}
    calls: list[tuple[str, Any]] = []

    def train(model, reward_fn, train_data, val_data=None, **kwargs):
        passed.update(model=model, train_data=train_data, val_data=val_data, **kwargs)

        def counted(completion: str, ground_truth: Any) -> float:
            calls.append((completion, ground_truth))
            return reward_fn(completion, ground_truth)

        config = {**kwargs.pop("config", {}), **TINY}
        kwargs.update(output_dir=out, config=config)
        return real(tiny_model_dir(), counted, as_data(train_data), as_data(val_data), **kwargs)

    monkeypatch.setattr(creditrl, "train", train)
    namespace: dict[str, Any] = {}
    exec(compile(readme_example(), str(README), "exec"), namespace)
    return namespace, passed, calls


def check_run(namespace: dict[str, Any], passed: dict[str, Any], calls: list, out: Path) -> None:
    """One step trained on the example's rows, validated on its val rows, with its reward."""
    assert isinstance(passed["model"], str) and passed["output_dir"] == "runs/api"
    rows, val = passed["train_data"], passed["val_data"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]
    step = metrics[0]
    for key in ("actor/pg_loss", "critic/score/mean", "val/score", "val/api/score"):
        assert key in step, key
    summary = namespace["summary"]
    assert summary.output_dir == out and summary.val_after["val/score"] == step["val/score"]
    # 2 prompts x rollout.n 2 trained, then every validation row once (greedy)
    assert len(calls) == 2 * 2 + len(val)
    truths = {row["ground_truth"] for row in rows} | {row["ground_truth"] for row in val}
    assert all(isinstance(text, str) and truth in truths for text, truth in calls)
    assert [c[1] for c in calls[4:]] == [row["ground_truth"] for row in val]
    written = (out / "data" / "train.jsonl").read_text().splitlines()
    assert len(written) == len(rows) == 90
    assert json.loads(written[0])["messages"] == [{"role": "user", "content": rows[0]["prompt"]}]
    assert not [name for name in SCORERS if name.startswith("creditrl.train/")]


def test_readme_example_with_a_list_of_dicts(monkeypatch, tmp_path: Path) -> None:
    """The README's Python API example trains and validates on the tiny model: metrics written,
    the example's reward function called on every trained and validated response, its
    temporary scorer registration removed afterwards."""
    namespace, passed, calls = run_readme(monkeypatch, tmp_path / "run")
    check_run(namespace, passed, calls, tmp_path / "run")


def test_readme_example_with_a_datasets_dataset(monkeypatch, tmp_path: Path) -> None:
    """The same example with its rows given as ``datasets.Dataset`` objects."""
    datasets = pytest.importorskip("datasets")
    namespace, passed, calls = run_readme(
        monkeypatch, tmp_path / "run", lambda rows: datasets.Dataset.from_list(rows)
    )
    check_run(namespace, passed, calls, tmp_path / "run")


@pytest.fixture
def no_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a trainer (and so any model) fails the test."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a trainer was built before the mistake was reported")

    monkeypatch.setattr("creditrl.trainers.rl_trainer.RLTrainer", refuse)


def ok(completion: str, ground_truth: Any) -> float:
    return 1.0


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (
            {"train_data": [{"prompt": "2 + 2?"}, {"ground_truth": "4"}]},
            DataError,
            "train_data row 2 has no prompt or messages",
        ),
        (
            {"train_data": [{"prompt": "hi"}], "val_data": [{"prompt": ""}]},
            DataError,
            "val_data row 1 has an empty prompt",
        ),
        ({"train_data": []}, DataError, "train_data has no rows"),
        (
            {"train_data": {"train": [], "test": []}},
            DataError,
            "train_data: got a mapping with keys ['test', 'train']; pass a list of row dicts",
        ),
        (
            {"reward_fn": lambda completion: 1.0},
            UserCodeError,
            "reward_fn: <lambda> has signature (completion) but is called as "
            "reward_fn(completion, ground_truth)",
        ),
        ({"reward_fn": "ok"}, UserCodeError, "reward_fn: got 'ok' (str), not a function"),
        (
            {"config": {"reward": {"num_workers": 2}}},
            ConfigError,
            "config['reward.num_workers']: creditrl.train sets reward.num_workers to 0: "
            "reward_fn is called in this process; remove it from config",
        ),
        ({"config": {"model.path": "x"}}, ConfigError, "config['model.path']: creditrl.train sets"),
        ({"config": {"rollout.nn": 8}}, ConfigError, "did you mean 'rollout.n'?"),
        ({"config": {"rollout.n": 0}}, ConfigError, "rollout.n"),
        ({"model": "/no/such/model"}, ConfigError, "model.path='/no/such/model' is neither"),
    ],
)
def test_mistakes_are_one_line_errors_before_any_model(
    no_trainer, tmp_path: Path, kwargs: dict, error: type, message: str
) -> None:
    """Each mistake raises its UserError subclass with a one-line message naming the row,
    argument or key; no trainer is built and no data file written."""
    args = {"model": tiny_model_dir(), "reward_fn": ok, "train_data": [{"prompt": "hi"}]}
    args.update(kwargs)
    with pytest.raises(error) as caught:
        creditrl.train(output_dir=tmp_path / "run", **args)
    text = str(caught.value)
    assert message in text and "\n" not in text
    assert not (tmp_path / "run").exists()


def test_reward_fn_forms() -> None:
    """A (completion, ground_truth) function is adapted to the scorer signature (with
    reward.scorer_kwargs passed on); a function with the scorer signature is used as is."""

    def simple(completion: str, ground_truth: Any, bonus: float = 0.0) -> float:
        return float(completion == ground_truth) + bonus

    def scorer(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return {"score": 0.5, "source": data_source}

    adapted = creditrl.api.as_scorer(simple, {"bonus": 0.25})
    assert adapted("api", "4", "4", {}, bonus=0.25) == 1.25
    assert adapted("api", "5", "4", None) == 0.0
    assert creditrl.api.as_scorer(scorer, {}) is scorer
    with pytest.raises(UserCodeError, match=r"reward\.scorer_kwargs"):
        creditrl.api.as_scorer(simple, {"malus": 1})

"""User mistakes in data, rewards, tools and user code refused up front, each in one line:
``creditrl.usercode`` (one loader for ``file.py:name``), the scorer signature check, the
``reward.max_failure_rate`` stop, data-file errors, and ``creditrl.preflight``."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import restore_registries

from creditrl.batch import Batch
from creditrl.config.schema import Config, DataConfig, RewardConfig
from creditrl.core import ADV_ESTIMATORS, compute_advantage
from creditrl.data import build_datasets, chat_prompt_ids
from creditrl.errors import ConfigError, DataError, UserCodeError
from creditrl.preflight import preflight
from creditrl.rewards import ScoringError, check_scorer_signature
from creditrl.rewards.manager import RewardManager
from creditrl.usercode import load_user_object, resolve_adv_estimator


def one_line(info: pytest.ExceptionInfo) -> str:
    """The exception's message, asserted to be a single line."""
    message = str(info.value)
    assert "\n" not in message and message.strip() == message
    return message


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def row(source: str = "gsm8k", **over) -> dict:
    return {"prompt": "What is 2 + 3?", "ground_truth": "5", "data_source": source, **over}


# ---- one loader for user code ----------------------------------------------------------------


def test_missing_file_names_key_and_path(tmp_path: Path) -> None:
    """A user-code file that does not exist: UserCodeError '<key>: <abs path> does not exist'."""
    with pytest.raises(UserCodeError) as info:
        load_user_object(f"{tmp_path}/missing.py:fn", "reward.scorer")
    assert one_line(info) == f"reward.scorer: {tmp_path}/missing.py does not exist"


def test_missing_function_names_file_function_and_choices(tmp_path: Path) -> None:
    """A name the file does not define: the file, the name and the callables it has."""
    path = write(tmp_path / "my.py", "def score(*a):\n    return 1\n")
    with pytest.raises(UserCodeError) as info:
        load_user_object(f"{path}:fn", "reward.scorer")
    assert (
        one_line(info) == f"reward.scorer: {path} has no function 'fn'; callables there: ['score']"
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("x = 1\ny = 1 / 0\n", "ZeroDivisionError: division by zero (at {p}:2)"),
        ("def f(:\n    pass\n", "SyntaxError: invalid syntax (my_bad.py, line 1) (at {p}:1)"),
        (
            "import no_such_module_xyz\n",
            "ModuleNotFoundError: No module named 'no_such_module_xyz'",
        ),
    ],
)
def test_file_that_fails_to_import_is_one_line_with_type_and_line(
    tmp_path: Path, source: str, expected: str
) -> None:
    """Importing a broken file: one line with the exception type, message and file:line."""
    path = write(tmp_path / "my_bad.py", source)
    with pytest.raises(UserCodeError) as info:
        load_user_object(f"{path}:fn", "agent.tool_config: t.yaml tools[0] function")
    message = one_line(info)
    assert message.startswith(f"agent.tool_config: t.yaml tools[0] function: importing {path}")
    assert expected.format(p=path) in message


def test_module_specs_and_malformed_specs() -> None:
    """'package.module:name' loads; a missing module or a spec without ':' is one line."""
    assert load_user_object("json:dumps", "reward.scorer") is json.dumps
    with pytest.raises(UserCodeError) as info:
        load_user_object("no_such_pkg_xyz.mod:fn", "reward.scorer")
    assert one_line(info).startswith("reward.scorer: no module named 'no_such_pkg_xyz.mod'")
    with pytest.raises(UserCodeError) as info:
        load_user_object("score.py", "reward.scorer")
    assert "reward.scorer: 'score.py' is not 'path/to/file.py:name'" in one_line(info)


# ---- scorer signature ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "kwargs"),
    [
        ("data_source, solution_str, ground_truth, extra_info=None, **kwargs", {}),
        ("data_source, solution_str, ground_truth, extra_info", {}),
        ("*args, **kwargs", {"bonus": 1}),
        ("data_source, solution_str, ground_truth, extra_info=None, bonus=0.0", {"bonus": 1}),
        ("a, b, c, d=None, *, bonus=0.0", {"bonus": 1}),
    ],
)
def test_scorer_signature_accepted(tmp_path: Path, params: str, kwargs: dict) -> None:
    """Scorers that can take fn(data_source, solution_str, ground_truth, extra_info, **kw)."""
    path = write(tmp_path / "ok.py", f"def fn({params}):\n    return 1.0\n")
    check_scorer_signature(load_user_object(f"{path}:fn", "reward.scorer"), f"{path}:fn", kwargs)


@pytest.mark.parametrize(
    ("params", "kwargs", "why"),
    [
        ("solution_str, ground_truth", {}, "too many positional arguments"),
        ("data_source, solution_str, ground_truth, extra_info, mode", {}, "'mode'"),
        ("data_source, solution_str, ground_truth, extra_info=None", {"bonus": 1}, "'bonus'"),
        ("a, b, c, d, *, scale", {}, "'scale'"),
    ],
)
def test_scorer_signature_refused_at_load(tmp_path: Path, params: str, kwargs: dict, why: str):
    """A scorer that cannot take the documented call is refused when loaded (preflight), in
    one line naming the key, file, function, its signature and the expected one."""
    path = write(tmp_path / "wrong.py", f"def fn({params}):\n    return 1.0\n")
    cfg = Config()
    cfg.reward.scorer = f"{path}:fn"
    cfg.reward.scorer_kwargs = kwargs
    with pytest.raises(UserCodeError) as info:
        preflight(cfg)
    message = one_line(info)
    assert message.startswith(f"reward.scorer: scorer {path}:fn has signature ({params})")
    assert why in message
    assert message.endswith(
        "expected (data_source, solution_str, ground_truth, extra_info=None, **kwargs)"
    )


# ---- reward.max_failure_rate -----------------------------------------------------------------


def scored_batch(tokenizer, texts: list[str]) -> Batch:
    """Responses (one per text, right-padded with EOS) with data_source 'toy'."""
    ids = [[*tokenizer.encode(t, add_special_tokens=False), tokenizer.eos_token_id] for t in texts]
    width = max(map(len, ids))
    responses = torch.full((len(ids), width), tokenizer.eos_token_id, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for i, x in enumerate(ids):
        responses[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), 1
    n = len(texts)
    return Batch(
        {"responses": responses, "response_mask": mask},
        {"data_source": ["toy"] * n, "ground_truth": ["1"] * n, "extra_info": [{}] * n},
    )


FLAKY_SCORER = """
def fn(data_source, solution_str, ground_truth, extra_info=None):
    if "bad" in solution_str:
        return 1 / 0
    return 1.0
"""


@pytest.mark.parametrize("bad", [3, 1])
def test_failure_rate_stops_the_step_above_the_limit_counts_below(tokenizer, tmp_path, bad):
    """More than max_failure_rate of a batch failing raises ScoringError quoting the first
    error (scorer, sample, data_source, exception); at or below it, failures get the fallback
    score and are counted in reward/errors."""
    path = write(tmp_path / "flaky.py", FLAKY_SCORER)
    cfg = RewardConfig(scorer=f"{path}:fn", num_workers=0, fallback_score=-1.0)
    texts = ["good"] * (4 - bad) + ["bad"] * bad
    with RewardManager(cfg, tokenizer) as manager:
        future = manager.submit(scored_batch(tokenizer, texts))
        if bad == 1:
            result = future.result(timeout=30)
            assert result.scores.tolist() == [1.0, 1.0, 1.0, -1.0]
            assert result.metrics["reward/errors"] == 1
            return
        with pytest.raises(ScoringError) as info:
            future.result(timeout=30)
    message = one_line(info)
    assert message.startswith(
        "reward: 3 of 4 samples failed to score (max_failure_rate 0.5); first error: "
        f"{path}:fn on sample 1 (data_source 'toy'): ZeroDivisionError: division by zero"
    )
    assert f"(at {path}:4)" in message


def test_scorer_failing_every_sample_stops_the_run(tokenizer, tmp_path) -> None:
    """A scorer whose signature is wrong (loaded past preflight) fails every sample: the step
    raises ScoringError instead of training on the fallback score."""
    path = write(tmp_path / "two_args.py", "def fn(solution_str, ground_truth):\n    return 1\n")
    cfg = RewardConfig(scorer=f"{path}:fn", num_workers=0)
    with RewardManager(cfg, tokenizer) as manager, pytest.raises(ScoringError) as info:
        manager(scored_batch(tokenizer, ["a", "b"]))
    assert "2 of 2 samples failed" in one_line(info) and "has signature" in one_line(info)


def test_max_failure_rate_out_of_range_is_a_config_error(tokenizer) -> None:
    """reward.max_failure_rate outside [0, 1] is refused when the manager is built."""
    with pytest.raises(
        ConfigError, match=r"^reward\.max_failure_rate must be in \[0, 1\], got 1\.5$"
    ):
        RewardManager(RewardConfig(num_workers=0, max_failure_rate=1.5), tokenizer)


# ---- data files ------------------------------------------------------------------------------


GOOD = b'{"prompt": "a", "ground_truth": 1, "data_source": "gsm8k"}\n'


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (GOOD + b"{oops\n", "row 2 of {p} is not valid JSON"),
        (GOOD + b'{"prompt": "\xff"}\n', "row 2 of {p} is not UTF-8: byte 12 of the line is"),
        (b'{"prompt": "a", "data_source": "gsm8k"}\n', "row 1 of {p} has no ground_truth"),
        (
            b'{"prompt": "a", "ground_truth": 1}\n',
            "row 1 of {p}: 'data_source' must be a non-empty str, got missing",
        ),
    ],
)
def test_bad_rows_name_file_and_row(tmp_path: Path, content: bytes, expected: str) -> None:
    """Rows that are not JSON, not UTF-8 or lack a field: DataError naming file and row,
    raised by preflight before any model."""
    path = tmp_path / "train.jsonl"
    path.write_bytes(content)
    cfg = Config()
    cfg.data.train_files = [str(path)]
    with pytest.raises(DataError) as info:
        preflight(cfg)
    assert one_line(info).startswith(expected.format(p=path))


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    """A missing data file names its key; an unreadable parquet file names the file."""
    cfg = Config()
    cfg.data.train_files = [str(jsonl(tmp_path / "t.jsonl", [row()]))]
    cfg.data.val_files = [str(tmp_path / "nope.jsonl")]
    with pytest.raises(DataError) as info:
        preflight(cfg)
    assert one_line(info) == f"data.val_files: {tmp_path}/nope.jsonl does not exist"
    (tmp_path / "x.parquet").write_bytes(b"not parquet at all")
    cfg.data.val_files = [str(tmp_path / "x.parquet")]
    with pytest.raises(DataError) as info:
        preflight(cfg)
    assert one_line(info).startswith(f"{tmp_path}/x.parquet is not a readable parquet file: ")


def test_utf8_bom_is_accepted(tmp_path: Path) -> None:
    """A UTF-8 byte-order mark before the first row is not an error."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(row()).encode() + b"\n")
    cfg = Config()
    cfg.data.train_files, cfg.data.val_files = [str(path)], [str(path)]
    assert preflight(cfg) == []


def test_every_prompt_too_long_names_files_limit_and_shortest(tokenizer, tmp_path) -> None:
    """When every prompt is over data.max_prompt_length, the error names the files, the
    limit and the shortest prompt's length."""
    path = jsonl(tmp_path / "t.jsonl", [row(prompt="one two"), row(prompt="one two three four")])
    shortest = len(chat_prompt_ids(tokenizer, [{"role": "user", "content": "one two"}]))
    cfg = DataConfig(task=None, train_files=[str(path)], max_prompt_length=shortest - 1)
    with pytest.raises(DataError) as info:
        build_datasets(cfg, tokenizer)
    assert one_line(info) == (
        f"all 2 prompts of data.train_files [{path}] are longer than "
        f"data.max_prompt_length={shortest - 1} tokens after the chat template "
        f"(shortest: {shortest}); raise data.max_prompt_length"
    )


# ---- data_source without a scorer, validation notice -----------------------------------------


def test_data_source_without_scorer_found_at_load(tmp_path: Path) -> None:
    """A data_source no scorer serves is refused by preflight, naming the key, the first row
    and the registered scorers; reward.scorer forcing one scorer makes it fine."""
    path = jsonl(tmp_path / "t.jsonl", [row("gsm8k"), row("foo"), row("foo")])
    cfg = Config()
    cfg.data.train_files = [str(path)]
    with pytest.raises(DataError) as info:
        preflight(cfg)
    assert one_line(info) == (
        f"data.train_files: rows with data_source 'foo' (first: row 2 of {path}) have no "
        "scorer; registered: gsm8k, math, reasoning_gym; or set reward.scorer=path.py:fn"
    )
    scorer = write(tmp_path / "s.py", "def fn(data_source, solution_str, *rest):\n    return 0\n")
    cfg.reward.scorer = f"{scorer}:fn"
    assert preflight(cfg) == [
        "data.val_files is empty: validation is off (no val/score); set data.val_files to "
        "measure held-out reward"
    ]


def test_scorer_kwargs_a_builtin_cannot_take(tmp_path: Path) -> None:
    """reward.scorer_kwargs the data_source's scorer cannot take: refused naming both."""
    cfg = Config()
    cfg.data.train_files = [str(jsonl(tmp_path / "t.jsonl", [row("math")]))]
    cfg.data.val_files = cfg.data.train_files
    cfg.reward.scorer_kwargs = {"format_reward": 2.0}
    with pytest.raises(UserCodeError) as info:
        preflight(cfg)
    message = one_line(info)
    assert message.startswith("data.train_files: data_source 'math': scorer 'math' has signature")
    assert "unexpected keyword argument 'format_reward'" in message


def test_builtin_task_passes_and_agent_task_needs_a_scorer() -> None:
    """The default reasoning-gym task passes with no notice; an agent task without the
    structured reward manager has no rule scorer, found before any model."""
    assert preflight(Config()) == []
    cfg = Config()
    cfg.data.task = "kgqa"
    with pytest.raises(DataError, match=r"^data\.task: rows with data_source 'kgqa'"):
        preflight(cfg)
    cfg.agent.enable = True
    assert preflight(cfg) == []


# ---- tools -----------------------------------------------------------------------------------


def test_tool_mistakes_are_one_line(tmp_path: Path) -> None:
    """agent.tools / agent.tool_config mistakes: unknown built-in, missing or unparsable file,
    bad entry, user tool code that does not load."""
    cfg = Config()
    cfg.agent.enable = True
    cfg.agent.tools = ["calculator", "magic"]
    with pytest.raises(ConfigError, match=r"^agent\.tools: tool 'magic' is not a built-in"):
        preflight(cfg)
    cfg.agent.tools = ["calculator"]
    cfg.agent.tool_config = str(tmp_path / "none.yaml")
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    assert one_line(info) == f"agent.tool_config: {tmp_path}/none.yaml does not exist"
    cases = [
        ("tools: [unclosed\n", ConfigError, "is not valid YAML"),
        ("tools:\n  - name: t\n    timeout_s: -1\n", ConfigError, "timeout_s must be a number > 0"),
        ("tools:\n  - name: t\n    function: nope.py:f\n", UserCodeError, "tools[0] function: "),
    ]
    for text, error, expected in cases:
        cfg.agent.tool_config = str(write(tmp_path / "tools.yaml", text))
        with pytest.raises(error) as info:
            preflight(cfg)
        assert one_line(info).startswith(f"agent.tool_config: {tmp_path}/tools.yaml")
        assert expected in str(info.value)
    code = write(tmp_path / "mytools.py", "def shout(text: str) -> str:\n    return text\n")
    cfg.agent.tool_config = str(
        write(tmp_path / "tools.yaml", f"tools:\n  - name: shout\n    function: {code}:shout\n")
    )
    assert preflight(cfg) == []


# ---- a user advantage estimator named by file.py:name ----------------------------------------


ESTIMATOR = """
from creditrl.core import register_adv_est

@register_adv_est("{name}")
def outcome_sum(token_level_rewards, response_mask, index=None, **_):
    total = (token_level_rewards * response_mask).sum(-1, keepdim=True)
    return total * response_mask, total * response_mask
"""


@pytest.fixture
def estimators(monkeypatch: pytest.MonkeyPatch):
    """ADV_ESTIMATORS restored after the test (a registered toy estimator would otherwise
    join the property tests that run every estimator)."""
    restore_registries(monkeypatch, ADV_ESTIMATORS)


def test_user_estimator_from_file_end_to_end(tmp_path: Path, estimators) -> None:
    """algorithm.adv_estimator=file.py:name registers and resolves to name, passes preflight
    and runs through compute_advantage."""
    path = write(tmp_path / "est.py", ESTIMATOR.format(name="outcome_sum_test"))
    spec = f"{path}:outcome_sum_test"
    assert resolve_adv_estimator(spec) == "outcome_sum_test"
    assert resolve_adv_estimator(spec) == "outcome_sum_test"  # loaded once, idempotent
    cfg = Config()
    cfg.algorithm.adv_estimator = spec
    assert preflight(cfg) == []
    rewards = torch.tensor([[0.0, 2.0, 0.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv, returns = compute_advantage("outcome_sum_test", rewards, mask, ["a", "a"])
    assert adv.tolist() == [[2.0, 2.0, 0.0], [1.0, 0.0, 0.0]]
    assert torch.equal(adv, returns)


def test_estimator_spec_mistakes(tmp_path: Path, estimators) -> None:
    """A file that registers no estimator under the name, or an unknown plain name."""
    path = write(tmp_path / "est2.py", ESTIMATOR.format(name="other_name_test"))
    with pytest.raises(UserCodeError) as info:
        resolve_adv_estimator(f"{path}:wanted")
    assert one_line(info).startswith(
        f"algorithm.adv_estimator: {path} registers no estimator 'wanted'"
    )
    with pytest.raises(ConfigError, match=r"^algorithm\.adv_estimator: unknown estimator 'grpoo'"):
        resolve_adv_estimator("grpoo")


def test_structured_reward_manager_honours_max_failure_rate(tokenizer, tmp_path) -> None:
    """The agent (structured) reward manager stops the step the same way above the limit."""
    from creditrl.agents.rewards import StructuredRewardManager
    from creditrl.config.schema import AgentConfig

    path = write(tmp_path / "flaky.py", FLAKY_SCORER)
    cfg = RewardConfig(scorer=f"{path}:fn", max_failure_rate=0.25)
    manager = StructuredRewardManager(cfg, AgentConfig(), tokenizer)
    assert manager(scored_batch(tokenizer, ["good", "good", "good", "bad"])).scores[3] == 0.0
    with pytest.raises(ScoringError) as info:
        manager(scored_batch(tokenizer, ["good", "good", "bad", "bad"]))
    assert one_line(info).startswith(
        "reward: 2 of 4 samples failed to score (max_failure_rate 0.25); first error: "
        "sample 2 (data_source 'toy'): ZeroDivisionError: division by zero"
    )

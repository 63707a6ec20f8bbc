"""``creditrl.train``: the ``creditrl train`` pipeline called from Python, for TRL users.

The rows are validated, the config is loaded and checked exactly as the CLI's, and only then
are the rows written as jsonl under ``OUTPUT_DIR/data/`` (named by ``data.train_files`` /
``data.val_files``). The reward function is registered as a scorer for the run
(``reward.scorer``) and called in this process (``reward.num_workers=0``), so a lambda or a
closure works and nothing is pickled. Then ``RLTrainer(cfg).fit()`` runs, as in
``creditrl train``.
"""

from __future__ import annotations

import inspect
import itertools
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from creditrl.errors import ConfigError, DataError, UserCodeError

if TYPE_CHECKING:
    from creditrl.trainers.rl_trainer import RunSummary

__all__ = ["API_KEYS", "DEFAULT_DATA_SOURCE", "REWARD_FN_FORMS", "as_scorer", "train"]

DEFAULT_DATA_SOURCE = "api"
REWARD_FN_FORMS = (
    "fn(completion: str, ground_truth) -> float, or the scorer form "
    "fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict"
)
# Config keys ``train`` sets itself, and from what; ``config`` may not set them too.
API_KEYS = {
    "model.path": "from the model argument",
    "data.train_files": "from train_data",
    "data.val_files": "from val_data",
    "reward.scorer": "to reward_fn",
    "reward.num_workers": "to 0: reward_fn is called in this process",
    "trainer.output_dir": "from output_dir",
}
_runs = itertools.count()


def train(
    model: str | os.PathLike[str],
    reward_fn: Callable[..., Any],
    train_data: Iterable[Mapping[str, Any]],
    val_data: Iterable[Mapping[str, Any]] | None = None,
    *,
    output_dir: str | os.PathLike[str] = "runs/api",
    config: Mapping[str, Any] | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> RunSummary:
    """Train ``model`` on ``train_data`` with ``reward_fn``, as ``creditrl train`` does.

    - ``model``: a local Hugging Face model directory (or ``"embedded"``).
    - ``reward_fn``: ``fn(completion, ground_truth) -> float`` (the decoded response and the
      row's ``ground_truth``), or the scorer form ``fn(data_source, solution_str, ground_truth,
      extra_info=None, **kwargs) -> float | dict`` (a dict holds ``"score"``). A call that
      raises or returns a non-number scores ``reward.fallback_score`` and is counted.
    - ``train_data`` / ``val_data``: a list of dicts or a ``datasets.Dataset``; each row has
      ``prompt`` (text or a chat list) or ``messages``; ``ground_truth`` (None when absent),
      ``data_source`` (``"api"`` when absent) and ``extra`` are optional; other keys are
      ignored. Without ``val_data`` there is no validation.
    - ``config``: dotted config keys to values, e.g. ``{"rollout.n": 8, "actor.optim.lr":
      1e-6, "preset": "ppo"}``, applied like the CLI's ``key=value`` overrides, after
      ``config_file`` (a YAML file like the CLI's ``CONFIG.yaml``).

    Returns the RunSummary (``output_dir``, ``val_before``, ``val_after``, ``rewards``). A
    mistake raises a one-line UserError (ConfigError, DataError, UserCodeError) before any
    model loads. Rerunning into the same ``output_dir`` resumes from its last checkpoint.
    """
    from rich.console import Console

    from creditrl.config.loader import load_config_with_sources
    from creditrl.console import print_warning
    from creditrl.rewards.registry import SCORERS
    from creditrl.trainers.rl_trainer import RLTrainer

    if not callable(reward_fn):
        raise UserCodeError(
            f"reward_fn: got {reward_fn!r} ({type(reward_fn).__name__}), not a function; "
            f"give {REWARD_FN_FORMS}"
        )
    user = dict(config or {})
    overrides = [_override(key, value) for key, value in user.items()]
    for key, source in API_KEYS.items():
        if _sets(user, key):
            raise ConfigError(
                f"config[{key!r}]: creditrl.train sets {key} {source}; remove it from config"
            )
    out = Path(output_dir)
    files = {"train": _rows(train_data, "train_data")}
    if val_data is not None:
        files["val"] = _rows(val_data, "val_data")
    paths = {split: (out / "data" / f"{split}.jsonl").resolve() for split in files}
    name = f"creditrl.train/{getattr(reward_fn, '__name__', 'reward_fn')}/{next(_runs)}"
    overrides += [
        _override("model.path", os.fspath(model)),
        _override("data.train_files", [str(paths["train"])]),
        _override("data.val_files", [str(paths["val"])] if "val" in paths else []),
        _override("reward.scorer", name),
        "reward.num_workers=0",
        _override("trainer.output_dir", str(out)),
    ]
    loaded = load_config_with_sources(config_file, overrides)
    cfg = loaded.config
    scorer = as_scorer(reward_fn, cfg.reward.scorer_kwargs)
    for split, rows in files.items():
        _write_rows(rows, paths[split])
    console = Console(highlight=False, emoji=False)
    for line in loaded.warnings:
        print_warning(console, line)
    SCORERS[name] = scorer
    try:
        return RLTrainer(cfg, console=console).fit()
    finally:
        if SCORERS.get(name) is scorer:
            del SCORERS[name]


def as_scorer(reward_fn: Callable[..., Any], scorer_kwargs: Mapping[str, Any]) -> Callable:
    """``reward_fn`` as a scorer (the documented scorer signature), its signature checked.

    The scorer form is recognised by a parameter named ``solution_str`` or a first parameter
    named ``data_source`` and used as is; any other function is called as
    ``reward_fn(completion, ground_truth, **reward.scorer_kwargs)``.
    """
    from creditrl.rewards.registry import check_scorer_signature

    label = getattr(reward_fn, "__qualname__", repr(reward_fn))
    try:
        signature = inspect.signature(reward_fn)
    except (TypeError, ValueError):
        signature = None
    names = list(signature.parameters) if signature is not None else []
    if "solution_str" in names or names[:1] == ["data_source"]:
        check_scorer_signature(reward_fn, label, scorer_kwargs, "reward_fn")
        return reward_fn
    if signature is not None:
        try:
            signature.bind("completion", None, **scorer_kwargs)
        except TypeError as e:
            given = f" with reward.scorer_kwargs {sorted(scorer_kwargs)}" if scorer_kwargs else ""
            raise UserCodeError(
                f"reward_fn: {label} has signature {signature} but is called as "
                f"reward_fn(completion, ground_truth){given}: {e}; give {REWARD_FN_FORMS}"
            ) from None

    def scorer(
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        return reward_fn(solution_str, ground_truth, **kwargs)

    scorer.__qualname__ = scorer.__name__ = f"reward_fn({label})"
    return scorer


def _override(key: Any, value: Any) -> str:
    """``key=value`` for the loader, the value written as YAML (JSON is YAML)."""
    if not isinstance(key, str):
        raise ConfigError(f"config: key {key!r} is not a string; use dotted keys like 'rollout.n'")
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, float) and not math.isfinite(value):
        text = ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
        return f"{key}={text}"
    try:
        return f"{key}={json.dumps(value)}"
    except (TypeError, ValueError):
        raise ConfigError(
            f"config[{key!r}]: {value!r} ({type(value).__name__}) is not a config value; "
            "give a number, string, bool, None, list or dict"
        ) from None


def _sets(tree: Mapping[str, Any], key: str) -> bool:
    """Whether ``tree`` (dotted keys and/or nested sections) sets the dotted ``key``."""
    for name, value in tree.items():
        if name == key:
            return True
        inside = isinstance(name, str) and key.startswith(name + ".")
        if inside and isinstance(value, Mapping) and _sets(value, key[len(name) + 1 :]):
            return True
    return False


def _rows(data: Any, what: str) -> list[dict[str, Any]]:
    """The rows of ``data`` (a list of dicts, a ``datasets.Dataset``, any iterable of dicts),
    each validated (DataError naming ``what`` and the row, from 1) and put in file form."""
    from creditrl.data.rows import parse_row

    if isinstance(data, str | bytes | os.PathLike):
        raise DataError(
            f"{what}: got the path {os.fsdecode(data)!r}; pass the rows (a list of dicts or a "
            "datasets.Dataset), or train from files with the CLI's data.train_files"
        )
    if isinstance(data, Mapping):
        raise DataError(
            f"{what}: got a mapping with keys {sorted(map(str, data))[:5]}; pass a list of row "
            "dicts or a datasets.Dataset (for a DatasetDict pick a split, e.g. data['train'])"
        )
    if not isinstance(data, Iterable):
        raise DataError(
            f"{what}: a {type(data).__name__} is not rows; pass a list of dicts or a "
            "datasets.Dataset"
        )
    rows = []
    for number, raw in enumerate(data, start=1):
        obj = dict(raw) if isinstance(raw, Mapping) else raw
        if isinstance(obj, dict):
            obj.setdefault("ground_truth", None)
            if obj.get("data_source") is None:
                obj["data_source"] = DEFAULT_DATA_SOURCE
        row = parse_row(obj, f"{what} row {number}")
        rows.append(
            {
                "messages": row.messages,
                "ground_truth": row.ground_truth,
                "data_source": row.data_source,
                "extra": row.extra,
            }
        )
    if not rows:
        raise DataError(f"{what} has no rows")
    return rows


def _write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    """``rows`` as a jsonl file at ``path`` (written to a temporary name, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)

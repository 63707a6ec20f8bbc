"""A verifiers environment trained unchanged: ``env.verifiers=FILE_OR_MODULE:load_environment``.

creditrl calls ``load_environment(**env.kwargs)`` once per process and takes what it returns;
what that is picks the path (verifiers ``>=0.3,<0.5``):

- a ``verifiers.Environment`` (``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv`` and the other
  classic environments of verifiers 0.3; 0.4 keeps only ``verifiers.v1``): this module;
- a ``verifiers.v1.Env`` (verifiers 0.4, and 0.3's ``verifiers.v1``): a taskset played by a
  harness program, its episodes run in process (``creditrl.environments.verifiers_v1``).

A classic environment:

- rows: its ``dataset`` is the training prompts (the first ``data.max_train_rows``), its
  ``eval_dataset`` the validation prompts (the first ``data.max_val_rows``; without one, the
  first ``data.val_size`` training rows, as verifiers' own evaluation does). Each row's
  ``prompt`` is checked like a data file's row (``creditrl.data.rows``); its ``answer`` is the
  ground truth and its ``answer``, ``info``, ``task`` and ``example_id`` travel with it;
- rollout: each trajectory is ``env.run_rollout`` with a verifiers client around the
  episode's ``openai.AsyncOpenAI`` at creditrl's endpoint (``creditrl.agents.program``: the
  recorded token ids are trained on, observations masked, drift located per trajectory);
- score: the rubric's total is the reward, each named part a ``reward/vf_<name>_mean``
  metric. An episode whose rollout fails (an exception, or an error the environment recorded)
  or whose rubric fails (a reward function raised or returned no number, which verifiers
  scores 0: ``creditrl.environments.reward_failures``) is scored ``reward.fallback_score`` and
  counted (``agent/episodes_error``). Every episode of an environment runs its rollout on the
  environment's one event loop (``creditrl.environments.event_loop``), so clients it made in
  ``load_environment`` serve every step.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from creditrl.bounded_json import JsonLimitError, loads_bounded
from creditrl.config.schema import Config, EnvConfig
from creditrl.data.dataset import PromptDataset
from creditrl.data.rows import ROW_LIMITS, PromptRow, RowError, parse_row
from creditrl.environments.event_loop import loop_of
from creditrl.environments.reward_failures import reward_failures, watch_rubric
from creditrl.environments.verifiers_v1 import (
    VerifiersV1Program,
    check_v1_environment,
    is_v1_environment,
    prepare_programs,
    serve,
    v1_rows,
)
from creditrl.errors import ConfigError, DataError, UserCodeError
from creditrl.usercode import load_user_object, one_line

__all__ = [
    "DATA_SOURCE",
    "INSTALL_HINT",
    "SUPPORTED",
    "VerifiersProgram",
    "build_verifiers_rollout",
    "check_environment",
    "environment_datasets",
    "environment_program",
    "load_verifiers_environment",
]

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'creditrl[verifiers]'"
DATA_SOURCE = "verifiers"
MODEL_NAME = "creditrl-policy"
PASSED_COLUMNS = ("answer", "info", "task", "example_id")  # travel with a row to its rollout
SAMPLING_KEYS = ("max_tokens", "max_completion_tokens")  # the environment's own; the rest is ours
SUPPORTED = (">=0.3", "<0.5")  # 0.3: the classic API and verifiers.v1; 0.4: verifiers.v1

_lock = threading.Lock()
_loaded: dict[tuple[str, str], Any] = {}


def _verifiers() -> ModuleType:
    """The verifiers package, of a supported version; ConfigError naming the extra otherwise."""
    try:
        import verifiers
    except ImportError:
        raise ConfigError(
            f"env.verifiers needs the verifiers package, which is not installed: {INSTALL_HINT}"
        ) from None
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    version = str(getattr(verifiers, "__version__", "0"))
    try:
        supported = Version(version) in SpecifierSet(",".join(SUPPORTED))
    except InvalidVersion:
        supported = False
    if not supported:
        raise ConfigError(
            f"env.verifiers: verifiers {version} is installed; creditrl runs verifiers "
            f"{','.join(SUPPORTED)} (0.3's classic environments, and the verifiers.v1 Env of "
            f"0.3 and 0.4): {INSTALL_HINT}"
        )
    return verifiers


def _classic(vf: ModuleType) -> type | None:
    """``verifiers.Environment`` where the installed version has the classic API (0.3)."""
    try:
        return vf.Environment
    except (AttributeError, ImportError):
        return None


def load_verifiers_environment(env_cfg: EnvConfig) -> Any:
    """The environment ``env_cfg`` names, loaded once per process per (spec, kwargs); a
    one-line UserError when the package is missing, the loader cannot be imported, raises or
    returns something else than a classic verifiers Environment or a ``verifiers.v1.Env``
    creditrl can train (``check_v1_environment``)."""
    spec = env_cfg.verifiers
    if spec is None:
        raise ConfigError("env.verifiers is not set")
    kwargs = dict(env_cfg.kwargs or {})
    key = (spec, json.dumps(kwargs, sort_keys=True, default=repr))
    with _lock:
        if key in _loaded:
            return _loaded[key]
        vf = _verifiers()
        loader = load_user_object(spec, "env.verifiers")
        try:
            env = loader(**kwargs)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # sys.exit() too: the run would end having trained nothing
            raise UserCodeError(
                f"env.verifiers: {spec} raised {type(e).__name__}: {one_line(e, 200)} "
                f"(called with env.kwargs {sorted(kwargs)})"
            ) from None
        if is_v1_environment(env):
            check_v1_environment(env, spec)
            _loaded[key] = env
            return env
        classic = _classic(vf)
        if classic is None or not isinstance(env, classic):
            kinds = "a verifiers.v1 Env"
            if classic is not None:
                kinds = (
                    "a verifiers Environment (SingleTurnEnv, MultiTurnEnv, ToolEnv, ...) or "
                    + kinds
                )
            raise UserCodeError(
                f"env.verifiers: {spec} returned a {type(env).__module__}.{type(env).__name__}, "
                f"not {kinds} (verifiers {getattr(vf, '__version__', '?')})"
            )
        try:
            grouped = bool(env.requires_group_rollouts)
        except Exception:
            grouped = False
        if grouped:
            raise UserCodeError(
                f"env.verifiers: {spec}'s rubric has group reward functions (scored over a "
                "group of rollouts together); creditrl scores each rollout on its own"
            )
        watch_rubric(env.rubric)
        _loaded[key] = env
        return env


def _split(env: Any, split: str) -> Any:
    """The environment's built dataset of ``split`` ("train" or "eval"), or None."""
    build = env.build_dataset if split == "train" else env.build_eval_dataset
    try:
        dataset = build()
    except Exception as e:
        raise UserCodeError(
            f"env.verifiers: building the environment's {split} dataset raised "
            f"{type(e).__name__}: {one_line(e, 200)}"
        ) from None
    if dataset is None:
        return None
    if not all(hasattr(dataset, a) for a in ("column_names", "__len__", "__getitem__")):
        raise UserCodeError(
            f"env.verifiers: the environment's {split} dataset is a {type(dataset).__name__}, "
            "not a datasets.Dataset"
        )
    return dataset


def _rows(dataset: Any, split: str, limit: int) -> list[PromptRow]:
    """The first ``limit`` rows of ``dataset`` as checked prompt rows."""
    if "prompt" not in dataset.column_names:
        raise DataError(
            f"env.verifiers: the environment's {split} dataset has no 'prompt' column (columns "
            f"{sorted(dataset.column_names)[:12]}); give its rows a prompt or a question"
        )
    rows = []
    for i in range(min(len(dataset), limit)):
        record = dataset[i]
        prompt = record.get("prompt")
        if isinstance(prompt, list):  # Arrow fills the keys other messages have with None
            prompt = [
                {k: v for k, v in m.items() if v is not None} if isinstance(m, Mapping) else m
                for m in prompt
            ]
        passed = {k: record[k] for k in PASSED_COLUMNS if record.get(k) is not None}
        where = f"env.verifiers {split} row {i + 1}"
        if isinstance(passed.get("info"), str):
            passed["info"] = _decoded_info(passed["info"], where)
        raw = {
            "prompt": prompt,
            "ground_truth": record.get("answer"),
            "data_source": DATA_SOURCE,
            "extra": {"verifiers": passed},
        }
        rows.append(parse_row(raw, where))
    return rows


def _decoded_info(text: str, where: str) -> Any:
    """A row's ``info`` string decoded as JSON within data-file rows' bounds (``ROW_LIMITS``)
    and without NaN or Infinity (the async learner refuses them); RowError past them. A string
    that is not JSON stays a string."""
    try:
        return loads_bounded(text, ROW_LIMITS, allow_nan=False)
    except JsonLimitError as e:
        raise RowError(f"{where}: 'info' is {e}") from None
    except json.JSONDecodeError:
        return text
    except ValueError as e:  # NaN, Infinity
        raise RowError(f"{where}: 'info' holds {e}") from None


def environment_datasets(cfg: Config, tokenizer: Any) -> tuple[PromptDataset, PromptDataset | None]:
    """``(train, val)`` prompt datasets of the environment ``cfg.env`` names (module
    docstring; a v1 taskset's first tasks, ``creditrl.environments.verifiers_v1``); ``val`` is
    None when there are no validation rows."""
    env = load_verifiers_environment(cfg.env)
    data = cfg.data
    origin = f"env.verifiers={cfg.env.verifiers!r}"
    if is_v1_environment(env):
        train_rows = v1_rows(env, data.max_train_rows, "train")
        if not train_rows:
            raise DataError(f"{origin}: the environment's taskset has no tasks")
        val_rows = train_rows[: data.val_size]
    else:
        train_set = _split(env, "train")
        if train_set is None or len(train_set) == 0:
            raise DataError(
                f"{origin}: the environment has no training rows (its dataset is empty)"
            )
        train_rows = _rows(train_set, "train", data.max_train_rows)
        eval_set = _split(env, "eval")
        val_rows = _rows(eval_set, "eval", data.max_val_rows) if eval_set is not None else None
        if val_rows is None:
            val_rows = train_rows[: data.val_size]
            if val_rows:
                log.info(
                    "%s has no eval_dataset: validating on its first %d rows",
                    origin,
                    len(val_rows),
                )

    def dataset(rows: list[PromptRow], split: str) -> PromptDataset:
        return PromptDataset(
            rows,
            tokenizer,
            data.max_prompt_length,
            data.overlong_prompt,
            split,
            f"{origin} ({split})",
        )

    return dataset(train_rows, "train"), (dataset(val_rows, "val") if val_rows else None)


class EnvironmentEpisodeError(RuntimeError):
    """An episode the environment could not run or score (its episode is scored as a fallback)."""


class VerifiersProgram:
    """The agent program of one environment: ``await program(row, client)`` runs the row's
    rollout through the environment with ``client`` and returns ``{"score": total,
    "vf_<part>": value, ...}``; EnvironmentEpisodeError when the rollout or rubric failed."""

    def __init__(self, env: Any) -> None:
        from verifiers.clients import OpenAIChatCompletionsClient

        self.env = env
        self.client_type = OpenAIChatCompletionsClient
        own = getattr(env, "sampling_args", None) or {}
        self.sampling_args = {k: own[k] for k in SAMPLING_KEYS if own.get(k) is not None}

    async def __call__(self, row: Mapping[str, Any], client: Any) -> dict[str, Any]:
        """The episode's rollout, run on the environment's event loop with a copy of
        ``client`` (its connections opened, used and closed there)."""
        return await loop_of(self.env).run(self._rollout(row, client.copy()))

    async def _rollout(self, row: Mapping[str, Any], client: Any) -> dict[str, Any]:
        try:
            return await self._scored(row, client)
        finally:
            await client.close()

    async def _scored(self, row: Mapping[str, Any], client: Any) -> dict[str, Any]:
        passed = dict((row.get("extra_info") or {}).get("verifiers") or {})
        rollout_input = {
            "prompt": row["messages"],
            "answer": passed.get("answer", ""),
            "info": passed.get("info") or {},
            "example_id": passed.get("example_id", 0),
        }
        if passed.get("task") is not None:
            rollout_input["task"] = passed["task"]
        with reward_failures() as rubric_errors:
            output = await self.env.run_rollout(
                rollout_input, self.client_type(client), MODEL_NAME, dict(self.sampling_args)
            )
        error = output.get("error")
        if error:
            raise EnvironmentEpisodeError(f"the environment's rollout failed: {one_line(error)}")
        if rubric_errors:
            raise EnvironmentEpisodeError(f"the environment's rubric failed: {rubric_errors[0]}")
        parts = {f"vf_{k}": float(v) for k, v in (output.get("metrics") or {}).items()}
        return {"score": float(output["reward"]), **parts}


def environment_program(env: Any) -> Any:
    """The agent program running ``env``'s episodes: ``VerifiersProgram`` for a classic
    environment, ``VerifiersV1Program`` for a ``verifiers.v1.Env`` (its harnesses' programs
    prepared and its serving() entered first, once per process)."""
    if is_v1_environment(env):
        return VerifiersV1Program(env)
    return VerifiersProgram(env)


def check_environment(cfg: Config) -> None:
    """The ``verifiers`` strategy's preflight, before any model is built: the package, the
    loader and what it returns; for a ``verifiers.v1.Env``, its harnesses' programs are
    prepared (once per process; one line saying what is missing when they cannot be)."""
    env = load_verifiers_environment(cfg.env)
    if is_v1_environment(env):
        prepare_programs(env, str(cfg.env.verifiers))


def build_verifiers_rollout(engine: Any, tokenizer: Any, cfg: Config) -> Any:
    """The rollout of ``env.verifiers``: ``ProgramRollout`` running the environment's rollouts
    (or a v1 Env's episodes) through the endpoint."""
    from creditrl.agents.program import ProgramRollout

    env = load_verifiers_environment(cfg.env)
    if is_v1_environment(env):
        prepare_programs(env, str(cfg.env.verifiers))
        serve(env)
    return ProgramRollout.for_run(engine, tokenizer, cfg, program=environment_program(env))

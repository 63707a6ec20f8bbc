"""Checks of everything a run names, before any model is built: ``preflight(cfg)``.

It loads the user code the config names (``reward.scorer``, an ``algorithm.adv_estimator``
given as ``file.py:name``, the environment of ``env.verifiers``, the tools of ``agent.tools`` /
``agent.tool_config``), reads the data files (JSON rows, no tokenizer) and checks that every
``data_source`` in them has a scorer. ``model.path`` and ``model.critic_path`` pass the model
directory checks (``creditrl.models.model_dir``: files, weights, JSON bounds, config sizes,
memory) and the model's chat template renders within its bound
(``creditrl.models.chat_template``). The first mistake raises a one-line ``UserError`` naming
the key, file, row or function; what is fine but worth saying (validation off) comes back as
notices to print. Checks that need the tokenizer
(prompt lengths) stay in the dataset builders.
"""

from __future__ import annotations

from creditrl.config.agent_task import is_agent_task
from creditrl.config.schema import Config, DataConfig
from creditrl.data.builders import validation_notice
from creditrl.data.rows import read_rows_from_files
from creditrl.errors import ConfigError, DataError
from creditrl.rewards.failures import check_max_failure_rate
from creditrl.rewards.registry import (
    SCORERS,
    check_scorer_signature,
    load_scorer_file,
    portable_spec,
    scorer_spec,
)
from creditrl.rollout.strategies import strategy_preflight, strategy_traits
from creditrl.usercode import resolve_adv_estimator

__all__ = ["check_models", "data_sources", "preflight"]

Sources = dict[str, tuple[str, str]]  # data_source -> (config key, first row that has it)


def preflight(cfg: Config) -> list[str]:
    """Check the estimator, tools, data files and scorers of ``cfg``; return notices to print.

    Raises ConfigError, DataError or UserCodeError (one line each) for the first mistake.
    """
    resolve_adv_estimator(cfg.algorithm.adv_estimator)
    strategy_preflight(cfg)  # an environment hub: its package, loader and what it returns
    check_models(cfg)
    check_max_failure_rate(cfg.reward.max_failure_rate)
    if _uses_tools(cfg):
        from creditrl.tools import build_registry

        agent = cfg.agent
        build_registry(
            agent.tools, agent.tool_config, agent.tool_timeout_s, agent.max_parallel_calls
        )
    _check_scorers(cfg, data_sources(cfg.data))
    notice = validation_notice(cfg.data)
    return [notice] if notice else []


def check_models(cfg: Config) -> None:
    """The directories of ``model.path`` (tokenizer and chat template included) and
    ``model.critic_path`` checked as loading them would, before any weights are read."""
    from creditrl.models import load_tokenizer, resolve_model_path, torch_dtype
    from creditrl.models.model_dir import check_memory

    model = cfg.model
    itemsize = torch_dtype(model.dtype).itemsize
    for path in (model.path, model.critic_path):
        if path is not None and path != "embedded":
            check_memory(resolve_model_path(path), itemsize)
    if model.path != "embedded":
        load_tokenizer(model.path)


def _uses_tools(cfg: Config) -> bool:
    return strategy_traits(cfg).uses_tools or is_agent_task(cfg.data)


def data_sources(cfg: DataConfig) -> Sources:
    """Every ``data_source`` the data will hold, with its config key and first row.

    The rows of the data files that are used (``data.max_train_rows``/``max_val_rows``) are
    read and validated (DataError naming file and row); a built-in task contributes the
    data_source its rows get.
    """
    sources: Sources = {}
    if cfg.train_files:
        for key, paths, limit in (
            ("data.train_files", cfg.train_files, "max_train_rows"),
            ("data.val_files", cfg.val_files, "max_val_rows"),
        ):
            max_rows = getattr(cfg, limit)
            for row in read_rows_from_files(paths, None, key, max_rows, f"data.{limit}"):
                sources.setdefault(row.data_source, (key, row.source))
    elif cfg.task:
        source = cfg.task if is_agent_task(cfg) else f"reasoning_gym/{cfg.task}"
        sources[source] = ("data.task", f"data.task={cfg.task!r}")
    else:
        raise ConfigError("no data: set data.task (a reasoning-gym name) or data.train_files")
    return sources


def _check_scorers(cfg: Config, sources: Sources) -> None:
    """Load and signature-check the scorer of every data_source (or ``reward.scorer``)."""
    from creditrl.agents.rewards import STRUCTURED_SCORERS, structured_scorer_for
    from creditrl.workers.plan import structured_reward

    reward = cfg.reward
    structured = structured_reward(cfg)
    if not structured and reward.reward_model.enable and reward.reward_model.mode == "replace":
        return  # the reward model alone scores; no rule scorer runs
    if strategy_traits(cfg).runs_program and not reward.scorer:
        return  # the program may return every reward; a row it leaves unscored and no scorer
        # takes fails its sample at scoring (counted, reward.max_failure_rate applies)
    in_workers = not structured and reward.num_workers > 0
    if reward.scorer:
        spec = scorer_spec("", reward.scorer)
        fn = SCORERS[spec] if spec in SCORERS else load_scorer_file(spec, "reward.scorer")
        check_scorer_signature(fn, spec, reward.scorer_kwargs, "reward.scorer")
        if in_workers:
            portable_spec(spec)
        return
    for source, (key, where) in sources.items():
        if structured and structured_scorer_for(source) is not None:
            continue
        try:
            spec = scorer_spec(source)
        except DataError:
            names = sorted({*SCORERS, *(STRUCTURED_SCORERS if structured else ())})
            raise DataError(
                f"{key}: rows with data_source {source!r} (first: {where}) have no scorer; "
                f"registered: {', '.join(names)}; or set reward.scorer=path.py:fn"
            ) from None
        what = f"{key}: data_source {source!r}"
        check_scorer_signature(SCORERS[spec], repr(spec), reward.scorer_kwargs, what)
        if in_workers:
            portable_spec(spec)

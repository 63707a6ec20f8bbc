"""Scorers by data_source: built-ins, runtime registrations and user code ("path.py:fn").

A scorer has verl's ``compute_score`` signature::

    fn(data_source: str, solution_str: str, ground_truth: Any,
       extra_info: dict | None = None, **kwargs) -> float | dict

and is called as ``SCORER_CALL``; user code that cannot take that call is refused when it is
loaded (``check_scorer_signature``). A dict holds "score" plus any extra per-sample info.
Lookup for a data_source: the exact name, then its "/"-prefixes, longest first
("reasoning_gym/chain_sum" -> "reasoning_gym").
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from creditrl.errors import ConfigError, DataError, UserCodeError
from creditrl.rewards import scorers
from creditrl.usercode import is_code_spec, load_user_object

__all__ = [
    "BUILTIN_SCORERS",
    "PROGRAM_SCORER",
    "SCORERS",
    "SCORER_CALL",
    "SCORER_SIGNATURE",
    "Scorer",
    "check_scorer_signature",
    "get_scorer",
    "is_builtin",
    "load_scorer_file",
    "portable_spec",
    "register_scorer",
    "scorer_spec",
]

Scorer = Callable[..., float | dict[str, Any]]
# scores a row whose extra_info carries the reward its agent.program episode returned
PROGRAM_SCORER = "creditrl_program_reward"

BUILTIN_SCORERS: dict[str, Scorer] = {
    "reasoning_gym": scorers.reasoning_gym_score,
    "gsm8k": scorers.gsm8k_score,
    "math": scorers.math_score,
}
SCORERS: dict[str, Scorer] = dict(BUILTIN_SCORERS)
SCORER_SIGNATURE = "(data_source, solution_str, ground_truth, extra_info=None, **kwargs)"
SCORER_CALL = "fn(data_source, solution_str, ground_truth, extra_info, **reward.scorer_kwargs)"


def register_scorer(name: str) -> Callable[[Scorer], Scorer]:
    """Decorator registering ``fn`` under ``name`` (a data_source or its prefix).

    Worker processes load a registered function from its source file, so it must be defined at
    a module's top level (or use ``num_workers=0``).
    """

    def deco(fn: Scorer) -> Scorer:
        SCORERS[name] = fn
        return fn

    return deco


def load_scorer_file(spec: str, what: str = "reward.scorer") -> Scorer:
    """The scorer ``fn`` of ``"path/to/file.py:fn"`` (or ``"package.module:fn"``), its
    signature checked against the documented call (UserCodeError naming ``what`` otherwise)."""
    fn = load_user_object(spec, what)
    check_scorer_signature(fn, spec, what=what)
    return fn


def check_scorer_signature(
    fn: Scorer, label: str, scorer_kwargs: Mapping[str, Any] | None = None, what: str = "reward"
) -> None:
    """UserCodeError unless ``fn`` accepts ``SCORER_CALL`` with these ``scorer_kwargs``.

    Callables whose signature Python cannot read (some C functions) pass unchecked.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    kwargs = dict(scorer_kwargs or {})
    try:
        signature.bind("data_source", "solution_str", None, {}, **kwargs)
    except TypeError as e:
        given = f" with reward.scorer_kwargs keys {sorted(kwargs)}" if kwargs else ""
        raise UserCodeError(
            f"{what}: scorer {label} has signature {signature} but is called as "
            f"{SCORER_CALL}{given}: {e}; expected {SCORER_SIGNATURE}"
        ) from None


def scorer_spec(data_source: str, override: str | None = None) -> str:
    """The registered name or file spec that scores ``data_source``.

    ``override`` (a registered name or "path/to/file.py:fn") wins; otherwise the exact
    data_source, then its "/"-prefixes. DataError names the data_source and the registered names
    (ConfigError for an ``override`` that is neither).
    """
    if override:
        if override in SCORERS or is_code_spec(override):
            return override
        raise ConfigError(
            f"reward.scorer: {override!r} is neither a registered name {sorted(SCORERS)} "
            "nor 'path/to/file.py:fn'"
        )
    parts = data_source.split("/")
    for cut in range(len(parts), 0, -1):
        name = "/".join(parts[:cut])
        if name in SCORERS:
            return name
    raise DataError(
        f"no reward scorer for data_source {data_source!r}; registered: {sorted(SCORERS)} "
        "(set reward.scorer to a name or 'path/to/file.py:fn')"
    )


def get_scorer(data_source: str, override: str | None = None) -> Scorer:
    """The scorer function for ``data_source`` (see ``scorer_spec`` for the lookup order)."""
    if override == PROGRAM_SCORER:  # not a data_source scorer: only the manager names it
        return scorers.program_reward_score
    spec = scorer_spec(data_source, override)
    return SCORERS[spec] if spec in SCORERS else load_scorer_file(spec)


def is_builtin(spec: str) -> bool:
    """Whether ``spec`` names a built-in scorer that no registration has replaced."""
    return spec in BUILTIN_SCORERS and SCORERS.get(spec) is BUILTIN_SCORERS[spec]


def portable_spec(spec: str) -> str:
    """A spec a fresh worker process can load: a built-in name, or an absolute "file.py:fn".

    A runtime-registered name becomes its function's source file and qualified name.
    """
    if is_builtin(spec):
        return spec
    if spec not in SCORERS:
        path, _, name = spec.rpartition(":")
        return f"{Path(path).expanduser().resolve()}:{name}" if path.endswith(".py") else spec
    fn = SCORERS[spec]
    source = inspect.getsourcefile(fn)
    qualname = getattr(fn, "__qualname__", "")
    if source is None or "<locals>" in qualname or not source.endswith(".py"):
        raise UserCodeError(
            f"reward: scorer {spec!r} ({fn!r}) is not a top-level function of a .py file, so "
            "reward worker processes cannot load it; define it at module level or set "
            "reward.num_workers=0"
        )
    return f"{Path(source).resolve()}:{qualname}"

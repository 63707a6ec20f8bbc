"""Scorers by data_source: built-ins, runtime registrations and user files ("path.py:fn").

A scorer has verl's ``compute_score`` signature::

    fn(data_source: str, solution_str: str, ground_truth: Any,
       extra_info: dict | None = None, **kwargs) -> float | dict

A dict holds "score" plus any extra per-sample info. Lookup for a data_source: the exact
name, then its "/"-prefixes, longest first ("reasoning_gym/chain_sum" -> "reasoning_gym").
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from creditrl.rewards import scorers

__all__ = [
    "BUILTIN_SCORERS",
    "SCORERS",
    "Scorer",
    "get_scorer",
    "load_scorer_file",
    "portable_spec",
    "register_scorer",
    "scorer_spec",
]

Scorer = Callable[..., float | dict[str, Any]]

BUILTIN_SCORERS: dict[str, Scorer] = {
    "reasoning_gym": scorers.reasoning_gym_score,
    "gsm8k": scorers.gsm8k_score,
    "math": scorers.math_score,
}
SCORERS: dict[str, Scorer] = dict(BUILTIN_SCORERS)

_file_lock = threading.Lock()
_file_modules: dict[str, Any] = {}


def register_scorer(name: str) -> Callable[[Scorer], Scorer]:
    """Decorator registering ``fn`` under ``name`` (a data_source or its prefix).

    Worker processes load a registered function from its source file, so it must be defined at
    a module's top level (or use ``num_workers=0``).
    """

    def deco(fn: Scorer) -> Scorer:
        SCORERS[name] = fn
        return fn

    return deco


def _is_file_spec(spec: str) -> bool:
    return ":" in spec and spec.rpartition(":")[0].endswith(".py")


def load_scorer_file(spec: str) -> Scorer:
    """Load ``fn`` from ``"path/to/file.py:fn"`` (the file imported once per process, by path)."""
    path_text, _, name = spec.rpartition(":")
    path = Path(path_text).expanduser().resolve()
    if not name:
        raise ValueError(f"scorer spec {spec!r} names no function (expected 'path/to/file.py:fn')")
    if not path.is_file():
        raise FileNotFoundError(f"scorer file {str(path)!r} (from spec {spec!r}) does not exist")
    key = str(path)
    with _file_lock:
        module = _file_modules.get(key)
        if module is None:
            mod_name = "creditrl_user_scorer_" + hashlib.sha1(key.encode()).hexdigest()[:12]
            module_spec = importlib.util.spec_from_file_location(mod_name, path)
            if module_spec is None or module_spec.loader is None:
                raise ImportError(f"cannot import scorer file {key!r}")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[mod_name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[mod_name]
                raise
            _file_modules[key] = module
    target: Any = module
    for part in name.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(
            f"scorer file {key!r} has no function {name!r} (callables there: {found})"
        )
    return target


def scorer_spec(data_source: str, override: str | None = None) -> str:
    """The registered name or file spec that scores ``data_source``.

    ``override`` (a registered name or "path/to/file.py:fn") wins; otherwise the exact
    data_source, then its "/"-prefixes. ValueError names the data_source and the registered names.
    """
    if override:
        if override in SCORERS or _is_file_spec(override):
            return override
        raise ValueError(
            f"reward scorer {override!r} is neither a registered name {sorted(SCORERS)} "
            "nor 'path/to/file.py:fn'"
        )
    parts = data_source.split("/")
    for cut in range(len(parts), 0, -1):
        name = "/".join(parts[:cut])
        if name in SCORERS:
            return name
    raise ValueError(
        f"no reward scorer for data_source {data_source!r}; registered: {sorted(SCORERS)} "
        "(set reward.scorer to a name or 'path/to/file.py:fn')"
    )


def get_scorer(data_source: str, override: str | None = None) -> Scorer:
    """The scorer function for ``data_source`` (see ``scorer_spec`` for the lookup order)."""
    spec = scorer_spec(data_source, override)
    return SCORERS[spec] if spec in SCORERS else load_scorer_file(spec)


def portable_spec(spec: str) -> str:
    """A spec a fresh worker process can load: a built-in name, or an absolute "file.py:fn".

    A runtime-registered name becomes its function's source file and qualified name.
    """
    if spec in BUILTIN_SCORERS and SCORERS[spec] is BUILTIN_SCORERS[spec]:
        return spec
    if _is_file_spec(spec):
        path, _, name = spec.rpartition(":")
        return f"{Path(path).expanduser().resolve()}:{name}"
    fn = SCORERS[spec]
    source = inspect.getsourcefile(fn)
    qualname = getattr(fn, "__qualname__", "")
    if source is None or "<locals>" in qualname or not source.endswith(".py"):
        raise ValueError(
            f"scorer {spec!r} ({fn!r}) is not a top-level function of a .py file, so reward "
            "worker processes cannot load it; define it at module level or use num_workers=0"
        )
    return f"{Path(source).resolve()}:{qualname}"

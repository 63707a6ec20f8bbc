"""User code named in the config: ``path/to/file.py:name`` or ``package.module:name``.

One loader serves every such key (``reward.scorer``, tool ``function`` entries,
``algorithm.adv_estimator``). A missing file, a file that fails to import, or a missing name
raises a one-line ``UserCodeError`` naming the key, the file and the name. A file is imported
once per process, by its resolved path, so code that registers things runs once; its folder is
added to the end of ``sys.path`` first, so it imports the modules beside it as ``python
file.py`` would (installed packages keep precedence over a module of the same name there).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import threading
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from creditrl.errors import ConfigError, UserCodeError
from creditrl.registry import registry

__all__ = [
    "is_code_spec",
    "load_user_module",
    "load_user_object",
    "one_line",
    "resolve_adv_estimator",
    "split_spec",
]

_lock = threading.RLock()
_modules: dict[str, ModuleType] = {}
_FORMS = "'path/to/file.py:name' or 'package.module:name'"


def one_line(text: object, limit: int = 300) -> str:
    """``text`` with every run of whitespace (newlines too) made one space, cut to ``limit``."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _is_module_path(target: str) -> bool:
    return all(part.isidentifier() for part in target.split("."))


def is_code_spec(spec: str) -> bool:
    """True for ``file.py:name`` and ``package.module:name`` (a name after the last ':')."""
    target, sep, name = spec.rpartition(":")
    return bool(sep and target and name) and (target.endswith(".py") or _is_module_path(target))


def split_spec(spec: str, what: str) -> tuple[str, str]:
    """``(file or module, name)`` of ``spec``; UserCodeError naming ``what`` if malformed."""
    if not is_code_spec(spec):
        raise UserCodeError(f"{what}: {spec!r} is not {_FORMS}")
    target, _, name = spec.rpartition(":")
    return target, name


def _import_failure(what: str, source: str, error: BaseException, path: str | None) -> str:
    """One line: the exception type and message and where in the user's file it was raised."""
    line = None
    if isinstance(error, SyntaxError) and error.filename:
        line = f"{error.filename}:{error.lineno}"
    else:
        frames = traceback.extract_tb(error.__traceback__)
        own = [f for f in frames if path is not None and f.filename == path] or frames[-1:]
        if own:
            line = f"{own[-1].filename}:{own[-1].lineno}"
    at = f" (at {line})" if line else ""
    message = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return one_line(f"{what}: importing {source} failed: {message}{at}", 500)


def _load_file(path: Path, what: str) -> ModuleType:
    key = str(path)
    module = _modules.get(key)
    if module is not None:
        return module
    name = "creditrl_user_" + hashlib.sha1(key.encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserCodeError(f"{what}: {key} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except KeyboardInterrupt:
        del sys.modules[name]
        raise
    except BaseException as e:  # SystemExit and the like too: one line, never the run's end
        del sys.modules[name]
        raise UserCodeError(_import_failure(what, key, e, key)) from e
    _modules[key] = module
    return module


def _load_module(target: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name is not None and (target == e.name or target.startswith(e.name + ".")):
            raise UserCodeError(
                f"{what}: no module named {target!r}; give {_FORMS} (a file path must end in .py)"
            ) from e
        raise UserCodeError(_import_failure(what, f"module {target!r}", e, None)) from e
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        raise UserCodeError(_import_failure(what, f"module {target!r}", e, None)) from e


def load_user_module(target: str, what: str) -> ModuleType:
    """The module of ``target`` (a ``.py`` file path or a dotted module name), imported once."""
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise UserCodeError(f"{what}: {path} does not exist")
        with _lock:
            return _load_file(path, what)
    with _lock:
        return _load_module(target, what)


def load_user_object(spec: str, what: str) -> Any:
    """The function ``name`` of ``spec`` (``path/to/file.py:name`` or ``package.module:name``;
    ``name`` may be dotted, e.g. ``Class.method``). ``what`` (the config key) starts every
    error message."""
    target, name = split_spec(spec, what)
    module = load_user_module(target, what)
    where = str(Path(target).expanduser().resolve()) if target.endswith(".py") else target
    obj: Any = module
    for part in name.split("."):
        obj = getattr(obj, part, None)
    if obj is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise UserCodeError(f"{what}: {where} has no function {name!r}; callables there: {found}")
    if not callable(obj):
        raise UserCodeError(f"{what}: {where}:{name} is a {type(obj).__name__}, not a function")
    return obj


def resolve_adv_estimator(spec: str) -> str:
    """The registered estimator name that ``algorithm.adv_estimator`` = ``spec`` selects.

    A plain name must be registered (ConfigError listing the choices). ``file.py:name`` (or
    ``package.module:name``) imports that code, which must register an estimator under
    ``name`` with ``creditrl.core.register_adv_est``; returns ``name``. Idempotent and cheap
    after the first call in a process, so each process may resolve the spec itself.
    """
    ADV_ESTIMATORS = registry("advantage estimator")
    what = "algorithm.adv_estimator"
    if ":" not in spec:
        if spec not in ADV_ESTIMATORS:
            raise ConfigError(
                f"{what}: unknown estimator {spec!r}; choose one of {ADV_ESTIMATORS.names()} "
                f"or {_FORMS} registering one"
            )
        return spec
    target, name = split_spec(spec, what)
    load_user_module(target, what)
    if name not in ADV_ESTIMATORS:
        raise UserCodeError(
            f"{what}: {target} registers no estimator {name!r} (decorate it with "
            f"@register_adv_est({name!r}) from creditrl.core); registered: "
            f"{ADV_ESTIMATORS.names()}"
        )
    return name

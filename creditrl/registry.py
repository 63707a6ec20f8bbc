"""Name -> entry registries that say where each entry is, imported when asked.

A built-in entry is declared with ``add(name, "package.module:attr", **info)``: the registry
holds the dotted path and what the entry declares about itself (an estimator's ``requires``, a
loss's ``options``, an engine's traits), and imports the module only when ``get`` asks for the
object. So the names and declarations of every registry (what ``creditrl config`` and its
checks read) are known without importing torch, and the structure test reads each path as an
import edge. User code registers an object it already holds with the ``register`` decorator.

Every registry is also listed in ``REGISTRIES`` by its ``kind``, which is how the config layer
(the vocabulary below the registries' layers) names the registry a setting draws from:
``meta(registry="policy loss")``.

This module is the ground floor: it imports nothing of creditrl.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable)

__all__ = ["REGISTRIES", "Registry", "import_path", "registry"]

REGISTRIES: dict[str, Registry] = {}
"""Every registry made so far, by ``kind``."""


def import_path(path: str) -> Any:
    """The object ``"package.module:attr"`` names (the module imported first)."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{path!r} is not a 'package.module:attr' path")
    return getattr(importlib.import_module(module), attr)


class Registry(Generic[F]):
    """Maps names (and aliases) to entries; ``get`` names the known choices on a miss."""

    def __init__(self, kind: str) -> None:
        if kind in REGISTRIES:
            raise ValueError(f"a registry of {kind!r} already exists")
        self.kind = kind
        self._paths: dict[str, str] = {}
        self._loaded: dict[str, F] = {}
        self._info: dict[str, dict[str, Any]] = {}
        self._first: dict[str, str] = {}  # every name and alias -> the entry's first name
        REGISTRIES[kind] = self

    def add(self, name: str, path: str, *aliases: str, **info: Any) -> None:
        """Declare a built-in entry: ``path`` (``"package.module:attr"``) is imported on the
        first ``get``; ``info`` is what it declares (``info(name)``)."""
        module, sep, attr = path.partition(":")
        if not sep or not module.startswith("creditrl.") or not attr:
            raise ValueError(f"{self.kind} {name!r}: {path!r} is not 'creditrl.module:attr'")
        for key in (name, *aliases):
            if key in self._paths or key in self._loaded:
                raise ValueError(f"{self.kind} {key!r} is already registered")
            self._paths[key] = path
            self._info[key] = dict(info)
            self._first[key] = name

    def register(self, name: str, *aliases: str, **info: Any) -> Callable[[F], F]:
        """Decorator: register ``fn`` under ``name`` and each alias, with ``info`` (what the
        entry declares about itself; see ``info``)."""

        def wrap(fn: F) -> F:
            for key in (name, *aliases):
                if key in self._paths or (key in self._loaded and self._loaded[key] is not fn):
                    raise ValueError(f"{self.kind} {key!r} is already registered")
                self._loaded[key] = fn
                self._info[key] = dict(info)
                self._first[key] = name
            return fn

        return wrap

    def info(self, name: str) -> dict[str, Any]:
        """What ``name`` declared (KeyError like ``get``); imports nothing."""
        self._known(name)
        return self._info.get(name, {})

    def get(self, name: str) -> F:
        """The entry registered as ``name`` (its module imported now if it was declared by
        path); KeyError listing the choices otherwise."""
        self._known(name)
        if name not in self._loaded:
            self._loaded[name] = import_path(self._paths[name])
        return self._loaded[name]

    def paths(self) -> dict[str, str]:
        """{name: ``"package.module:attr"``} of the entries declared by path."""
        return dict(self._paths)

    def first_names(self) -> list[str]:
        """Each entry once, under the first name it was registered with, in order."""
        return list(dict.fromkeys(self._first[key] for key in self))

    def _known(self, name: str) -> None:
        if name not in self:
            raise KeyError(f"unknown {self.kind} {name!r}; choose one of {self.names()}")

    def names(self) -> list[str]:
        """All registered names and aliases, sorted."""
        return sorted(self)

    def __contains__(self, name: object) -> bool:
        return name in self._first

    def __iter__(self) -> Iterator[str]:
        """The registered names and aliases, in the order they were registered."""
        return iter(list(self._first))

    def __len__(self) -> int:
        return len(self._first)


def registry(kind: str) -> Registry:
    """The registry of ``kind``; a LookupError (a programming error, not a user's) when no
    module has made it, i.e. ``creditrl.catalog`` was not imported."""
    try:
        return REGISTRIES[kind]
    except KeyError:
        raise LookupError(
            f"no registry of {kind!r} is loaded (creditrl.catalog makes them all)"
        ) from None

"""A small name -> function registry, so algorithms are selectable by name from config."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Maps names (and aliases) to functions; ``get`` names the known choices on a miss."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, F] = {}
        self._info: dict[str, dict[str, Any]] = {}

    def register(self, name: str, *aliases: str, **info: Any) -> Callable[[F], F]:
        """Decorator: register ``fn`` under ``name`` and each alias, with ``info`` (what the
        entry declares about itself, e.g. an estimator's ``requires``; see ``info``)."""

        def wrap(fn: F) -> F:
            for key in (name, *aliases):
                if key in self._items and self._items[key] is not fn:
                    raise ValueError(f"{self.kind} {key!r} is already registered")
                self._items[key] = fn
                self._info[key] = dict(info)
            return fn

        return wrap

    def info(self, name: str) -> dict[str, Any]:
        """What ``name`` declared when it was registered (KeyError like ``get``)."""
        self.get(name)
        return self._info.get(name, {})  # an entry placed without register declares nothing

    def get(self, name: str) -> F:
        """The function registered as ``name``; KeyError listing the choices otherwise."""
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.kind} {name!r}; choose one of {sorted(self._items)}"
            ) from None

    def names(self) -> list[str]:
        """All registered names and aliases, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        """The registered names and aliases, in the order they were registered."""
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

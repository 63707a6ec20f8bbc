"""Names a package imports on first use: its ``__init__`` keeps ``_HOMES`` ({name: module})
and ``__getattr__ = names_on_first_use(__name__, _HOMES)``, so importing the package (as every
submodule import does) loads none of its heavy modules. The structure test reads ``_HOMES`` as
import edges. Ground floor: imports nothing of creditrl."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["names_on_first_use"]


def names_on_first_use(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__``: ``package.NAME`` from the module ``homes`` names, imported
    now; AttributeError for any other name (so ``from package import submodule`` still
    imports the submodule)."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(homes[name]), name)

    return __getattr__

"""creditrl: reinforcement learning for language models, exact to the token."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import creditrl.catalog  # noqa: F401  (every registry and config check, by kind)
from creditrl.version import __version__

if TYPE_CHECKING:
    from creditrl.api import train
    from creditrl.batch import Batch
    from creditrl.exporting import export

__all__ = ["Batch", "__version__", "export", "train"]


def __getattr__(name: str) -> Any:
    """``creditrl.Batch``, ``creditrl.train`` and ``creditrl.export`` on first use: subprocesses
    that import a small part of the package (reward workers) do not pay for torch and
    tensordict."""
    if name == "Batch":
        from creditrl.batch import Batch

        return Batch
    if name == "train":
        from creditrl.api import train

        return train
    if name == "export":
        from creditrl.exporting import export

        return export
    raise AttributeError(f"module 'creditrl' has no attribute {name!r}")

"""creditrl: reinforcement learning for language models, exact to the token."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from creditrl.batch import Batch

__all__ = ["Batch", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``creditrl.Batch`` on first use: subprocesses that import a small part of the package
    (reward workers) do not pay for torch and tensordict."""
    if name == "Batch":
        from creditrl.batch import Batch

        return Batch
    raise AttributeError(f"module 'creditrl' has no attribute {name!r}")

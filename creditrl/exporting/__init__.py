"""Take the model out: a run's checkpoint as a Hugging Face directory with a model card
(``export``, ``creditrl export``), and validation of runs, checkpoints and exported or other
model directories (``creditrl eval``, ``creditrl eval --compare A B``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from creditrl.exporting.exporter import ExportResult, export

__all__ = ["ExportResult", "export"]


def __getattr__(name: str) -> Any:
    """``export`` and ``ExportResult`` on first use (they import torch and transformers), so
    the CLI's parser reads ``creditrl.exporting.options`` without them."""
    if name in __all__:
        from creditrl.exporting import exporter

        return getattr(exporter, name)
    raise AttributeError(f"module 'creditrl.exporting' has no attribute {name!r}")

"""Versioned policy weights on disk: moved to the weight channel, ``creditrl.weights.folder``
(``FolderChannel``, and its halves ``WeightPublisher`` and ``WeightSubscriber``). These names
stay importable from here."""

from creditrl.weights.folder import WeightPublisher, WeightSubscriber
from creditrl.weights.tensors import (
    load_tensors,
    merged_state_dict,
    publishable_state,
    save_tensors,
    snapshot_tensors,
)

__all__ = [
    "WeightPublisher",
    "WeightSubscriber",
    "load_tensors",
    "merged_state_dict",
    "publishable_state",
    "save_tensors",
    "snapshot_tensors",
]

"""One weight channel: how a policy's weights reach whoever samples with them, by version.

Every side uses ``WeightChannel`` (``creditrl.weights.channel``: ``publish``, ``newest``,
``load`` / ``load_folder``, ``attach`` + ``refresh``, and ``version``, the one place a process
holds the version its sampling weights are). The implementations:

- ``InProcessChannel``: trainer and engine in one process. ``creditrl train``'s hybrid worker
  publishes after every actor update (a new version) and its engine takes the weights at once
  (``HybridWorker.sync_rollout_weights``); the async learner's version is its worker's.
- ``FolderChannel`` (``creditrl.weights.folder``): the async learner publishes ``vNNNNNNNN/``
  folders and a ``latest`` pointer under ``asynchronous.weight_dir``; samplers poll and load
  (between batches, between partial-rollout chunks, before every agent turn).
- ``WireChannel`` / ``WirePublisher`` (``creditrl.weights.wire``): a publication as
  checksummed safetensors chunks that a sampler fetches through a connection it already has
  (no shared disk), bounded by ``WireLimits``, rate-limited on the publisher's side, applied
  only when complete and resumable after a dropped connection. An async sampler fetches it
  from the learner's weight port (``creditrl.asynchronous.weight_server``), which the learner
  serves while it trains.
- ``ChosenLater``: a sampler's channel before it knows which of the two it can use
  (``asynchronous.weight_channel=auto``).

This package is ground floor: torch, safetensors and the shared modules (``bounded_json``,
``errors``, the run lock), never the async, agents, rollout or pipeline layers.
"""

from creditrl.weights.channel import ChosenLater, InProcessChannel, WeightChannel
from creditrl.weights.folder import FolderChannel, WeightPublisher, WeightSubscriber
from creditrl.weights.tensors import (
    LORA_SYNC,
    apply_state,
    load_tensors,
    merged_state_dict,
    publishable_state,
    save_tensors,
    snapshot_tensors,
)
from creditrl.weights.wire import WireChannel, WireLimits, WirePublisher

__all__ = [
    "LORA_SYNC",
    "ChosenLater",
    "FolderChannel",
    "InProcessChannel",
    "WeightChannel",
    "WeightPublisher",
    "WeightSubscriber",
    "WireChannel",
    "WireLimits",
    "WirePublisher",
    "apply_state",
    "load_tensors",
    "merged_state_dict",
    "publishable_state",
    "save_tensors",
    "snapshot_tensors",
]

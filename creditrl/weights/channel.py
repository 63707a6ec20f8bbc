"""The weight channel: how a model's weights travel, by version, from the side that trains to
the side that samples (``creditrl.weights`` says which implementations there are).

``WeightChannel`` is the interface every side uses:

- ``publish(model, version)``: the trainer hands over ``model``'s weights as ``version``;
- ``newest()``: the newest published version (None before the first);
- ``load(model, then=...)``: the sampling side loads the newest version into ``model`` when it
  is newer than the one it holds (``then()`` afterwards, e.g. pushing it on to an engine that
  holds its own copy); ``load_folder(read)``: the same for an engine that reads a published
  folder itself (``weights_via="folder"``; only a folder channel has folders);
- ``attach(...)`` names what ``refresh()`` loads into, so a rollout (the partial rollout, the
  turn generator) refreshes without knowing the model or the engine;
- ``version``: the version the sampling side holds. It lives here and nowhere else: the
  trainer, the sampler, the turn generator and the partial rollout read it from their channel;
- ``unreadable()``: why the published weights cannot be had here (None when they can).

``ChosenLater`` is a channel whose implementation is picked once its side knows which one
works (an async sampler's, once the learner has answered: the folder when it can read it, else
the wire); until then it holds its version and loads nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import torch

from creditrl.weights.tensors import apply_state, publishable_state

__all__ = ["ChosenLater", "InProcessChannel", "WeightChannel"]


class WeightChannel(ABC):
    """See the module docstring. ``version``: the version held to start with (a resumed run's)."""

    def __init__(self, version: int = 0) -> None:
        self.version = int(version)
        self._model: torch.nn.Module | None = None
        self._then: Callable[[], object] | None = None
        self._read: Callable[[Path], object] | None = None

    @abstractmethod
    def publish(self, model: torch.nn.Module, version: int, *, background: bool = False) -> None:
        """Publish ``model``'s weights as ``version``; with ``background`` the channel may
        finish it later (``wait()``), the weights being copied first."""

    @abstractmethod
    def newest(self) -> int | None:
        """The newest published version, or None before the first publication."""

    @abstractmethod
    def load(self, model: torch.nn.Module, then: Callable[[], object] | None = None) -> bool:
        """Load the newest version into ``model`` if it is newer than ``version``, call
        ``then()`` and hold it; True when a version was loaded."""

    def load_folder(self, read: Callable[[Path], object]) -> bool:
        """``read(folder)`` the newest version's published folder if it is newer than
        ``version`` and hold it; True when a version was loaded. Only a channel that
        publishes folders has them."""
        raise TypeError(
            f"{type(self).__name__} publishes no folders: an engine with weights_via='folder' "
            "needs the folder channel"
        )

    def unreadable(self) -> str | None:
        """Why the newest published version cannot be had here, in words; None when it can."""
        return None

    def attach(
        self,
        model: torch.nn.Module | None = None,
        *,
        then: Callable[[], object] | None = None,
        folder: Callable[[Path], object] | None = None,
    ) -> None:
        """What ``refresh()`` loads into: ``model`` (then ``then()``), or, for an engine that
        reads published folders itself, ``folder(path)``."""
        if (model is None) == (folder is None):
            raise ValueError("attach a model or a folder reader, one of them")
        self._model, self._then, self._read = model, then, folder

    def refresh(self) -> bool:
        """Load the newest version into what ``attach`` named, if newer than ``version``; True
        when it did. Nothing attached: nothing to load (the in-process channel's consumer
        takes every publication when it is made)."""
        if self._read is not None:
            return self.load_folder(self._read)
        if self._model is not None:
            return self.load(self._model, self._then)
        return False

    def _hold(self, version: int, then: Callable[[], object] | None) -> bool:
        """Hold ``version`` (the one loaded, or the one held when nothing newer was); True
        when it is new, after ``then()``."""
        if version == self.version:
            return False
        if then is not None:
            then()
        self.version = version
        return True

    def wait(self) -> None:
        """Block until a background publication is complete (nothing to wait for here)."""
        return None


class InProcessChannel(WeightChannel):
    """Trainer and sampler in one process (``creditrl train``'s hybrid worker, the async
    learner's own engine). ``publish`` records the model itself, not a copy; with ``push`` (the
    consumer: ``HybridWorker.sync_rollout_weights``, which hands the policy's weights to an
    engine that holds its own copy) the consumer takes them at once and holds ``version`` from
    then on. Without it, ``load(model)`` copies the published model's weights (as they are
    when loaded; LoRA models as ``lora_sync`` says) into ``model``."""

    def __init__(
        self,
        push: Callable[[], object] | None = None,
        *,
        version: int = 0,
        lora_sync: str = "merged",
    ) -> None:
        super().__init__(version)
        self.push, self.lora_sync = push, lora_sync
        self._source: torch.nn.Module | None = None
        self._newest: int | None = None

    def publish(self, model: torch.nn.Module, version: int, *, background: bool = False) -> None:
        """``model`` is version ``version`` (``background`` changes nothing: no copy is made)."""
        self._source, self._newest = model, int(version)
        if self.push is not None:
            self.push()
            self.version = int(version)

    def newest(self) -> int | None:
        return self._newest

    def load(self, model: torch.nn.Module, then: Callable[[], object] | None = None) -> bool:
        if self._newest is None or self._newest <= self.version:
            return False
        if model is not self._source:
            kind, tensors = publishable_state(self._source, self.lora_sync)
            apply_state(model, kind, tensors, f"the in-process version {self._newest}")
        return self._hold(self._newest, then)


class ChosenLater(WeightChannel):
    """A channel whose implementation ``choose`` names later (module docstring): ``attach``,
    ``refresh`` and ``version`` work on it from the start, and load nothing until then."""

    def __init__(self, version: int = 0) -> None:
        super().__init__(version)
        self.chosen: WeightChannel | None = None

    def choose(self, channel: WeightChannel) -> None:
        """Load through ``channel`` from now on, from the version held."""
        channel.version = self.version
        self.chosen = channel

    def publish(self, model: torch.nn.Module, version: int, *, background: bool = False) -> None:
        raise TypeError("a channel chosen later receives weights; the learner publishes them")

    def newest(self) -> int | None:
        return None if self.chosen is None else self.chosen.newest()

    def unreadable(self) -> str | None:
        return None if self.chosen is None else self.chosen.unreadable()

    def load(self, model: torch.nn.Module, then: Callable[[], object] | None = None) -> bool:
        if self.chosen is None:
            return False
        loaded = self.chosen.load(model, then)
        self.version = self.chosen.version
        return loaded

    def load_folder(self, read: Callable[[Path], object]) -> bool:
        if self.chosen is None:
            return False
        loaded = self.chosen.load_folder(read)
        self.version = self.chosen.version
        return loaded

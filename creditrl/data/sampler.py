"""ResumableSampler: row indices per step, epoch after epoch, resumable from a JSON state."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["ResumableSampler"]


class ResumableSampler:
    """An endless iterator of ``batch_size`` row indices per step.

    Epoch ``e`` visits all rows once, in ``torch.randperm`` order from a ``torch.Generator``
    seeded from ``(seed, e)`` (or ``0..num_rows-1`` when ``shuffle=False``). Epochs form one
    stream: a step that reaches the end of an epoch continues with the next one, so no row is
    dropped. ``state_dict()`` is ``{"epoch", "position", ...}`` (JSON-safe): the next index is
    entry ``position`` of epoch ``epoch``'s order; ``load_state_dict`` continues exactly where
    an uninterrupted run would.
    """

    def __init__(self, num_rows: int, batch_size: int, seed: int = 0, shuffle: bool = True):
        if num_rows < 1 or batch_size < 1:
            raise ValueError(
                f"need num_rows >= 1 and batch_size >= 1, got {num_rows}, {batch_size}"
            )
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_rows, self.batch_size, self.seed, self.shuffle = (
            num_rows,
            batch_size,
            seed,
            shuffle,
        )
        self.epoch = 0
        self.position = 0
        self._order: list[int] | None = None

    def epoch_order(self, epoch: int) -> list[int]:
        """The row order of ``epoch``."""
        if not self.shuffle:
            return list(range(self.num_rows))
        generator = torch.Generator()
        generator.manual_seed(int(np.random.SeedSequence([self.seed, epoch]).generate_state(1)[0]))
        return torch.randperm(self.num_rows, generator=generator).tolist()

    def __iter__(self) -> ResumableSampler:
        return self

    def __next__(self) -> list[int]:
        indices: list[int] = []
        while len(indices) < self.batch_size:
            if self._order is None:
                self._order = self.epoch_order(self.epoch)
            take = min(self.batch_size - len(indices), self.num_rows - self.position)
            indices += self._order[self.position : self.position + take]
            self.position += take
            if self.position == self.num_rows:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return indices

    def update(self, batch: Any) -> None:
        """Hook called with each step's scored batch (spec 002 ``sampler.update``); curricula
        override it. No-op here."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe position in the stream, plus the settings it is only valid for."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_rows": self.num_rows,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``; ValueError if it came from different settings."""
        for key in ("num_rows", "batch_size", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has "
                    f"{getattr(self, key)!r}; the data or config changed since the checkpoint"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_rows:
            raise ValueError(f"invalid sampler state epoch={epoch}, position={position}")
        self.epoch, self.position, self._order = epoch, position, None

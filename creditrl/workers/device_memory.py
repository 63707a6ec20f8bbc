"""Peak GPU memory per stage, and a GPU out-of-memory error as one line saying what lowers it.

``StageMemory.stage(name)`` wraps one stage of a worker (the pipeline's timing names: ``gen``,
``old_log_prob``, ``ref``, ``values``, ``update_critic``, ``update_actor``). On CUDA it records
the stage's peak allocated memory (``torch.cuda.max_memory_allocated`` after resetting the peak
at entry); ``metrics()`` gives ``perf/<stage>/max_memory_allocated_gb`` and their maximum
``perf/max_memory_allocated_gb`` (absent on the CPU, where nothing is recorded). The peaks
cover one step: the first ``gen`` after ``metrics()`` was read starts afresh.

A ``torch.OutOfMemoryError`` inside a stage becomes ``DeviceMemoryError``: one line naming the
stage, the device and the keys that lower that stage's memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from creditrl.errors import UserError

__all__ = ["LOWER_WITH", "DeviceMemoryError", "StageMemory"]

_DYNAMIC = "or {0}.max_token_len_per_device with {0}.use_dynamic_bsz=true"
LOWER_WITH = {
    "gen": "rollout.micro_batch_size (trajectories generated together) or "
    "rollout.max_response_length",
    "old_log_prob": f"actor.log_prob_micro_batch_size, {_DYNAMIC.format('actor')}",
    "ref": f"actor.log_prob_micro_batch_size, {_DYNAMIC.format('actor')}",
    "values": f"actor.log_prob_micro_batch_size (the critic's forward too), "
    f"{_DYNAMIC.format('critic')}",
    "update_actor": f"actor.ppo_micro_batch_size, {_DYNAMIC.format('actor')}",
    "update_critic": f"critic.ppo_micro_batch_size, {_DYNAMIC.format('critic')}",
}
"""The keys that lower each stage's memory, as the error names them."""

_GIB = float(1 << 30)


class DeviceMemoryError(UserError):
    """A stage ran out of GPU memory (names the stage and the keys that lower its memory)."""


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:200]


class StageMemory:
    """Peak memory of each stage on ``device`` (recorded on CUDA only); see the module doc."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peaks: dict[str, float] = {}
        self._read = False

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Run one stage: its peak memory is recorded, and running out of memory is one line."""
        if name == "gen" and self._read:
            self.peaks.clear()
            self._read = False
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        except torch.OutOfMemoryError as err:
            raise DeviceMemoryError(
                f"out of memory on {self.device} in stage {name} ({_first_line(err)}): lower "
                f"{LOWER_WITH.get(name, 'the micro-batch sizes')}"
            ) from None
        if cuda:
            peak = torch.cuda.max_memory_allocated(self.device) / _GIB
            self.peaks[name] = max(self.peaks.get(name, 0.0), peak)

    def metrics(self) -> dict[str, float]:
        """``perf/<stage>/max_memory_allocated_gb`` of the stages run this step and their
        maximum ``perf/max_memory_allocated_gb``; empty on the CPU."""
        self._read = True
        if not self.peaks:
            return {}
        out = {f"perf/{name}/max_memory_allocated_gb": gb for name, gb in self.peaks.items()}
        out["perf/max_memory_allocated_gb"] = max(self.peaks.values())
        return out

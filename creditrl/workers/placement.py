"""Where this process's models and batches live: one decision, made once per process.

``trainer.device`` is ``auto`` (CUDA when it is visible), ``cpu`` or ``cuda``. Under
``trainer.backend=ray`` the workers' GPUs are the ones Ray gives them, so ``auto`` means CUDA
exactly when ``trainer.ray.gpus_per_worker`` > 0 (Ray hides the GPUs from an actor that asked
for none). Each rank takes its local GPU (``local_gpu_index``): the one Ray assigned it, else
``cuda:$LOCAL_RANK`` (torchrun; the async learner ranks set it to their rank), else ``cuda:0``.
Asking for CUDA where none is visible is a ``ConfigError`` naming the key.

The resolved ``Placement`` holds the device, the process-group backend (``nccl`` on CUDA, else
``gloo``) and what ``actor.autocast`` resolves to there; every worker reads it (models are moved
to its device, batches enter a stage through ``to_device`` and leave through ``to_cpu``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from creditrl.batch import Batch
from creditrl.errors import ConfigError
from creditrl.workers.precision import resolve_autocast

__all__ = [
    "CPU",
    "DEVICE_CHOICES",
    "Placement",
    "check_device",
    "cuda_visible",
    "describe",
    "device_type",
    "local_gpu_index",
    "placement_for",
    "to_cpu",
    "update_autocast",
]

DEVICE_CHOICES = ("auto", "cpu", "cuda")
_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


@dataclass(frozen=True)
class Placement:
    """This process's device, process-group backend and update autocast ('bf16' or 'none')."""

    device: torch.device
    backend: str
    autocast: str

    @property
    def on_cuda(self) -> bool:
        """True when the device is a CUDA GPU."""
        return self.device.type == "cuda"

    def to_device(self, batch: Batch) -> Batch:
        """``batch`` with its tensors on the device (the same Batch when already there)."""
        if all(t.device == self.device for t in batch.tensors.values()):
            return batch
        return batch.to(self.device)

    def describe(self) -> str:
        """One line for the start-up output: device (with the GPU's name), backend, autocast."""
        where = str(self.device)
        if self.on_cuda:
            where += f" ({torch.cuda.get_device_name(self.device)})"
        return (
            f"trainer.device: models and batches on {where}, process group {self.backend}, "
            f"update autocast {self.autocast}"
        )


CPU = Placement(torch.device("cpu"), "gloo", "none")
"""The CPU placement of workers built by hand (tests, tools); autocast is their own config's."""


def to_cpu(batch: Batch) -> Batch:
    """``batch`` with its tensors on the CPU (the same Batch when already there)."""
    if all(t.device.type == "cpu" for t in batch.tensors.values()):
        return batch
    return batch.to("cpu")


def cuda_visible() -> bool:
    """Whether this process sees a CUDA device (what ``auto`` asks; the test suite outside its
    ``gpu`` tests answers False here, so its figures are the CPU's on any machine)."""
    return torch.cuda.is_available()


def _external_ray(cfg: Any) -> bool:
    """True when the Ray workers run on a cluster the user names (not this machine)."""
    return cfg.trainer.backend == "ray" and bool(
        cfg.trainer.ray.address or os.environ.get("RAY_ADDRESS")
    )


def device_type(cfg: Any) -> str:
    """'cuda' or 'cpu': where ``cfg``'s workers put their models (no CUDA is initialised)."""
    trainer = cfg.trainer
    if trainer.device != "auto":
        return trainer.device
    if trainer.backend == "ray":
        return "cuda" if trainer.ray.gpus_per_worker > 0 else "cpu"
    return "cuda" if cuda_visible() else "cpu"


def _problem(cfg: Any, here: bool) -> str | None:
    """Why ``cfg``'s device settings cannot be met (``here``: by this machine's CUDA), or None."""
    trainer = cfg.trainer
    device, gpus = trainer.device, trainer.ray.gpus_per_worker
    if device not in DEVICE_CHOICES:
        return f"trainer.device must be one of {list(DEVICE_CHOICES)}, got {device!r}"
    if trainer.backend == "ray" and device == "cuda" and gpus <= 0:
        return (
            "trainer.device=cuda with trainer.backend=ray needs trainer.ray.gpus_per_worker > 0 "
            "(Ray gives an actor only the GPUs it asks for)"
        )
    if trainer.backend == "ray" and device == "cpu" and gpus > 0:
        return (
            f"trainer.ray.gpus_per_worker={gpus:g} reserves GPUs that trainer.device=cpu leaves "
            "unused: set trainer.ray.gpus_per_worker=0 or trainer.device=auto"
        )
    if not here or (device_type(cfg) != "cuda" and gpus <= 0) or cuda_visible():
        return None
    if device == "cuda":
        return (
            "trainer.device=cuda, but this machine has no visible CUDA device "
            "(torch.cuda.is_available() is False): use trainer.device=auto or cpu"
        )
    return (
        f"trainer.ray.gpus_per_worker={gpus:g} asks Ray for GPUs, but this machine has no "
        "visible CUDA device (torch.cuda.is_available() is False): set it to 0"
    )


def check_device(cfg: Any) -> None:
    """Raise ``ConfigError`` (one line naming the key) when ``cfg`` asks for CUDA that this
    machine does not have, before anything waits for it (Ray would wait for the GPU forever).
    The GPUs of a Ray cluster the user names are not checked here (its workers check theirs)."""
    problem = _problem(cfg, here=not _external_ray(cfg))
    if problem is not None:
        raise ConfigError(problem)


def update_autocast(cfg: Any) -> str:
    """What ``actor.autocast`` resolves to for this config's update: 'bf16' or 'none'."""
    return resolve_autocast(cfg.actor.autocast, device_type(cfg))


def describe(cfg: Any) -> str:
    """The start-up line: this process's placement, or the Ray workers' device."""
    if cfg.trainer.backend != "ray":
        return placement_for(cfg).describe()
    gpus = cfg.trainer.ray.gpus_per_worker
    kind = device_type(cfg)
    return (
        f"trainer.device: the Ray workers' models and batches on {kind} "
        f"(trainer.ray.gpus_per_worker={gpus:g}), process group {_BACKENDS[kind]}, "
        f"update autocast {update_autocast(cfg)}"
    )


def _ray_gpu() -> str | None:
    """The first GPU id Ray assigned this process (a Ray actor's), or None outside Ray."""
    ray = sys.modules.get("ray")  # a Ray worker has imported it; nothing else needs it
    if ray is None or not ray.is_initialized():
        return None
    ids = ray.get_gpu_ids()
    return str(ids[0]) if ids else None


def local_gpu_index() -> int:
    """This rank's GPU among the visible ones: the one Ray assigned (its place in
    ``$CUDA_VISIBLE_DEVICES``, which Ray normally narrows to it), else ``$LOCAL_RANK`` (torchrun,
    the async learner ranks) modulo the visible count, else 0."""
    count = max(torch.cuda.device_count(), 1)
    ray_gpu = _ray_gpu()
    if ray_gpu is not None:
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
        if ray_gpu in visible:
            return visible.index(ray_gpu) % count
        return int(ray_gpu) % count if ray_gpu.isdigit() else 0
    local = os.environ.get("LOCAL_RANK", "0")
    return (int(local) if local.isdigit() else 0) % count


@cache
def _resolve(kind: str, autocast: str) -> Placement:
    if kind == "cpu":
        return Placement(torch.device("cpu"), "gloo", resolve_autocast(autocast, "cpu"))
    index = local_gpu_index()
    torch.cuda.set_device(index)
    return Placement(torch.device("cuda", index), "nccl", resolve_autocast(autocast, "cuda"))


def placement_for(cfg: Any) -> Placement:
    """This process's placement for ``cfg`` (resolved once per process and setting). Raises
    ``ConfigError`` where CUDA is asked for and not visible here."""
    problem = _problem(cfg, here=True)
    if problem is not None:
        raise ConfigError(problem)
    return _resolve(device_type(cfg), cfg.actor.autocast)

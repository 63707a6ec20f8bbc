"""Worker groups (spec 002's single controller): the interface the trainer calls, in-process
and on Ray, with dispatch modes and the distributed utilities they share."""

from creditrl.config import Config
from creditrl.controller.dispatch import Dispatch
from creditrl.controller.worker_group import METHODS, LocalWorkerGroup, WorkerGroup

__all__ = ["METHODS", "Dispatch", "LocalWorkerGroup", "WorkerGroup", "build_worker_group"]


def build_worker_group(cfg: Config) -> WorkerGroup:
    """The group ``trainer.backend`` names: ``local`` (one rank here) or ``ray``."""
    if cfg.trainer.backend == "local":
        if cfg.trainer.workers != 1:
            raise ValueError(
                f"trainer.workers={cfg.trainer.workers} needs trainer.backend=ray "
                "(the local backend is one process)"
            )
        return LocalWorkerGroup(cfg)
    if cfg.trainer.backend == "ray":
        from creditrl.controller.ray_group import RayWorkerGroup

        return RayWorkerGroup(cfg)
    raise ValueError(f"trainer.backend must be 'local' or 'ray', got {cfg.trainer.backend!r}")

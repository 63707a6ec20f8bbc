"""Worker groups (spec 002's single controller): the interface the trainer calls, in-process
and on Ray, with dispatch modes and the distributed utilities they share."""

from creditrl.config import Config
from creditrl.controller.dispatch import Dispatch
from creditrl.controller.worker_group import METHODS, LocalWorkerGroup, WorkerGroup

__all__ = ["METHODS", "Dispatch", "LocalWorkerGroup", "WorkerGroup", "build_worker_group"]


def build_worker_group(cfg: Config) -> WorkerGroup:
    """The group ``trainer.backend`` names: ``local`` (one rank here) or ``ray``. The config's
    choices and the local backend's single worker are checked when it is loaded; CUDA asked
    for and not visible is refused here, before Ray would wait for a GPU."""
    from creditrl.workers.placement import check_device

    check_device(cfg)
    if cfg.trainer.backend == "local":
        return LocalWorkerGroup(cfg)
    if cfg.trainer.backend == "ray":
        from creditrl.controller.ray_group import RayWorkerGroup, RoutedWorkerGroup
        from creditrl.workers.plan import Plan

        separate = cfg.trainer.critic_placement == "separate" and Plan.from_config(cfg).needs_critic
        if not separate:
            return RayWorkerGroup(cfg)
        actor = RayWorkerGroup(cfg, "actor_rollout_ref", ("actor",))
        return RoutedWorkerGroup(actor, RayWorkerGroup(cfg, "critic", ("critic",)))
    raise ValueError(f"trainer.backend must be 'local' or 'ray', got {cfg.trainer.backend!r}")

"""Ray placement shared by the synchronous worker group (``controller.ray_group``) and the
async launcher's actors (``asynchronous.ray_launch``): one bundle of
``trainer.ray.cpus_per_worker`` CPUs (and ``gpus_per_worker`` GPUs) per actor, in one
placement group with ``trainer.ray.placement_strategy``, each actor pinned to its bundle."""

from __future__ import annotations

from typing import Any

from creditrl.config.schema import RayConfig

__all__ = ["actor_options", "create_placement", "rank_bundle", "remove_placement"]


def rank_bundle(ray_cfg: RayConfig) -> dict[str, float]:
    """The resources of one actor's bundle."""
    bundle = {"CPU": ray_cfg.cpus_per_worker}
    if ray_cfg.gpus_per_worker > 0:
        bundle["GPU"] = ray_cfg.gpus_per_worker
    return bundle


def create_placement(ray_cfg: RayConfig, count: int) -> Any:
    """A placement group of ``count`` bundles (not waited for: ``.ready()`` says when)."""
    from ray.util.placement_group import placement_group

    return placement_group([rank_bundle(ray_cfg)] * count, strategy=ray_cfg.placement_strategy)


def actor_options(ray_cfg: RayConfig, placement: Any, index: int) -> dict[str, Any]:
    """``ray.remote(...).options(**...)`` of the actor on bundle ``index`` of ``placement``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "num_cpus": ray_cfg.cpus_per_worker,
        "num_gpus": ray_cfg.gpus_per_worker,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement, placement_group_bundle_index=index
        ),
    }


def remove_placement(placement: Any) -> None:
    """Release ``placement``'s resources."""
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(placement)

"""The Ray worker group: N Ray actors, one ``HybridWorker`` each, joined by a torch.distributed
process group (``creditrl.workers.placement``: gloo on CPU, NCCL on each rank's own GPU when
``trainer.ray.gpus_per_worker`` > 0).

Resource pools: by default one pool holds every role (actor, rollout, reference and critic
share each rank's process and device). ``trainer.critic_placement=separate`` gives the critic
its own pool of ``trainer.workers`` ranks (its own placement group and process group), and
``RoutedWorkerGroup`` sends each call to the pool that holds its role.

Placement: one bundle of ``cpus_per_worker`` CPUs (and ``gpus_per_worker`` GPUs) per rank in a
placement group (``trainer.ray.placement_strategy``), so the actor, rollout and reference of
a rank share one process and its device. Batches travel as ``Batch.to_bytes()`` (safetensors
+ JSON) and metrics as JSON: Ray carries opaque bytes, never our objects.

Faults: every call waits with ``ray.wait`` up to ``trainer.call_timeout_s``; a rank whose
process died, or whose call raised, ends the call with a ``WorkerError`` naming the role and
rank (a rank whose collective failed names the peer that died, when one did within
``DEATH_GRACE_S``), and the group kills its remaining actors so none is left blocked in a
collective (those also time out after ``trainer.collective_timeout_s``).

Network: a cluster started here (no ``trainer.ray.address`` / ``$RAY_ADDRESS``) listens on
127.0.0.1 only, and so does its workers' process group (``creditrl.workers.distributed``); on a
cluster the user names, the ranks rendezvous at rank 0's node address.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import torch

from creditrl.batch import Batch
from creditrl.config import Config
from creditrl.config.loader import from_dict, to_dict
from creditrl.controller.dispatch import Dispatch, collect, split
from creditrl.controller.placement import actor_options, create_placement, remove_placement
from creditrl.controller.worker_group import METHODS, WorkerGroup

__all__ = ["RankActor", "RayWorkerGroup", "RoutedWorkerGroup", "WorkerError", "init_ray"]

log = logging.getLogger(__name__)
DEATH_GRACE_S = 10.0  # how long a failed call waits to see whether a peer rank died


class WorkerError(RuntimeError):
    """A worker died, raised, or did not answer in time; the message names role and rank."""


def encode(result: Any) -> bytes:
    """A worker's answer as bytes: ``B`` + Batch bytes, or ``J`` + JSON."""
    if isinstance(result, Batch):
        return b"B" + result.to_bytes()
    return b"J" + json.dumps(result).encode()


def decode(data: bytes) -> Any:
    """Inverse of ``encode``."""
    return Batch.from_bytes(data[1:]) if data[:1] == b"B" else json.loads(data[1:])


class RankActor:
    """One rank (wrapped with ``ray.remote`` by the group). Builds its ``HybridWorker`` after
    joining the process group."""

    def __init__(
        self, cfg_json: str, rank: int, world: int, threads: int, roles: list[str]
    ) -> None:
        if threads > 0:
            torch.set_num_threads(threads)
        self.cfg = from_dict(json.loads(cfg_json))
        self.rank, self.world, self.roles = rank, world, tuple(roles)
        self.worker = None

    def address(self) -> tuple[str, int, int]:
        """(this node's address, a free port on it, this process's pid)."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        return host, port, os.getpid()

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join the process group and build the models; returns the pad token id."""
        from creditrl.workers.distributed import init_process_group
        from creditrl.workers.hybrid import HybridWorker
        from creditrl.workers.placement import placement_for

        trainer = self.cfg.trainer
        placement = placement_for(self.cfg)
        init_process_group(
            self.rank,
            self.world,
            backend=placement.backend,
            device=placement.device,
            master_addr=master_addr,
            master_port=master_port,
            timeout_s=trainer.collective_timeout_s,
        )
        self.worker = HybridWorker(self.cfg, roles=self.roles)
        return int(self.worker.tokenizer.pad_token_id)

    def call(self, method: str, payload: bytes | None, kwargs_json: str) -> bytes:
        """Run ``HybridWorker.<method>`` on a Batch given as bytes; the answer as bytes."""
        fn = getattr(self.worker, method)
        kwargs = json.loads(kwargs_json)
        result = fn(Batch.from_bytes(payload), **kwargs) if payload is not None else fn(**kwargs)
        return encode(result)


@contextlib.contextmanager
def _single_node_mode() -> Iterator[None]:
    """Ray replaces a loopback ``_node_ip_address`` by the machine's outward address (so that
    other nodes could join) unless its single-node mode is on (``RAY_ENABLE_WINDOWS_OR_OSX_
    CLUSTER=0``, read once when Ray is imported). Switched on here while our own cluster starts,
    so its GCS, raylet, object manager, agents and workers listen on 127.0.0.1 only."""
    from ray._private import ray_constants

    before = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    if before is None:  # another Ray version: init_ray warns if the node is not loopback
        yield
        return
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def init_ray(cfg: Config) -> None:
    """Connect to ``trainer.ray.address`` (or ``$RAY_ADDRESS``), else start a local cluster
    bound to loopback (no dashboard) with the CPUs (and GPUs) the pools' bundles ask for."""
    import ray

    if ray.is_initialized():
        return
    ray_cfg = cfg.trainer.ray
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS")
    common = {"namespace": ray_cfg.namespace, "log_to_driver": True}
    if address:
        ray.init(address=address, **common)
        return
    pools = 2 if cfg.trainer.critic_placement == "separate" else 1
    ranks = pools * cfg.trainer.workers
    with _single_node_mode():
        ray.init(
            address="local",
            num_cpus=max(int(ranks * ray_cfg.cpus_per_worker + 0.999), 1),
            num_gpus=int(ranks * ray_cfg.gpus_per_worker + 0.999),
            include_dashboard=False,
            dashboard_host="127.0.0.1",
            _node_ip_address="127.0.0.1",
            **common,
        )
    node = ray.util.get_node_ip_address()
    if node != "127.0.0.1":
        log.warning(
            "the local Ray cluster listens on %s, not 127.0.0.1 (this Ray version ignored "
            "the loopback address): other machines on that network can reach it",
            node,
        )


class RayWorkerGroup(WorkerGroup):
    """``trainer.workers`` ranks on Ray; see the module docstring."""

    def __init__(
        self,
        cfg: Config,
        role: str = "actor_rollout_ref",
        roles: tuple[str, ...] = ("actor", "critic"),
    ) -> None:
        import ray

        init_ray(cfg)
        self.cfg, self.role = cfg, role
        self.world_size = n = cfg.trainer.workers
        ray_cfg = cfg.trainer.ray
        self.placement = create_placement(ray_cfg, n)
        self._wait({0: self.placement.ready()}, "placement", cfg.trainer.call_timeout_s)
        remote = ray.remote(RankActor)
        cfg_json = json.dumps(to_dict(cfg))
        threads = max(int(ray_cfg.cpus_per_worker), 1)
        self.actors = [
            remote.options(**actor_options(ray_cfg, self.placement, rank)).remote(
                cfg_json, rank, n, threads, list(roles)
            )
            for rank in range(n)
        ]
        timeout = cfg.trainer.call_timeout_s
        host, port, _ = self._wait({0: self.actors[0].address.remote()}, "address", timeout)[0]
        self.pids = [
            pid
            for _, _, pid in self._wait(
                {r: a.address.remote() for r, a in enumerate(self.actors)}, "address", timeout
            )
        ]
        self.pad_token_id = self._wait(
            {r: a.setup.remote(host, port) for r, a in enumerate(self.actors)}, "setup", timeout
        )[0]

    def call(self, method: str, batch: Batch | None = None, **kwargs: Any) -> Any:
        if method not in METHODS:
            raise AttributeError(f"worker groups have no method {method!r}")
        mode, strict = METHODS[method]
        kwargs_json = json.dumps(kwargs)
        pad = 0
        if batch is not None and mode is Dispatch.DP:
            parts, pad = split(batch, self.world_size, strict=strict, what=method)
            payloads = [p.to_bytes() for p in parts]
        else:
            payloads = [None if batch is None else batch.to_bytes()] * self.world_size
        ranks = range(self.world_size)
        refs = {r: self.actors[r].call.remote(method, payloads[r], kwargs_json) for r in ranks}
        answers = self._wait(refs, method, self.cfg.trainer.call_timeout_s)
        return collect([decode(a) for a in answers], mode, pad, self.pad_token_id)

    def _wait(self, refs: dict[int, Any], what: str, timeout: float) -> list[Any]:
        """Answers in rank order; the first failure or the timeout raises ``WorkerError``."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        by_ref = {ref: rank for rank, ref in refs.items()}
        answers: dict[int, Any] = {}
        pending = list(refs.values())
        deadline = time.monotonic() + timeout
        while pending:
            ready, pending = ray.wait(
                pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0)
            )
            if not ready:
                late = sorted(by_ref[r] for r in pending)
                self.shutdown()
                raise WorkerError(
                    f"{self.role} ranks {late} did not finish {what} within {timeout:.0f} s "
                    "(trainer.call_timeout_s)"
                )
            rank = by_ref[ready[0]]
            try:
                answers[rank] = ray.get(ready[0])
            except RayActorError as err:
                self.shutdown()
                raise WorkerError(
                    f"{self.role} rank {rank} died during {what}: {type(err).__name__}"
                ) from None
            except (RayTaskError, GetTimeoutError) as err:
                cause = getattr(err, "cause", err)
                failed = (
                    f"{self.role} rank {rank} failed in {what}: {type(cause).__name__}: {cause}"
                )
                dead = self._dead_rank(pending, by_ref, deadline)
                self.shutdown()
                if dead is not None:  # the root cause: a collective fails when a peer dies
                    raise WorkerError(
                        f"{self.role} rank {dead} died during {what} (then {failed})"
                    ) from None
                raise WorkerError(failed) from None
        return [answers[r] for r in sorted(answers)]

    @staticmethod
    def _dead_rank(pending: list, by_ref: dict, deadline: float) -> int | None:
        """The rank among ``pending`` whose process died, waiting up to ``DEATH_GRACE_S`` (a
        peer's death reaches the surviving ranks' collectives before Ray reports it)."""
        import ray
        from ray.exceptions import RayActorError

        grace = time.monotonic() + min(DEATH_GRACE_S, max(deadline - time.monotonic(), 0))
        while pending:
            ready, pending = ray.wait(
                pending, num_returns=1, timeout=max(grace - time.monotonic(), 0)
            )
            if not ready:
                return None
            try:
                ray.get(ready[0])
            except RayActorError:
                return by_ref[ready[0]]
            except Exception:  # another failure, not a death: keep looking
                continue
        return None

    def shutdown(self) -> None:
        import ray

        for actor in getattr(self, "actors", []):
            ray.kill(actor, no_restart=True)
        self.actors = []
        if getattr(self, "placement", None) is not None:
            remove_placement(self.placement)
            self.placement = None


class RoutedWorkerGroup(WorkerGroup):
    """Two pools behind one interface: critic calls go to ``critic``, the rest to ``actor``;
    checkpoints are written and read by both (their files do not overlap)."""

    CRITIC_METHODS = ("compute_values", "update_critic")

    def __init__(self, actor: WorkerGroup, critic: WorkerGroup) -> None:
        self.actor, self.critic = actor, critic
        self.world_size = actor.world_size

    def call(self, method: str, batch: Batch | None = None, **kwargs: Any) -> Any:
        if method in self.CRITIC_METHODS:
            return self.critic.call(method, batch, **kwargs)
        if method == "save_checkpoint":
            meta = self.actor.call(method, batch, **kwargs)
            return {**meta, **self.critic.call(method, batch, **kwargs)}
        if method == "load_checkpoint":  # None, or why the checkpoint does not fit
            return self.actor.call(method, batch, **kwargs) or self.critic.call(
                method, batch, **kwargs
            )
        return self.actor.call(method, batch, **kwargs)

    def shutdown(self) -> None:
        self.actor.shutdown()
        self.critic.shutdown()

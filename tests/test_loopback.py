"""Nothing a run starts listens beyond this machine unless the user names an address: the local
Ray cluster (GCS, raylet, object manager, agents, workers) with its workers' process group, and
the async learner ranks (their torch.distributed rendezvous, gloo, and the ZeroMQ socket)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import tiny_trainer_config

from creditrl.asynchronous.launcher import free_port
from creditrl.hosts import is_loopback
from creditrl.models.tiny import tiny_model_dir


def listening(pids: set[int]) -> list[tuple[str, int, int, str]]:
    """(ip, port, pid, process name) of every TCP socket in LISTEN state owned by ``pids``."""
    found = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            try:
                name = psutil.Process(conn.pid).name()
            except psutil.NoSuchProcess:
                continue
            found.append((conn.laddr.ip, conn.laddr.port, conn.pid, name))
    return sorted(found)


def tree(pid: int) -> set[int]:
    """``pid`` and all its descendants."""
    root = psutil.Process(pid)
    return {pid} | {p.pid for p in root.children(recursive=True)}


def test_loopback_helpers() -> None:
    """The address check used here (on what psutil reports: IPv4-mapped loopback is an IPv6
    socket bound to 127.0.0.1, as gRPC does) and by the rendezvous; every case is pinned in
    tests/test_hosts.py."""
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.0.2.2")
    assert is_loopback("localhost") and is_loopback("[::1]") and is_loopback("127.0.0.2")
    assert not is_loopback("10.0.0.1") and not is_loopback("node-3")


def test_local_ray_cluster_and_its_workers_listen_on_loopback_only(tmp_path: Path) -> None:
    """A 2-worker Ray group started by us (no trainer.ray.address / RAY_ADDRESS): every socket
    listening in this process and its descendants (GCS, raylet, agents, the workers with their
    TCP store and gloo) is on loopback. Ray would otherwise listen on every interface."""
    ray = pytest.importorskip("ray", reason="the Ray backend needs the 'ray' package")
    from creditrl.controller.ray_group import RayWorkerGroup

    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        pytest.skip("needs a Ray cluster of its own")
    cfg = tiny_trainer_config(tmp_path, "trainer.backend=ray", "trainer.workers=2")
    group = RayWorkerGroup(cfg)
    try:
        group.save_checkpoint(str(tmp_path))  # a collective over the workers' process group
        found = listening(tree(os.getpid()))
        names = {name for *_, name in found}
        assert {"gcs_server", "raylet"} <= names, found
        assert set(group.pids) <= {pid for _, _, pid, _ in found}, found
        assert [f for f in found if not is_loopback(f[0])] == []
    finally:
        group.shutdown()
        ray.shutdown()


def test_async_learner_ranks_listen_on_loopback_only(tmp_path: Path) -> None:
    """Two ``creditrl learner`` ranks up and waiting for samplers: their rendezvous store (on
    asynchronous.dist_port), gloo's sockets and the learner's ZeroMQ socket are all on
    loopback (torch's store listened on every interface before)."""
    port, dist_port = free_port(), free_port()
    args = [
        f"model.path={tiny_model_dir()}", "data.train_batch_size=2", "rollout.n=2",
        "actor.ppo_mini_batch_size=2", "trainer.logger=[jsonl]",
        f"trainer.output_dir={tmp_path / 'run'}", f"asynchronous.port={port}",
        f"asynchronous.dist_port={dist_port}", "asynchronous.learners=2",
        "asynchronous.learner_threads=1", "asynchronous.data_timeout_s=60",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME")}
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "creditrl.cli", "learner", *args, "--rank", str(r)],
            stdout=logs[r].open("w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        for r in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while "learner: listening on" not in logs[0].read_text():
            assert all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
            time.sleep(0.5)
        found = listening(set().union(*(tree(p.pid) for p in procs)))
        ports = {port for _, port, _, _ in found}
        assert {port, dist_port} <= ports, found
        assert {pid for _, _, pid, _ in found} == {p.pid for p in procs}, found
        assert [f for f in found if not is_loopback(f[0])] == []
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

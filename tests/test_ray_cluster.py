"""Beyond one machine: a simulated two-node Ray cluster (``ray.cluster_utils.Cluster``, both
nodes bound to 127.0.0.1). The synchronous trainer's ranks spread over the nodes and match the
in-process run; ``creditrl async asynchronous.launcher=ray`` runs the learner and the sampler
as actors on different nodes, sharing nothing but a socket, and ends at once, naming it, when
an actor fails."""

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import COMPARED_METRICS, read_metrics, tiny_scale_out_config
from rich.console import Console

from creditrl import cli
from creditrl.asynchronous import ray_launch
from creditrl.asynchronous.launcher import load_from_args
from creditrl.asynchronous.ray_launch import ActorRun, learner_host, supervise_actors
from creditrl.asynchronous.transport import CURVE_ENV, LEARNER_CURVE_ENV, make_curve_keys
from creditrl.config import load_config
from creditrl.controller.ray_group import _single_node_mode
from creditrl.errors import ConfigError
from creditrl.models.tiny import tiny_model_dir
from creditrl.trainers.rl_trainer import RLTrainer

ray = pytest.importorskip("ray", reason="the Ray backend needs the 'ray' package")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

SINGLE_NODE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # 0: Ray keeps every node on 127.0.0.1


@pytest.fixture(scope="module")
def two_nodes():
    """A head node and a second node, 2 CPUs each (so PACK would put two 1-CPU ranks on one
    node: only SPREAD splits them), on loopback; this process is connected."""
    before = os.environ.get(SINGLE_NODE)
    os.environ[SINGLE_NODE] = "0"  # the nodes' own processes read it
    loopback = {"num_cpus": 2, "node_ip_address": "127.0.0.1"}
    with _single_node_mode():
        cluster = Cluster(
            initialize_head=True, head_node_args={**loopback, "include_dashboard": False}
        )
        cluster.add_node(**loopback)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="test")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if before is None:
            os.environ.pop(SINGLE_NODE, None)
        else:
            os.environ[SINGLE_NODE] = before


def test_sync_trainer_spreads_its_ranks_over_two_nodes(tmp_path: Path, two_nodes) -> None:
    """trainer.ray.placement_strategy=SPREAD puts rank 0 and rank 1 on the two different nodes
    of the cluster named by trainer.ray.address, and one step there gives the in-process
    run's metrics (same seed) to 1e-5."""
    local = RLTrainer(tiny_scale_out_config(tmp_path / "local", "trainer.total_steps=1"))
    local.fit()
    spread = RLTrainer(
        tiny_scale_out_config(
            tmp_path / "ray",
            "trainer.total_steps=1",
            "trainer.backend=ray",
            "trainer.workers=2",
            "trainer.ray.placement_strategy=SPREAD",
            f"trainer.ray.address={two_nodes.address}",
        )
    )
    nodes = placement_group_table(spread.workers.placement)["bundles_to_node_id"]
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert len(alive) == 2 and set(nodes.values()) == alive  # one rank on each node
    spread.fit()
    a, b = read_metrics(tmp_path / "local")[1], read_metrics(tmp_path / "ray")[1]
    compared = [key for key in COMPARED_METRICS if key in a or key in b]
    assert len(compared) >= 6
    for key in compared:
        assert b[key] == pytest.approx(a[key], abs=1e-5), key


def fake_actor_class():
    """An actor class that behaves as told (defined here so Ray ships it by value)."""

    class Fake:
        def __init__(self, behaviour: str) -> None:
            self.behaviour = behaviour

        def run(self) -> str:
            if self.behaviour == "sleep":
                time.sleep(60)
            if self.behaviour == "fail":
                lines = ["Traceback (most recent call last):", "FileExistsError: /x exists"]
                return json.dumps(
                    {"code": 1, "error": "FileExistsError: /x exists", "lines": lines}
                )
            if self.behaviour == "die":
                os._exit(9)
            if self.behaviour == "raise":
                raise RuntimeError("out of memory")
            return json.dumps({"code": 0, "error": None, "lines": []})

    return ray.remote(num_cpus=0)(Fake)


def supervise_fakes(learner: str, sampler: str, grace_s: float = 5.0):
    """(code, console text, [learner run, sampler run]) of supervising two fakes."""
    remote = fake_actor_class()
    runs = []
    for role, behaviour in (("learner", learner), ("sampler", sampler)):
        actor = remote.remote(behaviour)
        runs.append(ActorRun(role, 0, actor, actor.run.remote()))
    out = io.StringIO()
    code = supervise_actors(runs[:1], runs[1:], Console(file=out, width=300), grace_s, 0.05)
    return code, out.getvalue(), runs


def killed(run: ActorRun) -> bool:
    """True when the actor of ``run`` is gone (its pending call fails with RayActorError)."""
    try:
        ray.get(run.actor.run.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        return True
    return False


def test_supervise_actors_names_a_failed_sampler_and_kills_the_learner(two_nodes) -> None:
    """A sampler actor answering code 1 ends the run at once with code 1, naming it, its error
    and its last lines; the learner actor (still busy) is killed."""
    code, text, runs = supervise_fakes("sleep", "fail")
    assert code == 1, text
    assert "async: sampler 0 (s0) failed with code 1: FileExistsError: /x exists" in text
    assert "  | FileExistsError: /x exists" in text
    assert "rerun the same command to resume" in text
    assert killed(runs[0])


def test_supervise_actors_reports_a_dead_or_raising_actor(two_nodes) -> None:
    """A sampler whose process dies: code 1, "died" and the Ray error named. A learner rank
    whose call raises: code 1 with the exception's type and message; the sampler is killed."""
    code, text, _ = supervise_fakes("sleep", "die")
    assert code == 1, text
    assert re.search(r"async: sampler 0 \(s0\) died \(\w*ActorDiedError", text), text
    code, text, runs = supervise_fakes("raise", "sleep")
    assert code == 1, text
    assert "async: learner rank 0 raised RuntimeError: out of memory" in text, text
    assert killed(runs[1])


def test_supervise_actors_ends_when_the_learner_finishes(two_nodes, monkeypatch) -> None:
    """Learner rank 0 finishing: code 0 and nothing reported, even when a sampler does not stop
    (it is waited for grace_s, for all that is pending, then killed)."""
    waits: list[tuple[int, float | None]] = []
    wait = ray.wait

    def counted(refs, *, num_returns=1, timeout=None, **kwargs):
        waits.append((num_returns, timeout))
        return wait(refs, num_returns=num_returns, timeout=timeout, **kwargs)

    monkeypatch.setattr(ray, "wait", counted)
    code, text, runs = supervise_fakes("ok", "sleep", grace_s=1.0)
    assert code == 0 and "stopping the run" not in text
    assert waits[-1] == (1, 1.0)  # the sampler's run, still pending, given grace_s
    assert not runs[1].done and killed(runs[1])


def test_learner_host_needs_curve_or_allow_insecure_off_loopback() -> None:
    """The learner binds 127.0.0.1 on a cluster started here and its node's address on a named
    one; a non-loopback node without CURVE keys or allow_insecure is a one-line ConfigError
    naming both keys."""
    cfg = load_config(overrides=[f"model.path={tiny_model_dir()}"])
    assert learner_host(cfg, "10.1.2.3", named_cluster=False) == "127.0.0.1"
    assert learner_host(cfg, "127.0.0.1", named_cluster=True) == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"node 10\.1\.2\.3 is not loopback.*curve_keys_dir.*"
                       r"allow_insecure=true"):  # fmt: skip
        learner_host(cfg, "10.1.2.3", named_cluster=True)
    for extra in ("asynchronous.allow_insecure=true", "asynchronous.curve_keys_dir=/keys"):
        secured = load_config(overrides=[f"model.path={tiny_model_dir()}", extra])
        assert learner_host(secured, "10.1.2.3", named_cluster=True) == "10.1.2.3"


def test_ray_keys_are_not_called_unused_with_the_ray_launcher() -> None:
    """`creditrl async asynchronous.launcher=ray` reads trainer.ray.*: no "set but
    trainer.backend=local" warning for them (the process launcher still gets it)."""
    ray_keys = ["trainer.ray.placement_strategy=SPREAD", "trainer.ray.cpus_per_worker=2"]
    for launcher, warned in (("ray", False), ("processes", True)):
        warnings: list[str] = []
        load_from_args([f"asynchronous.launcher={launcher}", *ray_keys], warnings)
        assert any("trainer.ray.cpus_per_worker=2" in w for w in warnings) is warned, warnings


def async_args(out: Path, address: str, *extra: str) -> list[str]:
    return [
        "async", f"model.path={tiny_model_dir()}", "data.train_size=8", "data.val_size=0",
        "data.max_prompt_length=128", "data.few_shot=0", "data.train_batch_size=1", "rollout.n=2",
        "rollout.max_response_length=8", "actor.ppo_mini_batch_size=1", "reward.num_workers=0",
        "trainer.total_steps=2", "trainer.logger=[jsonl]", f"trainer.output_dir={out}",
        "asynchronous.port=0", "asynchronous.launcher=ray", f"trainer.ray.address={address}",
        "trainer.ray.placement_strategy=SPREAD", *extra,
    ]  # fmt: skip


def test_creditrl_async_on_ray_actors_over_two_nodes_sharing_only_a_socket(
    tmp_path: Path, two_nodes, capsys, monkeypatch
) -> None:
    """`creditrl async asynchronous.launcher=ray` on the cluster: learner and sampler run as
    actors on the two different nodes, train 2 steps and the command exits 0, with nothing
    shared but the socket: the key folder is gone before the actors run (their CURVE keys
    came in their environment), their nodes lack the launcher's directory (each works in a
    folder of its own), and the sampler's weights came over the wire (CURVE, the weight
    port)."""
    out = tmp_path / "run"
    keys = make_curve_keys(tmp_path / "keys")
    monkeypatch.setattr(ray_launch, "_launch_dir", lambda: str(tmp_path / "not-on-any-node"))
    locate = ray_launch._locate

    def keys_gone(runs, timeout, console):  # the launcher has read them; the actors have not
        shutil.rmtree(keys)
        return locate(runs, timeout, console)

    monkeypatch.setattr(ray_launch, "_locate", keys_gone)
    wire = ["asynchronous.weight_channel=wire", "asynchronous.max_staleness=0"]  # v1 fetched
    args = async_args(out, two_nodes.address, f"asynchronous.curve_keys_dir={keys}", *wire)
    code = cli.main(args)
    text = capsys.readouterr().out
    assert code == 0, text[-3000:]
    assert not keys.exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[-1]["async/weights_chunks_sent"] > 0, rows[-1]
    address = re.search(r"learner at (tcp://127\.0\.0\.1:\d+)", text)
    assert address, text[-3000:]
    logs = _actor_logs()
    assert f"learner: listening on {address[1]} (CURVE)" in logs
    assert "sampler s0: weights over the wire from tcp://127.0.0.1:" in logs
    own = ray_launch.node_workdir(str(tmp_path / "not-on-any-node"))
    assert Path(own).is_dir()
    shutil.rmtree(own)  # kept for restarted actors; this run is over
    where = re.search(rf"learner rank 0 on 127\.0\.0\.1 \((\w+)\) in its node's own {own}, "
                      rf"sampler 0 \(s0\) on 127\.0\.0\.1 \((\w+)\) in its node's own {own}",
                      text)  # fmt: skip
    assert where and where[1] != where[2], text[-3000:]


def _actor_logs() -> str:
    """What the cluster's actors printed (its session's ``worker-*`` files)."""
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    return "".join(path.read_text(errors="replace") for path in sorted(logs.glob("worker-*")))


def test_actor_env_hands_each_role_only_its_keys(tmp_path: Path, monkeypatch) -> None:
    """The learner's actors get its secret key and the samplers' public keys, the samplers'
    the learner's public key and their own secret key; keys already in the launcher's
    environment win over the folder; no keys, no environment."""
    for name in (*LEARNER_CURVE_ENV, *CURVE_ENV):
        monkeypatch.delenv(name, raising=False)
    base = [f"model.path={tiny_model_dir()}"]
    assert ray_launch.actor_env(load_config(overrides=base)) == {"learner": {}, "sampler": {}}
    keys = make_curve_keys(tmp_path / "keys")
    cfg = load_config(overrides=[*base, f"asynchronous.curve_keys_dir={keys}"])
    envs = ray_launch.actor_env(cfg)
    assert set(envs["learner"]) == set(LEARNER_CURVE_ENV)
    assert set(envs["sampler"]) == set(CURVE_ENV)
    secret = envs["sampler"]["CREDITRL_CURVE_SECRET"]
    assert secret not in json.dumps(envs["learner"])  # a sampler's secret stays the sampler's
    monkeypatch.setenv("CREDITRL_CURVE_SERVER_PUBLIC", "p" * 40)
    monkeypatch.setenv("CREDITRL_CURVE_SECRET", "s" * 40)
    envs = ray_launch.actor_env(cfg)
    assert envs["sampler"] == {"CREDITRL_CURVE_SERVER_PUBLIC": "p" * 40,
                               "CREDITRL_CURVE_SECRET": "s" * 40}  # fmt: skip
    assert set(envs["learner"]) == set(LEARNER_CURVE_ENV)  # still from the folder


def test_creditrl_async_on_ray_ends_when_a_sampler_cannot_start(
    tmp_path: Path, two_nodes, capsys
) -> None:
    """A sampler actor failing at start-up (its state_dir is a file) ends the launch with code 1
    as soon as its failure is seen (not after the learner's data_timeout_s=600 s), naming the
    sampler and its error; the learner's actor is gone."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    args = async_args(tmp_path / "out", two_nodes.address, f"asynchronous.state_dir={blocker}",
                      "asynchronous.data_timeout_s=600")  # fmt: skip
    code = cli.main(args)
    text = capsys.readouterr().out
    assert code == 1, text[-3000:]
    assert "asynchronous.data_timeout_s" not in text
    assert "async: sampler 0 (s0) failed with code 1: NotADirectoryError" in text, text[-3000:]
    assert "  | NotADirectoryError: [Errno 20] Not a directory" in text
    deadline = time.monotonic() + 10  # the actors and their placement group are gone
    while ray.available_resources().get("CPU") != 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 4


@pytest.mark.slow
def test_creditrl_async_on_a_local_ray_cluster(tmp_path: Path) -> None:
    """Without trainer.ray.address, `creditrl async asynchronous.launcher=ray` starts its own
    cluster (loopback), trains 2 steps with the learner at 127.0.0.1 and exits 0."""
    out = tmp_path / "run"
    args = [arg for arg in async_args(out, "") if not arg.startswith("trainer.ray.address=")]
    env = {
        key: value for key, value in os.environ.items() if key not in (SINGLE_NODE, "RAY_ADDRESS")
    }
    done = subprocess.run(
        [sys.executable, "-m", "creditrl.cli", *args],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert [row["step"] for row in map(json.loads, (out / "metrics.jsonl").open())] == [1, 2]
    assert re.search(r"learner at tcp://127\.0\.0\.1:\d+", text), text[-3000:]

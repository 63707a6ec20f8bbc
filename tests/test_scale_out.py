"""The Ray backend on a local cluster (2 CPU workers, gloo): same metrics as in-process, a
killed worker ends the run naming role and rank, and a rerun resumes; dispatch keeps order."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import COMPARED_METRICS, read_metrics, tiny_scale_out_config

from creditrl.batch import Batch
from creditrl.controller.dispatch import Dispatch, collect, split
from creditrl.controller.ray_group import WorkerError, decode, encode
from creditrl.trainers.rl_trainer import RLTrainer

ray = pytest.importorskip("ray", reason="the Ray backend needs the 'ray' package")


@pytest.fixture(scope="module")
def ray_cluster():
    """A cluster of its own (address="local"): without it ray.init joins a cluster already
    running on this machine, such as test_ray_cluster's on the other test process, and
    refuses num_cpus."""
    ray.init(address="local", num_cpus=4, include_dashboard=False,
             _node_ip_address="127.0.0.1", namespace="test")  # fmt: skip
    yield
    ray.shutdown()


def test_dispatch_keeps_order_and_refuses_uneven_updates() -> None:
    batch = Batch.from_dict({"x": torch.arange(5)}, {"name": [f"s{i}" for i in range(5)]})
    parts, pad = split(batch, 2)
    assert pad == 1 and [len(p) for p in parts] == [3, 3]
    back = collect(parts, Dispatch.DP, pad)
    assert back["x"].tolist() == [0, 1, 2, 3, 4]
    assert list(back["name"]) == ["s0", "s1", "s2", "s3", "s4"]
    with pytest.raises(ValueError, match="do not divide evenly over 2 workers"):
        split(batch, 2, strict=True, what="update_actor")
    assert collect([{"a": 1}, {"a": 2}], Dispatch.ALL) == {"a": 1}
    assert decode(encode({"m": 1.5})) == {"m": 1.5}
    assert decode(encode(batch)).equals(batch)


def test_collect_right_pads_ranks_with_shorter_responses() -> None:
    short = Batch.from_dict(
        {
            "responses": torch.tensor([[5, 2]]),
            "response_mask": torch.tensor([[1, 1]]),
            "position_ids": torch.tensor([[0, 1, 2, 3]]),
            "score": torch.tensor([1.0]),
        }
    )
    long = Batch.from_dict(
        {
            "responses": torch.tensor([[6, 7, 8]]),
            "response_mask": torch.tensor([[1, 1, 1]]),
            "position_ids": torch.tensor([[0, 1, 2, 3, 4]]),
            "score": torch.tensor([0.5]),
        }
    )
    both = collect([short, long], Dispatch.DP, pad=0, pad_token_id=2)
    assert both["responses"].tolist() == [[5, 2, 2], [6, 7, 8]]
    assert both["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert both["position_ids"].tolist() == [[0, 1, 2, 3, 3], [0, 1, 2, 3, 4]]
    assert both["score"].tolist() == [1.0, 0.5]


def test_ray_two_workers_match_in_process(tmp_path: Path, ray_cluster) -> None:
    local = RLTrainer(tiny_scale_out_config(tmp_path / "local"))
    local.fit()
    distributed = RLTrainer(
        tiny_scale_out_config(tmp_path / "ray", "trainer.backend=ray", "trainer.workers=2")
    )
    distributed.fit()
    a, b = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "ray")
    for step in (1, 2):
        for key in COMPARED_METRICS:
            if key in a[step] or key in b[step]:
                assert b[step][key] == pytest.approx(a[step][key], abs=1e-5), (step, key)
    assert "global_seqlen/minmax_diff" in b[1]
    assert torch.equal(
        local.last_batch["responses"].sort(0)[0], distributed.last_batch["responses"].sort(0)[0]
    )


def test_killed_worker_is_named_and_rerun_resumes(tmp_path: Path, ray_cluster) -> None:
    out = tmp_path / "run"
    cfg = tiny_scale_out_config(
        out,
        "trainer.backend=ray",
        "trainer.workers=2",
        "trainer.total_steps=3",
        "trainer.collective_timeout_s=20",
        "trainer.call_timeout_s=60",
    )
    trainer = RLTrainer(cfg)
    victim = trainer.workers.pids[1]

    def kill_after_first_checkpoint() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (out / "checkpoints" / "latest").is_file():
                os.kill(victim, signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
    killer.start()
    with pytest.raises(WorkerError, match=r"actor_rollout_ref rank 1 (died|failed)"):
        trainer.fit()
    killer.join()
    assert max(read_metrics(out)) >= 1

    resumed = RLTrainer(
        tiny_scale_out_config(
            out, "trainer.backend=ray", "trainer.workers=2", "trainer.total_steps=3"
        )
    )
    resumed.fit()
    assert [step for step in sorted(read_metrics(out)) if step > 0] == [1, 2, 3]


def test_ppo_with_the_critic_in_its_own_pool(tmp_path: Path, ray_cluster) -> None:
    cfg = tiny_scale_out_config(
        tmp_path,
        "preset=ppo",
        "trainer.backend=ray",
        "trainer.workers=2",
        "trainer.critic_placement=separate",
        "trainer.total_steps=1",
        "trainer.test_freq=0",
    )
    trainer = RLTrainer(cfg)
    assert trainer.workers.critic.role == "critic"
    assert len(set(trainer.workers.actor.pids) & set(trainer.workers.critic.pids)) == 0
    trainer.fit()
    metrics = read_metrics(tmp_path)[1]
    assert "critic/vf_loss" in metrics and "actor/pg_loss" in metrics
    assert trainer.last_batch["values"].shape == trainer.last_batch["responses"].shape
    files = {p.name for p in (tmp_path / "checkpoints" / "step_000001").iterdir()}
    assert {"actor.model.safetensors", "critic.model.safetensors"} <= files


def test_agent_loop_runs_inside_ray_workers(tmp_path: Path, ray_cluster) -> None:
    cfg = tiny_scale_out_config(
        tmp_path,
        "preset=calculator_agent",
        "data.train_size=8",
        "rollout.max_response_length=24",
        "agent.max_tokens_per_turn=12",
        "trainer.backend=ray",
        "trainer.workers=2",
        "trainer.total_steps=1",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
    )
    trainer = RLTrainer(cfg)
    trainer.fit()
    metrics = read_metrics(tmp_path)[1]
    assert metrics["num_turns/mean"] >= 1
    batch = trainer.last_batch
    assert "turn_ids" in batch and batch["turn_ids"].shape == batch["responses"].shape
    assert len(batch) == 4


def test_cli_reports_a_dead_worker_and_how_to_resume(tmp_path: Path, capsys) -> None:
    from unittest import mock

    from creditrl import cli
    from creditrl.models.tiny import tiny_model_dir

    error = WorkerError("actor_rollout_ref rank 1 died during update_actor: ActorDiedError")
    with mock.patch.object(RLTrainer, "fit", side_effect=error):
        code = cli.main(
            [
                "train",
                f"model.path={tiny_model_dir()}",
                f"trainer.output_dir={tmp_path}",
                "reward.num_workers=1",
                "data.train_size=8",
                "data.val_size=2",
            ]
        )
    out = capsys.readouterr().out
    assert code == 1
    assert "rank 1 died during update_actor" in out
    assert "rerun the same command to resume" in out

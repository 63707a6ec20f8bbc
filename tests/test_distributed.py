"""Data-parallel training across processes (gloo on CPU): 2 ranks x half batch give the full
batch's gradient under ddp and fsdp2, and sharded/full checkpoints resume on another number
of ranks."""

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from creditrl.batch import Batch
from creditrl.config.loader import load_config
from creditrl.models.tiny import tiny_model_dir
from creditrl.workers.distributed import (
    all_reduce_sum,
    broadcast_bytes,
    destroy_process_group,
    init_process_group,
    scatter_batches,
)
from creditrl.workers.hybrid import HybridWorker
from creditrl.workers.parallel import full_state_dict

N = 8  # trajectories in the full batch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def config(strategy: str, world: int, fmt: str = "full", *extra: str):
    return load_config(
        overrides=[
            f"model.path={tiny_model_dir()}",
            "rollout.n=1",
            "algorithm.adv_estimator=reinforce_plus_plus",
            "trainer.backend=ray",
            f"data.train_batch_size={N}",
            f"actor.ppo_mini_batch_size={N}",
            "actor.ppo_micro_batch_size=3",
            "actor.autocast=none",
            "actor.shuffle=false",
            "actor.optim.lr=1e-3",
            f"trainer.strategy={strategy}",
            f"trainer.workers={world}",
            f"trainer.checkpoint_format={fmt}",
            "trainer.total_steps=1",
            *extra,
        ]
    )


def synthetic_batch() -> Batch:
    """N ragged trajectories: left-padded prompts of up to 5 tokens, responses of 2..7."""
    g = torch.Generator().manual_seed(0)
    prompt_len = torch.tensor([5, 3, 4, 5, 2, 5, 4, 3])
    response_len = torch.tensor([7, 2, 5, 6, 3, 7, 4, 2])
    P, T = 5, 7
    prompts = torch.randint(3, 400, (N, P), generator=g)
    prompt_mask = (torch.arange(P)[None] >= P - prompt_len[:, None]).long()
    prompts = torch.where(prompt_mask.bool(), prompts, 2)
    responses = torch.randint(3, 400, (N, T), generator=g)
    response_mask = (torch.arange(T)[None] < response_len[:, None]).long()
    responses = torch.where(response_mask.bool(), responses, 2)
    attention = torch.cat([prompt_mask, response_mask], 1)
    return Batch.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "old_log_probs": -torch.rand(N, T, generator=g) * response_mask,
            "advantages": torch.randn(N, T, generator=g) * response_mask,
        }
    )


def gradients_after_update(worker: HybridWorker, batch: Batch) -> dict[str, torch.Tensor]:
    """Run update_actor and capture the (full) gradients the optimizer step sees."""
    captured: dict[str, torch.Tensor] = {}
    model = worker.actor.model

    def capture(optimizer, args, kwargs):
        for name, param in model.named_parameters():
            grad = param.grad
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            captured[name] = grad.detach().clone()

    handle = worker.actor.optimizer.register_step_pre_hook(capture)
    worker.update_actor(batch, 1.0)
    handle.remove()
    return captured


def _rank(
    rank: int, world: int, port: int, strategy: str, fmt: str, out: str, extra: list[str]
) -> None:
    init_process_group(rank, world, master_port=port, timeout_s=60)
    try:
        worker = HybridWorker(config(strategy, world, fmt, *extra))
        shard = synthetic_batch().chunk(world)[rank]
        grads = gradients_after_update(worker, shard)
        meta = worker.save_checkpoint(out)
        state = full_state_dict(worker.actor.model)
        sums = all_reduce_sum({"rank": float(rank)})
        echoed = broadcast_bytes(b"hello" if rank == 0 else None)
        parts = [Batch.from_dict({"r": torch.full((2,), r)}) for r in range(world)]
        mine = scatter_batches(parts if rank == 0 else None)
        if rank == 0:
            save_file(grads, f"{out}/grads.safetensors")
            save_file({k: v.clone() for k, v in state.items()}, f"{out}/expected.safetensors")
            Path(out, "meta.json").write_text(json.dumps(meta))
        Path(out, f"rank{rank}.json").write_text(
            json.dumps({"sum": sums["rank"], "echo": echoed.decode(), "mine": mine["r"].tolist()})
        )
    finally:
        destroy_process_group()


def run_ranks(world: int, strategy: str, fmt: str, out: Path, extra: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank, args=(world, free_port(), strategy, fmt, str(out), extra), nprocs=world)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """Gradients of one rank on the full batch."""
    worker = HybridWorker(config("ddp", 1))
    return gradients_after_update(worker, synthetic_batch())


@pytest.mark.parametrize(
    "strategy,fmt,extra",
    [
        ("ddp", "full", []),
        ("fsdp2", "sharded", []),
        ("fsdp2", "full", ["trainer.fsdp_cpu_offload=true", "model.gradient_checkpointing=true"]),
    ],
)
def test_two_ranks_half_batch_equal_one_rank_full_batch(
    tmp_path: Path, reference: dict[str, torch.Tensor], strategy: str, fmt: str, extra: list
) -> None:
    run_ranks(2, strategy, fmt, tmp_path, extra)
    grads = load_file(str(tmp_path / "grads.safetensors"))
    assert set(grads) == set(reference)
    for name, expected in reference.items():
        torch.testing.assert_close(grads[name], expected, atol=1e-5, rtol=1e-5, msg=name)
    assert any(float(g.abs().sum()) > 0 for g in grads.values())
    for rank in range(2):
        info = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert info == {"sum": 1.0, "echo": "hello", "mine": [rank, rank]}

    # the checkpoint written by 2 ranks resumes on 1 rank with the same weights
    meta = json.loads((tmp_path / "meta.json").read_text())
    if fmt == "sharded":
        assert (tmp_path / "actor.model.rank1.safetensors").is_file()
    single = HybridWorker(config(strategy, 1))
    single.load_checkpoint(str(tmp_path), meta)
    expected = load_file(str(tmp_path / "expected.safetensors"))
    loaded = full_state_dict(single.actor.model)
    for name, value in expected.items():
        torch.testing.assert_close(loaded[name], value, atol=0, rtol=0, msg=name)
    state = single.actor.optimizer.state_dict()["state"]
    assert len(state) == len(list(single.actor.model.parameters()))
    first = next(iter(state.values()))
    assert first["exp_avg"].abs().sum() > 0

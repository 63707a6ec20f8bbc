"""One device decision (``trainer.device``, ``creditrl.workers.placement``): CUDA asked for on a
machine without it is one line; every parameter, buffer and batch tensor reaching a model's
forward is on the resolved device; a run resumes across a change of ``trainer.device``."""

import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import read_metrics, tiny_trainer_config
from safetensors.torch import load_file, save_file

from creditrl.batch import Batch
from creditrl.cli import main
from creditrl.errors import ConfigError
from creditrl.models.tiny import tiny_model_dir
from creditrl.trainers.rl_trainer import RLTrainer
from creditrl.workers import placement
from creditrl.workers.device_memory import DeviceMemoryError
from creditrl.workers.hybrid import HybridWorker
from creditrl.workers.placement import check_device, describe, placement_for, to_cpu

NO_CUDA = not torch.cuda.is_available()
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/", "time")


def _stable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["trainer.device=cuda"], "trainer.device=cuda"),
        (["trainer.ray.gpus_per_worker=1"], "trainer.ray.gpus_per_worker=1"),
        (["trainer.ray.gpus_per_worker=1", "trainer.backend=ray"], "trainer.ray.gpus_per_worker=1"),
    ],
)
def test_cuda_without_cuda_is_one_line(
    tmp_path: Path, capsys, monkeypatch, overrides: list[str], key: str
) -> None:
    """``creditrl train`` asking for CUDA on a machine without it exits 2 with one line naming
    the key, before any model is loaded or Ray is started."""
    monkeypatch.setattr(placement, "cuda_visible", lambda: False)
    args = [f"model.path={tiny_model_dir()}", f"trainer.output_dir={tmp_path / 'run'}"]
    code = main(["train", *args, *overrides])
    out = capsys.readouterr()
    text = (out.out + out.err).strip()
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in text, text
    assert key in errors[0] and "no visible CUDA device" in errors[0]
    assert not (tmp_path / "run").exists()


def test_device_settings_that_contradict_each_other(tmp_path: Path) -> None:
    """Under Ray, ``trainer.device=cuda`` needs GPUs from Ray, and GPUs from Ray are not left
    unused by ``trainer.device=cpu``."""
    cuda = tiny_trainer_config(tmp_path, "trainer.backend=ray", "trainer.device=cuda")
    with pytest.raises(ConfigError, match=r"trainer.device=cuda with trainer.backend=ray"):
        check_device(cuda)
    cpu = tiny_trainer_config(
        tmp_path, "trainer.backend=ray", "trainer.device=cpu", "trainer.ray.gpus_per_worker=1"
    )
    with pytest.raises(ConfigError, match=r"trainer.ray.gpus_per_worker=1 reserves GPUs"):
        check_device(cpu)


def test_auto_is_cpu_without_cuda(tmp_path: Path, monkeypatch) -> None:
    """``auto`` takes the CPU (gloo) where CUDA is not visible; the start-up line says so."""
    monkeypatch.setattr(placement, "cuda_visible", lambda: False)
    cfg = tiny_trainer_config(tmp_path, "trainer.device=auto")
    resolved = placement_for(cfg)
    assert (resolved.device, resolved.backend, resolved.autocast) == (
        torch.device("cpu"),
        "gloo",
        "none",
    )
    assert describe(cfg) == (
        "trainer.device: models and batches on cpu, process group gloo, update autocast none"
    )
    ray = tiny_trainer_config(tmp_path, "trainer.backend=ray", "trainer.ray.gpus_per_worker=1")
    assert "Ray workers' models and batches on cuda" in describe(ray)
    assert "process group nccl" in describe(ray)


def test_batches_move_once() -> None:
    """A batch already on the device is passed through as it is; ``to_cpu`` likewise."""
    batch = Batch.from_dict({"x": torch.zeros(2, 3)})
    cpu = placement_for(tiny_trainer_config(Path("unused"), "trainer.device=cpu"))
    assert cpu.to_device(batch) is batch and to_cpu(batch) is batch


def _devices(values) -> set[torch.device]:
    found = set()
    for value in values:
        if isinstance(value, torch.Tensor):
            found.add(value.device)
        elif isinstance(value, dict):
            found |= _devices(value.values())
        elif isinstance(value, list | tuple):
            found |= _devices(value)
    return found


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(NO_CUDA, reason="no CUDA device visible")],
        ),
    ],
)
def test_every_tensor_reaching_a_forward_is_on_the_device(tmp_path: Path, device: str) -> None:
    """One PPO step (actor, reference, critic; rollout, log-probs, values, both updates): every
    parameter and buffer of each model, and every tensor handed to its forward, is on the
    resolved device; the pipeline's batch comes back on the CPU."""
    cfg = tiny_trainer_config(
        tmp_path,
        "preset=ppo",
        f"trainer.device={device}",
        "trainer.total_steps=1",
        "trainer.val_before_train=false",
    )
    trainer = RLTrainer(cfg)
    worker = trainer.workers.worker
    expected = worker.placement.device
    assert expected.type == device
    seen: dict[str, set[torch.device]] = {}
    for name, model in (
        ("actor", worker.actor.model),
        ("ref", worker.ref.model),
        ("critic", worker.critic.model),
    ):

        def hook(module, args, kwargs, name=name):
            seen.setdefault(name, set()).update(_devices(args) | _devices(kwargs))

        for module in model.modules():  # the forward may call the backbone and head apart
            module.register_forward_pre_hook(hook, with_kwargs=True)
        assert _devices(list(model.parameters()) + list(model.buffers())) == {expected}, name
    trainer.fit()
    assert set(seen) == {"actor", "ref", "critic"}
    assert all(found == {expected} for found in seen.values()), seen
    for name in ("actor", "ref", "critic"):
        model = getattr(worker, name).model
        assert _devices(list(model.parameters()) + list(model.buffers())) == {expected}
    states = worker.actor.optimizer.state.values()
    assert _devices([v for s in states for v in s.values() if v.dim() > 0]) == {expected}
    assert _devices(list(trainer.last_batch.tensors.values())) == {torch.device("cpu")}
    memory = {k for k in read_metrics(tmp_path)[1] if k.endswith("max_memory_allocated_gb")}
    if device == "cpu":  # peak GPU memory is a CUDA figure: absent on the CPU
        assert memory == set()
    else:
        stages = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor")
        assert memory == {"perf/max_memory_allocated_gb"} | {
            f"perf/{stage}/max_memory_allocated_gb" for stage in stages
        }


def _resume_after_step_one(tmp_path: Path, first: str, then: str) -> tuple[dict, dict]:
    """Run 2 steps with ``trainer.device=first``; copy the run back to step 1 and resume it with
    ``trainer.device=then``. Returns (straight run's metrics, resumed run's metrics)."""
    full = tmp_path / "full"
    RLTrainer(tiny_trainer_config(full, f"trainer.device={first}")).fit()
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000002")
    (resumed / "checkpoints" / "latest").write_text("step_000001")
    trainer = RLTrainer(tiny_trainer_config(resumed, f"trainer.device={then}"))
    trainer.fit()
    assert trainer.step == 2
    return read_metrics(full), read_metrics(resumed)


def test_resume_across_a_change_of_trainer_device(tmp_path: Path) -> None:
    """A run checkpointed with ``trainer.device=cpu`` resumes with ``auto`` (the CPU here) and
    reproduces step 2 exactly."""
    full, resumed = _resume_after_step_one(tmp_path, "cpu", "auto")
    assert set(resumed) == {0, 1, 2}
    assert _stable(resumed[2]) == _stable(full[2])


def test_random_streams_of_another_device_restart(tmp_path: Path) -> None:
    """Generator states written on another kind of device (a CUDA generator's 16-byte Philox
    state) do not fit this device's generators: they are left as seeded instead of ending the
    resume with a RuntimeError."""
    worker = HybridWorker(tiny_trainer_config(tmp_path, "trainer.device=cpu"))
    meta = worker.save_checkpoint(str(tmp_path))
    path = tmp_path / "generators.rank0.safetensors"
    states = load_file(str(path))
    assert set(states) == {"rank0.actor", "rank0.rollout"}
    save_file({k: torch.zeros(16, dtype=torch.uint8) for k in states}, str(path))
    before = {k: g.get_state() for k, g in worker.generators().items()}
    assert worker.load_checkpoint(str(tmp_path), meta) is None
    assert all(torch.equal(g.get_state(), before[k]) for k, g in worker.generators().items())


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="no CUDA device visible")
@pytest.mark.parametrize("first,then", [("cpu", "cuda"), ("cuda", "cpu")])
def test_resume_across_devices_on_a_gpu(tmp_path: Path, first: str, then: str) -> None:
    """A run checkpointed on the CPU resumes on CUDA and back."""
    _, resumed = _resume_after_step_one(tmp_path, first, then)
    assert set(resumed) == {0, 1, 2} and resumed[2]["actor/grad_norm"] > 0


@pytest.mark.parametrize("command", ["async", "learner"])
def test_async_commands_refuse_cuda_without_cuda(
    tmp_path: Path, capsys, monkeypatch, command: str
) -> None:
    """``creditrl async`` (before any process starts) and a learner rank (before it joins its
    process group) refuse ``trainer.device=cuda`` without CUDA in one line, exit 2."""
    monkeypatch.setattr(placement, "cuda_visible", lambda: False)
    args = [f"model.path={tiny_model_dir()}", f"trainer.output_dir={tmp_path / 'run'}"]
    code = main([command, *args, "trainer.device=cuda"])
    out = capsys.readouterr()
    text = (out.out + out.err).strip()
    errors = [line for line in text.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in text, text
    assert "trainer.device=cuda" in errors[0] and "no visible CUDA device" in errors[0]


def _out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79 GiB\n"
        "of which 1.2 GiB is free."
    )


@pytest.mark.parametrize(
    "stage,keys",
    [
        ("gen", ["rollout.micro_batch_size"]),
        ("update_actor", ["actor.ppo_micro_batch_size", "actor.max_token_len_per_device"]),
    ],
)
def test_out_of_memory_is_one_line_naming_the_stage(
    tmp_path: Path, monkeypatch, stage: str, keys: list[str]
) -> None:
    """A stage running out of GPU memory is one line naming the stage, the device, torch's
    first line and the keys that lower that stage's memory."""
    worker = HybridWorker(tiny_trainer_config(tmp_path, "trainer.device=cpu"))
    batch = Batch.from_dict({"x": torch.zeros(2, 3)})
    if stage == "gen":
        monkeypatch.setattr(worker.rollout, "generate", _out_of_memory)
        call = lambda: worker.generate(batch)  # noqa: E731
    else:
        monkeypatch.setattr(worker.actor, "update_policy", _out_of_memory)
        call = lambda: worker.update_actor(batch, 1.0)  # noqa: E731
    with pytest.raises(DeviceMemoryError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"out of memory on cpu in stage {stage} (CUDA out of memory.")
    assert all(key in message for key in keys), message


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="no CUDA device visible")
def test_cuda_computes_the_cpu_log_probs_and_values(tmp_path: Path) -> None:
    """The same tiny weights give the same log-probs and values on CUDA as on the CPU (float32,
    within 1e-4): a CPU PPO step's recorded old_log_probs and values (taken before its update)
    against a fresh CUDA worker's."""
    cpu = RLTrainer(
        tiny_trainer_config(
            tmp_path / "cpu",
            "preset=ppo",
            "trainer.device=cpu",
            "trainer.total_steps=1",
            "trainer.val_before_train=false",
        )
    )
    cpu.fit()
    batch = cpu.last_batch
    cuda = HybridWorker(tiny_trainer_config(tmp_path / "cuda", "preset=ppo", "trainer.device=cuda"))
    mask = batch["response_mask"].bool()
    log_probs = cuda.compute_log_prob(batch, temperature=cpu.cfg.rollout.temperature)
    values = cuda.compute_values(batch)
    assert log_probs["old_log_probs"].device.type == "cpu"
    torch.testing.assert_close(
        log_probs["old_log_probs"][mask], batch["old_log_probs"][mask], atol=1e-4, rtol=0
    )
    torch.testing.assert_close(values["values"][mask], batch["values"][mask], atol=1e-4, rtol=0)


def test_each_rank_takes_its_local_gpu(monkeypatch) -> None:
    """The GPU Ray assigned (by its place in CUDA_VISIBLE_DEVICES), else LOCAL_RANK modulo the
    visible GPUs, else the first."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert placement.local_gpu_index() == 0
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert placement.local_gpu_index() == 1
    fake_ray = SimpleNamespace(is_initialized=lambda: True, get_gpu_ids=lambda: [6])
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert placement.local_gpu_index() == 1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # Ray left every GPU visible: its id is the index
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert placement.local_gpu_index() == 6


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_nccl_binds_the_process_group_to_the_rank_gpu(monkeypatch, backend: str) -> None:
    """Under NCCL the rank's GPU becomes current and goes to init_process_group as
    device_id (the communicator bound to it at once); gloo gets none; NCCL without a CUDA
    device is refused."""
    import torch.distributed as dist

    from creditrl.workers import distributed

    calls: dict = {}
    monkeypatch.setattr(dist, "TCPStore", lambda *args, **kwargs: "store")
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.update(kwargs))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.update(current=device))
    gpu = torch.device("cuda", 1)
    distributed.init_process_group(1, 2, backend=backend, device=gpu, master_port=29999)
    if backend == "nccl":
        assert calls["device_id"] == gpu and calls["current"] == gpu
    else:
        assert calls["device_id"] is None and "current" not in calls
    if backend == "nccl":
        with pytest.raises(ValueError, match="NCCL process group needs this rank's CUDA device"):
            distributed.init_process_group(1, 2, backend="nccl", master_port=29999)

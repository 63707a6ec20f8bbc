"""``perf/mfu`` (``creditrl.tracking.mfu``): the formula's number, the peak table, and the
metric in a training step (absent on the CPU unless trainer.device_peak_tflops is set)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import read_metrics, tiny_trainer_config

from creditrl.tracking.mfu import device_peak_flops, mfu_metrics, parameter_counts, update_flops
from creditrl.trainers.rl_trainer import RLTrainer

ONE_STEP = ("trainer.total_steps=1", "trainer.val_before_train=false", "trainer.test_freq=0")


def test_mfu_is_six_n_t_over_seconds_times_peak():
    """135M parameters, 16 x 640 tokens in 0.113 s on an H100 SXM (989.4 TFLOP/s): 7.4%."""
    assert update_flops(135_000_000, 10_240) == 6 * 135_000_000 * 10_240
    metrics = mfu_metrics(135_000_000, 10_240, 0.113, 989.4e12)
    assert metrics["perf/mfu"] == pytest.approx(0.074188, abs=1e-6)
    assert metrics["perf/update_tokens_per_s"] == pytest.approx(10_240 / 0.113)
    assert mfu_metrics(135_000_000, 10_240, 0.113, None) == {
        "perf/update_tokens_per_s": pytest.approx(10_240 / 0.113)
    }
    assert mfu_metrics(135_000_000, 0, 0.113, 1e12) == mfu_metrics(1, 1, 0.0, 1e12) == {}


def test_frozen_weights_are_not_counted_as_trained():
    """LoRA: frozen base weights cost the forward (2 N T) and pass activation gradients
    (2 N T), but only the trained ones get weight gradients (2 N_t T): (4 N + 2 N_t) T."""
    assert update_flops(1000, 10, trained=10) == (4 * 1000 + 2 * 10) * 10
    assert update_flops(1000, 10) == update_flops(1000, 10, trained=1000) == 6 * 1000 * 10
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    assert parameter_counts(model) == (20 + 10, 10)
    tied = torch.nn.Module()
    tied.a = tied.b = torch.nn.Linear(3, 3, bias=False)
    assert parameter_counts(tied) == (9, 9)
    lora = mfu_metrics(1000, 10, 1.0, 1e5, trained=10)["perf/mfu"]
    assert lora == pytest.approx((4 * 1000 + 2 * 10) * 10 / 1e5)


@pytest.mark.parametrize(
    "name,tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.1),
        ("NVIDIA L40", 181.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A100-PCIE-40GB", 312.0),
        ("NVIDIA GH200 480GB", 989.4),
        ("NVIDIA A10", None),
        ("NVIDIA GeForce GTX 1080", None),
    ],
)
def test_peak_flops_by_device_name(monkeypatch, name, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak = device_peak_flops(torch.device("cuda"))
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))
    assert device_peak_flops(torch.device("cuda"), 100.0) == 100e12


def test_no_peak_on_the_cpu_unless_given():
    assert device_peak_flops(torch.device("cpu")) is None
    assert device_peak_flops(torch.device("cpu"), 2.5) == 2.5e12


def test_a_step_logs_mfu_only_with_a_peak(tmp_path: Path):
    """On the CPU a step logs perf/update_tokens_per_s and no perf/mfu; with
    trainer.device_peak_tflops the mfu is 6 N T / (seconds x peak), T = the real tokens."""
    plain = tmp_path / "plain"
    RLTrainer(tiny_trainer_config(plain, *ONE_STEP)).fit()
    metrics = read_metrics(plain)[1]
    assert "perf/mfu" not in metrics and metrics["perf/update_tokens_per_s"] > 0
    peaked = tmp_path / "peak"
    trainer = RLTrainer(tiny_trainer_config(peaked, *ONE_STEP, "trainer.device_peak_tflops=0.5"))
    trainer.fit()
    metrics = read_metrics(peaked)[1]
    params = sum(p.numel() for p in trainer.workers.worker.actor.model.parameters())  # all trained
    tokens = float(trainer.last_batch["attention_mask"].sum())
    expected = 6 * params * metrics["perf/update_tokens_per_s"] / 0.5e12
    assert tokens == metrics["perf/total_num_tokens"]
    assert metrics["perf/mfu"] == pytest.approx(expected, rel=1e-9)


def test_device_peak_tflops_is_checked_at_config_load(capsys):
    from helpers import refused

    assert "trainer.device_peak_tflops=0 must be > 0" in refused(
        capsys, "trainer.device_peak_tflops=0"
    )
    assert "is not a float" in refused(capsys, "trainer.device_peak_tflops=fast")

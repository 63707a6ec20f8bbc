"""Tests for creditrl.tracking: metrics, sinks, progress view, summary and rollout dumps."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
import types
from io import StringIO
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from creditrl import Batch
from creditrl.tracking import (
    LOGGERS,
    RolloutDumper,
    Tracker,
    TrainingProgress,
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    load_rollout_dump,
    print_summary,
    reduce_metrics,
    reward_trend,
    timer,
)

EOS = 2


def make_batch(meta: dict | None = None) -> Batch:
    """B=3, P=3, T=4. Prompt lengths [2, 3, 1]; response lengths [3, 4, 4]: row 0 ends in EOS
    before the limit, row 1 is cut at max length without EOS, row 2 reaches max length ending in
    EOS and has two observation tokens (response_mask 0, attention 1) at columns 1 and 2."""
    prompts = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 0, 4]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])
    responses = torch.tensor([[10, 11, EOS, 0], [12, 13, 14, 15], [16, 30, 31, EOS]])
    response_attn = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    response_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 1]])
    advantages = torch.tensor([[1.0, 2, 3, 99], [-1, 0, 1, 2], [4, 99, 99, -4]])
    return Batch.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_attn], dim=1),
            "response_mask": response_mask,
            "token_level_scores": torch.tensor([[0.0, 0, 1, 0], [0, 0, 0, 0.5], [0, 0, 0, -1]]),
            "token_level_rewards": torch.tensor([[-0.1, 0, 1, 0], [0, 0, 0, 0.5], [0.2, 0, 0, -1]]),
            "advantages": advantages,
            "returns": advantages + 1,
            "values": torch.tensor([[0.5, 0.5, 0.5, 99], [0, 0, 0, 0], [1, 99, 99, 1]]),
            "old_log_probs": torch.tensor(
                [[-0.12345678, -1.0, -2.5, 0], [-0.1, -0.2, -0.3, -0.4], [-1, 0, 0, -1]]
            ),
        },
        {
            "uid": ["a", "a", "b"],
            "data_source": ["gsm", "gsm", "arith"],
            "ground_truth": ["4", "4", "7"],
            "reward_extra_info": [{"acc": 1.0}, {"acc": 0.0}, {"acc": 0.0}],
            "acc": [1.0, 0.0, 0.0],
        },
        {"max_response_length": 4, "eos_token_id": EOS, **(meta or {})},
    )


# ---- metrics -----------------------------------------------------------------------------------


def test_data_metrics_exact_values() -> None:
    m = compute_data_metrics(make_batch(), use_critic=True)
    expected = {
        "critic/score/mean": 0.5 / 3,
        "critic/score/max": 1.0,
        "critic/score/min": -1.0,
        "critic/rewards/mean": 0.2,
        "critic/rewards/max": 0.9,
        "critic/rewards/min": -0.8,
        "critic/advantages/mean": 8 / 9,
        "critic/advantages/max": 4.0,
        "critic/advantages/min": -4.0,
        "critic/returns/mean": 17 / 9,
        "critic/returns/max": 5.0,
        "critic/returns/min": -3.0,
        "critic/values/mean": 3.5 / 9,
        "critic/values/max": 1.0,
        "critic/values/min": 0.0,
        "response_length/mean": 11 / 3,
        "response_length/max": 4.0,
        "response_length/min": 3.0,
        "response_length/clip_ratio": 1 / 3,
        "prompt_length/mean": 2.0,
        "prompt_length/max": 3.0,
        "prompt_length/min": 1.0,
    }
    returns = np.array([2, 3, 4, 0, 1, 2, 3, 5, -3.0])
    values = np.array([0.5, 0.5, 0.5, 0, 0, 0, 0, 1, 1])
    expected["critic/vf_explained_var"] = 1 - np.var(returns - values, ddof=1) / (
        np.var(returns, ddof=1) + 1e-5
    )
    assert set(m) == set(expected)
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, abs=1e-6), key


def test_data_metrics_without_critic_and_without_eos_id() -> None:
    batch = make_batch()
    del batch.meta["eos_token_id"]
    m = compute_data_metrics(batch, use_critic=False)
    assert not any(k.startswith("critic/values") for k in m)
    assert "critic/vf_explained_var" not in m
    # without an EOS id every response at max length counts as clipped: rows 1 and 2
    assert m["response_length/clip_ratio"] == pytest.approx(2 / 3)


def test_data_metrics_errors_name_the_field() -> None:
    batch = make_batch()
    del batch["values"]
    with pytest.raises(KeyError, match="values"):
        compute_data_metrics(batch, use_critic=True)
    short = make_batch()
    short["attention_mask"] = short["attention_mask"][:, :5]
    with pytest.raises(ValueError, match="attention_mask"):
        compute_data_metrics(short, use_critic=False)


def test_timing_and_throughput() -> None:
    batch = make_batch()  # 11 response tokens, 6 prompt tokens
    timing = {"gen": 0.7, "step": 2.0}
    t = compute_timing_metrics(timing, batch)
    assert t == pytest.approx(
        {
            "timing_s/gen": 0.7,
            "timing_s/step": 2.0,
            "timing_per_token_ms/gen": 700 / 11,
            "timing_per_token_ms/step": 2000 / 17,
        }
    )
    p = compute_throughput_metrics(timing, batch)
    assert p == pytest.approx(
        {"perf/total_num_tokens": 17.0, "perf/time_per_step": 2.0, "perf/throughput": 8.5}
    )
    assert compute_throughput_metrics(timing, batch, n_gpus=2)["perf/throughput"] == 4.25
    with pytest.raises(KeyError, match="step"):
        compute_throughput_metrics({"gen": 1.0}, batch)


def test_reduce_metrics_and_timer() -> None:
    assert reduce_metrics([{"a": 1, "b": 2.0}, {"a": 3}, {"a": torch.tensor(5.0)}]) == {
        "a": 3.0,
        "b": 2.0,
    }
    timing = {"gen": 1.0}
    with timer("gen", timing) as t:
        time.sleep(0.01)
    assert t.elapsed >= 0.01
    assert timing["gen"] == pytest.approx(1.0 + t.elapsed)
    with timer("ref", timing):
        pass
    assert set(timing) == {"gen", "ref"} and timing["ref"] >= 0.0


# ---- sinks -------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_sink_lines_and_truncate(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path, ["console"], {"lr": 1e-6}, "run")
    for step in (1, 2, 3):
        tracker.log({"loss": step / 10, "kl": torch.tensor(0.5), "bad": math.nan}, step=step)
    rows = read_jsonl(tmp_path / "metrics.jsonl")  # readable while the run is open
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["loss"] == 0.2 and rows[1]["kl"] == 0.5 and rows[1]["bad"] is None
    assert all(isinstance(r["time"], float) for r in rows)

    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "loss"')  # a half-written line from a crash
    assert tracker.truncate_after(1) == 3
    tracker.log({"loss": 9.0}, step=2)
    tracker.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 0.1), (2, 9.0)]


def test_tracker_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown logger") as err:
        Tracker(tmp_path, ["jsonl", "neptune"], {}, "run")
    assert all(name in str(err.value) for name in LOGGERS)
    with Tracker(tmp_path, [], {}, "run") as tracker, pytest.raises(TypeError, match="'note'"):
        tracker.log({"note": "hello"}, step=1)


def test_missing_optional_logger_warns_and_skips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with caplog.at_level(logging.WARNING), Tracker(tmp_path, ["tensorboard"], {}, "r") as tracker:
        assert set(tracker.sinks) == {"jsonl"}
        tracker.log({"x": 1.0}, step=1)
    assert "tensorboard" in caplog.text and "pip install tensorboard" in caplog.text
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 1


def test_wandb_sink_is_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, list] = {"init": [], "log": [], "finish": []}

    class Run:
        def log(self, metrics: dict, step: int) -> None:
            calls["log"].append((metrics, step))

        def finish(self) -> None:
            calls["finish"].append(True)

    def init(**kwargs: object) -> Run:
        calls["init"].append(kwargs)
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with Tracker(tmp_path, ["wandb"], {"actor": {"lr": 1e-6}}, "my-run") as tracker:
        tracker.log({"x": 2}, step=7)
    (kwargs,) = calls["init"]
    assert kwargs["mode"] == "offline" and kwargs["name"] == "my-run"
    assert kwargs["config"] == {"actor": {"lr": 1e-6}}
    assert calls["log"] == [({"x": 2.0}, 7)] and calls["finish"] == [True]


# ---- progress and summary ----------------------------------------------------------------------


def test_progress_non_terminal_prints_one_line_per_update() -> None:
    out = StringIO()
    console = Console(file=out, force_terminal=False, width=60)
    progress = TrainingProgress(total_steps=10, start_step=4, console=console)
    progress.update(
        5,
        {
            "critic/rewards/mean": 0.5,
            "response_length/mean": 42.0,
            "timing_s/step": 1.25,
            "val/score/mean": 0.375,
        },
    )
    progress.update(
        6, {"critic/rewards/mean": 0.75, "response_length/mean": 40.0, "timing_s/step": 1.5}
    )
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 5/10 | reward 0.5 | val 0.375 | resp_len 42 | s/step 1.25")
    # the last validation score stays on screen until the next validation
    assert lines[1].startswith("step 6/10 | reward 0.75 | val 0.375 | resp_len 40 | s/step 1.5")
    assert "elapsed 0:00:00" in lines[1] and "eta " in lines[1]


def test_progress_terminal_mode_renders() -> None:
    out = StringIO()
    console = Console(file=out, force_terminal=True, width=150)
    with TrainingProgress(total_steps=3, start_step=0, console=console) as progress:
        progress.update(3, {"critic/rewards/mean": 0.25})
    assert "step 3/3" in out.getvalue() and "reward 0.25" in out.getvalue()


def test_summary_shows_before_after_trend_and_files(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "rollouts").mkdir()
    out = StringIO()
    print_summary(
        Console(file=out, width=250),
        {
            "val_score_before": 0.25,
            "val_score_after": 0.5,
            "rewards": [0.1, 0.2, 0.8, 0.9],
            "steps": 4,
            "total_time_s": 125.0,
            "output_dir": tmp_path,
        },
    )
    text = out.getvalue()
    assert "0.25 -> 0.5" in text and "+0.25" in text
    assert "first 2 steps 0.15 -> last 2 steps 0.85" in text
    assert "0:02:05" in text
    assert str(tmp_path / "metrics.jsonl") in text
    assert f"{tmp_path / 'checkpoints'}/  (not written)" in text
    assert reward_trend([1.0, 2.0, 3.0], k=5) == (2.0, 2.0)
    with pytest.raises(ValueError):
        reward_trend([], k=1)


# ---- rollout dumps -----------------------------------------------------------------------------


class StubTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(f"t{i}" for i in ids if not (skip_special_tokens and i == EOS))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"<{i}>" for i in ids]


def test_rollout_dump_round_trip(tmp_path: Path) -> None:
    dumper = RolloutDumper(tmp_path, rows_per_step=2, tokenizer=StubTokenizer())
    batch = make_batch({"reward_extra_keys": ["acc"]})
    path = dumper.dump(batch, step=12)
    assert path == tmp_path / "rollouts" / "step_000012.jsonl"
    assert [p.name for p in path.parent.iterdir()] == ["step_000012.jsonl"]  # no temp files left
    rows = load_rollout_dump(path)
    assert len(rows) == 3
    r0, r1, r2 = rows
    assert r0["prompt"] == "t5 t6" and r0["response"] == "t10 t11 t2"
    assert (r0["uid"], r0["data_source"], r0["ground_truth"]) == ("a", "gsm", "4")
    assert r0["score"] == 1.0 and r2["score"] == -1.0 and r0["response_length"] == 3
    assert r0["reward_extra"] == {"reward_extra_info": {"acc": 1.0}, "acc": 1.0}
    tok = r0["per_token"]
    assert tok["ids"] == [10, 11, 2] and tok["tokens"] == ["<10>", "<11>", "<2>"]
    assert tok["response_mask"] == [1, 1, 1]
    assert tok["old_log_probs"] == [-0.123457, -1.0, -2.5]
    assert tok["advantages"] == [1.0, 2.0, 3.0]  # only the 3 valid tokens, padding dropped
    assert tok["values"] == [0.5, 0.5, 0.5]
    assert "rollout_log_probs" not in tok and "ref_log_prob" not in tok
    assert len(r1["per_token"]["returns"]) == 4
    assert "per_token" not in r2 and r2["prompt"] == "t4"


def test_rollout_dump_bad_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "step_000001.jsonl"
    path.write_text('{"row": 0}\n{not json\n')
    with pytest.raises(ValueError, match="line 2"):
        load_rollout_dump(path)

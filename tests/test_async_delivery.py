"""Delivery guarantees: the outbox, ledger and journal alone, then real processes on loopback —
a sampler killed and restarted mid-run loses and duplicates nothing acknowledged, and a learner
killed mid-run resumes from its checkpoint and reports the in-flight episodes it dropped."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from creditrl.asynchronous.delivery import AckJournal, DeliveryLedger, Outbox
from creditrl.asynchronous.launcher import free_port
from creditrl.batch import Batch
from creditrl.models.tiny import tiny_model_dir

# ---- units ------------------------------------------------------------------------------


def test_ledger_marks_groups_consumed_and_round_trips() -> None:
    ledger = DeliveryLedger()
    for seq in (0, 2, 3, 1, 7):
        ledger.add("s0", seq)
    ledger.add("s1", 4)
    assert ledger.below == {"s0": 4, "s1": 0} and ledger.extra == {"s0": {7}, "s1": {4}}
    assert [ledger.consumed("s0", q) for q in range(9)] == [True] * 4 + [False] * 3 + [True, False]
    assert ledger.count("s0") == 5 and not ledger.consumed("s2", 0)
    other = DeliveryLedger()
    other.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert other.below == ledger.below and other.extra == ledger.extra


def test_journal_recovery_counts_updates_lost_after_the_checkpoint(tmp_path: Path) -> None:
    journal = AckJournal(tmp_path / "acks.jsonl")
    journal.record(3, "s0", [(5, "trained", 4), (6, "stale", 4)])
    journal.record(4, "s1", [(0, "trained", 4)])
    journal.record(5, "s0", [(7, "trained", 4)])
    with (tmp_path / "acks.jsonl").open("a") as f:
        f.write('{"step": 5, "sampler_id": "s0", "se')  # torn by a crash: its ack never left
    ledger = DeliveryLedger()
    dropped = journal.recover(3, ledger)
    assert dropped == {"groups": 2, "episodes": 8}  # trained at steps 4 and 5, checkpoint at 3
    lost = (tmp_path / "dropped.jsonl").read_text().splitlines()
    assert [(r["sampler_id"], r["seq"]) for r in map(json.loads, lost)] == [("s1", 0), ("s0", 7)]
    assert ledger.consumed("s0", 5) and ledger.consumed("s0", 6) and ledger.consumed("s1", 0)
    assert journal.recover(3, DeliveryLedger()) == {"groups": 0, "episodes": 0}  # counted once
    journal.checkpointed()
    assert (tmp_path / "acks.jsonl").read_text() == ""


def test_outbox_survives_reopening(tmp_path: Path) -> None:
    box = Outbox(tmp_path, "s0")
    group = Batch({"x": torch.arange(2)}, {"episode_id": ["s0:0:0", "s0:0:1"]}, {"k": 1})
    assert [box.put(group), box.put(group), box.put(group)] == [0, 1, 2]
    box.save_state({"epoch": 0, "position": 3})
    assert box.ack(1, "trained") and not box.ack(1, "trained")
    (box.groups / ".0000000003.tmp").mkdir()  # a save cut short by a kill
    reopened = Outbox(tmp_path, "s0")
    assert reopened.pending() == [0, 2] and reopened.next_seq == 3
    assert reopened.data_state == {"epoch": 0, "position": 3}
    assert reopened.load(2).equals(group)
    assert reopened.acknowledged() == [{"seq": 1, "status": "trained"}]
    assert not list(reopened.groups.glob(".*"))


def test_outbox_drops_a_group_whose_ack_was_logged_before_a_kill(tmp_path: Path) -> None:
    """A kill between ``ack``'s log line and its rename left the group pending: reopening
    drops it (the learner consumed it) instead of resending it for a second, duplicate line."""
    box = Outbox(tmp_path, "s0")
    group = Batch({"x": torch.arange(2)}, {"episode_id": ["s0:0:0", "s0:0:1"]}, {"k": 1})
    assert [box.put(group), box.put(group), box.put(group)] == [0, 1, 2]
    box.save_state(None)
    assert box.ack(0, "trained")
    with box.acks_path.open("a") as f:  # ack(1, ...) cut short after its log line
        f.write(json.dumps({"seq": 1, "status": "trained"}) + "\n")
    (box.groups / ".acked-0000000002").mkdir()  # a kill between a rename and its rmtree
    reopened = Outbox(tmp_path, "s0")
    assert reopened.pending() == [2] and reopened.next_seq == 3
    assert [a["seq"] for a in reopened.acknowledged()] == [0, 1]
    assert not list(reopened.groups.glob(".*"))


# ---- processes --------------------------------------------------------------------------


def _start(kind: str, args: list[str], log: Path, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "creditrl.cli", kind, *args, *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=log.open("a"), stderr=subprocess.STDOUT, env=env)


def _logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except json.JSONDecodeError:
            continue
    return steps


def _wait_for_step(out: Path, step: int, procs: list[subprocess.Popen], log: Path) -> None:
    deadline = time.monotonic() + 90
    while max(_logged_steps(out), default=0) < step:
        for p in procs:
            assert p.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Learner + sampler; the sampler is killed after step 2 and restarted; the learner is
    killed after step 4 (checkpoint at 3) and restarted; the run ends at step 8."""
    out = tmp_path_factory.mktemp("async_run")
    log = out / "processes.log"
    args = [
        f"model.path={tiny_model_dir()}",
        "data.train_size=24",
        "data.val_size=0",
        "data.train_batch_size=1",
        "rollout.n=2",
        "rollout.max_response_length=8",
        "rollout.temperature=1.0",
        "actor.ppo_mini_batch_size=1",
        "actor.optim.lr=1e-3",
        "reward.num_workers=0",
        "trainer.total_steps=8",
        "trainer.save_freq=3",
        "trainer.logger=[jsonl]",
        "trainer.rollout_dump_rows=0",
        f"trainer.output_dir={out}",
        f"asynchronous.port={free_port()}",
        "asynchronous.max_inflight_groups=2",
        "asynchronous.max_staleness=3",
        "asynchronous.ping_s=0.5",
        "asynchronous.data_timeout_s=60",
        "asynchronous.sampler_threads=1",
        "asynchronous.learner_threads=1",
    ]
    learner = _start("learner", args, log, [])
    sampler = _start("sampler", args, log, ["--index", "0"])
    procs = [learner, sampler]
    try:
        _wait_for_step(out, 2, procs, log)
        sampler.send_signal(signal.SIGKILL)
        sampler.wait()
        sampler = procs[1] = _start("sampler", args, log, ["--index", "0"])
        _wait_for_step(out, 4, procs, log)
        learner.send_signal(signal.SIGKILL)
        learner.wait()
        killed_after = max(_logged_steps(out))
        learner = procs[0] = _start("learner", args, log, [])
        assert learner.wait(timeout=120) == 0, log.read_text()[-3000:]
        assert sampler.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out, log.read_text(), killed_after


def _trained_episodes(out: Path) -> list[str]:
    ids = []
    for path in sorted((out / "rollouts").glob("step_*.jsonl")):
        ids += [json.loads(line)["episode_id"] for line in path.read_text().splitlines()]
    return ids


def test_sampler_restart_loses_and_duplicates_nothing_acknowledged(run) -> None:
    out, text, _ = run
    resent = [int(x) for x in re.findall(r"(\d+) unacknowledged group\(s\) to resend", text)]
    assert len(resent) == 2 and resent[0] == 0 and resent[1] >= 1  # second life resent its outbox
    box = out / "samplers" / "s0"
    produced = json.loads((box / "state.json").read_text())["next_seq"]
    acks = [json.loads(line) for line in (box / "acks.jsonl").read_text().splitlines()]
    acked = [a["seq"] for a in acks]
    pending = sorted(int(p.name) for p in (box / "outbox").iterdir() if p.name.isdigit())
    assert set(acked).isdisjoint(pending)
    assert sorted(set(acked) | set(pending)) == list(range(produced))  # nothing vanished
    assert all(sum(a["status"] == "trained" for a in acks if a["seq"] == s) <= 1 for s in acked)
    trained = _trained_episodes(out)
    assert len(trained) == len(set(trained)) == 8 * 2  # 8 steps x 1 group x 2 answers, no repeat
    trained_groups = {int(e.split(":")[1]) for e in trained}
    lost = (out / "async" / "dropped.jsonl").read_text().splitlines()
    dropped = {r["seq"] for r in map(json.loads, lost) if r["status"] == "dropped"}
    for a in acks:  # every group acknowledged as trained is in the final history or reported
        if a["status"] == "trained":
            assert a["seq"] in trained_groups or a["seq"] in dropped, a
    assert trained_groups.isdisjoint(pending)


def test_learner_resumes_from_checkpoint_and_reports_dropped_episodes(run) -> None:
    out, text, killed_after = run
    match = re.search(
        r"resumed from step (\d+) .*?; (\d+) in-flight episode\(s\) in (\d+) group", text
    )
    assert match, text[-3000:]
    step, episodes, groups = map(int, match.groups())
    assert step == 3 and episodes == 2 * groups and groups >= killed_after - 3 >= 1
    metrics = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        metrics[row["step"]] = row
    assert sorted(metrics) == list(range(1, 9))  # steps after the checkpoint were re-run
    assert metrics[4]["async/dropped_on_resume_episodes"] == episodes
    versions = [metrics[s]["async/weight_version"] for s in range(1, 9)]
    assert versions[:3] == [1, 2, 3] and versions[3] > killed_after  # no version reused
    assert all(metrics[s]["async/staleness/max"] <= 3 for s in metrics)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000008"
    assert "learner: done" in text and "stopped after" in text

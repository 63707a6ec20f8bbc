"""Samplers that come and go (issue 53): the learner's fleet bookkeeping (``fleet/*``), the
``started`` id of a sampler's hello, the socket telling a gone sampler from a busy one, and
an async run where a sampler dies, another joins mid-run and the first comes back."""

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from creditrl.asynchronous.delivery import DeliveryLedger, Outbox
from creditrl.asynchronous.fleet import PER_SAMPLER_METRICS, Fleet, SamplerRestarts
from creditrl.asynchronous.launcher import free_port, start_child, supervise
from creditrl.asynchronous.messages import PROTOCOL, MessageError, decode, encode
from creditrl.asynchronous.transport import LearnerSocket, SamplerSocket
from creditrl.config.schema import AsyncConfig
from creditrl.models.tiny import tiny_model_dir


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_fleet_counts_joins_restarts_silence_and_deliveries() -> None:
    """Joined, restarted (a new started id), back (alive again, same id), gone; the metrics
    are the sums and maxima of the members' numbers."""
    clock = Clock()
    fleet = Fleet(clock)
    empty = ("alive", "known", "restarts", "last_heard_s", "groups_delivered")
    assert fleet.metrics() == {f"fleet/{name}": 0.0 for name in empty}
    assert fleet.heard("s0", "a") == "joined"
    assert fleet.heard("s0", "a") == "" and fleet.heard("s0") == ""  # pings, groups
    for _ in range(3):
        fleet.delivered("s0")
    clock.now = 103.0
    assert fleet.heard("s1") == "joined"  # a sampler that never said started
    fleet.delivered("s1")
    clock.now = 110.0
    m = fleet.metrics()
    assert m["fleet/alive"] == 2 and m["fleet/known"] == 2 and m["fleet/restarts"] == 0
    assert m["fleet/last_heard_s"] == 10.0  # s0, heard at 100
    assert m["fleet/groups_delivered"] == 4
    assert m["fleet/s0/groups_delivered"] == 3 and m["fleet/s1/groups_delivered"] == 1
    assert m["fleet/s0/last_heard_s"] == 10.0 and m["fleet/s1/last_heard_s"] == 7.0

    assert fleet.mark_gone("s0") and not fleet.mark_gone("s0") and not fleet.mark_gone("s9")
    assert fleet.alive() == ["s1"]
    assert fleet.metrics()["fleet/last_heard_s"] == 7.0  # over the samplers alive
    assert fleet.mark_gone("s1") and fleet.alive() == []
    clock.now = 120.0
    assert fleet.metrics()["fleet/last_heard_s"] == 20.0  # none alive: over every sampler
    assert fleet.describe_none_alive() == "s1 last heard 17s ago, s0 last heard 20s ago"

    assert fleet.heard("s0", "b") == "restarted"  # a new process
    assert fleet.heard("s0", "b") == ""
    assert fleet.heard("s1") == "back"  # the same process, connected again
    assert fleet.heard("s1", "x") == ""  # its first started id: no restart
    assert fleet.heard("s1", "y") == "restarted"
    fleet.mark_gone("s0")
    assert fleet.heard("s0", "c") == "restarted"
    m = fleet.metrics()
    assert m["fleet/restarts"] == 3 and m["fleet/s0/restarts"] == 2 and m["fleet/s1/restarts"] == 1
    assert m["fleet/alive"] == 2 and m["fleet/s0/alive"] == 1 and m["fleet/known"] == 2
    assert m["fleet/groups_delivered"] == 4  # restarts keep the counts


def test_a_new_process_without_the_outbox_numbers_past_what_the_learner_holds(
    tmp_path: Path,
) -> None:
    """The welcome's next_seq: one past the highest seq consumed (the ledger) or delivered
    (the fleet: groups buffered, not yet consumed); an outbox behind it numbers from there,
    saved, and never moves back."""
    ledger = DeliveryLedger()
    assert ledger.next_seq("s0") == 0
    for seq in (0, 1, 2, 7):
        ledger.add("s0", seq)
    assert ledger.below["s0"] == 3 and ledger.next_seq("s0") == 8
    fleet = Fleet(Clock())
    fleet.delivered("s0", 9)
    fleet.delivered("s0", 4)
    assert fleet.members["s0"].next_seq == 10 and fleet.members["s0"].groups == 2
    box = Outbox(tmp_path, "s0")
    assert box.next_seq == 0 and box.skip_to(10) and box.next_seq == 10
    assert not box.skip_to(10) and not box.skip_to(3) and box.next_seq == 10
    assert Outbox(tmp_path, "s0").next_seq == 10  # saved
    welcome = {"incarnation": "abc", "weight_version": 3, "queued": 0}
    assert decode(encode("welcome", {**welcome, "next_seq": 10})).header["next_seq"] == 10
    for bad in (-1, 2**53, "10", 1.5, True, None):
        with pytest.raises(MessageError, match="'next_seq' must be an int"):
            decode(encode("welcome", {**welcome, "next_seq": bad}))


def test_fleet_metrics_name_at_most_64_samplers_and_count_all() -> None:
    fleet = Fleet(Clock())
    ids = [f"s{i}" for i in range(PER_SAMPLER_METRICS + 6)]
    for sampler_id in ids:
        fleet.delivered(sampler_id)
    m = fleet.metrics()
    assert m["fleet/known"] == m["fleet/alive"] == m["fleet/groups_delivered"] == len(ids)
    named = {key.split("/")[1] for key in m if key.count("/") == 2}
    assert named == set(sorted(ids)[:PER_SAMPLER_METRICS])
    assert "and 65 more" in fleet.describe_none_alive()


def test_a_hello_says_started_as_a_short_id_or_is_rejected() -> None:
    hello = {"sampler_id": "s0", "pending": []}
    assert decode(encode("hello", {**hello, "started": "0f3a9c"})).header["started"] == "0f3a9c"
    assert "started" not in decode(encode("hello", hello)).header  # an older sampler
    for bad in ("", "a b", "x" * 65, 7, ["a"], {"a": 1}, True):
        frames = [PROTOCOL, json.dumps({**hello, "kind": "hello", "started": bad}).encode()]
        with pytest.raises(MessageError, match="hello field 'started'") as err:
            decode(frames)
        assert err.value.reason == "header"


def test_the_learner_socket_tells_a_gone_sampler_from_a_busy_one() -> None:
    """A send to a sampler whose socket closed fails with unreachable set; a send to one that
    is connected but not reading (its queue of hwm=1 full) fails with unreachable unset."""
    learner = LearnerSocket(AsyncConfig(port=0, hwm=1))
    busy = SamplerSocket(AsyncConfig(hwm=1), "busy", port=learner.port)
    gone = SamplerSocket(AsyncConfig(), "gone", port=learner.port)
    try:
        for sock, name in ((busy, "busy"), (gone, "gone")):
            assert sock.send(encode("hello", {"sampler_id": name}), timeout_s=5)
            assert learner.recv(5.0)[0] == name
        gone.close()
        seen = 0
        for _ in range(3000):  # a hang guard, not a time bound: ~30 s of polls
            seen = learner.disconnects()
            if seen:
                break
            time.sleep(0.01)
        assert seen, "the learner never saw the closed sampler go"
        assert not learner.send("gone", encode("stop", {"reason": "x"}))
        assert learner.unreachable
        sent = 0
        while learner.send("busy", encode("stop", {"reason": "x"})):
            sent += 1
            assert sent < 10_000
        assert not learner.unreachable and sent >= 1
    finally:
        busy.close()
        learner.close()


# ---- a run whose samplers come and go ------------------------------------------------------


def _start(kind: str, args: list[str], log: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "creditrl.cli", kind, *args, *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=log.open("a"), stderr=subprocess.STDOUT, env=env)


def _metrics(out: Path) -> dict[int, dict]:
    rows = {}
    path = out / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # being written
            continue
        rows[row["step"]] = row
    return rows


def _wait_for(what, procs: list[subprocess.Popen], log: Path) -> None:
    """Until ``what()``; fails when a process ends first, or after 3600 polls (~180 s: a hang
    guard, not a time bound)."""
    for _ in range(3600):
        if what():
            return
        for p in procs:
            assert p.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)
    pytest.fail("hung: " + log.read_text()[-3000:])


def _waiting(log: Path) -> int:
    return log.read_text().count("learner: no sampler connected")


def test_samplers_come_and_go_and_the_learner_goes_on(tmp_path: Path) -> None:
    """Learner + s0; s0 is killed after step 2: the learner says it is gone, trains what it
    holds, then says in one line that no sampler is connected and waits. s1 (never part of
    the run) starts then: welcomed, its groups trained. Two steps later s1 is killed too, and
    once the learner says it waits again s0 starts again without its outbox (a new machine): a
    restart (fleet/restarts 1) that the learner's welcome tells where to number its groups
    from, so none is answered duplicate. The run ends at step 10, and the fleet metrics count
    them all."""
    out = tmp_path / "run"
    log = tmp_path / "processes.log"
    args = [
        f"model.path={tiny_model_dir()}", "data.train_size=24", "data.val_size=0",
        "data.train_batch_size=1", "rollout.n=2", "rollout.max_response_length=8",
        "actor.ppo_mini_batch_size=1", "reward.num_workers=0", "trainer.total_steps=10",
        "trainer.logger=[jsonl]", f"trainer.output_dir={out}", f"asynchronous.port={free_port()}",
        "asynchronous.max_inflight_groups=1", "asynchronous.max_staleness=3",
        "asynchronous.ping_s=0.5", "asynchronous.data_timeout_s=120",
        "asynchronous.sampler_threads=1", "asynchronous.learner_threads=1",
    ]  # fmt: skip
    learner = _start("learner", args, log)
    first = _start("sampler", args, log, "--index", "0")
    procs = [learner, first]
    try:
        _wait_for(lambda: max(_metrics(out), default=0) >= 2, procs, log)
        first.send_signal(signal.SIGKILL)
        first.wait()
        procs.remove(first)
        _wait_for(lambda: _waiting(log) == 1, procs, log)
        waited_at = max(_metrics(out), default=0)
        joined = _start("sampler", args, log, "--index", "1")
        procs.append(joined)
        _wait_for(lambda: max(_metrics(out), default=0) >= waited_at + 2, procs, log)
        joined.send_signal(signal.SIGKILL)
        joined.wait()
        procs.remove(joined)
        _wait_for(lambda: _waiting(log) == 2, procs, log)
        shutil.rmtree(out / "samplers" / "s0")  # it comes back on a new machine
        again = _start("sampler", args, log, "--index", "0")
        procs.append(again)
        assert learner.wait(timeout=300) == 0, log.read_text()[-3000:]
        assert again.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = log.read_text()
    assert "learner: sampler s0 joined; 1 sampler(s) connected (s0)" in text, text[-3000:]
    assert "learner: sampler s0 disconnected; 0 sampler(s) connected" in text, text[-3000:]
    waiting = [line for line in text.splitlines() if "learner: no sampler connected" in line]
    assert len(waiting) == 2, waiting  # one line for each whole wait
    assert "(s0 last heard " in waiting[0] and "asynchronous.data_timeout_s" in waiting[0]
    assert "(s1 last heard " in waiting[1] and ", s0 last heard " in waiting[1]
    assert "learner: sampler s1 joined; 1 sampler(s) connected (s1)" in text, text[-3000:]
    assert "learner: sampler s0 restarted (restart 1 seen)" in text, text[-3000:]
    assert "s0: the learner holds groups of s0 up to seq " in text, text[-3000:]
    assert "that this outbox never held (another process's); numbering new groups from" in text
    metrics = _metrics(out)
    assert sorted(metrics) == list(range(1, 11))
    assert metrics[waited_at + 1]["fleet/alive"] == 1  # s1 alone
    last = metrics[10]
    assert last["fleet/known"] == 2 and last["fleet/restarts"] == 1 == last["fleet/s0/restarts"]
    assert last["fleet/s1/restarts"] == 0 and last["fleet/s1/alive"] == 0
    assert last["fleet/alive"] == 1 == last["fleet/s0/alive"]
    assert last.get("async/duplicate_groups", 0) == 0  # the new s0 reused no consumed seq
    delivered = last["fleet/s0/groups_delivered"] + last["fleet/s1/groups_delivered"]
    assert last["fleet/groups_delivered"] == delivered == last["async/received_groups"]
    assert last["fleet/s1/groups_delivered"] >= 1 and last["fleet/last_heard_s"] >= 0
    trained = []
    for path in sorted((out / "rollouts").glob("step_*.jsonl")):
        trained += [json.loads(line)["episode_id"] for line in path.read_text().splitlines()]
    assert len(trained) == len(set(trained)) == 10 * 2
    assert any(e.startswith("s1:") for e in trained)  # the sampler that joined was trained


# ---- the launchers' restarts -----------------------------------------------------------------


def test_sampler_restarts_are_bounded_per_sampler_and_said() -> None:
    restarts = SamplerRestarts(2)
    what = "was killed by SIGKILL"
    for n in (1, 2):
        assert restarts.decide(0, "sampler 0 (s0)", what, others=0) == (
            "restart",
            f"async: sampler 0 (s0) was killed by SIGKILL; restarting it ({n} of 2, "
            "asynchronous.max_sampler_restarts)",
        )
    assert restarts.decide(1, "sampler 1 (s1)", what, others=1)[0] == "restart"  # its own 2
    assert restarts.decide(0, "sampler 0 (s0)", what, others=0) == ("stop", "")
    action, line = restarts.decide(0, "sampler 0 (s0)", what, others=1)
    assert action == "leave" and restarts.left_out == {0} and restarts.total == 3
    assert line.endswith("its 2 restart(s) are used (asynchronous.max_sampler_restarts): the "
                         "run goes on with 1 other sampler(s)")  # fmt: skip
    assert SamplerRestarts(0).decide(0, "s", what, others=0) == ("stop", "")


def _fake(code: str) -> list[str]:
    return [sys.executable, "-c", code]


KILL_SELF = _fake("import os, time; time.sleep(0.3); os.kill(os.getpid(), 9)")
SLEEP = _fake("import time; time.sleep(60)")


def _supervise_restarting(tmp_path: Path, samplers: list[list[str]], then: list[str], limit: int):
    """supervise() over a learner that ends after its samplers died (it waits for a file
    the restarted ones write) and ``samplers``; a restart starts ``then``."""
    logs = tmp_path / "logs"
    quiet = (io.BytesIO(), io.BytesIO())
    flag = tmp_path / "flag"
    wait = f"import pathlib, time\nwhile not pathlib.Path({str(flag)!r}).exists(): time.sleep(0.05)"
    learner = start_child("learner", 0, _fake(wait), logs, echo=quiet)
    children = [start_child("sampler", i, cmd, logs, echo=quiet) for i, cmd in enumerate(samplers)]
    started = []

    def restart(child):
        new = start_child("sampler", child.index, then, logs, echo=quiet)
        started.append(child.index)
        flag.touch()
        return new

    out = io.StringIO()
    code = supervise([learner], children, Console(file=out, width=300), grace_s=1,
                     poll_s=0.05, restart=restart, max_restarts=limit)  # fmt: skip
    return code, out.getvalue(), started, [learner, *children]


def test_the_process_launcher_restarts_a_killed_sampler(tmp_path: Path) -> None:
    """A sampler killed by SIGKILL is started again (said in one line) and the run ends with
    the learner, code 0; with no restart left, the last sampler's death ends the run as
    before (137), and one that dies while another runs is left out, the run going on."""
    code, text, started, _ = _supervise_restarting(tmp_path / "a", [KILL_SELF], _fake("pass"), 3)
    assert code == 0 and started == [0], text
    assert "async: sampler 0 (s0) was killed by SIGKILL; restarting it (1 of 3, " in text
    assert "stopping the run" not in text

    code, text, started, children = _supervise_restarting(tmp_path / "b", [KILL_SELF], SLEEP, 0)
    assert code == 137 and started == [] and "sampler 0 (s0) was killed by SIGKILL" in text
    assert "stopping the run" in text and children[0].proc.returncode == -15

    touch = _fake(f"import pathlib; pathlib.Path({str(tmp_path / 'c' / 'flag')!r}).touch()")
    slow_touch = _fake("import time; time.sleep(1.5)\n" + touch[-1])
    code, text, started, _ = _supervise_restarting(tmp_path / "c", [KILL_SELF, slow_touch],
                                                   SLEEP, 0)  # fmt: skip
    assert code == 0 and started == [], text
    assert (
        "async: sampler 0 (s0) was killed by SIGKILL; its 0 restart(s) are used "
        "(asynchronous.max_sampler_restarts): the run goes on with 1 other sampler(s)"
    ) in text
    assert "stopping the run" not in text

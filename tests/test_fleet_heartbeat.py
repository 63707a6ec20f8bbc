"""Samplers whose machine vanishes (issue 53): a peer that stops answering without closing its
TCP connection is dropped by the ZeroMQ heartbeats (``asynchronous.heartbeat_s``), and the
learner marks exactly that sampler not alive; with none left it says so and waits."""

import io
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq
from rich.console import Console

from creditrl.asynchronous.receiver import GroupReceiver
from creditrl.asynchronous.transport import (
    HEARTBEAT_MISSES,
    LearnerSocket,
    SamplerSocket,
    heartbeat_ms,
)
from creditrl.config import load_config
from creditrl.config.schema import AsyncConfig
from creditrl.errors import ConfigError

HEARTBEAT_S = 0.5  # a dropped peer: 1.5 s without an answer (margin for a loaded machine)
# a sampler process that says hello, says "ready", then sleeps until stopped and killed
PEER = textwrap.dedent(
    """
    import sys, time
    from creditrl.asynchronous.messages import encode
    from creditrl.asynchronous.transport import SamplerSocket
    from creditrl.config.schema import AsyncConfig
    name, port = sys.argv[1], int(sys.argv[2])
    sock = SamplerSocket(AsyncConfig(heartbeat_s={hb}), name, port=port)
    assert sock.send(encode("hello", {{"sampler_id": name, "started": "p" + name}}), 30)
    print("ready", flush=True)
    time.sleep(3600)
    """
).format(hb=HEARTBEAT_S)


class Receiver(GroupReceiver):
    """The learner's receiving side alone: no model, version 0, console into ``said``."""

    def __init__(self, out: Path) -> None:
        self.cfg = load_config(overrides=[f"asynchronous.heartbeat_s={HEARTBEAT_S}"])
        self.step = 0
        self.weights = SimpleNamespace(version=0)
        self.said = io.StringIO()
        self.console = Console(file=self.said, width=400)
        self.init_receiving(self.cfg, vocab_size=64, out=out)
        self.open_socket(0)

    def poll(self) -> None:
        """What ``collect`` does while it waits: receive, else the waiting's probe."""
        if not self._receive(0.05):
            self._waiting(self.cfg.asynchronous.data_timeout_s)


def _peer(name: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-c", PEER, name, str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout.readline().strip() == "ready", proc.stdout.read()
    return proc


def _until(what, receiver: Receiver, polls: int, why: str) -> int:
    """Poll until ``what()``; the number of polls it took (a hang guard, not a time bound)."""
    for n in range(polls):
        if what():
            return n
        receiver.poll()
    pytest.fail(f"{why} after {polls} polls: {receiver.said.getvalue()[-2000:]}")


def test_a_stopped_sampler_is_marked_gone_and_the_running_one_stays(tmp_path: Path) -> None:
    """Two sampler processes say hello; one is SIGSTOPped (its TCP connection stays open, its
    heartbeats go unanswered): the learner marks it, and only it, not alive. Then the other
    is stopped too: none is alive and the learner says it waits for one."""
    receiver = Receiver(tmp_path)
    port = receiver.socket.port
    peers = {name: _peer(name, port) for name in ("frozen", "later")}
    try:
        _until(lambda: receiver.fleet.alive() == ["frozen", "later"], receiver, 600, "no hello")
        peers["frozen"].send_signal(signal.SIGSTOP)
        _until(lambda: receiver.fleet.alive() == ["later"], receiver, 2000, "still alive")
        assert receiver.counters["peer_disconnects"] >= 1
        said = receiver.said.getvalue()
        assert "sampler frozen disconnected; 1 sampler(s) connected (later)" in said, said
        assert "no sampler connected" not in said
        for _ in range(60):  # ~2 heartbeat timeouts of polls: the running one stays alive
            receiver.poll()
        assert receiver.fleet.alive() == ["later"]

        peers["later"].send_signal(signal.SIGSTOP)
        _until(lambda: receiver.fleet.alive() == [], receiver, 2000, "still alive")
        _until(lambda: receiver.said_none_alive, receiver, 100, "no waiting line")
        said = receiver.said.getvalue()
        assert "sampler later disconnected; 0 sampler(s) connected" in said, said
        assert said.count("learner: no sampler connected (") == 1, said
        metrics = receiver.receiving_metrics()
        assert metrics["fleet/alive"] == 0 and metrics["fleet/known"] == 2
        assert metrics["fleet/frozen/alive"] == 0 == metrics["fleet/later/alive"]
    finally:
        for proc in peers.values():
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
        receiver.socket.close()


def test_both_sockets_carry_the_configured_heartbeats() -> None:
    """Interval heartbeat_s in ms, timeout HEARTBEAT_MISSES of it, on the learner's ROUTER and
    a sampler's DEALER."""
    cfg = AsyncConfig(port=0, heartbeat_s=0.25)
    assert heartbeat_ms(cfg) == (250, 250 * HEARTBEAT_MISSES)
    learner = LearnerSocket(cfg)
    sampler = SamplerSocket(cfg, "s0", port=learner.port)
    try:
        for sock in (learner.sock, sampler.sock):
            assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 250
            assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == 750
    finally:
        sampler.close()
        learner.close()


@pytest.mark.parametrize("value", ["0", "0.05", "3601", "-1"])
def test_a_heartbeat_libzmq_cannot_keep_is_refused_at_load(value: str) -> None:
    with pytest.raises(ConfigError, match=r"asynchronous\.heartbeat_s"):
        load_config(overrides=[f"asynchronous.heartbeat_s={value}"])
    with pytest.raises(ValueError, match=r"heartbeat_s must be in \[0.1, 3600\]"):
        heartbeat_ms(AsyncConfig(heartbeat_s=float(value)))
    assert load_config(overrides=["asynchronous.heartbeat_s=0.1"]).asynchronous.heartbeat_s == 0.1


def test_the_docs_say_the_heartbeats_a_peer_may_miss() -> None:
    """The key's note, its docstring (docs/config.md) and the README say ``HEARTBEAT_MISSES``:
    the one number libzmq's timeout is built from."""
    root = Path(__file__).resolve().parents[1]
    config_md = (root / "docs" / "config.md").read_text()
    readme = " ".join((root / "README.md").read_text().split())
    assert f"within {HEARTBEAT_MISSES} of them" in config_md
    assert f"a peer silent {HEARTBEAT_MISSES} heartbeats is dropped" in config_md
    assert f"once it leaves {HEARTBEAT_MISSES} of them unanswered" in readme

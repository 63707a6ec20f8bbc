"""The weight port keeps ``asynchronous.heartbeat_s``'s heartbeats (issue 53): a sampler whose
learner stops answering without closing its TCP connection drops the connection and, once the
learner answers again, reconnects and fetches; the learner's side drops a silent sampler the
same way (the same options on its socket)."""

import signal
import subprocess
import sys
import textwrap

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from creditrl.asynchronous.transport import heartbeat_ms
from creditrl.asynchronous.weight_server import WeightClient, WeightServer
from creditrl.config.schema import AsyncConfig
from creditrl.weights import WirePublisher

HEARTBEAT_S = 0.3  # a dropped peer: 0.9 s without an answer
# a learner's weight port with nothing published: says its address, then serves until killed
LEARNER = textwrap.dedent(
    """
    import time
    from creditrl.asynchronous.weight_server import WeightServer
    from creditrl.config.schema import AsyncConfig
    from creditrl.weights import WirePublisher
    server = WeightServer(AsyncConfig(heartbeat_s={hb}), WirePublisher(), 0)
    print(server.address, flush=True)
    time.sleep(3600)
    """
).format(hb=HEARTBEAT_S)


def _events(monitor: zmq.Socket, wanted: int, polls: int) -> list[int]:
    """Monitor events until ``wanted`` arrives; the events seen. ``polls`` x 100 ms is a hang
    guard only, hundreds of times the 0.9 s the event takes: nothing here is timed."""
    seen: list[int] = []
    for _ in range(polls):
        if monitor.poll(100):
            seen.append(recv_monitor_message(monitor)["event"])
            if seen[-1] == wanted:
                return seen
    pytest.fail(f"no event {wanted} after {polls} polls; saw {seen}")


def test_a_sampler_drops_a_frozen_learners_weight_port_and_reconnects_when_it_answers() -> None:
    """The learner's process is SIGSTOPped: its TCP connection stays open, so without
    heartbeats the sampler's socket never notices; with them it disconnects, and after SIGCONT
    it reconnects and its next request is answered."""
    learner = subprocess.Popen(
        [sys.executable, "-c", LEARNER], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    client = monitor = None
    try:
        address = learner.stdout.readline().strip()
        assert address.startswith("tcp://127.0.0.1:"), address + learner.stdout.read()
        client = WeightClient(AsyncConfig(heartbeat_s=HEARTBEAT_S), "s0", address, timeout_s=30)
        monitor = client.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        assert client.newest() is None  # connected and answered: nothing published yet
        learner.send_signal(signal.SIGSTOP)
        _events(monitor, zmq.EVENT_DISCONNECTED, polls=3000)
        learner.send_signal(signal.SIGCONT)
        _events(monitor, zmq.EVENT_HANDSHAKE_SUCCEEDED, polls=3000)
        assert client.newest() is None
    finally:
        if monitor is not None:
            client.sock.disable_monitor()
            monitor.close(linger=0)
        if client is not None:
            client.close()
        learner.kill()
        learner.wait()


def test_the_learners_weight_port_and_the_samplers_socket_keep_heartbeats() -> None:
    """Both weight sockets carry ``heartbeat_ms``'s interval and timeout."""
    cfg = AsyncConfig(heartbeat_s=HEARTBEAT_S)
    server = WeightServer(cfg, WirePublisher(), 0)
    client = WeightClient(cfg, "s0", server.address)
    try:
        for sock in (server.sock, client.sock):
            options = sock.getsockopt(zmq.HEARTBEAT_IVL), sock.getsockopt(zmq.HEARTBEAT_TIMEOUT)
            assert options == heartbeat_ms(cfg) == (300, 900)
    finally:
        client.close()
        server.close()

"""The sampler <-> learner wire: real ZeroMQ sockets on loopback, no pickle anywhere, checks on
malformed input, CURVE authentication, high-water-mark back-pressure."""

import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import synthetic_group

import creditrl.asynchronous as async_pkg
import creditrl.weights as weights_pkg
from creditrl.asynchronous.messages import (
    PROTOCOL,
    MessageError,
    ack_message,
    decode,
    encode,
    episodes_message,
)
from creditrl.asynchronous.transport import LearnerSocket, SamplerSocket, make_curve_keys
from creditrl.config.schema import AsyncConfig


@pytest.fixture
def pair():
    cfg = AsyncConfig(port=0, hwm=8)
    learner = LearnerSocket(cfg)
    sampler = SamplerSocket(cfg, "s3", port=learner.port)
    yield learner, sampler
    sampler.close()
    learner.close()


def test_group_round_trip_and_ack_over_loopback(pair) -> None:
    learner, sampler = pair
    group = synthetic_group("s3", seq=7, version=2)
    assert sampler.send(episodes_message("s3", 7, group), timeout_s=5)
    sender, message = learner.recv(timeout_s=5)
    assert sender == "s3" and message.kind == "episodes"
    assert message.header["weight_version"] == 2 and message.header["seq"] == 7
    assert message.header["episode_ids"] == ["s3:7:0", "s3:7:1"]
    assert message.batch.equals(group)
    assert learner.send("s3", ack_message("inc", 3, [(7, "trained")]))
    reply = sampler.recv(timeout_s=5)
    assert reply.kind == "ack" and reply.header["acks"] == [{"seq": 7, "status": "trained"}]
    assert reply.header["weight_version"] == 3
    assert not learner.send("nobody", encode("stop", {}))  # unroutable: reported, not lost


def test_wire_path_never_pickles(tmp_path: Path) -> None:
    """Statically: no module of the package or of the weight channel (``creditrl.weights``)
    mentions pickle or pickle-based APIs. Dynamically: with pickle, torch.save and torch.load
    poisoned, a group crosses a real socket and a weight version is published and loaded."""
    banned = {"pickle", "cPickle", "dill", "marshal", "send_pyobj", "recv_pyobj", "torch.save"}
    banned |= {"torch.load", "shelve"}
    packages = (Path(async_pkg.__file__).parent, Path(weights_pkg.__file__).parent)
    for path in (p for package in packages for p in package.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not banned & {n.split(".")[0] for n in names}, (path, names)
            if isinstance(node, ast.Attribute):
                dotted = ast.unparse(node)
                assert node.attr not in banned and dotted not in banned, (path, dotted)
    script = textwrap.dedent(
        f"""
        import pickle, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from helpers import synthetic_group
        from creditrl.asynchronous.messages import episodes_message
        from creditrl.asynchronous.transport import LearnerSocket, SamplerSocket
        from creditrl.weights import WeightPublisher, WeightSubscriber
        from creditrl.config.schema import AsyncConfig

        def poisoned(*a, **k):
            raise AssertionError("pickle used on the wire path")

        for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
            setattr(pickle, name, poisoned)
        torch.save = torch.load = poisoned
        cfg = AsyncConfig(port=0)
        learner = LearnerSocket(cfg)
        sampler = SamplerSocket(cfg, "s0", port=learner.port)
        group = synthetic_group()
        assert sampler.send(episodes_message("s0", 0, group), timeout_s=5)
        sender, message = learner.recv(timeout_s=5)
        assert message.batch.equals(group)
        model = torch.nn.Linear(3, 2)
        WeightPublisher({str(tmp_path)!r}).publish(model, 1)
        other = torch.nn.Linear(3, 2)
        assert WeightSubscriber({str(tmp_path)!r}).maybe_load(other, 0) == 1
        assert torch.equal(other.weight, model.weight)
        sampler.close(); learner.close()
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-2000:]


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda f: [b"other/1", *f[1:]], "not a creditrl.async/1 message"),
        (lambda f: [f[0], b"{not json", f[2]], "header is not JSON"),
        (lambda f: [f[0], b'{"kind": "shout"}', f[2]], "no known 'kind'"),
        (lambda f: [f[0], f[1]], "3 frames"),
        (lambda f: [f[0], f[1], b"CRLBATCH garbage"], "payload is not a creditrl batch"),
        (
            lambda f: [f[0], f[1].replace(b'"s0:0:1"', b'"s0:9:1"'), f[2]],
            "episode_ids of group s0:0",
        ),
        (lambda f: [f[0], f[1].replace(b'"s0"', b'"../x"'), f[2]], "sampler_id"),
    ],
)
def test_malformed_messages_are_rejected_with_a_reason(mutate, match: str) -> None:
    frames = episodes_message("s0", 0, synthetic_group())
    with pytest.raises(MessageError, match=match):
        decode(mutate(frames))


def test_group_content_is_checked() -> None:
    group = synthetic_group()
    group["rollout_log_probs"] = group["rollout_log_probs"].clone()
    group["rollout_log_probs"][0, 0] = float("nan")
    with pytest.raises(MessageError, match="non-finite"):
        decode(episodes_message("s0", 0, group))
    frames = episodes_message("s0", 0, synthetic_group())
    mixed = synthetic_group()
    mixed["uid"] = ["s0:0", "s0:other"]
    with pytest.raises(MessageError, match="several uids"):
        decode([PROTOCOL, frames[1], mixed.to_bytes()])


def test_public_bind_needs_curve() -> None:
    with pytest.raises(ValueError, match="curve_keys_dir"):
        LearnerSocket(AsyncConfig(host="0.0.0.0", port=0))


def test_curve_authenticates_samplers(tmp_path: Path) -> None:
    keys = make_curve_keys(tmp_path / "keys")
    cfg = AsyncConfig(port=0, curve_keys_dir=str(keys))
    learner = LearnerSocket(cfg)
    good = SamplerSocket(cfg, "s0", port=learner.port)
    intruder_keys = make_curve_keys(tmp_path / "other")  # a keypair the learner never authorized
    shutil.copy(keys / "server.key", intruder_keys / "server.key")  # knows the server key
    bad = SamplerSocket(AsyncConfig(port=0, curve_keys_dir=str(intruder_keys)), "s1", learner.port)
    try:
        assert bad.send(encode("hello", {"sampler_id": "s1"}), timeout_s=2)
        assert good.send(encode("hello", {"sampler_id": "s0"}), timeout_s=2)
        sender, message = learner.recv(timeout_s=5)
        assert (sender, message.kind) == ("s0", "hello")
        assert learner.recv(timeout_s=1.0) is None  # the intruder's hello never arrives
    finally:
        bad.close()
        good.close()
        learner.close()


def test_high_water_mark_bounds_the_send_queue() -> None:
    sampler = SamplerSocket(AsyncConfig(port=1, hwm=2), "s0")  # nobody listens on port 1
    try:
        frames = encode("hello", {"sampler_id": "s0"})
        sent = 0
        while sent < 100 and sampler.send(frames, timeout_s=0.05):
            sent += 1
        assert 1 <= sent <= 4  # the queue holds about hwm messages, then send reports full
    finally:
        sampler.close()

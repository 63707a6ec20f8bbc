"""Untrusted input and faults in the async pair: malformed messages are rejected (acknowledged,
counted per reason, logged) and never end the learner; oversized frames never reach Python; a
sender rejected too often is disconnected; a sampler drops rejected groups; and a dead child
process ends ``creditrl async`` within seconds, naming its role, index and last error."""

import dataclasses
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq
from helpers import model_group as make_group
from helpers import tiny_learner_config
from rich.console import Console

from creditrl.asynchronous.launcher import free_port, start_child, supervise
from creditrl.asynchronous.learner import Learner
from creditrl.asynchronous.messages import (
    PROTOCOL,
    decode,
    encode,
    episode_ids,
    episodes_message,
    group_of,
    reject_message,
)
from creditrl.asynchronous.sampler import Sampler
from creditrl.asynchronous.settings import inflight_groups, max_message_bytes
from creditrl.asynchronous.transport import LearnerSocket, SamplerSocket
from creditrl.asynchronous.validation import REASONS, max_group_bytes
from creditrl.batch import Batch
from creditrl.config.schema import AsyncConfig
from creditrl.models.tiny import tiny_model_dir

RUN = [
    "data.train_size=8",
    "data.val_size=0",
    "data.max_prompt_length=128",
    "data.few_shot=0",
    "rollout.max_response_length=8",
    "reward.num_workers=0",
    "trainer.rollout_dump_rows=0",
    "asynchronous.max_rejects=1000",
]


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    """A learner (tiny model, rollout.n=2, 2 groups a step) behind a real socket on loopback."""
    cfg = tiny_learner_config(tmp_path_factory.mktemp("learner"), *RUN)
    learner = Learner(cfg)
    learner.socket = LearnerSocket(cfg.asynchronous, 0, max_message_bytes(cfg))
    yield learner
    learner.socket.close()


def frames_of(group: Batch, sid: str, seq: int, /, **header) -> list[bytes]:
    """Episodes frames (weight version 0) with any header field overridden (or added)."""
    fields = {"sampler_id": sid, "seq": seq, "weight_version": 0,
              "episode_ids": episode_ids(sid, seq, len(group))}  # fmt: skip
    return encode("episodes", {**fields, **header}, group.to_bytes())


def header_field(**header):
    """A case sending a fresh valid group with header fields overridden (or added)."""

    def build(model, sid, seq):
        return frames_of(make_group(model, sid, seq, 0), sid, 0, **header)

    return build


def without(group: Batch, name: str) -> Batch:
    return Batch({k: v for k, v in group.tensors.items() if k != name}, group.non_tensors)


def widen_prompt(group: Batch, extra: int) -> Batch:
    """The same group with ``extra`` more left-padding columns (consistent everywhere)."""
    pad = torch.full((len(group), extra), 2)
    zero = torch.zeros(len(group), extra, dtype=torch.long)
    for name, fill in (("prompts", pad), ("input_ids", pad), ("attention_mask", zero),
                       ("position_ids", zero)):  # fmt: skip
        group[name] = torch.cat([fill, group[name]], dim=1)
    return group


def edit(**changes):
    """A case building a group, then setting ``tensor[row, col] = value`` for each change."""

    def build(model, sid, seq):
        g = make_group(model, sid, seq, 0)
        p = g["prompts"].shape[1]
        for name, value in changes.items():
            g[name] = g[name].clone()
            g[name][0, 0] = value
            if name == "responses":
                g["input_ids"] = g["input_ids"].clone()
                g["input_ids"][0, p] = value
        return frames_of(g, sid, seq)

    return build


def mutate(fn):
    """A case applying ``fn`` to a fresh valid group."""

    def build(model, sid, seq):
        g = make_group(model, sid, seq, 0)
        return frames_of(fn(g) or g, sid, seq)

    return build


def payload_bytes(fn):
    """A case applying ``fn`` to the serialized payload of a fresh valid group."""

    def build(model, sid, seq):
        frames = episodes_message(sid, seq, make_group(model, sid, seq, 0))
        return [frames[0], frames[1], fn(frames[2])]

    return build


def header_json(text: bytes):
    def build(model, sid, seq):
        return [PROTOCOL, text, make_group(model, sid, seq, 0).to_bytes()]

    return build


def _declared(payload: bytes, offset: int, value: int) -> bytes:
    return payload[:offset] + value.to_bytes(8, "little") + payload[offset + 8 :]


def _safetensors_offset(payload: bytes) -> int:
    return 16 + int.from_bytes(payload[8:16], "little")


def _three_answers(g: Batch) -> Batch:
    sid, seq = g["sampler_id"][0], int(g["episode_id"][0].split(":")[1])
    return group_of(g[[0, 1, 1]], sid, seq, 0)


# name -> (build(model, sampler_id, seq) -> frames, reason, whether the ack names the seq)
CASES = {
    "garbage bytes": (lambda m, s, q: [b"\x00\xffnot a message"], "protocol", False),
    "bad JSON header": (header_json(b'{"kind": "episodes", "seq": '), "header", False),
    "deeply nested JSON header": (header_json(b"[" * 100000 + b"]" * 100000), "header", False),
    "NaN in the header": (header_json(b'{"kind": "episodes", "seq": NaN}'), "header", False),
    "seq is a string": (header_field(seq="0"), "header", False),
    "negative weight version": (header_field(weight_version=-1), "header", True),
    "seq beyond 2**53": (header_field(seq=2**60), "header", False),
    "unknown header field": (header_field(priority=9), "header", True),
    "claims another sampler id": (
        lambda m, s, q: episodes_message("other", q, make_group(m, "other", q, 0)), "header", True),
    "a kind samplers may not send": (lambda m, s, q: encode("ack", {"acks": []}), "protocol",
                                     False),
    "garbage payload": (payload_bytes(lambda p: b"CRLBATCH" + os.urandom(64)), "payload", True),
    "truncated safetensors": (payload_bytes(lambda p: p[:-10]), "payload", True),
    "huge declared header size": (payload_bytes(lambda p: _declared(p, 8, 2**62)), "payload",
                                  True),
    "huge declared safetensors size": (
        payload_bytes(lambda p: _declared(p, _safetensors_offset(p), 2**40)), "payload", True),
    "float token ids": (mutate(lambda g: g.__setitem__("input_ids", g["input_ids"].float())),
                        "dtype", True),
    "float64 log-probs": (mutate(lambda g: g.__setitem__(
        "rollout_log_probs", g["rollout_log_probs"].double())), "dtype", True),
    "token id = vocabulary size": (edit(responses=49152), "token_id", True),
    "negative token id": (edit(responses=-1), "token_id", True),
    "non-binary mask": (edit(response_mask=2), "mask", True),
    "mask shorter than responses": (mutate(lambda g: g.__setitem__(
        "response_mask", g["response_mask"][:, :-1].clone())), "shape", True),
    "prompts narrower than input_ids": (mutate(lambda g: g.__setitem__(
        "prompts", g["prompts"][:, 1:].clone())), "shape", True),
    "NaN log-prob": (edit(rollout_log_probs=float("nan")), "non_finite", True),
    "infinite score": (edit(token_level_scores=float("inf")), "non_finite", True),
    "positive log-prob": (edit(rollout_log_probs=0.5), "value", True),
    "three answers for rollout.n=2": (mutate(_three_answers), "group_size", True),
    "unknown tensor field": (mutate(lambda g: g.__setitem__("evil", torch.zeros(2))), "fields",
                             True),
    "unknown non-tensor field": (mutate(lambda g: g.__setitem__("note", ["a", "b"])), "fields",
                                 True),
    "missing field": (mutate(lambda g: without(g, "token_level_scores")), "fields", True),
    "prompt wider than max_prompt_length": (mutate(lambda g: widen_prompt(g, 128)), "length",
                                            True),
    "uid of another group": (mutate(lambda g: g.__setitem__("uid", ["s9:0", "s9:0"])), "value",
                             True),
    "data_source not a string": (mutate(lambda g: g.__setitem__("data_source", [1, 2])),
                                 "non_tensor", True),
    "meta of the wrong type": (mutate(lambda g: g.meta.update(max_response_length="long")),
                               "non_tensor", True),
    "future weight version": (lambda m, s, q: episodes_message(s, q, make_group(m, s, q, 5)),
                              "version", True),
}  # fmt: skip


def _acks(sock: SamplerSocket, timeout_s: float = 5.0) -> list[dict]:
    message = sock.recv(timeout_s)
    assert message is not None and message.kind == "ack", message
    return message.header["acks"]


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_message_is_rejected_counted_and_the_next_group_accepted(learner, case) -> None:
    """Each malformed message: the learner does not raise, acknowledges it rejected with the
    case's reason (and its seq when the header gave one), counts it in async/rejected and
    async/rejected/<reason>; a valid group from the same sampler right after is accepted."""
    build, reason, names_seq = CASES[case]
    assert reason in REASONS
    sid = f"c{list(CASES).index(case)}"
    model = learner.actor.model
    before = dict(learner.counters)
    sock = SamplerSocket(learner.cfg.asynchronous, sid, port=learner.socket.port)
    try:
        assert sock.send(build(model, sid, 0), timeout_s=5)
        assert learner._receive(5.0) == 0
        expected_seq = 0 if names_seq else None
        assert _acks(sock) == [{"seq": expected_seq, "status": "rejected", "reason": reason}]
        assert learner.counters["rejected"] == before.get("rejected", 0) + 1
        assert learner.counters[f"rejected/{reason}"] == before.get(f"rejected/{reason}", 0) + 1
        assert sock.send(episodes_message(sid, 1, make_group(model, sid, 1, 0)), timeout_s=5)
        assert learner._receive(5.0) == 1
        assert learner.buffer.holds(sid, 1)
    finally:
        sock.close()
        learner.buffer.take(len(learner.buffer))


def test_rejections_never_stop_training(learner) -> None:
    """Bad groups between good ones: the step trains on the 2 good groups, acknowledges them
    trained and reports async/rejected and async/rejected/<reason> in its metrics."""
    model = learner.actor.model
    sock = SamplerSocket(learner.cfg.asynchronous, "t0", port=learner.socket.port)
    try:
        bad = make_group(model, "t0", 1, 0)
        bad["response_mask"] = bad["response_mask"] * 3
        for frames in (episodes_message("t0", 0, make_group(model, "t0", 0, 0)),
                       frames_of(bad, "t0", 1), [b"junk"],
                       episodes_message("t0", 2, make_group(model, "t0", 2, 0))):  # fmt: skip
            assert sock.send(frames, timeout_s=5)
        learner.step += 1
        metrics = learner.train_step()
        acks = _acks(sock) + _acks(sock) + _acks(sock)
        assert {"seq": 1, "status": "rejected", "reason": "mask"} in acks
        assert {"seq": None, "status": "rejected", "reason": "protocol"} in acks
        assert [a for a in acks if a["status"] == "trained"] == [
            {"seq": 0, "status": "trained"}, {"seq": 2, "status": "trained"}]  # fmt: skip
        assert list(learner.last_batch["episode_id"]) == ["t0:0:0", "t0:0:1", "t0:2:0", "t0:2:1"]
        assert metrics["async/rejected"] == learner.counters["rejected"] >= 2
        assert metrics["async/rejected/mask"] >= 1 and metrics["async/rejected/protocol"] >= 1
        assert all(torch.isfinite(p).all() for p in learner.actor.model.parameters())
    finally:
        sock.close()


def test_an_identity_that_is_no_sampler_id_gets_its_rejection(learner) -> None:
    """A peer whose routing identity is not a valid sampler id (arbitrary bytes) is answered on
    that identity, rejected with reason header, and nothing is journaled for it."""
    context = zmq.Context.instance()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.IDENTITY, b"\xff\x00bad id")
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(learner.socket.address)
    try:
        raw.send_multipart(encode("hello", {"sampler_id": "s0"}))
        assert learner._receive(5.0) == 0
        assert raw.poll(5000)
        reply = decode(raw.recv_multipart())
        assert reply.header["acks"] == [{"seq": None, "status": "rejected", "reason": "header"}]
    finally:
        raw.close()


def test_oversized_frame_never_reaches_python_and_the_learner_keeps_serving() -> None:
    """A frame above MAXMSGSIZE is dropped by libzmq (recv sees nothing; the drop shows as a
    peer disconnect); the sender reconnects and its next message is delivered."""
    learner = LearnerSocket(AsyncConfig(port=0), max_message_bytes=4096)
    sampler = SamplerSocket(AsyncConfig(), "s0", port=learner.port)
    try:
        assert sampler.send(encode("hello", {"sampler_id": "s0"}), timeout_s=2)
        assert learner.recv(5.0)[1].kind == "hello"
        assert sampler.send([PROTOCOL, b"{}", b"x" * 10_000], timeout_s=2)
        assert learner.recv(1.0) is None
        deadline = time.monotonic() + 5
        while not (dropped := learner.disconnects()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dropped >= 1
        assert sampler.send(encode("hello", {"sampler_id": "s0"}), timeout_s=2)
        assert learner.recv(5.0)[1].kind == "hello"
    finally:
        sampler.close()
        learner.close()


def test_learner_survives_a_frame_over_its_limit(learner) -> None:
    """A 9 MiB frame (the limit sized for this run is 8 MiB) never reaches the learner's
    checks: nothing is rejected, the dropped connection is counted, and the same sampler's
    next group is accepted."""
    sock = SamplerSocket(learner.cfg.asynchronous, "big0", port=learner.socket.port)
    try:
        learner._receive(0.1)  # count the disconnects of earlier tests' sockets
        rejected, dropped = learner.counters["rejected"], learner.counters["peer_disconnects"]
        frames = episodes_message("big0", 0, make_group(learner.actor.model, "big0", 0, 0))
        assert sock.send([frames[0], frames[1], frames[2] + b"x" * (9 << 20)], timeout_s=5)
        deadline = time.monotonic() + 10
        while learner.counters["peer_disconnects"] == dropped and time.monotonic() < deadline:
            assert learner._receive(0.2) == 0
        assert learner.counters["peer_disconnects"] >= dropped + 1
        assert learner.counters["rejected"] == rejected and sock.recv(0.2) is None
        model = learner.actor.model
        assert sock.send(episodes_message("big0", 1, make_group(model, "big0", 1, 0)), 5)
        assert learner._receive(5.0) == 1 and learner.buffer.holds("big0", 1)
    finally:
        sock.close()
        learner.buffer.take(len(learner.buffer))


def test_message_limit_is_sized_for_the_batch(tmp_path: Path) -> None:
    """max_message_mb=0 sizes the limit from rollout.n and the length budgets (at least
    8 MiB); a positive value is taken as MiB."""
    small = tiny_learner_config(tmp_path)
    assert max_message_bytes(small) == 8 << 20
    big = tiny_learner_config(tmp_path, "rollout.n=64", "data.max_prompt_length=2048",
                              "rollout.max_response_length=4096")  # fmt: skip
    assert max_message_bytes(big) == 64 * (256 * 6144 + 65536) + (1 << 20)
    explicit = tiny_learner_config(tmp_path, "asynchronous.max_message_mb=1.5")
    assert max_message_bytes(explicit) == 3 << 19


def test_a_learner_whose_groups_are_all_rejected_says_why_in_one_line(learner, monkeypatch) -> None:
    """Issue 50, item 4b: a learner whose only sampler's groups are all rejected (forged
    log-probs: reason value) waits asynchronous.data_timeout_s, then says in one line how many
    were rejected, counted by reason, and the last one: a NoEpisodesError (a UserError: the
    CLI prints it as one line, no traceback). Before: a TimeoutError traceback asking "are the
    samplers running?". With nothing rejected, the line still asks that."""
    from creditrl.asynchronous.receiver import NoEpisodesError
    from creditrl.errors import UserError

    a = dataclasses.replace(learner.cfg.asynchronous, data_timeout_s=1.0)
    monkeypatch.setattr(learner, "cfg", dataclasses.replace(learner.cfg, asynchronous=a))
    model = learner.actor.model
    sock = SamplerSocket(a, "f0", port=learner.socket.port)
    try:
        for seq in range(3):
            assert sock.send(edit(rollout_log_probs=0.5)(model, "f0", seq), timeout_s=5)
        assert sock.send([b"junk"], timeout_s=5)
        with pytest.raises(NoEpisodesError) as err:
            learner.collect()
        line = str(err.value)
        assert isinstance(err.value, UserError) and "\n" not in line
        assert line.startswith("learner: no usable group for 1s on tcp://")
        assert "(0 of 2 groups buffered): 4 rejected in that time (value 3, protocol 1)" in line
        assert "the last f0 (protocol): " in line
        assert "samplers running" not in line
        with pytest.raises(NoEpisodesError, match=r"buffered\); are the samplers running\?"):
            learner.collect()
    finally:
        sock.close()


def test_sender_is_disconnected_after_max_rejects(learner, monkeypatch) -> None:
    """After max_rejects rejections a sender gets `disconnected`; every later message of it,
    even a valid group, is answered `disconnected` and otherwise ignored; others still train."""
    a = dataclasses.replace(learner.cfg.asynchronous, max_rejects=3)
    monkeypatch.setattr(learner, "cfg", dataclasses.replace(learner.cfg, asynchronous=a))
    model = learner.actor.model
    bad = SamplerSocket(a, "b0", port=learner.socket.port)
    good = SamplerSocket(a, "g0", port=learner.socket.port)
    rejected = learner.counters["rejected"]
    try:
        for _ in range(3):
            assert bad.send([b"junk"], timeout_s=5)
            learner._receive(5.0)
        kinds = [bad.recv(5.0).kind for _ in range(4)]
        assert kinds == ["ack", "ack", "ack", "disconnected"]
        assert bad.send(episodes_message("b0", 0, make_group(model, "b0", 0, 0)), timeout_s=5)
        assert good.send(episodes_message("g0", 0, make_group(model, "g0", 0, 0)), timeout_s=5)
        deadline = time.monotonic() + 10
        while not learner.buffer.holds("g0", 0) and time.monotonic() < deadline:
            learner._receive(0.5)
        assert bad.recv(5.0).kind == "disconnected" and bad.recv(0.5) is None
        assert learner.counters["rejected"] == rejected + 3
        assert learner.counters["disconnected_samplers"] == 1
        assert learner.counters["ignored_messages"] == 1  # the valid group sent after
        assert not learner.buffer.holds("b0", 0) and learner.buffer.holds("g0", 0)
    finally:
        bad.close()
        good.close()
        learner.buffer.take(len(learner.buffer))


# ---- the sampler side -----------------------------------------------------------------------


class RecordingSocket:
    """Stands in for the sampler's socket: records what is sent."""

    address = "stand-in"

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send(self, frames: list[bytes], timeout_s: float) -> bool:
        self.sent.append(frames)
        return True


@pytest.fixture(scope="module")
def sampler(tmp_path_factory):
    out = tmp_path_factory.mktemp("sampler")
    cfg = tiny_learner_config(out, *RUN)
    sampler = Sampler(cfg, 0)
    sampler.socket = RecordingSocket()
    yield sampler
    sampler.socket = None
    sampler.close()


def test_a_real_sampler_group_passes_the_learner_checks(sampler, learner, tokenizer) -> None:
    """What the sampler really produces decodes and fits the learner's limits (same config), and
    the token-id bound is the tokenizer's vocabulary for this model."""
    assert learner.limits.vocab_size == len(tokenizer)
    groups, _ = sampler.produce()
    assert len(groups) == 2
    for group in groups:
        seq = int(group["episode_id"][0].split(":")[1])
        message = decode(episodes_message("s0", seq, group))
        learner.limits.check(message.batch, "s0", seq, 0, 0)


def test_sampler_drops_a_rejected_group_and_never_resends_it(sampler) -> None:
    """A `rejected` ack removes the group from the outbox (logged as rejected, counted); when
    the learner restarts only the other unacknowledged group is resent."""
    model = sampler.model
    first = sampler.outbox.put(make_group(model, "s0", sampler.outbox.next_seq, 0))
    second = sampler.outbox.put(make_group(model, "s0", sampler.outbox.next_seq, 0))
    count = sampler.rejected
    sampler._on_message(decode(encode("welcome", {"incarnation": "one", "weight_version": 0})))
    sampler._on_message(decode(reject_message("one", 0, first, "mask")))
    sampler._on_message(decode(reject_message("one", 0, None, "protocol")))
    assert first not in sampler.outbox.pending() and second in sampler.outbox.pending()
    assert {"seq": first, "status": "rejected"} in sampler.outbox.acknowledged()
    assert sampler.rejected == count + 2
    sampler.socket.sent.clear()
    sampler._on_message(decode(encode("welcome", {"incarnation": "two", "weight_version": 0})))
    assert [decode(f).header["seq"] for f in sampler.socket.sent] == [second]
    sampler.outbox.ack(second, "trained")


def test_sampler_stops_with_an_error_when_disconnected(sampler, monkeypatch) -> None:
    """`disconnected` ends the sampler's loop with exit code 1 and a line naming the cause."""
    out = io.StringIO()
    monkeypatch.setattr(sampler, "console", Console(file=out, width=300))
    monkeypatch.setattr(sampler, "stopped", False)
    monkeypatch.setattr(sampler, "exit_code", 0)
    header = {"reason": "disconnected after 16 rejected messages", "rejected": 16}
    sampler._on_message(decode(encode("disconnected", header)))
    assert sampler.stopped and sampler.exit_code == 1
    assert "the learner disconnected this sampler: disconnected after 16" in out.getvalue()


def test_sampler_drops_a_group_too_large_to_send(sampler, monkeypatch) -> None:
    """A group above the learner's message limit is dropped before sending (outbox status
    too_large, counted), instead of vanishing in the learner's socket."""
    monkeypatch.setattr(sampler, "max_message", 1000)
    seq = sampler.outbox.put(make_group(sampler.model, "s0", sampler.outbox.next_seq, 0))
    sampler.socket.sent.clear()
    count = sampler.rejected
    sampler._send_group(seq, sampler.outbox.load(seq))
    assert sampler.socket.sent == [] and seq not in sampler.outbox.pending()
    assert {"seq": seq, "status": "too_large"} in sampler.outbox.acknowledged()
    assert sampler.rejected == count + 1


def test_a_sampler_that_cannot_read_the_published_weights_says_so_and_exits(
    tmp_path: Path,
) -> None:
    """Issue 50, item 4c: the learner says it published v3, but the sampler's weight folder
    is one it cannot see. Before, it waited for newer weights without a word; now one line
    names the folder and what is missing, and after asynchronous.data_timeout_s of it the
    sampler exits 1 saying why (no traceback, and not "no word from the learner")."""
    import threading

    missing = tmp_path / "not_here"
    cfg = tiny_learner_config(tmp_path, *RUN, f"asynchronous.weight_dir={missing}",
                              "asynchronous.max_staleness=0", "asynchronous.ping_s=0.2",
                              "asynchronous.data_timeout_s=3")  # fmt: skip
    learner = LearnerSocket(cfg.asynchronous, 0, max_message_bytes(cfg))
    stop = threading.Event()

    def answer_hellos() -> None:  # a learner at v3 that hears the sampler's pings
        while not stop.is_set():
            got = learner.recv(0.1)
            if got is not None and got[1].kind == "hello":
                welcome = {"incarnation": "one", "weight_version": 3, "queued": 0}
                learner.send(got[0], encode("welcome", welcome))

    thread = threading.Thread(target=answer_hellos, daemon=True)
    thread.start()
    out = io.StringIO()
    try:
        sampler = Sampler(cfg, 0, port=learner.port, console=Console(file=out, width=400))
        assert sampler.run() == 1
    finally:
        stop.set()
        thread.join(timeout=10)
        learner.close()
    text = out.getvalue()
    chose = [line for line in text.splitlines() if "weights from the folder" in line]
    assert len(chose) == 1 and "weight_channel=wire on the learner and its samplers" in chose[0]
    said = [line for line in text.splitlines() if "weights v3" in line]
    assert len(said) == 2, text
    assert said[0] == (
        f"sampler s0: the learner published weights v3, but they cannot be read here: "
        f"{missing} does not exist here; holding v0 meanwhile, exiting if this lasts 3s "
        "(asynchronous.weight_dir, asynchronous.data_timeout_s)"
    )
    assert said[1].startswith("sampler s0: the learner's weights v3 still cannot be read after")
    assert f"{missing} does not exist here; exiting" in said[1]
    assert sampler.batches == 0 and "no word from the learner" not in text
    assert "Traceback" not in text


# ---- supervision ------------------------------------------------------------------------------


def _fake(code: str) -> list[str]:
    return [sys.executable, "-c", code]


SLEEP = _fake("import time; time.sleep(60)")


def _supervise(tmp_path: Path, learner_code: list[str], sampler_code: list[str]):
    out = io.StringIO()
    logs = tmp_path / "logs"
    quiet = (io.BytesIO(), io.BytesIO())
    learners = [start_child("learner", 0, learner_code, logs, echo=quiet)]
    samplers = [start_child("sampler", 0, sampler_code, logs, echo=quiet)]
    began = time.monotonic()
    code = supervise(learners, samplers, Console(file=out, width=300), grace_s=5, poll_s=0.05)
    return code, time.monotonic() - began, out.getvalue(), learners + samplers


def test_a_sampler_dying_at_start_up_ends_the_run_at_once(tmp_path: Path) -> None:
    """The sampler exits with an error while the learner waits: supervise returns its code
    within seconds, names `sampler 0 (s0)`, prints its last error line, stops the learner and
    keeps the sampler's stdout and stderr in its log file."""
    crash = _fake("import sys; print('loading...'); "
                  "sys.exit('OSError: model path /nope does not exist')")  # fmt: skip
    code, _, text, children = _supervise(tmp_path, SLEEP, crash)
    assert code == 1  # sys.exit(str) exits 1
    assert "sampler 0 (s0) exited with code 1" in text
    assert "| OSError: model path /nope does not exist" in text
    assert children[0].proc.returncode == -15  # the learner was stopped, not left to finish
    log = (tmp_path / "logs" / "sampler-0.log").read_text().splitlines()
    assert sorted(log) == ["OSError: model path /nope does not exist", "loading..."]


def test_a_killed_sampler_or_a_dead_learner_ends_the_run(tmp_path: Path) -> None:
    """A sampler killed by SIGKILL mid-run: exit code 128 + 9 and the signal named. A learner
    rank failing: its code, and the samplers stopped."""
    killed = _fake("import os, signal, time; time.sleep(0.5); os.kill(os.getpid(), 9)")
    code, _, text, children = _supervise(tmp_path / "a", SLEEP, killed)
    assert code == 137 and "sampler 0 (s0) was killed by SIGKILL" in text
    assert children[0].proc.returncode == -15
    failing = _fake("import sys; print('RuntimeError: out of memory', file=sys.stderr); "
                    "sys.exit(4)")  # fmt: skip
    code, _, text, children = _supervise(tmp_path / "b", failing, SLEEP)
    assert code == 4 and "learner rank 0 exited with code 4" in text
    assert "| RuntimeError: out of memory" in text
    assert children[1].proc.returncode == -15  # the sampler was terminated


def test_a_refusal_is_not_followed_by_resume_advice(tmp_path: Path) -> None:
    """Issue 50, item 4a: a learner refused in one line (exit 2: a weight folder in use) is
    shown with that line and no advice to resume (before: "rerun the same command to resume
    (the learner from its last checkpoint, ...)", which would be refused again); a child that
    failed otherwise still gets the advice."""
    refused = _fake("import sys; print('error: asynchronous.weight_dir=/w is in use by another "
                    "run (pid 7)', file=sys.stderr); sys.exit(2)")  # fmt: skip
    code, _, text, _ = _supervise(tmp_path / "a", refused, SLEEP)
    assert code == 2 and "learner rank 0 exited with code 2" in text
    assert "| error: asynchronous.weight_dir=/w is in use by another run (pid 7)" in text
    assert "resume" not in text
    code, _, text, _ = _supervise(tmp_path / "b", _fake("import sys; sys.exit(1)"), SLEEP)
    assert code == 1 and "rerun the same command to resume" in text


def test_a_run_that_finishes_exits_zero(tmp_path: Path) -> None:
    """The learner exits 0 and the sampler follows: code 0, nothing reported."""
    code, _, text, _ = _supervise(tmp_path, _fake("pass"), _fake("import time; time.sleep(0.3)"))
    assert code == 0 and "stopping the run" not in text


def test_creditrl_async_ends_when_a_sampler_cannot_start(tmp_path: Path) -> None:
    """`creditrl async` whose sampler fails at start-up (its state_dir is a file: one line,
    exit 2) exits with the sampler's code as soon as the sampler's exit is seen (before: the
    learner waited data_timeout_s=600 s, past the 300 s this test allows a loaded machine)
    naming the sampler and its error, with the sampler's output in its log file."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    args = [f"model.path={tiny_model_dir()}", *RUN, "data.train_batch_size=1", "rollout.n=2",
            "actor.ppo_mini_batch_size=1", "trainer.total_steps=2", "trainer.logger=[jsonl]",
            f"trainer.output_dir={tmp_path / 'out'}", f"asynchronous.port={free_port()}",
            f"asynchronous.state_dir={blocker}", "asynchronous.data_timeout_s=600"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "creditrl.cli", "async", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "asynchronous.data_timeout_s" not in output
    assert "sampler 0 (s0) exited with code 2" in output
    assert "| error: cannot use " in output and "Not a directory" in output, output[-3000:]
    assert "Traceback" not in output
    assert (tmp_path / "out" / "async" / "logs" / "sampler-0.log").is_file()


# ---- amplification: what a group holds in memory against its bytes on the wire ----------


def _with_ground_truth(model, sid: str, seq: int, value) -> list[bytes]:
    """Episodes frames of a valid group whose ground truth (any JSON value) is ``value``."""
    g = make_group(model, sid, seq, 0)
    columns = {k: list(v) for k, v in g.non_tensors.items()}
    return frames_of(
        Batch(dict(g.tensors), {**columns, "ground_truth": [value] * len(g)}), sid, seq
    )


def test_a_decoded_group_holds_no_more_than_it_is_charged(learner) -> None:
    """The bytes a decoded group is charged (its tensors, its JSON by held_bytes, the fixed
    overhead) cover what decoding it holds, measured by tracemalloc, for the worst shape of
    JSON (a list of one-key dicts: ~66 bytes held per element against 128 charged)."""
    import tracemalloc

    frames = _with_ground_truth(learner.actor.model, "m0", 0, [{"a": 0}] * 600)
    tracemalloc.start()
    message = decode(frames, learner.json_limits)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert message.kind == "episodes" and len(message.batch["ground_truth"][0]) == 600
    assert held <= message.nbytes, (held, message.nbytes)


@pytest.mark.parametrize(
    "value,what",
    [([[] for _ in range(20_000)], "elements"), (None, "deep")],
)
def test_amplified_json_is_refused_before_decoding(learner, value, what) -> None:
    """A group whose non-tensor JSON would grow ~20x in memory (20,000 empty lists in ~60 KB)
    or is nested 500 deep is refused with reason json_limit before it is decoded, under the
    learner's limits for its config (settings.json_limits); the next honest group is taken."""
    if value is None:  # 500 nested lists (deeper ones the sender cannot encode either)
        value = []
        for _ in range(500):
            value = [value]
    sid = f"amp{what}"
    model = learner.actor.model
    sock = SamplerSocket(learner.cfg.asynchronous, sid, port=learner.socket.port)
    limits, learner.socket.json_limits = learner.socket.json_limits, learner.json_limits
    try:
        rejected = learner.counters["rejected/json_limit"]
        assert sock.send(_with_ground_truth(model, sid, 0, value), timeout_s=5)
        assert learner._receive(5.0) == 0
        assert _acks(sock) == [{"seq": 0, "status": "rejected", "reason": "json_limit"}]
        assert learner.counters["rejected/json_limit"] == rejected + 1
        assert sock.send(episodes_message(sid, 1, make_group(model, sid, 1, 0)), timeout_s=5)
        assert learner._receive(5.0) == 1 and learner.buffer.holds(sid, 1)
    finally:
        learner.socket.json_limits = limits
        sock.close()
        learner.buffer.take(len(learner.buffer))


def test_buffered_bytes_are_bounded_and_a_full_buffer_strikes_no_one(learner) -> None:
    """With room for one group, a second is refused buffer_full (counted, not toward
    max_rejects); once the buffer is taken the same sampler's next group is accepted."""
    model = learner.actor.model
    sock = SamplerSocket(learner.cfg.asynchronous, "full0", port=learner.socket.port)
    limit = learner.buffer_limit
    try:
        first = decode(episodes_message("full0", 0, make_group(model, "full0", 0, 0)))
        learner.buffer_limit = first.nbytes + 100
        before = learner.counters["rejected/buffer_full"]
        for seq in (0, 3):  # groups of one size (make_group's prompt width cycles with seq)
            assert sock.send(episodes_message("full0", seq, make_group(model, "full0", seq, 0)), 5)
        assert learner._receive(5.0) == 1 and learner._receive(5.0) == 0
        assert learner.buffer.nbytes == first.nbytes
        assert _acks(sock) == [{"seq": 3, "status": "rejected", "reason": "buffer_full"}]
        assert learner.counters["rejected/buffer_full"] == before + 1
        assert learner.rejects["full0"] == 0 and "full0" not in learner.blocked
        learner.buffer.take(1)
        assert learner.buffer.nbytes == 0
        assert sock.send(episodes_message("full0", 6, make_group(model, "full0", 6, 0)), 5)
        assert learner._receive(5.0) == 1
    finally:
        learner.buffer_limit = limit
        sock.close()
        learner.buffer.take(len(learner.buffer))


def test_the_buffer_limit_leaves_room_for_every_honest_group(learner) -> None:
    """max_buffered_bytes holds every sampler's unacknowledged groups at the largest size a
    group passing the checks can have, and an honest group is far below that size."""
    cfg = learner.cfg
    largest = max_group_bytes(cfg.rollout.n, cfg.data.max_prompt_length,
                              cfg.rollout.max_response_length, learner.json_limits)  # fmt: skip
    groups = cfg.asynchronous.num_samplers * inflight_groups(cfg)
    assert learner.buffer_limit == max(groups, 2 * cfg.data.train_batch_size) * largest
    honest = decode(episodes_message("h0", 0, make_group(learner.actor.model, "h0", 0, 0)))
    assert honest.nbytes < largest


def test_a_group_sampled_at_another_temperature_is_refused(learner) -> None:
    """The temperature a group was sampled at (its meta, written by the sampler's pipeline)
    must be the learner's rollout.temperature: its behaviour log-probs are of that
    distribution, and the learner's log-prob passes divide by it. Refused "temperature"."""
    model = learner.actor.model
    sock = SamplerSocket(learner.cfg.asynchronous, "temp0", port=learner.socket.port)
    try:
        group = make_group(model, "temp0", 0, 0)
        group.meta["temperature"] = learner.cfg.rollout.temperature + 0.5
        assert sock.send(episodes_message("temp0", 0, group), timeout_s=5)
        assert learner._receive(5.0) == 0
        assert _acks(sock) == [{"seq": 0, "status": "rejected", "reason": "temperature"}]
        same = make_group(model, "temp0", 1, 0)
        same.meta["temperature"] = learner.cfg.rollout.temperature
        assert sock.send(episodes_message("temp0", 1, same), timeout_s=5)
        assert learner._receive(5.0) == 1
    finally:
        sock.close()
        learner.buffer.take(len(learner.buffer))

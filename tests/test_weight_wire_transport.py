"""Weights over the wire between processes (creditrl.asynchronous.weight_server): the weight
port's requests and answers, checked like every message; served while the learner is busy;
CURVE keys from files or the environment; hostile answers refused and counted, the sampler
keeping its last good weights."""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from transformers import LlamaForCausalLM

from creditrl.asynchronous.launcher import free_port
from creditrl.asynchronous.messages import MessageError, decode, encode, weight_message
from creditrl.asynchronous.transport import (
    CURVE_ENV,
    endpoint,
    make_curve_keys,
    sampler_curve_keys,
)
from creditrl.asynchronous.weight_server import (
    WINDOW,
    WeightClient,
    WeightServer,
    weight_port,
    weight_timeout_s,
)
from creditrl.config import load_config
from creditrl.config.schema import AsyncConfig
from creditrl.errors import ConfigError
from creditrl.weights import ChosenLater, WireChannel, WirePublisher
from creditrl.weights.hashing import wire_hash
from creditrl.weights.wire import WireError, encode_publication


def tiny(seed: int) -> LlamaForCausalLM:
    from conftest import tiny_llama_config

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config()).float().eval()


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def serve(cfg: AsyncConfig, publisher: WirePublisher) -> tuple[WeightServer, WeightClient]:
    server = WeightServer(cfg, publisher, free_port())
    client = WeightClient(cfg, "s0", server.address, timeout_s=10.0)
    return server, client


def test_a_sampler_fetches_each_version_over_curve_and_the_learner_counts_it(
    tmp_path: Path,
) -> None:
    """CURVE on 127.0.0.1 with the key folder: v1 then v2 arrive whole (equal to the learner's
    weights), the learner's counters say how many chunks and bytes it sent."""
    cfg = AsyncConfig(curve_keys_dir=str(make_curve_keys(tmp_path / "keys")))
    learner, sampler = tiny(0), tiny(1)
    publisher = WirePublisher(chunk_bytes=1 << 16)
    server, client = serve(cfg, publisher)
    try:
        channel = WireChannel(client)
        assert channel.load(sampler) is False and channel.problem is None  # nothing published
        manifest = publisher.publish(learner, 1)
        assert channel.load(sampler) is True and channel.version == 1
        assert same_weights(sampler, learner)
        with torch.no_grad():
            learner.model.norm.weight.add_(1.0)
        publisher.publish(learner, 2, background=True)
        publisher.wait()
        assert channel.load(sampler) is True and channel.version == 2
        assert same_weights(sampler, learner)
        assert server.counts["weights_chunks_sent"] == 2 * len(manifest.chunks)
        assert server.counts["weights_bytes_sent"] == 2 * manifest.size
        assert sum(channel.rejected.values()) == 0 and sum(client.rejected.values()) == 0
    finally:
        client.close()
        server.close()


def test_a_sampler_fetches_while_the_learner_is_busy() -> None:
    """The weight port is answered by the server's own thread: a whole version arrives while
    the main work (a training-sized matmul loop, standing for an update) never stops; the
    busy loop stops only once the fetch is done, and has run all along."""
    learner, sampler = tiny(0), tiny(1)
    publisher = WirePublisher(chunk_bytes=1 << 14)
    manifest = publisher.publish(learner, 1)
    server, client = serve(AsyncConfig(), publisher)
    done, steps = threading.Event(), [0]

    def fetch() -> None:
        channel = WireChannel(client)
        while not channel.load(sampler):
            pass
        done.set()

    fetcher = threading.Thread(target=fetch, daemon=True)
    a = torch.randn(256, 256)
    try:
        fetcher.start()
        while not done.is_set() and steps[0] < 1_000_000:  # the "learner", busy throughout
            a = torch.tanh(a @ a.T / 256)
            steps[0] += 1
        fetcher.join(timeout=60)
    finally:
        client.close()
        server.close()
    assert done.is_set() and same_weights(sampler, learner)
    assert steps[0] > 0 and server.counts["weights_chunks_sent"] == len(manifest.chunks) > 4


# ---- the messages ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "fields", "payload", "match"),
    [
        ("chunk_request", {"rid": 1, "version": 1}, None, "'index' must be int"),
        ("chunk_request", {"rid": 1, "version": True, "index": 0}, None, "'version' must be int"),
        ("chunk_request", {"rid": 1, "version": -1, "index": 0}, None, "'version' must be int"),
        ("chunk_request", {"rid": 1, "version": 2**53, "index": 0}, None, "must be int"),
        ("manifest_request", {"rid": 1, "version": None, "x": 1}, None, "unknown fields"),
        ("manifest_request", {"rid": "1", "version": None}, None, "'rid' must be int"),
        ("manifest", {"rid": 1, "newest": 1, "manifest": []}, None, "must be dict or null"),
        ("chunk", {"rid": 1, "version": 1, "index": 0}, None, "has 3 frames, got 2"),
        ("chunk_request", {"rid": 1, "version": 1, "index": 0}, b"x", "has 2 frames, got 3"),
        ("weights_refused", {"rid": 1, "reason": "version", "detail": "x" * 201}, None,
         "'detail' must be str"),
    ],
)  # fmt: skip
def test_a_weight_message_is_checked_as_every_message_is(
    kind: str, fields: dict[str, Any], payload: bytes | None, match: str
) -> None:
    frames = encode(kind, fields, payload)
    with pytest.raises(MessageError, match=match) as err:
        decode(frames)
    assert err.value.reason in ("header", "protocol")
    with pytest.raises((ValueError, MessageError)):
        weight_message(kind, payload, **fields)


def test_the_weight_port_refuses_and_counts_bad_requests_and_keeps_serving() -> None:
    """Requests it cannot read (another kind, unknown fields) are counted and unanswered, one
    over its size limit is dropped by libzmq; a version it does not hold is answered
    ``weights_refused``; then a good request is answered as before."""
    publisher = WirePublisher(chunk_bytes=1 << 10)
    publisher.publish(tiny(0), 3)
    server = WeightServer(AsyncConfig(), publisher, free_port())
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    try:
        sock.send_multipart(encode("hello", {"sampler_id": "s0"}))
        sock.send_multipart(encode("chunk_request", {"rid": 1, "version": 3, "index": 0, "y": 2}))
        sock.send_multipart([b"creditrl.async/1", b"{" * (80 << 10)])  # over 64 KiB: dropped
        assert not sock.poll(1000)
        sock.send_multipart(weight_message("chunk_request", rid=2, version=1, index=0))
        assert sock.poll(10_000)
        refused = decode(sock.recv_multipart())
        assert refused.kind == "weights_refused" and refused.header["rid"] == 2
        assert refused.header["reason"] == "version" and "not held" in refused.header["detail"]
        sock.send_multipart(weight_message("chunk_request", rid=3, version=3, index=1))
        assert sock.poll(10_000)
        chunk = decode(sock.recv_multipart())
        assert chunk.kind == "chunk" and chunk.payload == publisher.chunk(3, 1)
        assert server.counts["weights_bad_requests"] == 2  # the hello, the unknown field
        assert server.counts["weights_refused"] == 1 and server.counts["weights_requests"] == 2
    finally:
        sock.close()
        context.term()
        server.close()


# ---- a hostile learner -----------------------------------------------------------------------


class Forger:
    """A fake weight port: answers each request as ``answer(request header)`` says (a list of
    frame lists, sent in order; the real publisher's answers are at hand in ``publisher``)."""

    def __init__(self, publisher: WirePublisher, answer: Any) -> None:
        self.publisher, self.answer = publisher, answer
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = endpoint("127.0.0.1", self.port)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def honest(self, header: dict[str, Any]) -> list[bytes]:
        rid, version = header["rid"], header["version"]
        if header["kind"] == "manifest_request":
            newest = self.publisher.newest()
            manifest = self.publisher.manifest(version or newest)
            return weight_message("manifest", rid=rid, newest=newest, manifest=manifest)
        data = self.publisher.chunk(version, header["index"])
        return weight_message("chunk", data, rid=rid, version=version, index=header["index"])

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *frames = self.sock.recv_multipart()
            header = decode(frames).header
            for reply in self.answer(self, header):
                self.sock.send_multipart([identity, *reply])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.sock.close()
        self.context.term()


def _with_manifest(forger: Forger, header: dict[str, Any], **change: Any) -> list[list[bytes]]:
    if header["kind"] != "manifest_request":
        return [forger.honest(header)]
    newest = forger.publisher.newest()
    fields = {**forger.publisher.manifest(newest), **change}
    return [weight_message("manifest", rid=header["rid"], newest=newest, manifest=fields)]


def _bad_chunk(forger: Forger, header: dict[str, Any], data: bytes) -> list[list[bytes]]:
    if header["kind"] == "manifest_request" or header["index"] != 0:
        return [forger.honest(header)]
    return [weight_message("chunk", data, rid=header["rid"], version=header["version"],
                           index=0)]  # fmt: skip


def _honest(forger: Forger, header: dict[str, Any]) -> list[list[bytes]]:
    return [forger.honest(header)]


def _first(forger: Forger, header: dict[str, Any], bad: list[bytes]) -> list[list[bytes]]:
    """``bad`` before the honest answer to the first request only."""
    forger.calls = getattr(forger, "calls", 0) + 1
    return [bad, forger.honest(header)] if forger.calls == 1 else [forger.honest(header)]


HOSTILE = {
    "a manifest for another version": (
        lambda f, h: _with_manifest(f, h, version=7), "version"),
    "a forged manifest": (lambda f, h: _with_manifest(f, h, digest="zz"), "manifest"),
    "a manifest beyond the limits": (
        lambda f, h: _with_manifest(f, h, size=1 << 50), "manifest"),
    "a chunk failing its checksum": (
        lambda f, h: _bad_chunk(f, h, bytes(len(f.publisher.chunk(1, 0)))), "checksum"),
    "a chunk too large for its manifest": (
        lambda f, h: _bad_chunk(f, h, f.publisher.chunk(1, 0) + b"x"), "size"),
    "an answer to another chunk": (
        lambda f, h: [f.honest({**h, "index": 1}) if h.get("index") == 0 else f.honest(h)],
        "order"),
    "a late answer to an earlier request first": (
        lambda f, h: _first(f, h, weight_message("chunk", b"x", rid=0, version=1, index=0)),
        "order"),
    "a second answer to the first request": (lambda f, h: _first(f, h, f.honest(h)), "order"),
    "an answer that does not decode": (
        lambda f, h: _first(f, h, [b"creditrl.async/1", b"[1]"]), "message"),
    "a whole whose tensors do not fit": (None, "payload"),
}  # fmt: skip


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_a_hostile_answer_is_refused_counted_and_the_last_good_weights_kept(
    attack: str,
) -> None:
    """Each forged answer is refused and counted by its reason (``REFUSALS``), the model keeps
    the version it holds; what can be fetched honestly afterwards still loads."""
    learner, sampler = tiny(0), tiny(1)
    publisher = WirePublisher(chunk_bytes=1 << 16)
    answer, reason = HOSTILE[attack]
    if answer is None:  # a complete, checksummed publication of tensors the model lacks
        manifest, payload = encode_publication("full", {"w": torch.ones(3)}, 1, 1 << 16)
        publisher._held[1] = (manifest, payload)
        answer = _honest
    else:
        publisher.publish(learner, 1)
    before = copy.deepcopy(sampler.state_dict())
    forger = Forger(publisher, answer)
    client = WeightClient(AsyncConfig(), "s0", forger.address, timeout_s=10.0)
    channel = WireChannel(client)
    try:
        loaded = channel.load(sampler)
        honest_after = "first" in attack or "decode" in attack  # skipped; the honest one follows
        assert loaded is honest_after and channel.version == (1 if honest_after else 0)
        counted = {k: v for k, v in {**channel.rejected}.items() if v}
        counted.update({k: v + counted.get(k, 0) for k, v in client.rejected.items() if v})
        assert counted == {reason: 1}, counted
        if not honest_after:
            assert all(torch.equal(v, before[k]) for k, v in sampler.state_dict().items())
            forger.answer = lambda f, h: [f.honest(h)]
            publisher.publish(learner, 2)
            assert channel.load(sampler) is True and channel.version == 2
            assert same_weights(sampler, learner)
    finally:
        client.close()
        forger.close()


def test_an_answer_over_the_size_limit_never_reaches_python_and_the_weights_stay() -> None:
    """A frame above the sampler's bound (``WireLimits.max_chunk_bytes`` + 1 MiB) is dropped by
    libzmq: no answer, said by ``unreadable()``; nothing is loaded."""
    from creditrl.weights.wire import WireLimits

    publisher = WirePublisher(chunk_bytes=1 << 16)
    publisher.publish(tiny(0), 1)
    huge = b"x" * (3 << 20)

    def answer(f: Forger, h: dict[str, Any]) -> list[list[bytes]]:
        if h["kind"] == "manifest_request":
            return [f.honest(h)]
        return [weight_message("chunk", huge, rid=h["rid"], version=1, index=h["index"])]

    forger = Forger(publisher, answer)
    limits = WireLimits(max_chunk_bytes=1 << 20)
    client = WeightClient(AsyncConfig(), "s0", forger.address, limits=limits, timeout_s=2.0)
    channel, sampler = WireChannel(client, limits=limits), tiny(1)
    before = copy.deepcopy(sampler.state_dict())
    try:
        assert channel.load(sampler) is False and channel.version == 0
        assert "no answer from the learner's weight port" in channel.unreadable()
        assert all(torch.equal(v, before[k]) for k, v in sampler.state_dict().items())
    finally:
        client.close()
        forger.close()


# ---- a window of requests in flight ----------------------------------------------------------


class Holder(Forger):
    """A fake weight port that holds chunk requests until ``hold`` are waiting (or none came
    for 0.5 s), then answers them as ``answer(port, waiting)`` says (frame lists, in order;
    ``waiting``: the held request headers, oldest first); ``held``: how many each time."""

    def __init__(self, publisher: WirePublisher, answer: Any, hold: int = WINDOW) -> None:
        self.hold, self.held, self.requests = hold, [], 0
        super().__init__(publisher, answer)

    def run(self) -> None:
        waiting: list[dict[str, Any]] = []
        identity = b""
        while not self.stop.is_set():
            if self.sock.poll(500 if waiting else 50):
                identity, *frames = self.sock.recv_multipart()
                header = decode(frames).header
                if header["kind"] == "manifest_request":
                    self.sock.send_multipart([identity, *self.honest(header)])
                    continue
                self.requests += 1
                waiting.append(header)
                if len(waiting) < self.hold:
                    continue
            if waiting:
                self.held.append(len(waiting))
                for reply in self.answer(self, waiting):
                    self.sock.send_multipart([identity, *reply])
                waiting = []


def _reversed(port: Holder, waiting: list[dict[str, Any]]) -> list[list[bytes]]:
    return [port.honest(h) for h in reversed(waiting)]


def _forged_in_the_middle(port: Holder, waiting: list[dict[str, Any]]) -> list[list[bytes]]:
    """The first window, newest first, with three forgeries among the answers: one to a
    request never made, a copy of an answer already given, and a chunk of zeros."""
    replies = _reversed(port, waiting)
    if port.held != [len(waiting)]:
        return replies
    last = waiting[-1]
    zeros = bytes(len(port.publisher.chunk(last["version"], last["index"])))
    return [
        replies[0],
        weight_message("chunk", zeros, rid=last["rid"] + 1000, version=1, index=0),
        replies[0],
        *replies[1:-1],
        weight_message("chunk", zeros, rid=waiting[0]["rid"], version=1,
                       index=waiting[0]["index"]),
    ]  # fmt: skip


def _refused_first(port: Holder, waiting: list[dict[str, Any]]) -> list[list[bytes]]:
    """The first window: the oldest request refused, then the others answered honestly."""
    if port.held != [len(waiting)]:
        return _reversed(port, waiting)
    first = waiting[0]
    refused = weight_message("weights_refused", rid=first["rid"], reason="version",
                             detail="weight version 1 is not held")  # fmt: skip
    return [refused, *[port.honest(h) for h in waiting[1:]]]


def _fetch_through(answer: Any) -> tuple[Holder, WeightClient, WireChannel, Any, Any]:
    learner, sampler = tiny(0), tiny(1)
    publisher = WirePublisher(chunk_bytes=1 << 14)
    publisher.publish(learner, 1)
    port = Holder(publisher, answer)
    client = WeightClient(AsyncConfig(), "s0", port.address, timeout_s=10.0)
    return port, client, WireChannel(client), learner, sampler


def test_a_window_of_chunk_requests_is_in_flight_and_answered_in_any_order() -> None:
    """The sampler asks for WINDOW chunks before the first answer (the port holds them until
    then), takes the answers newest first, and loads the version whole; nothing refused."""
    port, client, channel, learner, sampler = _fetch_through(_reversed)
    try:
        assert channel.load(sampler) is True and same_weights(sampler, learner)
        chunks = len(port.publisher.manifest(1)["chunks"])
        assert chunks > 2 * WINDOW and port.held[0] == WINDOW and sum(port.held) == chunks
        assert port.requests == chunks and channel.fetched == chunks
        assert sum(channel.rejected.values()) == 0 and sum(client.rejected.values()) == 0
    finally:
        client.close()
        port.close()


def test_forged_answers_in_the_middle_of_a_window_are_refused_and_counted() -> None:
    """Among the first window's answers: one to a request never made and a second copy of an
    answer are skipped (``order``), a chunk of zeros fails its checksum; the other chunks are
    kept, nothing is loaded, and the next load asks for the refused chunk alone."""
    port, client, channel, learner, sampler = _fetch_through(_forged_in_the_middle)
    before = copy.deepcopy(sampler.state_dict())
    try:
        assert channel.load(sampler) is False and channel.version == 0
        assert all(torch.equal(v, before[k]) for k, v in sampler.state_dict().items())
        assert {k: v for k, v in client.rejected.items() if v} == {"order": 2}
        assert {k: v for k, v in channel.rejected.items() if v} == {"checksum": 1}
        chunks = len(port.publisher.manifest(1)["chunks"])
        assert port.requests == chunks
        assert channel.load(sampler) is True and same_weights(sampler, learner)
        assert port.requests == chunks + 1 and port.held[-1] == 1
    finally:
        client.close()
        port.close()


def test_a_refusal_in_a_window_gives_up_the_rest_and_their_late_answers_count_nothing() -> None:
    """The first request of a window refused: the version is refused (``version``) and the
    window's other requests abandoned; their answers, arriving late, are dropped uncounted,
    and the next load fetches the version whole."""
    port, client, channel, learner, sampler = _fetch_through(_refused_first)
    try:
        assert channel.load(sampler) is False
        assert {k: v for k, v in channel.rejected.items() if v} == {"version": 1}
        assert channel.load(sampler) is True and same_weights(sampler, learner)
        assert sum(client.rejected.values()) == 0 and channel.rejected["version"] == 1
    finally:
        client.close()
        port.close()


# ---- keys and settings -----------------------------------------------------------------------


def _key(path: Path, line: str) -> str:
    text = path.read_text()
    return text.split(f'{line} = "')[1].split('"')[0]


def test_a_sampler_takes_its_curve_keys_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CREDITRL_CURVE_SERVER_PUBLIC and CREDITRL_CURVE_SECRET instead of key files: the weight
    port (CURVE, the key folder's authorized/) answers; a wrong server key gets no answer."""
    keys = make_curve_keys(tmp_path / "keys")
    server_cfg = AsyncConfig(curve_keys_dir=str(keys))
    publisher = WirePublisher(chunk_bytes=1 << 16)
    publisher.publish(tiny(0), 1)
    server = WeightServer(server_cfg, publisher, free_port())
    monkeypatch.setenv(CURVE_ENV[0], _key(keys / "server.key", "public-key"))
    monkeypatch.setenv(CURVE_ENV[1], _key(keys / "sampler.key_secret", "secret-key"))
    assert sampler_curve_keys(AsyncConfig())[0].decode() == _key(keys / "sampler.key", "public-key")
    client = WeightClient(AsyncConfig(), "s0", server.address, timeout_s=10.0)
    try:
        assert client.newest() == 1
        monkeypatch.setenv(CURVE_ENV[0], _key(keys / "sampler.key", "public-key"))  # wrong
        wrong = WeightClient(AsyncConfig(), "s1", server.address, timeout_s=1.0)
        with pytest.raises(ConnectionError, match="no answer"):
            wrong.newest()
        wrong.close()
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"CREDITRL_CURVE_SERVER_PUBLIC": "short"},
         "CREDITRL_CURVE_SERVER_PUBLIC is set but CREDITRL_CURVE_SECRET is not"),
        ({"CREDITRL_CURVE_SERVER_PUBLIC": "x" * 40, "CREDITRL_CURVE_SECRET": "x" * 39},
         "environment variable CREDITRL_CURVE_SECRET is not a CURVE key"),
        ({"CREDITRL_CURVE_SERVER_PUBLIC": "~" * 40, "CREDITRL_CURVE_SECRET": "x" * 40},
         "environment variable CREDITRL_CURVE_SERVER_PUBLIC is not a CURVE key"),
    ],
)  # fmt: skip
def test_a_malformed_curve_variable_is_one_line_naming_it(
    env: dict[str, str], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=match) as err:
        sampler_curve_keys(AsyncConfig())
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["asynchronous.weight_channel=folder", "asynchronous.weight_port=7000"],
         "asynchronous.weight_port applies to weights over the wire"),
        (["asynchronous.weight_channel=folder", "asynchronous.weight_rate_mb=5"],
         "asynchronous.weight_rate_mb applies to weights over the wire"),
        (["asynchronous.weight_port=5557"], "asynchronous.weight_port=5557 is asynchronous.port"),
        (["asynchronous.weight_channel=disk"], "asynchronous.weight_channel='disk' is not one of"),
    ],
)  # fmt: skip
def test_weight_channel_settings_that_cannot_work_are_refused(
    overrides: list[str], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=overrides)


def test_the_weight_port_follows_the_episodes_port() -> None:
    assert weight_port(AsyncConfig(), 5557) == 5558
    assert weight_port(AsyncConfig(weight_port=6000), 5557) == 6000
    assert weight_port(AsyncConfig(), 0) == 0  # a free one, said by the learner


def test_a_sampler_waits_for_every_chunk_asked_for_ahead_of_its_next_answer() -> None:
    """Under a rate limit of one chunk a second, the next answer may wait for the WINDOW
    chunks each of the 3 samplers has in flight, and the one being sent: 13 s, plus ping_s."""
    assert weight_timeout_s(AsyncConfig(ping_s=5.0)) == 5.0  # no rate limit
    rated = AsyncConfig(ping_s=5.0, num_samplers=3, weight_rate_mb=8.0)
    assert weight_timeout_s(rated) == pytest.approx(5.0 + 3 * WINDOW + 1)


def test_a_channel_chosen_later_loads_nothing_until_chosen() -> None:
    publisher = WirePublisher(chunk_bytes=1 << 16)
    learner, sampler = tiny(0), tiny(1)
    publisher.publish(learner, 2)
    channel = ChosenLater()
    channel.attach(sampler)
    assert channel.refresh() is False and channel.version == 0 and channel.newest() is None
    channel.choose(WireChannel(publisher))
    assert channel.refresh() is True and channel.version == 2 and same_weights(sampler, learner)
    with pytest.raises(TypeError, match="learner publishes"):
        channel.publish(learner, 3)


def test_a_wire_error_names_its_reason() -> None:
    assert WireError("x").reason == "manifest" and WireError("x", "order").reason == "order"


def test_auto_takes_the_folder_it_sees_else_the_wire_the_learner_serves(tmp_path: Path) -> None:
    """weight_channel=auto, said in one line: the learner's weight folder with its run lock
    visible -> the folder; hidden, with a learner serving the wire (a host that is not
    loopback) -> the wire; hidden on loopback (the learner serves no wire) -> the folder, with
    the key that would take the wire."""
    from creditrl.asynchronous.weight_server import choose_channel
    from creditrl.run_lock import LOCK_NAME
    from creditrl.weights import FolderChannel

    def chosen(out: Path, *extra: str) -> tuple[Any, list[str]]:
        cfg = load_config(overrides=[f"trainer.output_dir={out}", *extra])
        channel, said = ChosenLater(), []
        client = choose_channel(cfg, channel, "s0", 5557, said.append)
        if client is not None:
            client.close()
        return channel.chosen, said

    (tmp_path / "seen" / "weights").mkdir(parents=True)
    (tmp_path / "seen" / "weights" / LOCK_NAME).touch()
    remote = ["asynchronous.host=192.0.2.1", "asynchronous.allow_insecure=true"]
    channel, said = chosen(tmp_path / "seen", *remote)
    assert isinstance(channel, FolderChannel)
    assert said == [f"sampler s0: weights from the folder {tmp_path / 'seen' / 'weights'} "
                    "(asynchronous.weight_channel=auto)"]  # fmt: skip
    channel, said = chosen(tmp_path / "hidden", *remote)
    assert isinstance(channel, WireChannel)
    assert said == [f"sampler s0: weights over the wire from tcp://192.0.2.1:5558 "
                    f"(asynchronous.weight_channel=auto: {tmp_path / 'hidden' / 'weights'} "
                    "cannot be read here)"]  # fmt: skip
    channel, said = chosen(tmp_path / "hidden")
    assert isinstance(channel, FolderChannel)
    hidden = tmp_path / "hidden" / "weights"
    assert said == [
        f"sampler s0: weights from the folder {hidden} (asynchronous.weight_channel=auto: "
        f"{hidden} cannot be read here, and a learner on 127.0.0.1 serves no wire; set "
        "asynchronous.weight_channel=wire on the learner and its samplers)"
    ]
    channel, said = chosen(tmp_path / "seen", "asynchronous.weight_channel=wire")
    assert isinstance(channel, WireChannel) and said[0].endswith("weight_channel=wire)")


def test_a_resumed_learner_publishes_its_version_to_the_folder_and_the_wire(
    tmp_path: Path,
) -> None:
    """A learner resumed at v5 whose folder holds only its own v3 (a crash before v4 and v5 were
    written): start_versions publishes v5, to the folder and to the weight port, whose
    publications did not survive the restart (before: the folder kept v3 and the wire had
    nothing, so a sampler over the wire sampled with its first weights)."""
    from creditrl.asynchronous.settings import start_versions
    from creditrl.asynchronous.weight_server import LearnerChannel

    cfg = load_config(overrides=[
        f"trainer.output_dir={tmp_path}", "asynchronous.weight_channel=wire",
        f"asynchronous.weight_port={free_port()}"])  # fmt: skip
    model = tiny(0)
    first = LearnerChannel(cfg, 5557, lambda line, **_: None, {})
    first.publish(model, 3)
    first.close()
    first.lock.release()
    said: list[str] = []
    channel = LearnerChannel(cfg, 5557, lambda line, **_: said.append(line), {})
    try:
        assert channel.newest() == 3 and channel.wire.newest() is None
        assert start_versions(cfg, channel, model, 5, said.append) == 5
        assert channel.newest() == 5 and channel.wire.newest() == 5
        assert said[0].startswith("learner: serving weights over the wire on tcp://127.0.0.1:")
        name, why = wire_hash()
        assert said[0].endswith(f"weight_channel=wire; chunks hashed with {name}: {why})")
        assert channel.wire.hash == name
    finally:
        channel.close()
        channel.lock.release()


def test_a_weight_port_in_use_is_one_line_or_said_and_served_without(tmp_path: Path) -> None:
    """weight_channel=wire: a weight port that cannot be bound is a one-line ConfigError naming
    the key, and the weight folder is released; auto (on a host that is not loopback): said in
    one line, and the learner publishes to the folder alone."""
    from creditrl.asynchronous.weight_server import LearnerChannel

    context = zmq.Context()
    taken = context.socket(zmq.ROUTER)
    taken.setsockopt(zmq.LINGER, 0)
    port = taken.bind_to_random_port("tcp://0.0.0.0")
    try:
        cfg = load_config(overrides=[
            f"trainer.output_dir={tmp_path}", "asynchronous.weight_channel=wire",
            f"asynchronous.weight_port={port}"])  # fmt: skip
        with pytest.raises(ConfigError, match=rf"^asynchronous.weight_port: cannot serve weights "
                                              rf"on tcp://127.0.0.1:{port}: ") as err:  # fmt: skip
            LearnerChannel(cfg, 5557, lambda line, **_: None, {})
        assert "\n" not in str(err.value)
        cfg = load_config(overrides=[
            f"trainer.output_dir={tmp_path}", "asynchronous.host=0.0.0.0",
            "asynchronous.allow_insecure=true", f"asynchronous.weight_port={port}"])  # fmt: skip
        said: list[str] = []
        channel = LearnerChannel(cfg, 5557, lambda line, **_: said.append(line), {})
        assert channel.wire is None and channel.server is None
        assert said == [f"learner: cannot serve weights on tcp://0.0.0.0:{port} (Address already "
                        "in use); samplers that cannot read the weight folder get none "
                        "(asynchronous.weight_port)"]  # fmt: skip
        channel.publish(tiny(0), 1)
        assert channel.newest() == 1
        channel.close()
        channel.lock.release()
    finally:
        taken.close()
        context.term()


def test_a_sampler_key_folder_missing_its_pair_is_one_line(tmp_path: Path) -> None:
    """A sampler's key folder needs only server.key and sampler.key_secret; without the
    secret, or with a file that is not a key, one line naming asynchronous.curve_keys_dir."""
    keys = make_curve_keys(tmp_path / "keys")
    only = tmp_path / "sampler_keys"
    only.mkdir()
    for name in ("server.key", "sampler.key_secret"):
        (only / name).write_bytes((keys / name).read_bytes())
    assert len(sampler_curve_keys(AsyncConfig(curve_keys_dir=str(only)))) == 3
    (only / "sampler.key_secret").unlink()
    with pytest.raises(ConfigError, match=r"^asynchronous.curve_keys_dir: CURVE key .*missing"):
        sampler_curve_keys(AsyncConfig(curve_keys_dir=str(only)))
    (only / "sampler.key_secret").write_text("not a key\n")
    with pytest.raises(ConfigError, match=r"^asynchronous.curve_keys_dir: ") as err:
        sampler_curve_keys(AsyncConfig(curve_keys_dir=str(only)))
    assert "\n" not in str(err.value)

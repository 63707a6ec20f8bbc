"""Weights over the wire between the learner and its samplers (``asynchronous.weight_channel``).

The learner serves its ``WirePublisher``'s publications on a second ZeroMQ port (``weight_port``:
``asynchronous.weight_port``, 0: the learner's port + 1), CURVE-protected as the episodes'
port is, from a thread of its own (``WeightServer``), so a sampler fetches weights while the
learner trains. A sampler's ``WeightClient`` (a ``creditrl.weights.wire.WireSource``) asks over
a DEALER socket, ``manifest_request`` then ``chunk_request`` per chunk
(``creditrl.asynchronous.messages``), keeping a window of ``WINDOW`` chunk requests in flight
(so the learner sends the next chunks while the sampler checks the last; each answer matched to
its request by ``rid``, in any order), and waits ``weight_timeout_s`` for each next answer;
what it cannot use is refused and counted (``rejected``), and its ``WireChannel`` keeps the
last good weights. Both sockets keep ``asynchronous.heartbeat_s``'s heartbeats
(``transport.set_heartbeats``): the learner drops a vanished sampler's connection and the
answers queued for it, and a sampler whose learner vanished (its TCP connection never closed)
drops the connection and reconnects once the learner answers again; a single chunk must cross
within the heartbeat timeout. A chunk travels without a copy in Python on either side: the
server sends a view of the publication, the client hands on a read-only view of the frame it
received.

Bounds: a request is at most ``_MAX_REQUEST`` bytes (libzmq's ``MAXMSGSIZE``: a larger one
disconnects its sender unread); an answer at most the sampler's ``WireLimits.max_chunk_bytes``
plus 1 MiB of header; both are decoded by ``messages.decode`` with their fields checked, never
pickled. ``LearnerChannel`` is the learner's channel: the folder, and the weight port when it
serves the wire (``serves_wire``: ``weight_channel=wire``, or ``auto`` with a host that is not
loopback). ``sampler_channel`` / ``choose_channel`` pick a sampler's (``auto``: the folder when
its run lock is visible here or the learner serves no wire, else the wire) and say which in
one line.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Iterable, Iterator
from contextlib import closing
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from creditrl.asynchronous.messages import (
    WEIGHT_REPLIES,
    WEIGHT_REQUESTS,
    Message,
    MessageError,
    decode,
    weight_message,
)
from creditrl.asynchronous.settings import run_id, weight_channel, weight_root
from creditrl.asynchronous.transport import (
    endpoint,
    sampler_curve_keys,
    server_curve_keys,
    set_heartbeats,
    start_authenticator,
)
from creditrl.config import Config
from creditrl.config.schema import AsyncConfig
from creditrl.errors import ConfigError
from creditrl.hosts import is_loopback
from creditrl.run_lock import LOCK_NAME
from creditrl.weights import (
    ChosenLater,
    FolderChannel,
    WeightChannel,
    WireChannel,
    WireLimits,
    WirePublisher,
)
from creditrl.weights.hashing import wire_hash
from creditrl.weights.wire import REFUSALS, WireError

__all__ = [
    "LearnerChannel",
    "WeightClient",
    "WeightServer",
    "choose_channel",
    "learner_channel",
    "sampler_channel",
    "serves_wire",
    "weight_port",
    "weight_timeout_s",
    "wire_publisher",
]

log = logging.getLogger(__name__)
_MAX_REQUEST = 64 << 10  # a request is a short JSON header
_HEADER_SLACK = 1 << 20  # an answer's header beside its chunk
CHUNK_BYTES = 8 << 20
WINDOW = 4  # chunk requests a sampler keeps in flight
_ABANDONED_KEPT = 64  # requests given up on whose late answers are still dropped uncounted
COUNTS = ("weights_requests", "weights_chunks_sent", "weights_bytes_sent", "weights_refused",
          "weights_bad_requests", "weights_unsent")  # fmt: skip
_MIB = 1 << 20


def weight_port(cfg: AsyncConfig, port: int) -> int:
    """The learner's weight port: ``weight_port``, or 0: the episodes' ``port`` + 1 (0, a
    free one, when that is 0 too)."""
    return cfg.weight_port or (port + 1 if port else 0)


def serves_wire(cfg: Config) -> bool:
    """The learner serves weights over the wire: ``weight_channel=wire``, or ``auto`` with a
    host that is not loopback (samplers on other machines may not see its folder)."""
    a = cfg.asynchronous
    return a.weight_channel == "wire" or (a.weight_channel == "auto" and not is_loopback(a.host))


def wire_publisher(cfg: Config) -> WirePublisher:
    """The learner's publications for the wire: the newest 2 kept, LoRA models as
    ``lora_sync`` says, ``weight_rate_mb`` MB/s at most (0: unbounded)."""
    a = cfg.asynchronous
    return WirePublisher(a.lora_sync, keep=2, chunk_bytes=CHUNK_BYTES,
                         rate_bytes=a.weight_rate_mb * _MIB)  # fmt: skip


def weight_timeout_s(cfg: AsyncConfig) -> float:
    """How long a sampler waits for its next answer: ``ping_s``, plus the time the learner's
    rate limit may take to send every chunk asked for ahead of it (``WINDOW`` per sampler)."""
    if cfg.weight_rate_mb <= 0:
        return cfg.ping_s
    ahead = cfg.num_samplers * WINDOW + 1
    return cfg.ping_s + ahead * CHUNK_BYTES / (cfg.weight_rate_mb * _MIB)


class WeightServer:
    """The learner's weight port (module docstring): a thread answering manifest and chunk
    requests from ``publisher`` on ``tcp://host:port`` (0: a free port). ``context``: the
    episodes' socket's, whose CURVE authenticator then admits the same samplers; None: its own
    (with an authenticator of its own for ``curve_keys_dir``'s ``authorized/``). ``counts``
    (the learner's ``async/*`` counters, else its own; its keys are made here, so the thread
    only changes values while the learner reads them): ``weights_requests`` answered,
    ``weights_chunks_sent``, ``weights_bytes_sent``, ``weights_refused`` (a version or chunk it
    does not hold, answered so), ``weights_bad_requests`` (unreadable, unanswered; the reason
    logged), ``weights_unsent`` (an answer to a full queue)."""

    def __init__(self, cfg: AsyncConfig, publisher: WirePublisher, port: int, *,
                 context: zmq.Context | None = None,
                 counts: dict[str, int] | None = None) -> None:  # fmt: skip
        self.publisher = publisher
        self.own_context = context is None
        self.context = zmq.Context() if context is None else context
        self.auth: ThreadAuthenticator | None = None
        self.counts: dict[str, int] = defaultdict(int) if counts is None else counts
        for key in COUNTS:
            self.counts.setdefault(key, 0)
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.SNDHWM, cfg.hwm)
        self.sock.setsockopt(zmq.RCVHWM, cfg.hwm)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        set_heartbeats(self.sock, cfg)
        keys = server_curve_keys(cfg)
        try:
            if keys is not None:
                if self.own_context:
                    self.auth = start_authenticator(self.context, cfg)
                self.sock.curve_publickey, self.sock.curve_secretkey = keys
                self.sock.curve_server = True
            elif not is_loopback(cfg.host) and not cfg.allow_insecure:
                raise ValueError(
                    f"refusing to serve weights on {cfg.host!r} (not loopback) without CURVE: "
                    "set asynchronous.curve_keys_dir or asynchronous.allow_insecure=true"
                )
            if port == 0:
                port = self.sock.bind_to_random_port(endpoint(cfg.host, 0).rsplit(":", 1)[0])
            else:
                self.sock.bind(endpoint(cfg.host, port))
        except BaseException:
            self._close_sockets()
            raise
        self.port, self.address = port, endpoint(cfg.host, port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="weight-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.sock.poll(100):
                    continue
                identity = self.sock.recv()
                frames = []
                while self.sock.rcvmore:
                    frame = self.sock.recv(copy=False)
                    if len(frames) < 3:
                        frames.append(frame.bytes)
                    else:
                        frames.append(b"")  # counted as too many frames below, unread
                self._answer(identity, frames)
            except zmq.ZMQError as e:
                if self._stop.is_set() or e.errno == zmq.ETERM:
                    return
                log.exception("weight server: socket error")
            except Exception:  # one bad request never stops the server
                log.exception("weight server: failed on a request")
                self.counts["weights_bad_requests"] += 1

    def _answer(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            message = decode(frames)
            if message.kind not in WEIGHT_REQUESTS:
                raise MessageError(f"the weight port answers {WEIGHT_REQUESTS}, not {message.kind}")
        except MessageError as e:
            self.counts["weights_bad_requests"] += 1
            log.warning("weight server: refused a request (%s): %s", e.reason, e)
            return
        header, rid = message.header, message.header["rid"]
        try:
            if message.kind == "manifest_request":
                version, newest = header["version"], self.publisher.newest()
                manifest = None if version is None else self.publisher.manifest(version)
                reply = weight_message("manifest", rid=rid, newest=newest, manifest=manifest)
            else:
                data = self.publisher.chunk_view(header["version"], header["index"])
                reply = weight_message("chunk", data, rid=rid, version=header["version"],
                                       index=header["index"])  # fmt: skip
                self.counts["weights_chunks_sent"] += 1
                self.counts["weights_bytes_sent"] += len(data)
        except WireError as e:
            self.counts["weights_refused"] += 1
            reply = weight_message("weights_refused", rid=rid, reason=e.reason, detail=str(e)[:200])
        self.counts["weights_requests"] += 1
        try:
            self.sock.send_multipart([identity, *reply], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.counts["weights_unsent"] += 1  # its queue is full: it asks again after its timeout

    def close(self) -> None:
        """Stop the thread, then close the socket (and the context and authenticator it owns)."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self.sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        if self.own_context:
            self.context.term()


class LearnerChannel(FolderChannel):
    """The learner's weight channel: the weight folder (``FolderChannel``, claimed as run
    ``run_id``), and with ``serves_wire`` a ``WirePublisher`` served on the weight port from
    the start (said in one line through ``say``; a port that cannot be bound is a one-line
    ConfigError with ``weight_channel=wire``, said and served without otherwise). ``publish``
    goes to both; ``close`` waits for both and stops the server."""

    def __init__(self, cfg: Config, port: int, say: Any, counts: dict[str, int]) -> None:
        a = cfg.asynchronous
        super().__init__(weight_root(cfg), publish=True, keep=a.keep_weight_versions,
                         lora_sync=a.lora_sync, run=run_id(cfg))  # fmt: skip
        self.wire: WirePublisher | None = None
        self.server: WeightServer | None = None
        if not serves_wire(cfg):
            return
        wanted = endpoint(a.host, weight_port(a, port))
        try:
            self.server = WeightServer(a, wire_publisher(cfg), weight_port(a, port), counts=counts)
        except zmq.ZMQError as e:
            why = os.strerror(e.errno)
            if a.weight_channel == "wire":
                self.lock.release()
                raise ConfigError(
                    f"asynchronous.weight_port: cannot serve weights on {wanted}: {why}"
                ) from None
            say(
                f"learner: cannot serve weights on {wanted} ({why}); samplers that "
                "cannot read the weight folder get none (asynchronous.weight_port)",
                markup=False,
            )
            return
        self.wire = self.server.publisher
        hashed = f"{self.wire.hash}: {wire_hash()[1]}"
        say(f"learner: serving weights over the wire on {self.server.address} "
            f"(asynchronous.weight_channel={a.weight_channel}; chunks hashed with {hashed})",
            markup=False)  # fmt: skip

    def publish(self, model: Any, version: int, *, background: bool = False) -> None:
        super().publish(model, version, background=background)
        if self.wire is not None:
            self.wire.publish(model, version, background=background)

    def wait(self) -> None:
        super().wait()
        if self.wire is not None:
            self.wire.wait()

    def close(self) -> None:
        """Wait for the publications in flight, then stop serving."""
        self.wait()
        if self.server is not None:
            self.server.close()


def learner_channel(
    cfg: Config, port: int | None, say: Any, counts: dict[str, int]
) -> LearnerChannel:
    """Learner rank 0's weight channel (``LearnerChannel``) for episodes on ``port`` (None:
    ``asynchronous.port``)."""
    return LearnerChannel(cfg, cfg.asynchronous.port if port is None else port, say, counts)


class WeightClient:
    """A sampler's ``WireSource`` over a DEALER to the learner's weight port ``address`` (module
    docstring). ``newest``, ``manifest`` and ``chunk`` send one request and wait ``timeout_s``
    for its answer; ``chunks`` keeps up to ``window`` chunk requests in flight and waits at
    most ``timeout_s`` for each next answer. No answer in time is a ``ConnectionError``; an
    answer is matched to its request by ``rid``: one to no request in flight, or one that does
    not decode, is skipped and counted (``rejected``); the learner's refusal, or an answer to a
    request that names another version or chunk than it asked for, is a ``WireError``.
    Requests left in flight when a call ends so (the last ``_ABANDONED_KEPT``) are abandoned:
    their late answers are dropped uncounted. A chunk's bytes are not copied: a read-only view
    of the frame libzmq received. Thread-safe (one call at a time)."""

    def __init__(
        self,
        cfg: AsyncConfig,
        sampler_id: str,
        address: str,
        *,
        limits: WireLimits | None = None,
        timeout_s: float | None = None,
        window: int = WINDOW,
    ) -> None:
        if type(window) is not int or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        self.address, self.limits, self.window = address, limits or WireLimits(), window
        self.timeout_s = weight_timeout_s(cfg) if timeout_s is None else timeout_s
        self.rejected: dict[str, int] = dict.fromkeys(REFUSALS, 0)
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 2 * window + 2)
        self.sock.setsockopt(zmq.RCVHWM, 2 * window + 2)
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_chunk_bytes + _HEADER_SLACK)
        self.sock.setsockopt(zmq.IDENTITY, f"{sampler_id}.w".encode())
        set_heartbeats(self.sock, cfg)
        keys = sampler_curve_keys(cfg)
        if keys is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = keys
        self.sock.connect(address)
        self._lock = threading.Lock()
        self._rid = 0
        self._abandoned: OrderedDict[int, None] = OrderedDict()

    def newest(self) -> int | None:
        """The learner's newest published version (a short answer: asked at every refresh)."""
        return self._ask("manifest_request", version=None).header["newest"]

    def manifest(self, version: int) -> dict[str, Any]:
        """Version ``version``'s manifest fields (checked by the ``WireChannel``)."""
        manifest = self._ask("manifest_request", version=version).header["manifest"]
        if manifest is None:
            raise WireError(f"the learner sent no manifest for version {version}", "version")
        return manifest

    def chunk(self, version: int, index: int) -> memoryview:
        """Chunk ``index`` of ``version``."""
        with closing(self.chunks(version, [index])) as answers:
            return next(answers)[1]

    def chunks(self, version: int, indices: Iterable[int]) -> Iterator[tuple[int, memoryview]]:
        """(index, bytes) for each of ``indices`` of ``version`` as the answers arrive (any
        order), ``window`` requests in flight at most (class docstring)."""
        todo = deque(indices)
        with self._lock:
            asked: dict[int, int] = {}
            try:
                while todo or asked:
                    while todo and len(asked) < self.window:
                        send = self._try_send if asked else self._send
                        rid = send("chunk_request", version=version, index=todo[0])
                        if rid is None:
                            break  # its queue is full: asked again once an answer is in
                        asked[rid] = todo.popleft()
                    reply, data = self._await(asked, "chunk")
                    index = asked.pop(reply.header["rid"])
                    if (reply.header["version"], reply.header["index"]) != (version, index):
                        raise WireError(
                            f"asked for chunk {index} of version {version}, got chunk "
                            f"{reply.header['index']} of version {reply.header['version']}",
                            "order",
                        )
                    yield index, data
            finally:
                self._abandon(asked)

    def _ask(self, kind: str, **fields: Any) -> Message:
        """One manifest request's answer."""
        with self._lock:
            rid = self._send(kind, **fields)
            asked = {rid: 0}
            try:
                reply = self._await(asked, "manifest")[0]
                del asked[rid]
                return reply
            finally:
                self._abandon(asked)

    def _send(self, kind: str, **fields: Any) -> int:
        """Send one request; its ``rid``; a ``ConnectionError`` when libzmq cannot queue it
        (no connection, a full queue)."""
        rid = self._try_send(kind, **fields)
        if rid is None:
            raise ConnectionError(f"the learner's weight port {self.address} takes no request")
        return rid

    def _try_send(self, kind: str, **fields: Any) -> int | None:
        """Send one request if libzmq can queue it now; its ``rid``, else None."""
        self._rid += 1
        try:
            self.sock.send_multipart(weight_message(kind, rid=self._rid, **fields), zmq.NOBLOCK)
        except zmq.Again:
            return None
        return self._rid

    def _await(self, asked: dict[int, int], expected: str) -> tuple[Message, memoryview | None]:
        """The next answer to one of ``asked`` (by ``rid``), within ``timeout_s``, and a chunk's
        bytes; a refused request is taken out of ``asked``, an answered one left to the
        caller."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise ConnectionError(
                    f"no answer from the learner's weight port {self.address} within "
                    f"{self.timeout_s:.0f}s (asynchronous.weight_port)"
                )
            received = self._receive()
            if received is None:
                continue
            reply, data = received
            rid = reply.header["rid"]
            if rid not in asked:
                if rid in self._abandoned:
                    del self._abandoned[rid]  # a late answer to a request given up on
                    continue
                self.rejected["order"] += 1
                log.warning("weights over the wire: skipped an answer to request %s (asked %s)",
                            rid, sorted(asked))  # fmt: skip
                continue
            if reply.kind == "weights_refused":
                del asked[rid]
                raise WireError(f"the learner refused: {reply.header['detail']}", "version")
            if reply.kind != expected:
                del asked[rid]
                raise WireError(f"asked for a {expected}, got a {reply.kind}", "order")
            return reply, data

    def _abandon(self, asked: dict[int, int]) -> None:
        for rid in asked:
            self._abandoned[rid] = None
        while len(self._abandoned) > _ABANDONED_KEPT:
            self._abandoned.popitem(last=False)

    def _receive(self) -> tuple[Message, memoryview | None] | None:
        """The next answer and, for a chunk, a read-only view of its bytes (``decode`` checks
        the frame count and header; the bytes are checked by their hash, not copied here)."""
        frames = self.sock.recv_multipart(copy=False)
        try:
            message = decode([f.bytes for f in frames[:2]] + [b""] * len(frames[2:]))
        except MessageError as e:
            self.rejected["message"] += 1
            log.warning("weights over the wire: skipped an answer that does not decode: %s", e)
            return None
        if message.kind not in WEIGHT_REPLIES:
            self.rejected["message"] += 1
            log.warning("weights over the wire: skipped a %r message", message.kind)
            return None
        return message, frames[2].buffer.toreadonly() if message.kind == "chunk" else None

    def close(self) -> None:
        """Close the socket and its context."""
        self.sock.close(linger=0)
        self.context.term()


def sampler_channel(cfg: Config) -> WeightChannel:
    """A sampler's weight channel: the folder's with ``weight_channel=folder`` or an engine
    that reads published folders itself; else one chosen once the learner has answered
    (``choose_channel``)."""
    from creditrl.rollout import engine_traits

    sampler_curve_keys(cfg.asynchronous)  # a malformed key in the environment: said now
    folder_engine = engine_traits(cfg.rollout.engine).weights_via == "folder"
    if cfg.asynchronous.weight_channel == "folder" or folder_engine:
        return weight_channel(cfg)
    return ChosenLater()


def folder_visible(cfg: Config) -> str | None:
    """None when the learner's weight folder (``weight_root``) is visible here, with its run
    lock in it (the learner holds the folder from start-up); else why not, in words."""
    root = weight_root(cfg)
    if not os.access(root, os.R_OK | os.X_OK) or not root.is_dir():
        return f"{root} cannot be read here"
    if not (root / LOCK_NAME).exists():
        return f"{root} holds no learner's {LOCK_NAME}"
    return None


def choose_channel(
    cfg: Config, channel: ChosenLater, sampler_id: str, port: int, say: Any
) -> WeightClient | None:
    """Pick ``channel``'s implementation once the learner has answered (its folder is claimed
    by then) and say it in one line through ``say``: the wire to the learner's weight port
    with ``weight_channel=wire``, or with ``auto`` when the folder is not visible here
    (``folder_visible``) and the learner serves the wire (``serves_wire``: a host that is not
    loopback); else the folder. Returns the wire's client, for the sampler to close."""
    a = cfg.asynchronous
    hidden = folder_visible(cfg) if a.weight_channel == "auto" else "set"
    if hidden is None or not serves_wire(cfg):
        channel.choose(weight_channel(cfg))
        why = a.weight_channel
        if hidden is not None:  # auto, the folder hidden, a loopback learner serving no wire
            why += (f": {hidden}, and a learner on {a.host} serves no wire; set "
                    "asynchronous.weight_channel=wire on the learner and its samplers")  # fmt: skip
        say(f"sampler {sampler_id}: weights from the folder {weight_root(cfg)} "
            f"(asynchronous.weight_channel={why})")  # fmt: skip
        return None
    client = WeightClient(a, sampler_id, endpoint(a.host, weight_port(a, port)))
    channel.choose(WireChannel(client))
    why = "wire" if a.weight_channel == "wire" else f"auto: {hidden}"
    say(f"sampler {sampler_id}: weights over the wire from {client.address} "
        f"(asynchronous.weight_channel={why})")  # fmt: skip
    return client

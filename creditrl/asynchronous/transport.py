"""ZeroMQ sockets between samplers and the learner: bounded, loopback by default, optionally
CURVE-authenticated. Only bytes cross them (``messages.encode`` / ``messages.decode``).

The learner binds a ROUTER at ``tcp://host:port``; each sampler connects a DEALER whose
routing identity is its sampler id, so the learner can acknowledge to the sampler that sent a
group. The ROUTER's ``MAXMSGSIZE`` (``max_message_bytes``) makes libzmq drop, before Python
sees it, any frame larger than that, and disconnect its sender (which reconnects); a socket
monitor counts such disconnects (``LearnerSocket.disconnects``). libzmq has no limit on the
frames of a message and hands a message over only whole, so the learner reads it frame by
frame and lets go of every frame past the three a message may have without copying it.
``ROUTER_HANDOVER`` lets a restarted sampler take over its identity; with
``ROUTER_MANDATORY`` an acknowledgement to a sampler that is gone fails visibly instead of
vanishing. Every socket has send and receive high-water marks of ``hwm`` messages, so a slow
learner blocks its samplers (back-pressure) instead of growing memory without bound.

Heartbeats (``heartbeat_s``): each socket (the weight port's too) sends a ZeroMQ PING on every
connection that often,
and drops a connection that brings nothing (no frame, no PONG) for ``HEARTBEAT_MISSES`` of them
after a PING, as if it had closed: a peer whose machine vanished or whose process stopped,
its TCP connection never closed, is dropped like one that exited (the learner's monitor counts
it, its routing identity goes, and a send to it fails ``unreachable``); a sampler reconnects
to a learner that vanished once it answers again. libzmq answers PINGs on its own I/O thread,
so a busy process is not dropped; a single frame must cross within that timeout, though (its
PONG waits behind it). No TTL is sent: each side times out on its own PINGs.

CURVE (``curve_keys_dir``, laid out by ``make_curve_keys``): the learner holds
``server.key_secret`` and accepts only the public keys in ``authorized/``; a sampler holds
``sampler.key_secret`` and the learner's ``server.key`` (a sampler's machine needs only these
two files), or the environment's ``CREDITRL_CURVE_SERVER_PUBLIC`` (the learner's public key)
and ``CREDITRL_CURVE_SECRET`` (its own secret key; the public one follows from it), Z85 text
as in the key files, which then win over the folder (``sampler_curve_keys``). The learner
likewise takes ``CREDITRL_CURVE_SERVER_SECRET`` (its secret key) and
``CREDITRL_CURVE_AUTHORIZED`` (the samplers' public keys, separated by commas or spaces) from
the environment (``LEARNER_CURVE_ENV``, both or neither) over the folder (``server_curve_keys``,
``start_authenticator``): how the Ray launcher hands an actor its keys without a shared disk.
Binding anything but a loopback address without CURVE is refused unless ``allow_insecure`` is
set.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message
from zmq.utils.z85 import Z85CHARS

from creditrl.asynchronous.messages import Message, MessageError, check_sampler_id, decode
from creditrl.asynchronous.validation import DEFAULT_JSON_LIMITS
from creditrl.bounded_json import JsonLimits
from creditrl.config.schema import HEARTBEAT, HEARTBEAT_MISSES, AsyncConfig
from creditrl.errors import ConfigError
from creditrl.hosts import is_loopback, url_host

__all__ = [
    "CURVE_ENV",
    "HEARTBEAT_MISSES",
    "LEARNER_CURVE_ENV",
    "LearnerSocket",
    "SamplerSocket",
    "curve_env",
    "endpoint",
    "heartbeat_ms",
    "make_curve_keys",
    "sampler_curve_keys",
    "server_curve_keys",
    "set_heartbeats",
    "start_authenticator",
    "uses_curve",
]

log = logging.getLogger(__name__)
_MAX_FRAMES = 3  # PROTOCOL, header, payload: the most frames a message has (after the identity)
CURVE_ENV = ("CREDITRL_CURVE_SERVER_PUBLIC", "CREDITRL_CURVE_SECRET")
LEARNER_CURVE_ENV = ("CREDITRL_CURVE_SERVER_SECRET", "CREDITRL_CURVE_AUTHORIZED")
_MAX_AUTHORIZED = 4096  # sampler public keys the learner's environment may list
_Z85 = frozenset(Z85CHARS.decode())


def endpoint(host: str, port: int) -> str:
    """``tcp://host:port`` (IPv6 addresses in brackets)."""
    return f"tcp://{url_host(host)}:{port}"


def make_curve_keys(directory: str | Path) -> Path:
    """Create a CURVE key set: ``server.key(_secret)``, ``sampler.key(_secret)`` and
    ``authorized/sampler.key``. Returns the directory."""
    directory = Path(directory)
    (directory / "authorized").mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(str(directory), "server")
    public, _ = zmq.auth.create_certificates(str(directory), "sampler")
    shutil.copy(public, directory / "authorized" / "sampler.key")
    return directory


def _load_key(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise FileNotFoundError(
            f"CURVE key {path} is missing (create a key set with `creditrl async --make-keys DIR`)"
        )
    public, private = zmq.auth.load_certificate(str(path))
    if secret and private is None:
        raise ValueError(f"{path} holds no secret key")
    return public, private


def _z85_key(value: str, name: str) -> bytes:
    if len(value) != 40 or not set(value) <= _Z85:
        raise ConfigError(
            f"environment variable {name} is not a CURVE key: 40 Z85 characters, as on the "
            "key files' public-key / secret-key lines (`creditrl async --make-keys DIR`)"
        )
    return value.encode()


def _env_key(name: str) -> bytes:
    return _z85_key(os.environ[name].strip(), name)


def _env_pair(names: tuple[str, str], who: str) -> bool:
    """Whether both of ``names`` are set in the environment (neither: False; one: ConfigError)."""
    given = [name for name in names if os.environ.get(name)]
    missing = [name for name in names if name not in given]
    if given and missing:
        raise ConfigError(f"{given[0]} is set but {missing[0]} is not: {who} needs both")
    return bool(given)


def _env_authorized() -> frozenset[bytes]:
    """The samplers' public keys in ``CREDITRL_CURVE_AUTHORIZED`` (commas or spaces between;
    at most ``_MAX_AUTHORIZED``; each a CURVE key, else a one-line ConfigError)."""
    name = LEARNER_CURVE_ENV[1]
    words = os.environ[name].replace(",", " ").split()
    if len(words) > _MAX_AUTHORIZED:
        raise ConfigError(f"{name} lists {len(words)} keys, more than {_MAX_AUTHORIZED}")
    return frozenset(_z85_key(word, f"{name} (key {i})") for i, word in enumerate(words))


def uses_curve(cfg: AsyncConfig) -> bool:
    """Whether the learner's sockets are CURVE servers: ``curve_keys_dir`` or its keys in the
    environment (``LEARNER_CURVE_ENV``)."""
    return bool(cfg.curve_keys_dir) or _env_pair(LEARNER_CURVE_ENV, "the learner")


def sampler_curve_keys(cfg: AsyncConfig) -> tuple[bytes, bytes, bytes] | None:
    """(public, secret, the learner's public) key a sampler connects with: from the
    environment (``CURVE_ENV``, both or neither; a one-line ConfigError naming a variable
    that is missing or not a key), else ``curve_keys_dir``'s ``sampler.key_secret`` and
    ``server.key`` (one missing or not a key file: a one-line ConfigError); None: plain TCP."""
    if _env_pair(CURVE_ENV, "a sampler"):
        server, secret = (_env_key(name) for name in CURVE_ENV)
        return zmq.curve_public(secret), secret, server
    if not cfg.curve_keys_dir:
        return None
    keys = Path(cfg.curve_keys_dir)
    try:
        public, secret = _load_key(keys / "sampler.key_secret", secret=True)
        server, _ = _load_key(keys / "server.key", secret=False)
    except (OSError, ValueError) as e:  # missing, unreadable, not a key file: one line
        raise ConfigError(f"asynchronous.curve_keys_dir: {' '.join(str(e).split())}") from None
    return public, secret, server


def server_curve_keys(cfg: AsyncConfig) -> tuple[bytes, bytes] | None:
    """(public, secret) key of the learner: ``CREDITRL_CURVE_SERVER_SECRET`` (the public one
    follows from it), else ``curve_keys_dir``'s ``server.key_secret``; None: plain TCP."""
    if _env_pair(LEARNER_CURVE_ENV, "the learner"):
        secret = _env_key(LEARNER_CURVE_ENV[0])
        return zmq.curve_public(secret), secret
    if not cfg.curve_keys_dir:
        return None
    return _load_key(Path(cfg.curve_keys_dir) / "server.key_secret", secret=True)


def curve_env(cfg: AsyncConfig) -> tuple[dict[str, str], dict[str, str]]:
    """The environments that carry ``curve_keys_dir``'s keys to a learner and to a sampler on
    a machine without the folder: the learner's secret key and every ``authorized/*.key``
    (``LEARNER_CURVE_ENV``); the learner's public key and the sampler's secret key
    (``CURVE_ENV``). Both empty without ``curve_keys_dir``; a key missing or not a key file:
    a one-line ConfigError."""
    if not cfg.curve_keys_dir:
        return {}, {}
    keys = Path(cfg.curve_keys_dir)
    try:
        server_public, server_secret = _load_key(keys / "server.key_secret", secret=True)
        _, sampler_secret = _load_key(keys / "sampler.key_secret", secret=True)
        admitted = [_load_key(path, secret=False)[0]
                    for path in sorted((keys / "authorized").glob("*.key"))]  # fmt: skip
    except (OSError, ValueError) as e:
        raise ConfigError(f"asynchronous.curve_keys_dir: {' '.join(str(e).split())}") from None
    assert server_secret is not None and sampler_secret is not None  # _load_key(secret=True)
    learner = {LEARNER_CURVE_ENV[0]: server_secret.decode(),
               LEARNER_CURVE_ENV[1]: " ".join(key.decode() for key in admitted)}  # fmt: skip
    sampler = {CURVE_ENV[0]: server_public.decode(), CURVE_ENV[1]: sampler_secret.decode()}
    return learner, sampler


class _KeySet:
    """A ZAP credentials provider admitting the CURVE public keys (Z85) it holds."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def start_authenticator(context: zmq.Context, cfg: AsyncConfig) -> ThreadAuthenticator:
    """A started ZAP authenticator on ``context`` admitting the samplers' public keys: those
    in ``CREDITRL_CURVE_AUTHORIZED`` when the learner's keys come from the environment, else
    the ``*.key`` files in ``curve_keys_dir``'s ``authorized/``."""
    from_env = _env_pair(LEARNER_CURVE_ENV, "the learner")
    admitted = _KeySet(_env_authorized()) if from_env else None  # a bad key: said before start
    auth = ThreadAuthenticator(context)
    auth.start()
    if admitted is not None:
        auth.configure_curve_callback(domain="*", credentials_provider=admitted)
    else:
        auth.configure_curve(
            domain="*", location=str(Path(cfg.curve_keys_dir or "") / "authorized")
        )
    return auth


def heartbeat_ms(cfg: AsyncConfig) -> tuple[int, int]:
    """(interval, timeout) of the ZeroMQ heartbeats in milliseconds: ``heartbeat_s`` to the
    millisecond, and ``HEARTBEAT_MISSES`` of it (ValueError outside ``HEARTBEAT``)."""
    if not HEARTBEAT.holds(cfg.heartbeat_s):
        raise ValueError(f"asynchronous.heartbeat_s must be {HEARTBEAT.text()}")
    interval = round(cfg.heartbeat_s * 1000)
    return interval, HEARTBEAT_MISSES * interval


def set_heartbeats(sock: zmq.Socket, cfg: AsyncConfig) -> None:
    """Turn on ``sock``'s ZeroMQ heartbeats (``heartbeat_ms``; module docstring): the episodes'
    sockets and the weight port's (``weight_server``) both."""
    interval, timeout = heartbeat_ms(cfg)
    sock.setsockopt(zmq.HEARTBEAT_IVL, interval)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout)


def _configure(sock: zmq.Socket, cfg: AsyncConfig) -> None:
    """High-water marks of ``hwm`` messages, no linger, and heartbeats (``set_heartbeats``)."""
    if cfg.hwm < 1:
        raise ValueError(f"asynchronous.hwm must be >= 1, got {cfg.hwm}")
    sock.setsockopt(zmq.SNDHWM, cfg.hwm)
    sock.setsockopt(zmq.RCVHWM, cfg.hwm)
    sock.setsockopt(zmq.LINGER, 0)
    set_heartbeats(sock, cfg)


class LearnerSocket:
    """The learner's ROUTER: receives hello/episodes, sends welcome/ack/stop by sampler id.

    ``max_message_bytes`` > 0 sets libzmq's ``MAXMSGSIZE`` (per frame); ``json_limits`` bound
    the JSON of a group before it is decoded (``settings.json_limits``)."""

    def __init__(
        self,
        cfg: AsyncConfig,
        port: int | None = None,
        max_message_bytes: int = 0,
        json_limits: JsonLimits = DEFAULT_JSON_LIMITS,
    ) -> None:
        port = cfg.port if port is None else port
        self.json_limits = json_limits
        self.unreachable = False  # the last failed send found its sampler not connected
        self.context = zmq.Context()
        self.auth: ThreadAuthenticator | None = None
        self.sock = self.context.socket(zmq.ROUTER)
        _configure(self.sock, cfg)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if max_message_bytes > 0:
            self.sock.setsockopt(zmq.MAXMSGSIZE, int(max_message_bytes))
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        keys = server_curve_keys(cfg)
        if keys is not None:
            public, secret = keys
            self.auth = start_authenticator(self.context, cfg)
            self.sock.curve_secretkey, self.sock.curve_publickey = secret, public
            self.sock.curve_server = True
        elif not is_loopback(cfg.host) and not cfg.allow_insecure:
            self.close()
            raise ValueError(
                f"refusing to bind {cfg.host!r} (not loopback) without CURVE: set "
                "asynchronous.curve_keys_dir (see `creditrl async --make-keys DIR`) or "
                "asynchronous.allow_insecure=true"
            )
        if port == 0:
            self.port = self.sock.bind_to_random_port(endpoint(cfg.host, 0).rsplit(":", 1)[0])
        else:
            self.sock.bind(endpoint(cfg.host, port))
            self.port = port
        self.address = endpoint(cfg.host, self.port)

    @property
    def security(self) -> str:
        """``CURVE`` or ``no CURVE``, as the learner says where it listens."""
        return "CURVE" if self.auth is not None else "no CURVE"

    def recv(self, timeout_s: float) -> tuple[str, Message] | None:
        """The next (sampler id, message), or None after ``timeout_s``. A malformed message
        raises MessageError whose ``sender`` is the routing identity it came from (arbitrary
        bytes kept by ``surrogateescape``, so ``send`` can answer it)."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        identity = self.sock.recv()
        frames = []
        while self.sock.rcvmore and len(frames) < _MAX_FRAMES:
            frames.append(self.sock.recv())
        extra = 0
        while self.sock.rcvmore:  # copy=False: the frame is freed unread, never copied
            self.sock.recv(copy=False)
            extra += 1
        sender = identity.decode("utf-8", errors="surrogateescape")
        try:
            if extra:
                raise MessageError(
                    f"a message has at most {_MAX_FRAMES} frames, got {_MAX_FRAMES + extra} "
                    "(the rest dropped unread)"
                )
            message = decode(frames, self.json_limits)
            check_sampler_id(sender)
            claimed = message.header.get("sampler_id", sender)
            if claimed != sender:
                seq = message.header["seq"] if message.kind == "episodes" else None
                raise MessageError(
                    f"message from {sender!r} claims sampler_id {claimed!r:.80}", "header", seq
                )
        except MessageError as e:
            e.sender = sender
            raise
        except Exception as e:  # a check that breaks rejects, never crashes
            log.exception("decoding a message from %r failed", sender)
            err = MessageError(f"decoding failed: {type(e).__name__}: {e}", "error")
            err.sender = sender
            raise err from e
        return sender, message

    def disconnects(self) -> int:
        """Peer disconnections since the last call (a sampler exiting, one silent past the
        heartbeat timeout, or libzmq dropping a peer that sent a frame over ``MAXMSGSIZE``)."""
        count = 0
        while self.monitor.poll(0):
            if recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED:
                count += 1
        return count

    def send(self, sampler_id: str, frames: list[bytes]) -> bool:
        """Send to ``sampler_id``; False (logged) when it is not connected or its queue is full
        (``unreachable`` then says which: True when it is not connected)."""
        identity = sampler_id.encode("utf-8", errors="surrogateescape")
        self.unreachable = False
        try:
            self.sock.send_multipart([identity, *frames], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            self.unreachable = e.errno == zmq.EHOSTUNREACH
            log.warning("could not send to sampler %r: %s", sampler_id, e.strerror)
            return False

    def close(self) -> None:
        """Close the socket, its monitor, the authenticator and the context."""
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.context.term()


class SamplerSocket:
    """A sampler's DEALER connected to the learner, identified by ``sampler_id``."""

    def __init__(self, cfg: AsyncConfig, sampler_id: str, port: int | None = None) -> None:
        port = cfg.port if port is None else port
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        _configure(self.sock, cfg)
        self.sock.setsockopt(zmq.IDENTITY, check_sampler_id(sampler_id).encode())
        keys = sampler_curve_keys(cfg)
        if keys is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = keys
        self.address = endpoint(cfg.host, port)
        self.sock.connect(self.address)

    def send(self, frames: list[bytes], timeout_s: float) -> bool:
        """Queue a message; False when the high-water mark stays reached for ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
                return True
            except zmq.Again:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.sock.poll(int(min(left, 0.1) * 1000), zmq.POLLOUT)

    def recv(self, timeout_s: float) -> Message | None:
        """The next message from the learner, or None after ``timeout_s``."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return decode(self.sock.recv_multipart())

    def close(self) -> None:
        """Close the socket and its context."""
        self.sock.close(linger=0)
        self.context.term()

"""Weights over the wire: a publication as checksummed chunks that a sampler fetches through a
connection it already has (no shared disk), loaded only when complete, resumable after a
dropped connection, never pickled.

A publication (``publishable_state``: ``full``, ``merged`` or ``adapter`` tensors) is one
safetensors buffer (``creditrl.weights.packing``: each tensor copied once, into place; tensors
that share memory once, aliases in its metadata), cut into ``chunk_bytes`` pieces. Its
``Manifest`` names the version, kind, total size, its hash (``creditrl.weights.hashing``:
SHA-256 or BLAKE2b-256, the faster on the learner's CPU), the digest of every chunk and the
digest of those digests in order (the whole's: ``whole_digest``; the bytes are hashed once,
chunk by chunk, and every chunk checked in place is the whole checked). Chunks are hashed on up to
``HASH_THREADS`` threads on both sides (hashlib lets go of the GIL while it hashes). The
sampling side checks the manifest against its ``WireLimits`` and its whole digest before asking
for a byte, and each chunk against its hash as it arrives (a bad one is dropped and asked for
again at the next ``load``), copying it into place in one buffer the size of the manifest;
what it already holds survives a dropped connection, so the next ``refresh`` asks only for the
missing chunks. The complete buffer is read as tensors that are views of it (its header
checked: ``packing.unpack``), and copied once more, into the model.

- ``WirePublisher`` (the learner's side): ``publish(model, version)`` packs the weights (the
  one copy, in the caller's thread) and hashes them (with ``background``: in a thread), and
  keeps the newest ``keep`` publications; ``manifest(version)``, ``chunk(version, index)`` and
  ``chunks(version, indices)`` serve them, at most ``rate_bytes`` a second (``RateLimit``).
- ``WireChannel`` (the sampler's side): a ``WeightChannel`` over a ``WireSource`` (anything with
  ``newest``, ``manifest`` and ``chunk``, and optionally ``chunks``, which may keep a window of
  requests in flight and answer in any order: the publisher itself in process, or the
  transport's requests to it, ``creditrl.asynchronous.weight_server.WeightClient``). Whatever
  comes back that is not what the publisher sends (a forged manifest, an answer to another
  request, a version it did not ask for, a chunk or a whole failing its hash, a mutable
  buffer, tensors that do not fit the model) is refused, counted by reason in ``rejected`` and
  logged; the model keeps the last good weights. A source that does not answer
  (``ConnectionError``) loads nothing and is said by ``unreadable()``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from creditrl.bounded_json import JsonLimits, loads_bounded
from creditrl.weights.background import OneInFlight
from creditrl.weights.channel import WeightChannel
from creditrl.weights.hashing import HASHES, digest, wire_hash
from creditrl.weights.packing import buffer, pack, unpack
from creditrl.weights.tensors import apply_state, distinct_tensors, is_peft, publishable_state

__all__ = [
    "HASH_THREADS",
    "KINDS",
    "REFUSALS",
    "Manifest",
    "RateLimit",
    "WireAssembler",
    "WireChannel",
    "WireError",
    "WireLimits",
    "WirePublisher",
    "WireSource",
    "check_fits",
    "chunk_digests",
    "decode_publication",
    "encode_publication",
    "whole_digest",
]

log = logging.getLogger(__name__)

KINDS = ("full", "merged", "adapter")
# why a sampler refused what came back (``WireError.reason``), counted in ``WireChannel.rejected``
REFUSALS = {
    "manifest": "a manifest that is not what a publisher sends (type, range, consistency)",
    "order": "an answer to another request than the one asked (late, or out of order)",
    "version": "a version other than the one asked for, or one the learner does not hold",
    "size": "a message larger than the limits allow, a chunk not of its manifest's size, or a "
    "publication too large to hold here",
    "checksum": "a chunk or a whole publication whose digest differs from its manifest's, or "
    "a chunk in a mutable buffer",
    "payload": "a complete publication that is not safetensors, or whose tensors do not fit",
    "message": "an answer that does not decode (frames, header fields, types)",
}
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
# threads that hash chunks (each side), and so chunks a sampler holds received but unchecked
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
_ALIAS_LIMITS = JsonLimits(max_bytes=16 << 20, max_depth=1, max_items=1_000_000)


class WireError(ValueError):
    """A manifest, chunk or publication that is not what ``WirePublisher`` sends; ``reason``
    says which kind of refusal it is (``REFUSALS``)."""

    def __init__(self, message: str, reason: str = "manifest") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class WireLimits:
    """What a sampler accepts: a publication of at most ``max_bytes``, in at most
    ``max_chunks`` chunks of at most ``max_chunk_bytes`` each."""

    max_bytes: int = 64 << 30
    max_chunks: int = 1 << 16
    max_chunk_bytes: int = 64 << 20


@dataclass(frozen=True)
class Manifest:
    """One publication: ``version``, ``kind``, ``size`` bytes, the ``chunk_bytes`` and
    per-chunk ``chunks`` digests it is cut into, ``digest``, the whole's
    (``whole_digest(chunks, hash)``), and ``hash``, the one of ``hashing.HASHES`` they are."""

    version: int
    kind: str
    size: int
    digest: str
    chunk_bytes: int
    chunks: tuple[str, ...]
    hash: str

    def as_dict(self) -> dict[str, Any]:
        """The manifest as JSON-able fields (what goes on the wire)."""
        return {
            "version": self.version,
            "kind": self.kind,
            "size": self.size,
            "hash": self.hash,
            "digest": self.digest,
            "chunk_bytes": self.chunk_bytes,
            "chunks": list(self.chunks),
        }

    @classmethod
    def parse(cls, fields: Any, limits: WireLimits) -> Manifest:
        """A manifest from untrusted ``fields``: every field's type and range checked against
        ``limits`` and against each other (the chunk count is what ``size`` and
        ``chunk_bytes`` give); WireError naming the first that is not."""
        if not isinstance(fields, dict):
            raise WireError(f"a weight manifest is a mapping, not {type(fields).__name__}")
        version = _count(fields, "version", 1 << 62)
        size = _count(fields, "size", limits.max_bytes)
        chunk_bytes = _count(fields, "chunk_bytes", limits.max_chunk_bytes)
        kind, whole, chunks = fields.get("kind"), fields.get("digest"), fields.get("chunks")
        name = fields.get("hash")
        if kind not in KINDS:
            raise WireError(f"weight manifest kind {str(kind)[:40]!r} is not one of {KINDS}")
        if name not in HASHES:
            raise WireError(f"weight manifest hash {str(name)[:40]!r} is not one of {HASHES}")
        if not isinstance(whole, str) or not _DIGEST.match(whole):
            raise WireError("weight manifest digest is not 64 hex digits")
        if not isinstance(chunks, list) or len(chunks) > limits.max_chunks:
            raise WireError(f"weight manifest chunks is not a list of <= {limits.max_chunks}")
        if chunk_bytes < 1 or len(chunks) != -(-size // chunk_bytes):
            raise WireError(
                f"weight manifest: {len(chunks)} chunks do not cut {size} bytes into "
                f"{chunk_bytes}-byte pieces"
            )
        if not all(isinstance(c, str) and _DIGEST.match(c) for c in chunks):
            raise WireError("weight manifest chunk digests are not 64 hex digits each")
        if whole_digest(chunks, name) != whole:
            raise WireError("weight manifest digest is not the digest of its chunks' digests")
        return cls(version, kind, size, whole, chunk_bytes, tuple(chunks), name)


def _count(fields: dict[str, Any], key: str, most: int) -> int:
    value = fields.get(key)
    if type(value) is not int or not 0 <= value <= most:
        raise WireError(f"weight manifest {key} is not an integer in [0, {most}]")
    return value


def chunk_digests(
    data: bytes | bytearray | memoryview, chunk_bytes: int, name: str = "sha256"
) -> tuple[str, ...]:
    """The ``name`` digest (``hashing.digest``) of each ``chunk_bytes`` piece of ``data`` in
    order, ``HASH_THREADS`` at a time."""
    view = memoryview(data).cast("B")
    pieces = [view[i : i + chunk_bytes] for i in range(0, len(view), chunk_bytes)]
    if len(pieces) < 2 or HASH_THREADS == 1:
        return tuple(digest(piece, name) for piece in pieces)
    with ThreadPoolExecutor(min(HASH_THREADS, len(pieces)), "wire-hash") as pool:
        return tuple(pool.map(lambda piece: digest(piece, name), pieces))


def whole_digest(chunks: list[str] | tuple[str, ...], name: str = "sha256") -> str:
    """A publication's digest: ``name``'s of its chunks' digests (32 bytes each), in order.
    With every chunk matching its digest, the whole matches it: one pass over the bytes."""
    return digest(b"".join(bytes.fromhex(c) for c in chunks), name)


def _packed(tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> memoryview:
    return pack(tensors, {"aliases": json.dumps(aliases)}).toreadonly()


def _manifest(
    kind: str, payload: memoryview, version: int, chunk_bytes: int, name: str
) -> Manifest:
    chunks = chunk_digests(payload, chunk_bytes, name)
    whole = whole_digest(chunks, name)
    return Manifest(int(version), kind, len(payload), whole, chunk_bytes, chunks, name)


def encode_publication(
    kind: str,
    tensors: dict[str, torch.Tensor],
    version: int,
    chunk_bytes: int = 8 << 20,
    *,
    aliases: dict[str, str] | None = None,
    hash_name: str = "sha256",
) -> tuple[Manifest, memoryview]:
    """(manifest, payload): ``tensors`` as one safetensors buffer (shared tensors once, aliases
    in the metadata; read-only) cut into ``chunk_bytes`` pieces hashed with ``hash_name``. With
    ``aliases``, ``tensors`` are already ``distinct_tensors``'s."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if aliases is None:
        tensors, aliases = distinct_tensors(tensors)
    payload = _packed(tensors, aliases)
    return _manifest(kind, payload, version, chunk_bytes, hash_name), payload


def decode_publication(payload: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """The tensors of a complete payload (its hash already checked), aliases restored: views of
    ``payload`` when it is writable (``packing.unpack``); WireError if it is not safetensors or
    its alias table is not a bounded {name: name}."""
    try:
        tensors, metadata = unpack(payload)
        aliases = loads_bounded(metadata.get("aliases", "{}"), _ALIAS_LIMITS)
    except ValueError as e:  # a header over its bounds or not as safetensors writes it
        why = f"the weight payload is not safetensors: {str(e)[:200]}"
        raise WireError(why, "payload") from None
    if not isinstance(aliases, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v in tensors for k, v in aliases.items()
    ):
        why = "the weight payload's aliases are not {name: stored tensor name}"
        raise WireError(why, "payload")
    for alias, target in aliases.items():
        tensors[alias] = tensors[target]
    return tensors


def _immutable(data: Any) -> bool:
    """``bytes``, or a read-only flat byte ``memoryview`` (a zero-copy frame): nothing can
    change it between its hash check and its copy into place."""
    if isinstance(data, bytes):
        return True
    return (isinstance(data, memoryview) and data.readonly and data.ndim == 1
            and data.itemsize == 1 and data.c_contiguous)  # fmt: skip


class WireAssembler:
    """The chunks of one manifest as they arrive (any order, any number of connections or
    threads): ``add`` checks each against its hash and copies it into place in one buffer of
    the manifest's size (``packing.buffer``: none of it is read before all is written),
    ``missing`` lists what is still needed, ``payload`` is that buffer once complete (its hash
    then holds)."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        try:
            self._buffer = buffer(manifest.size)
        except (MemoryError, RuntimeError):  # RuntimeError: torch's allocator
            raise WireError(f"weight version {manifest.version}: {manifest.size} bytes cannot "
                            "be held here", "size") from None  # fmt: skip
        self._have: set[int] = set()
        self._lock = threading.Lock()
        self.rejected = 0

    def missing(self) -> list[int]:
        """The chunk indices not yet received, in order."""
        with self._lock:
            return [i for i in range(len(self.manifest.chunks)) if i not in self._have]

    def size(self, index: int) -> int:
        """The byte count of chunk ``index`` (the last may be short)."""
        return min(
            self.manifest.chunk_bytes, self.manifest.size - index * self.manifest.chunk_bytes
        )

    def add(self, index: Any, data: Any) -> bool:
        """Keep chunk ``index`` if it is one of the manifest's, immutable (``bytes`` or a
        read-only ``memoryview``) and matches its hash; False (counted in ``rejected``)
        otherwise: it is asked for again. Thread-safe."""
        chunks = self.manifest.chunks
        ok = type(index) is int and 0 <= index < len(chunks) and _immutable(data)
        ok = ok and len(data) == self.size(index)
        if ok and digest(data, self.manifest.hash) == chunks[index]:
            start = index * self.manifest.chunk_bytes
            self._buffer[start : start + len(data)] = data
            with self._lock:
                self._have.add(index)
            return True
        with self._lock:
            self.rejected += 1
        return False

    def payload(self) -> memoryview:
        """The whole publication, its chunks in order (each matched its digest, and the
        manifest's whole digest is theirs: ``Manifest.parse``); WireError if one is missing."""
        missing = self.missing()
        if missing:
            raise WireError(
                f"weight version {self.manifest.version}: {len(missing)} chunks missing", "size"
            )
        return self._buffer


class RateLimit:
    """At most ``rate_bytes`` a second on average (0: unbounded), in bursts of one second's:
    ``take(n)`` sleeps until ``n`` bytes may go."""

    def __init__(self, rate_bytes: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
        self.rate, self.clock, self.sleep = float(rate_bytes), clock, sleep
        self._allowance, self._last = float(rate_bytes), clock()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Wait until ``n`` more bytes fit the rate."""
        if self.rate <= 0:
            return
        with self._lock:
            now = self.clock()
            self._allowance = min(self.rate, self._allowance + (now - self._last) * self.rate)
            self._last = now
            self._allowance -= n
            wait = -self._allowance / self.rate if self._allowance < 0 else 0.0
        if wait > 0:
            self.sleep(wait)


class WireSource(Protocol):
    """Where a ``WireChannel`` fetches from (the publisher in process, or requests to it over
    the transport; each call may raise ``ConnectionError`` when the connection drops). A source
    may also have ``chunks(version, indices)``: (index, bytes) for each of ``indices``, in the
    order they arrive (``WeightClient``: a window of requests in flight); without it, the
    channel calls ``chunk`` once per index."""

    def newest(self) -> int | None: ...

    def manifest(self, version: int) -> dict[str, Any]: ...

    def chunk(self, version: int, index: int) -> bytes | memoryview: ...


def _answers(
    source: WireSource, version: int, indices: list[int]
) -> Iterator[tuple[int, bytes | memoryview]]:
    """(index, data) for each of ``indices``: ``source.chunks`` if it has one, else ``chunk``
    one index at a time."""
    many = getattr(source, "chunks", None)
    if many is not None:
        yield from many(version, indices)
        return
    for index in indices:
        yield index, source.chunk(version, index)


class WirePublisher:
    """The learner's side: publications kept in memory, served by chunk under a rate limit,
    hashed with ``hash_name`` (None: ``hashing.wire_hash``'s choice for this CPU)."""

    def __init__(self, lora_sync: str = "merged", keep: int = 2, chunk_bytes: int = 8 << 20,
                 rate_bytes: float = 0.0, hash_name: str | None = None) -> None:  # fmt: skip
        self.lora_sync, self.keep, self.chunk_bytes = lora_sync, max(int(keep), 1), chunk_bytes
        self.hash = wire_hash()[0] if hash_name is None else hash_name
        if self.hash not in HASHES:
            raise ValueError(f"hash_name must be one of {HASHES}, got {hash_name!r}")
        self.rate = RateLimit(rate_bytes)
        self._held: OrderedDict[int, tuple[Manifest, bytes | memoryview]] = OrderedDict()
        self._lock = threading.Lock()
        self._job = OneInFlight("encoding weights for the wire failed")

    def publish(self, model: torch.nn.Module, version: int, *,
                background: bool = False) -> Manifest | None:  # fmt: skip
        """Pack ``model``'s weights (``lora_sync`` for a LoRA model) as ``version`` (the one
        copy, here), hash them and return the manifest; with ``background`` the hashing is a
        thread's (None; ``wait()`` for it), one publication in flight at a time."""
        self.wait()
        kind, tensors = publishable_state(model, self.lora_sync)
        payload = _packed(*distinct_tensors(tensors))
        if not background:
            return self._hold(kind, payload, version)
        self._job.run(self._hold, kind, payload, version)
        return None

    def wait(self) -> None:
        """Block until the publication in flight (if any) is served, re-raising its error."""
        self._job.wait()

    def _hold(self, kind: str, payload: memoryview, version: int) -> Manifest:
        manifest = _manifest(kind, payload, version, self.chunk_bytes, self.hash)
        with self._lock:
            self._held[manifest.version] = (manifest, payload)
            while len(self._held) > self.keep:
                self._held.popitem(last=False)
        return manifest

    def newest(self) -> int | None:
        with self._lock:
            return next(reversed(self._held), None)

    def manifest(self, version: int) -> dict[str, Any]:
        return self._get(version)[0].as_dict()

    def chunk(self, version: int, index: int) -> bytes:
        return bytes(self.chunk_view(version, index))

    def chunks(self, version: int, indices: Iterable[int]) -> Iterator[tuple[int, memoryview]]:
        """(index, ``chunk_view``) for each of ``indices``, in order."""
        for index in indices:
            yield index, self.chunk_view(version, index)

    def chunk_view(self, version: int, index: int) -> memoryview:
        """Chunk ``index`` of ``version`` without a copy (read-only; what the weight port
        sends), after the rate limit let its bytes go."""
        manifest, payload = self._get(version)
        if type(index) is not int or not 0 <= index < len(manifest.chunks):
            raise WireError(f"weight version {version} has no chunk {index!r}", "version")
        start = index * manifest.chunk_bytes
        data = memoryview(payload).toreadonly()[start : start + manifest.chunk_bytes]
        self.rate.take(len(data))
        return data

    def _get(self, version: int) -> tuple[Manifest, bytes | memoryview]:
        with self._lock:
            held = self._held.get(version)
        if held is None:
            raise WireError(
                f"weight version {version!r} is not held (pruned or never published)", "version"
            )
        return held


def check_fits(model: torch.nn.Module, kind: str, tensors: dict[str, torch.Tensor]) -> None:
    """WireError (``payload``) unless ``tensors`` are exactly what ``apply_state`` loads into
    ``model`` for ``kind``: every name and shape of its state dict (``full``, ``merged``), or
    of its adapter (``adapter``), and nothing else; checked before a tensor is copied, so a
    publication that does not fit leaves the model as it was."""
    if kind == "adapter":
        if not is_peft(model):
            raise WireError("an adapter publication for a model without LoRA", "payload")
        from peft import get_peft_model_state_dict

        expected = get_peft_model_state_dict(model)
    else:
        if is_peft(model):
            raise WireError(f"a {kind} publication for a LoRA model", "payload")
        expected = model.state_dict()
    if tensors.keys() != expected.keys():
        unknown = sorted(set(tensors) ^ set(expected))[:3]
        raise WireError(f"the publication's tensor names differ from the model's: {unknown}",
                        "payload")  # fmt: skip
    for name, value in tensors.items():
        if value.shape != expected[name].shape or value.dtype.is_floating_point != (
            expected[name].dtype.is_floating_point
        ):
            raise WireError(f"tensor {name[:80]} has shape {tuple(value.shape)}, the model's "
                            f"{tuple(expected[name].shape)}", "payload")  # fmt: skip


class WireChannel(WeightChannel):
    """The sampler's side over a ``WireSource``: ``load`` fetches the newest version's missing
    chunks (kept across dropped connections and calls), checks and decodes it, and applies it
    only when complete and fitting the model. ``publish`` is the learner's (``WirePublisher``),
    not this side's. ``rejected``: refusals by reason (``REFUSALS``); ``fetched``: chunks
    received; ``problem``: why the last attempt got no answer (None after one that did)."""

    def __init__(self, source: WireSource, *, limits: WireLimits | None = None,
                 version: int = 0) -> None:  # fmt: skip
        super().__init__(version)
        self.source, self.limits = source, limits or WireLimits()
        self._pending: WireAssembler | None = None
        self.rejected: dict[str, int] = dict.fromkeys(REFUSALS, 0)
        self.fetched = 0
        self.problem: str | None = None

    def publish(self, model: torch.nn.Module, version: int, *, background: bool = False) -> None:
        raise TypeError("a sampler's wire channel receives weights; the learner publishes them")

    def newest(self) -> int | None:
        return self.source.newest()

    def unreadable(self) -> str | None:
        """Why the last attempt to fetch weights got no answer; None when it got one."""
        return self.problem

    def load(self, model: torch.nn.Module, then: Callable[[], object] | None = None) -> bool:
        """Fetch and apply the newest version if it is newer than ``version``. A dropped
        connection (``ConnectionError``) leaves what arrived for the next call and loads
        nothing now; a refusal (``WireError``) is counted and logged, and what was pending for
        that version dropped; either way the model keeps the weights it holds."""
        try:
            loaded = self._load(model, then)
        except ConnectionError as e:
            self.problem = str(e)[:300] or type(e).__name__
            return False
        except WireError as e:
            self.problem = None
            self.rejected[e.reason if e.reason in REFUSALS else "message"] += 1
            if e.reason in ("manifest", "version", "payload"):
                self._pending = None
            log.warning("weights over the wire: refused (%s): %s", e.reason, e)
            return False
        self.problem = None
        return loaded

    def _load(self, model: torch.nn.Module, then: Callable[[], object] | None) -> bool:
        newest = self.source.newest()
        if newest is None or newest <= self.version:
            return False
        pending = self._pending
        if pending is None or pending.manifest.version != newest:
            manifest = Manifest.parse(self.source.manifest(newest), self.limits)
            if manifest.version != newest:
                raise WireError(
                    f"asked for weight version {newest}, got {manifest.version}", "version"
                )
            pending = self._pending = WireAssembler(manifest)
        self._fetch(pending, newest)
        if pending.missing():
            return False  # rejected chunks: asked for again at the next call
        tensors = decode_publication(pending.payload())
        self._pending = None
        check_fits(model, pending.manifest.kind, tensors)
        apply_state(model, pending.manifest.kind, tensors, f"weight version {newest} (wire)")
        return self._hold(newest, then)

    def _fetch(self, pending: WireAssembler, version: int) -> None:
        """Fetch ``pending``'s missing chunks, each checked and copied into place by one of
        ``HASH_THREADS`` threads while the next ones arrive (at most ``2 * HASH_THREADS``
        received and unchecked); what was checked stays when the source fails midway."""
        checks: deque[tuple[int, int, Future[bool]]] = deque()
        with ThreadPoolExecutor(HASH_THREADS, "wire-check") as pool:
            try:
                with closing(_answers(self.source, version, pending.missing())) as answers:
                    for index, data in answers:
                        self.fetched += 1
                        checks.append((index, len(data), pool.submit(pending.add, index, data)))
                        while len(checks) > 2 * HASH_THREADS:
                            self._settle(pending, version, *checks.popleft())
            finally:
                while checks:
                    self._settle(pending, version, *checks.popleft())

    def _settle(self, pending: WireAssembler, version: int, index: int, size: int,
                check: Future[bool]) -> None:  # fmt: skip
        if check.result():
            return
        why = "checksum" if type(index) is int and size == pending.size(index) else "size"
        self.rejected[why] += 1
        log.warning("weights over the wire: chunk %r of version %d refused (%s)",
                    index, version, why)  # fmt: skip

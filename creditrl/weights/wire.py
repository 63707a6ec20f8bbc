"""Weights over the wire: a publication as checksummed chunks that a sampler fetches through a
connection it already has (no shared disk), loaded only when complete, resumable after a
dropped connection, never pickled.

A publication (``publishable_state``: ``full``, ``merged`` or ``adapter`` tensors) is written
as one safetensors byte string (tensors that share memory once, aliases in its metadata), cut
into ``chunk_bytes`` pieces. Its ``Manifest`` names the version, kind, total size, the SHA-256
of every chunk and the SHA-256 of those digests in order (the whole's: ``whole_digest``; the
bytes are hashed once, chunk by chunk, and every chunk checked in place is the whole checked).
The sampling side checks the manifest against its ``WireLimits`` and its whole digest before
asking for a byte, and each chunk against its hash as it arrives (a bad one is dropped and
asked for again); what it already holds survives a dropped connection, so the next
``refresh`` asks only for the missing chunks.

- ``WirePublisher`` (the learner's side): ``publish(model, version)`` encodes (with
  ``background``: copies now, encodes in a thread) and keeps the newest ``keep``
  publications; ``manifest(version)`` and ``chunk(version, index)`` serve them, at most
  ``rate_bytes`` a second (``RateLimit``).
- ``WireChannel`` (the sampler's side): a ``WeightChannel`` over a ``WireSource`` (anything with
  ``newest``, ``manifest`` and ``chunk``: the publisher itself in process, or the transport's
  requests to it, ``creditrl.asynchronous.weight_server.WeightClient``). Whatever comes back
  that is not what the publisher sends (a forged manifest, an answer to another request, a
  version it did not ask for, a chunk or a whole failing its hash, tensors that do not fit the
  model) is refused, counted by reason in ``rejected`` and logged; the model keeps the last
  good weights. A source that does not answer (``ConnectionError``) loads nothing and is said
  by ``unreadable()``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from creditrl.bounded_json import JsonLimits, loads_bounded
from creditrl.weights.background import OneInFlight
from creditrl.weights.channel import WeightChannel
from creditrl.weights.tensors import apply_state, is_peft, publishable_state, snapshot_tensors

__all__ = [
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
    "size": "a message larger than the limits allow, or a chunk not of its manifest's size",
    "checksum": "a chunk or a whole publication whose SHA-256 differs from its manifest's",
    "payload": "a complete publication that is not safetensors, or whose tensors do not fit",
    "message": "an answer that does not decode (frames, header fields, types)",
}
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_HEADER_LIMITS = JsonLimits(max_bytes=64 << 20, max_depth=4, max_items=4_000_000)
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
    per-chunk ``chunks`` SHA-256s it is cut into, and ``sha256``, the whole's
    (``whole_digest(chunks)``)."""

    version: int
    kind: str
    size: int
    sha256: str
    chunk_bytes: int
    chunks: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        """The manifest as JSON-able fields (what goes on the wire)."""
        return {
            "version": self.version,
            "kind": self.kind,
            "size": self.size,
            "sha256": self.sha256,
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
        kind, digest, chunks = fields.get("kind"), fields.get("sha256"), fields.get("chunks")
        if kind not in KINDS:
            raise WireError(f"weight manifest kind {str(kind)[:40]!r} is not one of {KINDS}")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise WireError("weight manifest sha256 is not 64 hex digits")
        if not isinstance(chunks, list) or len(chunks) > limits.max_chunks:
            raise WireError(f"weight manifest chunks is not a list of <= {limits.max_chunks}")
        if chunk_bytes < 1 or len(chunks) != -(-size // chunk_bytes):
            raise WireError(
                f"weight manifest: {len(chunks)} chunks do not cut {size} bytes into "
                f"{chunk_bytes}-byte pieces"
            )
        if not all(isinstance(c, str) and _SHA256.match(c) for c in chunks):
            raise WireError("weight manifest chunk hashes are not 64 hex digits each")
        if whole_digest(chunks) != digest:
            raise WireError("weight manifest sha256 is not the digest of its chunk hashes")
        return cls(version, kind, size, digest, chunk_bytes, tuple(chunks))


def _count(fields: dict[str, Any], key: str, most: int) -> int:
    value = fields.get(key)
    if type(value) is not int or not 0 <= value <= most:
        raise WireError(f"weight manifest {key} is not an integer in [0, {most}]")
    return value


def _sha(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def whole_digest(chunks: list[str] | tuple[str, ...]) -> str:
    """A publication's SHA-256: of its chunks' SHA-256 digests (32 bytes each), in order. With
    every chunk matching its digest, the whole matches it: one pass over the bytes, not two."""
    return _sha(b"".join(bytes.fromhex(c) for c in chunks))


def encode_publication(
    kind: str,
    tensors: dict[str, torch.Tensor],
    version: int,
    chunk_bytes: int = 8 << 20,
    *,
    aliases: dict[str, str] | None = None,
) -> tuple[Manifest, bytes]:
    """(manifest, payload): ``tensors`` as safetensors bytes (shared tensors once, aliases in
    the metadata) cut into ``chunk_bytes`` pieces. With ``aliases``, ``tensors`` are already
    ``snapshot_tensors``'s copies."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    stored = tensors
    if aliases is None:
        stored, aliases = snapshot_tensors(tensors)
    payload = save_safetensors(stored, metadata={"aliases": json.dumps(aliases)})
    view = memoryview(payload)
    chunks = tuple(_sha(view[i : i + chunk_bytes]) for i in range(0, len(payload), chunk_bytes))
    manifest = Manifest(int(version), kind, len(payload), whole_digest(chunks), chunk_bytes, chunks)
    return manifest, payload


def decode_publication(payload: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a complete payload (its hash already checked), aliases restored;
    WireError if it is not safetensors or its alias table is not a bounded {name: name}."""
    try:
        header_size = int.from_bytes(payload[:8], "little")
        header = loads_bounded(payload[8 : 8 + header_size], _HEADER_LIMITS)
        raw = (header.get("__metadata__") or {}).get("aliases", "{}")
        aliases = loads_bounded(raw, _ALIAS_LIMITS)
        tensors = load_safetensors(payload)
    except Exception as e:  # a header over its bounds, safetensors' own errors
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


class WireAssembler:
    """The chunks of one manifest as they arrive (any order, any number of connections):
    ``add`` checks each against its hash, ``missing`` lists what is still needed,
    ``payload`` is the whole once complete and its hash holds."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._pieces: dict[int, bytes] = {}
        self.rejected = 0

    def missing(self) -> list[int]:
        """The chunk indices not yet received, in order."""
        return [i for i in range(len(self.manifest.chunks)) if i not in self._pieces]

    def add(self, index: Any, data: Any) -> bool:
        """Keep chunk ``index`` if it is one of the manifest's and matches its hash; False
        (counted in ``rejected``) otherwise: it is asked for again."""
        chunks = self.manifest.chunks
        if type(index) is not int or not 0 <= index < len(chunks) or not isinstance(data, bytes):
            self.rejected += 1
            return False
        expected = min(
            self.manifest.chunk_bytes, self.manifest.size - index * self.manifest.chunk_bytes
        )
        if len(data) != expected or _sha(data) != chunks[index]:
            self.rejected += 1
            return False
        self._pieces[index] = data
        return True

    def payload(self) -> bytes:
        """The whole publication, its chunks in order (each matched its digest, and the
        manifest's whole digest is theirs: ``Manifest.parse``); WireError if one is missing."""
        missing = self.missing()
        if missing:
            raise WireError(
                f"weight version {self.manifest.version}: {len(missing)} chunks missing", "size"
            )
        return b"".join(self._pieces[i] for i in range(len(self.manifest.chunks)))


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
    the transport; each call may raise ``ConnectionError`` when the connection drops)."""

    def newest(self) -> int | None: ...

    def manifest(self, version: int) -> dict[str, Any]: ...

    def chunk(self, version: int, index: int) -> bytes: ...


class WirePublisher:
    """The learner's side: publications kept in memory, served by chunk under a rate limit."""

    def __init__(self, lora_sync: str = "merged", keep: int = 2, chunk_bytes: int = 8 << 20,
                 rate_bytes: float = 0.0) -> None:  # fmt: skip
        self.lora_sync, self.keep, self.chunk_bytes = lora_sync, max(int(keep), 1), chunk_bytes
        self.rate = RateLimit(rate_bytes)
        self._held: OrderedDict[int, tuple[Manifest, bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self._job = OneInFlight("encoding weights for the wire failed")

    def publish(self, model: torch.nn.Module, version: int, *,
                background: bool = False) -> Manifest | None:  # fmt: skip
        """Encode ``model``'s weights (``lora_sync`` for a LoRA model) as ``version`` and
        return its manifest; with ``background`` the weights are copied now and encoded by a
        thread (None; ``wait()`` for it), one publication in flight at a time."""
        self.wait()
        kind, tensors = publishable_state(model, self.lora_sync)
        stored, aliases = snapshot_tensors(tensors)
        if not background:
            return self._encode(kind, stored, aliases, version)
        self._job.run(self._encode, kind, stored, aliases, version)
        return None

    def wait(self) -> None:
        """Block until the publication in flight (if any) is served, re-raising its error."""
        self._job.wait()

    def _encode(self, kind: str, stored: dict[str, torch.Tensor], aliases: dict[str, str],
                version: int) -> Manifest:  # fmt: skip
        manifest, payload = encode_publication(
            kind, stored, version, self.chunk_bytes, aliases=aliases
        )
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

    def chunk_view(self, version: int, index: int) -> memoryview:
        """Chunk ``index`` of ``version`` without a copy (what the weight port sends), after the
        rate limit let its bytes go."""
        manifest, payload = self._get(version)
        if type(index) is not int or not 0 <= index < len(manifest.chunks):
            raise WireError(f"weight version {version} has no chunk {index!r}", "version")
        start = index * manifest.chunk_bytes
        data = memoryview(payload)[start : start + manifest.chunk_bytes]
        self.rate.take(len(data))
        return data

    def _get(self, version: int) -> tuple[Manifest, bytes]:
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
        manifest = pending.manifest
        for index in pending.missing():
            data = self.source.chunk(newest, index)
            self.fetched += 1
            size = min(manifest.chunk_bytes, manifest.size - index * manifest.chunk_bytes)
            if not pending.add(index, data):
                self.rejected["size" if len(data) != size else "checksum"] += 1
                log.warning("weights over the wire: chunk %d of version %d refused (%s)",
                            index, newest, "size" if len(data) != size else "checksum")  # fmt: skip
        if pending.missing():
            return False  # rejected chunks: asked for again at the next call
        tensors = decode_publication(pending.payload())
        self._pending = None
        check_fits(model, pending.manifest.kind, tensors)
        apply_state(model, pending.manifest.kind, tensors, f"weight version {newest} (wire)")
        return self._hold(newest, then)

"""The hash that checks weights over the wire, chosen by the learner's CPU and named in each
manifest.

Both are 256-bit cryptographic hashes from ``hashlib`` (which lets go of the GIL while it
hashes): ``sha256``, and ``blake2b`` with a 32-byte digest. A CPU with SHA extensions
(``sha_ni`` in ``/proc/cpuinfo``) hashes SHA-256 several times faster than BLAKE2b; without
them BLAKE2b is the faster (about 1.7x on an AVX-512 Xeon without SHA extensions:
``benchmarks/results/weight_transfer.md``). The learner picks once (``wire_hash``) and says
which at start-up; a sampler checks with whichever of ``HASHES`` the manifest names and refuses
any other name.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__all__ = ["HASHES", "digest", "wire_hash"]

HASHES = ("sha256", "blake2b")
"""The hashes a manifest may name; each gives 32 bytes (64 hex digits)."""


def digest(data: bytes | bytearray | memoryview, name: str) -> str:
    """The hex digest of ``data`` under ``name`` (one of ``HASHES``; ValueError otherwise)."""
    if name == "sha256":
        return hashlib.sha256(data).hexdigest()
    if name == "blake2b":
        return hashlib.blake2b(data, digest_size=32).hexdigest()
    raise ValueError(f"unknown weight hash {name!r}: one of {HASHES}")


@functools.cache
def wire_hash(cpuinfo: str | Path = "/proc/cpuinfo") -> tuple[str, str]:
    """(hash, why): ``sha256`` where the CPU flags include ``sha_ni``, else ``blake2b``; ``why``
    is the reason in words, for the start-up line. An unreadable ``cpuinfo`` counts as no
    SHA extensions. Read once per path."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        text = ""
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])  # fmt: skip
    if "sha_ni" in flags:
        return "sha256", "this CPU has SHA extensions"
    return "blake2b", "no SHA extensions on this CPU"

"""What a host string names, decided once for every server and client creditrl starts (the async
learner's ZeroMQ socket, the workers' torch.distributed rendezvous, the agent endpoint,
``creditrl serve-tinker``). Standard library only, so any layer may import it.

- ``is_loopback(host)``: nothing but this machine can reach an address bound to ``host``;
- ``unbracketed(host)``: ``host`` without the brackets of an IPv6 literal (``[::1]`` -> ``::1``),
  as sockets take it;
- ``url_host(host)``: ``host`` as a URL writes it (an IPv6 literal in brackets, once).
"""

from __future__ import annotations

import ipaddress

__all__ = ["is_loopback", "unbracketed", "url_host"]


def unbracketed(host: str) -> str:
    """``host`` without one pair of enclosing brackets (``[::1]`` -> ``::1``); else unchanged."""
    if len(host) >= 2 and host[0] == "[" and host[-1] == "]":
        return host[1:-1]
    return host


def url_host(host: str) -> str:
    """``host`` for a URL or a ZeroMQ endpoint: an IPv6 literal in brackets (``::1`` ->
    ``[::1]``; an already bracketed one unchanged), a name or IPv4 address as it is."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def is_loopback(host: str) -> bool:
    """True when ``host`` names this machine's loopback only: ``localhost`` (any case), an
    address in 127.0.0.0/8, ``::1`` (with brackets, ``[::1]``, or a zone, ``::1%lo``), or an
    IPv4-mapped loopback address (``::ffff:127.0.0.1``, on every Python version). False for
    anything else, including ``""``, ``0.0.0.0`` and ``::`` (every interface) and any other
    host name (it could resolve anywhere)."""
    if host.lower() == "localhost":
        return True
    bare = unbracketed(host)
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        return False
    if bare != host and address.version != 6:  # brackets hold an IPv6 literal only
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback

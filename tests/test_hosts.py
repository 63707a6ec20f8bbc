"""One answer to "is this host loopback?" (``creditrl.hosts``) for every server creditrl starts:
the async learner's socket, the workers' rendezvous, the agent endpoint's config check and
``creditrl serve-tinker``'s key; and one way to write a host into a URL."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

import creditrl
from creditrl.hosts import is_loopback, unbracketed, url_host

LOOPBACK = [
    "127.0.0.1", "127.0.0.2", "127.255.255.254", "::1", "[::1]", "::1%lo", "localhost",
    "LocalHost", "::ffff:127.0.0.1", "[::ffff:127.0.0.1]", "0:0:0:0:0:0:0:1",
]  # fmt: skip
NOT_LOOPBACK = [
    "", "0.0.0.0", "::", "[::]", "10.0.0.1", "192.0.2.2", "::ffff:10.0.0.1", "2001:db8::1",
    "node-3", "localhost.example.com", "foo.localhost", "[localhost]", "[127.0.0.1]",
    "[::1", "::1]", " 127.0.0.1", "127.0.0.1:80", "128.0.0.1",
]  # fmt: skip


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", NOT_LOOPBACK)
def test_hosts_that_are_not_loopback(host: str) -> None:
    """Every interface, other addresses, any other name (it could resolve anywhere), and
    brackets around anything but an IPv6 literal."""
    assert not is_loopback(host)


def test_brackets_on_and_off() -> None:
    assert unbracketed("[::1]") == "::1" and unbracketed("::1") == "::1"
    assert unbracketed("127.0.0.1") == "127.0.0.1" and unbracketed("[") == "["
    assert url_host("::1") == "[::1]" and url_host("[::1]") == "[::1]"
    assert url_host("127.0.0.1") == "127.0.0.1" and url_host("localhost") == "localhost"


def test_every_server_reads_the_same_answer() -> None:
    """The learner's bind check, the rendezvous, the endpoint's config check and serve-tinker
    use ``creditrl.hosts.is_loopback`` (no copy of their own)."""
    from creditrl.asynchronous import checks, ray_launch, transport
    from creditrl.commands import serve_tinker
    from creditrl.workers import distributed

    for module in (checks, ray_launch, transport, serve_tinker, distributed):
        assert module.is_loopback is is_loopback, module.__name__


def test_only_creditrl_hosts_parses_addresses() -> None:
    """No other module imports ``ipaddress``: a second parser would be a second answer."""
    root = Path(creditrl.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if "ipaddress" in names and path != root / "hosts.py":
                offenders.append(str(path.relative_to(root.parent)))
    assert offenders == []


def test_endpoint_host_check_accepts_bracketed_and_named_loopback() -> None:
    """agent.endpoint_host: ``[::1]`` and ``localhost`` pass as loopback (the endpoint binds
    ``[::1]`` as ``::1``); any other address needs agent.endpoint_allow_remote."""
    from creditrl.agents.endpoint import Endpoint
    from creditrl.asynchronous.checks import _check_endpoint_host
    from creditrl.config.schema import Config
    from creditrl.errors import ConfigError

    for host in ("[::1]", "localhost", "127.0.0.5"):
        cfg = Config()
        cfg.agent.endpoint_host = host
        _check_endpoint_host(cfg)
    cfg = Config()
    cfg.agent.endpoint_host = "0.0.0.0"
    with pytest.raises(ConfigError, match="not a loopback address"):
        _check_endpoint_host(cfg)
    endpoint = Endpoint(lambda request: None, lambda t: False, "m", host="[::1]", port=8)
    assert endpoint.host == "::1"
    assert endpoint.base_url("t1") == "http://[::1]:8/t/t1/v1"


def test_serve_tinker_gives_a_key_off_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """serve-tinker needs no key on ``[::1]`` or ``localhost`` (as on 127.0.0.1) and makes one
    up on any other address."""
    from rich.console import Console

    from creditrl.commands import serve_tinker
    from creditrl.tinker import server

    keys: dict[str, str | None] = {}

    class Stop(Exception):
        pass

    class FakeServer:
        def __init__(self, settings, host, port, api_key) -> None:
            keys[host] = api_key

        def start(self) -> None:
            raise Stop

    monkeypatch.setattr(server, "TinkerServer", FakeServer)
    for host in ("[::1]", "localhost", "127.0.0.1", "0.0.0.0"):
        args = argparse.Namespace(
            threads=None, api_key=None, host=host, port=0, out="out", model=[],
            max_sessions=1, max_models=1,
        )  # fmt: skip
        with pytest.raises(Stop):
            serve_tinker.run(args, Console())
    assert keys["[::1]"] is None and keys["localhost"] is None and keys["127.0.0.1"] is None
    assert keys["0.0.0.0"] is not None and keys["0.0.0.0"].startswith("tml-")

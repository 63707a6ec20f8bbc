"""env.verifiers takes verifiers 0.3 and 0.4 (0.4 keeps only verifiers.v1, which creditrl runs)
and refuses another release in one line that says which it runs (docs/environments.md)."""

from __future__ import annotations

import sys
import types

import pytest

from creditrl.errors import ConfigError


def _installed(monkeypatch: pytest.MonkeyPatch, version: str) -> types.ModuleType:
    """A verifiers package root with only a version, as 0.4.0's is (no classic API)."""
    root = types.ModuleType("verifiers")
    root.__version__ = version
    monkeypatch.setitem(sys.modules, "verifiers", root)
    return root


def test_verifiers_0_4_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    from creditrl.environments.verifiers import _verifiers

    root = _installed(monkeypatch, "0.4.0")
    assert _verifiers() is root


@pytest.mark.parametrize("version", ["0.5.0", "0.2.9", "not-a-version"])
def test_another_release_is_refused_saying_why(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    from creditrl.environments.verifiers import _verifiers

    _installed(monkeypatch, version)
    with pytest.raises(ConfigError) as err:
        _verifiers()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"env.verifiers: verifiers {version} is installed")
    assert "verifiers.v1" in message and ">=0.3,<0.5" in message

"""env.verifiers refuses a verifiers release without the classic API in one line that says why
(docs/environments.md: verifiers 0.4 keeps only verifiers.v1)."""

from __future__ import annotations

import sys
import types

import pytest

from creditrl.errors import ConfigError


def test_verifiers_0_4_is_refused_saying_why(monkeypatch) -> None:
    from creditrl.environments.verifiers import _verifiers

    v1_only = types.ModuleType("verifiers")
    v1_only.__version__ = "0.4.0"  # 0.4.0's package root: a version and nothing else
    monkeypatch.setitem(sys.modules, "verifiers", v1_only)
    with pytest.raises(ConfigError) as err:
        _verifiers()
    message = str(err.value)
    assert "\n" not in message and message.startswith("env.verifiers: verifiers 0.4.0 is installed")
    assert "verifiers.v1" in message and "uv installs at run time" in message
    assert "openai<3" in message and "docs/environments.md" in message

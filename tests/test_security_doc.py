"""docs/security.md claims no more than tests show: every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _defined_tests() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        names.update(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", path.read_text(), re.M))
    return names


def test_every_test_the_security_doc_names_exists() -> None:
    doc = (ROOT / "docs" / "security.md").read_text()
    named = set(re.findall(r"\b(test_\w+)\b", doc))
    files = {n for n in named if (ROOT / "tests" / f"{n}.py").exists()}
    missing = sorted(named - files - _defined_tests())
    assert len(named) > 50
    assert missing == []

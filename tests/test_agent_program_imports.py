"""An agent.program file imports the modules beside it, as ``python file.py`` would
(issue 40, item 16)."""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

from creditrl.agents.program import load_program


def test_a_program_imports_a_module_beside_it(tmp_path: Path) -> None:
    helper = f"agent_helpers_{uuid.uuid4().hex[:8]}"  # a name no other test imports
    (tmp_path / f"{helper}.py").write_text("GREETING = 'hello'\n")
    (tmp_path / "agent.py").write_text(
        f"from {helper} import GREETING\n\n\n"
        "async def run(row, client):\n"
        f"    import {helper}\n\n"
        f"    return float({helper}.GREETING == GREETING)\n"
    )
    program = load_program(f"{tmp_path / 'agent.py'}:run")
    assert asyncio.run(program({}, None)) == 1.0
    assert helper in sys.modules and sys.path.index(str(tmp_path)) > 0  # after the installed

"""What the benchmarks print about the machine they ran on."""

from __future__ import annotations

import platform
from pathlib import Path

__all__ = ["cpu_flags"]


def cpu_flags() -> str:
    """The CPU model and its vector/bf16 flags (what decides the speed choices)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                  if ln.startswith("model name")), platform.processor())  # fmt: skip
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines()
                  if ln.startswith("flags")), [])  # fmt: skip
    wanted = [f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]
    return f"{model}; {' '.join(wanted)}"

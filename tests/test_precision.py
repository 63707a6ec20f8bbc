"""actor.autocast=auto picks bf16 only where bfloat16 matmuls are native."""

import pytest

from creditrl.config.loader import load_config
from creditrl.workers import precision
from creditrl.workers.precision import autocast_choice, cpu_has_native_bf16, resolve_autocast


def _cpuinfo(tmp_path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\n")
    return str(path)


def test_cpu_flags_decide(tmp_path):
    assert cpu_has_native_bf16.__wrapped__(_cpuinfo(tmp_path, "avx2 avx512f avx512_bf16"))
    assert cpu_has_native_bf16.__wrapped__(_cpuinfo(tmp_path, "avx2 amx_bf16 amx_tile"))
    assert not cpu_has_native_bf16.__wrapped__(_cpuinfo(tmp_path, "avx2 fma avx512f"))
    assert not cpu_has_native_bf16.__wrapped__(str(tmp_path / "missing"))


@pytest.mark.parametrize("native", [True, False])
def test_auto_resolves_on_cpu(monkeypatch, native):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    assert resolve_autocast("auto", "cpu") == ("bf16" if native else "none")
    assert resolve_autocast("bf16", "cpu") == "bf16" and resolve_autocast("none", "cpu") == "none"


def test_default_is_auto_and_bad_values_refused():
    assert load_config().actor.autocast == "auto"
    with pytest.raises(ValueError, match=r"actor\.autocast"):
        resolve_autocast("fp16", "cpu")


@pytest.mark.parametrize("native", [True, False])
def test_the_choice_and_the_flags_behind_it_are_said(monkeypatch, native):
    """The start-up line names what ``auto`` chose on this CPU and the flags that decided."""
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    line = autocast_choice("auto", "cpu")
    assert line.startswith(
        f"actor.autocast=auto: the update runs in {'bf16' if native else 'none'}"
    )
    assert "avx512_bf16" in line and "amx_bf16" in line
    assert autocast_choice("none", "cpu") == "actor.autocast=none: the update runs in none on cpu"

"""Tools: schemas from hints and docstrings, argument checks, the registry's error results,
timeouts and parallel cap, YAML config, the calculator, kg_lookup and the python sandbox."""

import asyncio
import json
import time
from pathlib import Path
from typing import Literal

import pytest

from creditrl.agents.tasks import KGQA_QUESTIONS
from creditrl.tools import (
    Tool,
    ToolArgumentError,
    ToolRegistry,
    build_registry,
    function_schema,
    truncate_text,
    validate_arguments,
)
from creditrl.tools.calculator import calculate
from creditrl.tools.kg_lookup import DEFAULT_TRIPLES, KnowledgeGraph, normalize_entity
from creditrl.tools.python_sandbox import PythonSandbox


def weather(city: str, days: int, unit: Literal["C", "F"] = "C", hours: list[int] | None = None):
    """Forecast for a city.

    More text that is not the description.

    Args:
        city: the city name
        days: how many days,
            at most 7
        unit: temperature unit
        hours: hours of the day to include
    """
    return {"city": city, "days": days}


def test_function_schema_from_hints_and_docstring() -> None:
    assert function_schema(weather) == {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "the city name"},
                    "days": {"type": "integer", "description": "how many days, at most 7"},
                    "unit": {
                        "type": "string",
                        "enum": ["C", "F"],
                        "description": "temperature unit",
                    },
                    "hours": {
                        "type": "array",
                        "items": {"type": "integer"},
                        "description": "hours of the day to include",
                    },
                },
                "required": ["city", "days"],
            },
        },
    }


def test_function_schema_needs_hints() -> None:
    def bad(x):
        return x

    with pytest.raises(TypeError, match="parameter 'x' has no type hint"):
        function_schema(bad)


@pytest.mark.parametrize(
    "args,match",
    [
        ([1], "must be a JSON object"),
        ({"days": 2}, r"missing required argument\(s\) \['city'\]"),
        ({"city": "Oslo", "days": 2, "extra": 1}, r"unknown argument\(s\) \['extra'\]"),
        ({"city": "Oslo", "days": "2"}, "argument 'days'='2' does not match integer"),
        ({"city": "Oslo", "days": True}, "'days'=True does not match integer"),
        ({"city": "Oslo", "days": 2, "unit": "K"}, "'unit'='K' does not match"),
        ({"city": "Oslo", "days": 2, "hours": [1, "x"]}, "'hours'"),
    ],
)
def test_validate_arguments_rejects(args: object, match: str) -> None:
    params = function_schema(weather)["function"]["parameters"]
    with pytest.raises(ToolArgumentError, match=match):
        validate_arguments(params, args)


def test_validate_arguments_accepts() -> None:
    params = function_schema(weather)["function"]["parameters"]
    args = {"city": "Oslo", "days": 2, "unit": "F", "hours": [9, 12]}
    assert validate_arguments(params, args) == args


def _registry(**kw: float) -> ToolRegistry:
    async def slow_async(seconds: float) -> str:
        """Sleep."""
        await asyncio.sleep(seconds)
        return "done"

    def slow_sync(seconds: float) -> str:
        """Sleep."""
        time.sleep(seconds)
        return "done"

    def fails(x: int) -> str:
        """Raise."""
        raise RuntimeError(f"boom {x}")

    registry = ToolRegistry(timeout_s=kw.get("timeout", 0.2), max_parallel=int(kw.get("par", 4)))
    for fn in (slow_async, slow_sync, fails, weather):
        registry.register(Tool.from_function(fn))
    return registry


def test_registry_turns_every_failure_into_a_result() -> None:
    registry = _registry()

    async def calls():
        return await asyncio.gather(
            registry.call("nope", {}),
            registry.call("fails", {"x": "1"}),
            registry.call("fails", {"x": 1}),
            registry.call("slow_async", {"seconds": 2.0}),
            registry.call("slow_sync", {"seconds": 0.5}),
            registry.call("weather", {"city": "Oslo", "days": 1}),
        )

    unknown, bad, error, timeout_async, timeout_sync, ok = asyncio.run(calls())
    assert unknown.status == "unknown_tool" and "available tools: ['slow_async'" in unknown.output
    assert bad.status == "bad_arguments" and "'x'='1' does not match integer" in bad.output
    assert (error.status, error.output) == ("error", "Error: RuntimeError: boom 1")
    assert timeout_async.status == timeout_sync.status == "timeout"
    assert "no result after 0.2s" in timeout_async.output
    assert ok.ok and json.loads(ok.output) == {"city": "Oslo", "days": 1}


def test_registry_caps_parallel_calls() -> None:
    running = peak = 0

    async def probe(i: int) -> str:
        """Count concurrency."""
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.05)
        running -= 1
        return str(i)

    registry = ToolRegistry(timeout_s=5, max_parallel=2)
    registry.register(Tool.from_function(probe))

    async def calls():
        return await asyncio.gather(*(registry.call("probe", {"i": i}) for i in range(6)))

    results = asyncio.run(calls())
    assert [r.output for r in results] == [str(i) for i in range(6)]
    assert peak == 2


def test_build_registry_from_yaml(tmp_path: Path) -> None:
    (tmp_path / "mytools.py").write_text(
        "def shout(text: str) -> str:\n    '''Upper-case the text.'''\n    return text.upper()\n"
    )
    (tmp_path / "kg.tsv").write_text("Oslo\tcapital of\tNorway\n")
    (tmp_path / "tools.yaml").write_text(
        "tools:\n"
        f"  - name: shout\n    function: {tmp_path / 'mytools.py'}:shout\n    timeout_s: 3\n"
        f"  - name: kg_lookup\n    kwargs: {{path: {tmp_path / 'kg.tsv'}}}\n"
    )
    registry = build_registry(["calculator"], str(tmp_path / "tools.yaml"), timeout_s=1.0)
    assert registry.names() == ["calculator", "shout", "kg_lookup"]
    assert registry.tools["shout"].timeout_s == 3.0
    assert registry.tools["shout"].schema["function"]["description"] == "Upper-case the text."
    shout = asyncio.run(registry.call("shout", {"text": "hi"}))
    kg = asyncio.run(registry.call("kg_lookup", {"entity": "norway"}))
    assert (shout.output, kg.output) == ("HI", "Oslo | capital of | Norway")
    (tmp_path / "bad.yaml").write_text("tools:\n  - name: calculator\n    colour: red\n")
    with pytest.raises(ValueError, match=r"unknown keys \['colour'\]"):
        build_registry([], str(tmp_path / "bad.yaml"))
    (tmp_path / "bad2.yaml").write_text("tools:\n  - name: magic\n")
    with pytest.raises(ValueError, match="'magic' is not a built-in"):
        build_registry([], str(tmp_path / "bad2.yaml"))


@pytest.mark.parametrize(
    "side,expected",
    [
        ("right", "abcd...[6 chars truncated]..."),
        ("left", "...[6 chars truncated]...ghij"),
        ("middle", "ab...[6 chars truncated]...ij"),
    ],
)
def test_truncate_text(side: str, expected: str) -> None:
    assert truncate_text("abcdefghij", 4, side) == expected
    assert truncate_text("abc", 4, side) == "abc"
    assert truncate_text("abcdefghij", 0, side) == "abcdefghij"


def test_truncate_side_is_checked() -> None:
    with pytest.raises(ValueError, match="truncate side must be one of"):
        truncate_text("x", 1, "top")


@pytest.mark.parametrize(
    "expression,value",
    [
        ("(12 + 7) * 3", "57"),
        ("7 / 2", "3.5"),
        ("6 / 3", "2"),
        ("2 ** 10", "1024"),
        ("-3 + +4", "1"),
        ("17 // 5 + 17 % 5", "5"),
        ("12 × 3 ÷ 4", "9"),
        ("0.1 + 0.2", "0.3"),
        ("-2 ** 2", "-4"),
        ("2 ** 3 ** 2", "512"),
        ("2 ** -1", "0.5"),
        ("1e3 + .5", "1000.5"),
    ],
)
def test_calculator_values(expression: str, value: str) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression,error,match",
    [
        ("__import__('os').system('echo hi')", ValueError, "unexpected '_' at position 0"),
        ("x + 1", ValueError, "unexpected 'x' at position 0"),
        ("(1).real", ValueError, "unexpected '.' at position 3"),
        ("(1", ValueError, "missing '\\)' at position 2"),
        ("1 2", ValueError, "unexpected 2 at position 2"),
        ("(-8) ** 0.5", ValueError, "complex number"),
        ("2 ^ 3", ValueError, "write \\*\\* for powers"),
        ("2 ** 1000", ValueError, "exponent 1000 is larger than 100"),
        ("99 ** 99", ValueError, "more than 100 digits"),
        ("1 / 0", ZeroDivisionError, "division by zero"),
        ("1 +", ValueError, "unexpected end of the expression"),
        ("1" * 300, ValueError, "longer than 200"),
    ],
)
def test_calculator_refuses(expression: str, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        calculate(expression)


def test_kg_lookup(tmp_path: Path) -> None:
    graph = KnowledgeGraph.from_tsv(DEFAULT_TRIPLES)
    assert (
        graph.lookup("vienna") == "Vienna | located on river | Danube\nAustria | capital | Vienna"
    )
    assert graph.lookup("Austria", "capital") == "Austria | capital | Vienna"
    assert graph.lookup("Atlantis") == "No facts found for 'Atlantis'."
    (tmp_path / "bad.tsv").write_text("# header\na\tb\n")
    with pytest.raises(ValueError, match=r"bad\.tsv line 2: expected subject"):
        KnowledgeGraph.from_tsv(tmp_path / "bad.tsv")


def test_every_shipped_kgqa_answer_is_in_the_graph() -> None:
    entities = {normalize_entity(e) for e in KnowledgeGraph.from_tsv(DEFAULT_TRIPLES).entities()}
    rows = [json.loads(line) for line in KGQA_QUESTIONS.read_text().splitlines()]
    assert len(rows) == 40
    for row in rows:
        assert any(normalize_entity(a) in entities for a in row["answers"]), row


def test_python_sandbox_runs_and_confines(tmp_path: Path) -> None:
    """Pins ``isolation: none`` (the unsafe opt-out, a plain subprocess): output, the output
    cap, the timeout, the memory limit, and its audit hook's refusals (which code can undo;
    tests/test_security.py pins the bubblewrap sandbox)."""
    sandbox = PythonSandbox(timeout_s=10.0, max_output_chars=200, isolation="none")
    short = PythonSandbox(timeout_s=1.0, isolation="none")
    outside = tmp_path / "escaped.txt"

    async def runs():
        return await asyncio.gather(
            sandbox.run("print(sum(range(10)))"),
            sandbox.run("open('inside.txt', 'w').write('x'); print(open('inside.txt').read())"),
            sandbox.run(f"open({str(outside)!r}, 'w').write('x')"),
            sandbox.run("import socket; socket.socket()"),
            sandbox.run("import subprocess; subprocess.run(['ls'])"),
            sandbox.run("while True: print('a' * 100)"),
            short.run("while True: pass"),
            sandbox.run("import ctypes"),
            sandbox.run("import resource as r; r.setrlimit(r.RLIMIT_CPU, (99, 99))"),
            sandbox.run("x = bytearray(2 * 1024**3)"),
            return_exceptions=True,
        )

    ok, inside, escaped, socket_, subprocess_, flood, spin, *rest = asyncio.run(runs())
    ctypes_, rlimit, memory = rest
    assert isinstance(ctypes_, RuntimeError) and "ctypes.dlopen is not allowed" in str(ctypes_)
    assert isinstance(rlimit, RuntimeError) and "resource.setrlimit is not allowed" in str(rlimit)
    assert isinstance(memory, RuntimeError) and "MemoryError" in str(memory)
    assert ok == "45\n" and inside == "x\n"
    assert isinstance(escaped, RuntimeError) and "writing" in str(escaped)
    assert not outside.exists()
    assert isinstance(socket_, RuntimeError) and "socket.__new__ is not allowed" in str(socket_)
    assert isinstance(subprocess_, RuntimeError) and "subprocess.Popen" in str(subprocess_)
    assert isinstance(flood, str), repr(flood)
    assert flood.endswith("...[output cut at 200 bytes]") and flood.startswith("a" * 100)
    assert isinstance(spin, TimeoutError) and "1s" in str(spin)

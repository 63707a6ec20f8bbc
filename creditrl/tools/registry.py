"""Tools the policy can call: OpenAI function schemas, argument checks, execution with timeouts.

A ``Tool`` is a Python function (sync or async) returning text, plus its OpenAI function schema
``{"type": "function", "function": {"name", "description", "parameters"}}``. The schema comes
from an explicit dict, or from the function's type hints and its docstring: the first paragraph
is the description, and lines ``name: text`` under an ``Args:`` heading describe parameters.

``ToolRegistry.call`` never raises for the policy's mistakes: an unknown tool, arguments that do
not fit the schema, a tool that raises, and a tool that runs past its timeout each come back as
a ``ToolResult`` with a status (``unknown_tool``, ``bad_arguments``, ``error``, ``timeout``) and
an error text that becomes the observation.

YAML tool config (``agent.tool_config``)::

    tools:
      - name: calculator                       # a built-in (see BUILTIN_TOOLS)
      - name: kg_lookup
        kwargs: {path: my_triples.tsv}          # passed to the built-in's factory
      - name: weather
        function: path/to/tools.py:get_weather  # or package.module:function
        description: Current weather of a city  # optional; else the docstring
        parameters: {type: object, properties: {city: {type: string}}, required: [city]}
        timeout_s: 3                            # optional; else agent.tool_timeout_s
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from creditrl.errors import ConfigError, UserCodeError
from creditrl.tools import calculator, kg_lookup, python_sandbox  # noqa: F401  (they register)
from creditrl.tools.base import (
    TOOL_FACTORIES,
    TOOL_STATUSES,
    Tool,
    ToolArgumentError,
    ToolResult,
    function_schema,
    validate_arguments,
)
from creditrl.usercode import load_user_object, one_line

__all__ = [
    "BUILTIN_TOOLS",
    "TOOL_STATUSES",
    "Tool",
    "ToolArgumentError",
    "ToolRegistry",
    "ToolResult",
    "build_registry",
    "function_schema",
    "validate_arguments",
]


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


@dataclass
class ToolRegistry:
    """Tools by name; ``call`` runs one with argument checks, a timeout and error capture.

    ``max_parallel`` bounds the calls running at once (over every sample of a batch), within
    one event loop.
    """

    tools: dict[str, Tool] = field(default_factory=dict)
    timeout_s: float = 5.0
    max_parallel: int = 4

    def __post_init__(self) -> None:
        if self.max_parallel < 1:
            raise ValueError(f"max_parallel_calls must be >= 1, got {self.max_parallel}")
        self._semaphores: dict[int, asyncio.Semaphore] = {}

    def register(self, tool: Tool) -> Tool:
        """Add ``tool``; ValueError if its name is taken."""
        if tool.name in self.tools:
            raise ValueError(f"tool {tool.name!r} is registered twice")
        self.tools[tool.name] = tool
        return tool

    def names(self) -> list[str]:
        return list(self.tools)

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI function schemas of every tool, in registration order."""
        return [tool.schema for tool in self.tools.values()]

    def _semaphore(self) -> asyncio.Semaphore:
        loop_id = id(asyncio.get_running_loop())
        if loop_id not in self._semaphores:
            self._semaphores = {loop_id: asyncio.Semaphore(self.max_parallel)}
        return self._semaphores[loop_id]

    async def call(self, name: str, arguments: Any) -> ToolResult:
        """Run tool ``name`` with ``arguments``; every failure becomes a ToolResult."""
        start = time.perf_counter()
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(
                "unknown_tool", f"Error: unknown tool {name!r}; available tools: {self.names()}"
            )
        try:
            arguments = validate_arguments(tool.parameters, arguments)
        except ToolArgumentError as e:
            return ToolResult("bad_arguments", f"Error: bad arguments for {name!r}: {e}")
        timeout = tool.timeout_s if tool.timeout_s is not None else self.timeout_s
        async with self._semaphore():
            start = time.perf_counter()
            try:
                if inspect.iscoroutinefunction(tool.fn):
                    value = await asyncio.wait_for(tool.fn(**arguments), timeout)
                else:
                    value = await asyncio.wait_for(asyncio.to_thread(tool.fn, **arguments), timeout)
            except TimeoutError as e:
                return ToolResult(
                    "timeout",
                    f"Error: tool {name!r} timed out: {str(e) or f'no result after {timeout:g}s'}",
                    time.perf_counter() - start,
                )
            except Exception as e:
                return ToolResult(
                    "error",
                    f"Error: {type(e).__name__}: {e}",
                    time.perf_counter() - start,
                )
        return ToolResult("ok", _as_text(value), time.perf_counter() - start)


BUILTIN_TOOLS = tuple(TOOL_FACTORIES)  # the built-ins, each registered by its module


_ENTRY_KEYS = ("description", "function", "kwargs", "parameters", "timeout_s")


def _check_entry(entry: Any, where: str) -> dict[str, Any]:
    """The entry as a dict with its keys' types checked (ConfigError naming ``where``)."""
    if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
        raise ConfigError(f"{where}: each tool entry needs a 'name' string (got {entry!r})")
    entry = dict(entry)
    name = entry["name"]
    unknown = sorted(set(entry) - {"name", *_ENTRY_KEYS})
    if unknown:
        raise ConfigError(
            f"{where}: tool {name!r} has unknown keys {unknown}; use {sorted(_ENTRY_KEYS)}"
        )
    types_ = {"function": str, "description": str, "parameters": Mapping, "kwargs": Mapping}
    for key, kind in types_.items():
        if entry.get(key) is not None and not isinstance(entry[key], kind):
            raise ConfigError(
                f"{where}: tool {name!r}: {key!r} must be a {kind.__name__}, "
                f"got {type(entry[key]).__name__}"
            )
    timeout = entry.get("timeout_s")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
    ):
        raise ConfigError(
            f"{where}: tool {name!r}: timeout_s must be a number > 0, got {timeout!r}"
        )
    return entry


def _tool_from_entry(entry: Any, where: str, timeout_s: float) -> Tool:
    entry = _check_entry(entry, where)
    name = entry.pop("name")
    kwargs = dict(entry.get("kwargs") or {})
    if "function" in entry:
        if kwargs:
            raise ConfigError(f"{where}: tool {name!r}: 'kwargs' is for built-ins only")
        fn = load_user_object(entry["function"], f"{where} function")
        try:
            tool = Tool.from_function(fn, name, entry.get("description"), entry.get("parameters"))
        except (TypeError, ValueError, NameError) as e:
            raise UserCodeError(
                f"{where}: tool {name!r} ({entry['function']}): {one_line(e)}"
            ) from e
    else:
        if name not in TOOL_FACTORIES:
            raise ConfigError(
                f"{where}: tool {name!r} is not a built-in {TOOL_FACTORIES.names()}; "
                "give a 'function: path.py:fn'"
            )
        factory = TOOL_FACTORIES.get(name)
        if "timeout_s" in inspect.signature(factory).parameters:
            kwargs.setdefault("timeout_s", float(entry.get("timeout_s") or timeout_s))
        try:
            tool = factory(**kwargs)
        except (TypeError, ValueError, OSError) as e:
            raise ConfigError(
                f"{where}: built-in tool {name!r} with kwargs {kwargs}: "
                f"{type(e).__name__}: {one_line(e)}"
            ) from e
        if "description" in entry:
            tool.schema["function"]["description"] = entry["description"]
        if "parameters" in entry:
            tool.schema["function"]["parameters"] = dict(entry["parameters"])
    if entry.get("timeout_s") is not None and tool.timeout_s is None:
        tool.timeout_s = float(entry["timeout_s"])
    return tool


def _tool_entries(tool_config: str) -> list[Any]:
    """The ``tools:`` list of the YAML file ``tool_config`` (ConfigError naming the file)."""
    from omegaconf import OmegaConf

    path = Path(tool_config).expanduser()
    if not path.is_file():
        raise ConfigError(f"agent.tool_config: {path} does not exist")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}
    except Exception as e:
        raise ConfigError(
            f"agent.tool_config: {path} is not valid YAML: {type(e).__name__}: {one_line(e)}"
        ) from e
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ConfigError(f"agent.tool_config: {path}: expected a top-level 'tools:' list")
    return entries


def build_registry(
    names: Sequence[str] = (),
    tool_config: str | None = None,
    timeout_s: float = 5.0,
    max_parallel: int = 4,
) -> ToolRegistry:
    """A registry of the built-ins ``names`` plus the entries of the YAML ``tool_config``.

    Every mistake in them (an unknown name, a missing or unparsable file, a bad entry, user
    code that does not load) is a one-line ConfigError or UserCodeError naming the entry.
    """
    registry = ToolRegistry(timeout_s=timeout_s, max_parallel=max_parallel)
    for name in names:
        if name in registry.tools:
            raise ConfigError(f"agent.tools: {name!r} is listed twice")
        registry.register(_tool_from_entry({"name": name}, "agent.tools", timeout_s))
    if tool_config:
        for i, entry in enumerate(_tool_entries(tool_config)):
            where = f"agent.tool_config: {Path(tool_config).expanduser()} tools[{i}]"
            tool = _tool_from_entry(entry, where, timeout_s)
            if tool.name in registry.tools and tool.name not in names:
                raise ConfigError(f"{where}: tool {tool.name!r} is defined twice in the file")
            registry.tools[tool.name] = tool  # a file entry may refine a built-in of agent.tools
    return registry

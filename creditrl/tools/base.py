"""What a tool is: a Python function with its OpenAI function schema (``Tool``), the outcome of
one call (``ToolResult``), schemas from type hints and docstrings (``function_schema``),
argument checks (``validate_arguments``), and the registry of built-in tool factories
(``TOOL_FACTORIES``, ``register_tool``) each built-in adds itself to.

The schema comes from an explicit dict, or from the function's type hints and its docstring:
the first paragraph is the description, and lines ``name: text`` under an ``Args:`` heading
describe parameters.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from creditrl.registry import Registry

__all__ = [
    "TOOL_FACTORIES",
    "TOOL_STATUSES",
    "Tool",
    "ToolArgumentError",
    "ToolResult",
    "function_schema",
    "register_tool",
    "validate_arguments",
]

TOOL_STATUSES = ("ok", "error", "timeout", "unknown_tool", "bad_arguments", "malformed", "skipped")

_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    tuple: "array",
    dict: "object",
}


_ARG_HEADINGS = ("Args:", "Arguments:", "Parameters:")


class ToolArgumentError(ValueError):
    """Arguments that do not fit a tool's schema."""


@dataclass
class Tool:
    """A callable the policy may use. ``fn(**arguments)`` returns text (other values are
    JSON-encoded); it may be a coroutine function. ``timeout_s`` None: the registry default."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    timeout_s: float | None = None

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the arguments object."""
        return self.schema["function"]["parameters"]

    @classmethod
    def from_function(
        cls,
        fn: Callable[..., Any],
        name: str | None = None,
        description: str | None = None,
        parameters: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> Tool:
        """A Tool whose schema comes from ``fn``'s hints and docstring unless given."""
        schema = function_schema(fn, name, description)
        if parameters is not None:
            schema["function"]["parameters"] = dict(parameters)
        return cls(schema["function"]["name"], fn, schema, timeout_s)


@dataclass
class ToolResult:
    """One call's outcome: ``status`` in TOOL_STATUSES, ``output`` (the observation text)."""

    status: str
    output: str
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _doc_parts(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google-style docstring: the first
    paragraph, and the ``name: text`` lines of an indented ``Args:`` block (deeper-indented
    lines continue the previous parameter)."""
    doc = inspect.getdoc(fn) or ""
    description = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    lines = doc.splitlines()
    heads = [i for i, line in enumerate(lines) if line.strip() in _ARG_HEADINGS]
    params: dict[str, str] = {}
    if not heads:
        return description, params
    indent, current = None, None
    for line in lines[heads[0] + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:
            break
        indent = depth if indent is None else indent
        head, sep, text = line.strip().partition(":")
        name = head.split("(")[0].strip()
        if depth == indent and sep and name.isidentifier():
            current = name
            params[name] = text.strip()
        elif current is not None:
            params[current] = f"{params[current]} {line.strip()}".strip()
    return description, params


def _type_schema(hint: Any, where: str) -> dict[str, Any]:
    """JSON schema of one annotation (str, int, float, bool, list[X], dict, Literal, X | None)."""
    origin = typing.get_origin(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if origin is typing.Literal:
        values = list(typing.get_args(hint))
        return {"type": _JSON_TYPES.get(type(values[0]), "string"), "enum": values}
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return _type_schema(args[0], where)
        return {"anyOf": [_type_schema(a, where) for a in args]}
    if origin in (list, tuple, Sequence):
        args = typing.get_args(hint)
        item = _type_schema(args[0], where) if args and args[0] is not Ellipsis else {}
        return {"type": "array", "items": item} if item else {"type": "array"}
    if origin in (dict, Mapping):
        return {"type": "object"}
    raise TypeError(f"{where}: cannot describe type {hint!r} in a tool schema")


def function_schema(
    fn: Callable[..., Any], name: str | None = None, description: str | None = None
) -> dict[str, Any]:
    """OpenAI function schema of ``fn`` from its type hints and docstring.

    Every parameter needs a hint; parameters without a default are ``required``.
    """
    name = name or fn.__name__
    hints = typing.get_type_hints(fn)
    doc_description, doc_params = _doc_parts(fn)
    properties: dict[str, Any] = {}
    required = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.name not in hints:
            raise TypeError(f"tool {name!r}: parameter {param.name!r} has no type hint")
        prop = _type_schema(hints[param.name], f"tool {name!r} parameter {param.name!r}")
        if param.name in doc_params:
            prop["description"] = doc_params[param.name]
        properties[param.name] = prop
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description or doc_description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _fits(value: Any, schema: Mapping[str, Any]) -> bool:
    if "anyOf" in schema:
        return any(_fits(value, s) for s in schema["anyOf"])
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind is None:
        return True
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
        "null": lambda v: v is None,
    }
    kinds = kind if isinstance(kind, list) else [kind]
    if not any(checks.get(k, lambda v: True)(value) for k in kinds):
        return False
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return all(_fits(v, schema["items"]) for v in value)
    return True


def validate_arguments(parameters: Mapping[str, Any], arguments: Any) -> dict[str, Any]:
    """``arguments`` checked against a parameters schema (object with properties/required):
    a dict, no unknown keys, every required key, each value of its declared type (and enum).
    Raises ToolArgumentError naming the first problem."""
    if not isinstance(arguments, dict):
        raise ToolArgumentError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    properties = parameters.get("properties", {})
    unknown = sorted(set(arguments) - set(properties))
    if unknown and parameters.get("additionalProperties", False) is False:
        raise ToolArgumentError(f"unknown argument(s) {unknown}; expected {sorted(properties)}")
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    if missing:
        raise ToolArgumentError(f"missing required argument(s) {missing}")
    for key, value in arguments.items():
        schema = properties.get(key, {})
        if not _fits(value, schema):
            want = schema.get("type") or schema.get("anyOf") or schema.get("enum")
            raise ToolArgumentError(f"argument {key!r}={value!r} does not match {want}")
    return dict(arguments)


ToolFactory = Callable[..., "Tool"]
TOOL_FACTORIES: Registry[ToolFactory] = Registry("built-in tool")


def register_tool(name: str) -> Callable[[ToolFactory], ToolFactory]:
    """Decorator: register a built-in tool's factory ``fn(**kwargs) -> Tool`` under ``name``
    (a tool config entry ``{name, kwargs}`` builds it; a factory taking ``timeout_s`` gets
    the entry's or ``agent.tool_timeout_s``)."""
    return TOOL_FACTORIES.register(name)

"""Tools for multi-turn agents: a registry of OpenAI-schema functions and the built-ins.

- ``registry``: ``Tool``, ``ToolRegistry`` (argument checks, timeouts, error results),
  ``function_schema`` (from type hints and docstrings), ``build_registry`` (names + YAML file).
- ``calculator``: arithmetic from a parsed syntax tree (never ``eval``).
- ``python_sandbox``: model-written code in a bubblewrap sandbox (namespaces, no network,
  bounded disk, memory, processes and time; docs/security.md states what it promises).
- ``kg_lookup``: facts from a local triple file.
- ``output``: ``truncate_text`` (left / right / middle).
"""

from creditrl.tools.output import TRUNCATE_SIDES, truncate_text
from creditrl.tools.registry import (
    BUILTIN_TOOLS,
    TOOL_STATUSES,
    Tool,
    ToolArgumentError,
    ToolRegistry,
    ToolResult,
    build_registry,
    function_schema,
    validate_arguments,
)

__all__ = [
    "BUILTIN_TOOLS",
    "TOOL_STATUSES",
    "TRUNCATE_SIDES",
    "Tool",
    "ToolArgumentError",
    "ToolRegistry",
    "ToolResult",
    "build_registry",
    "function_schema",
    "truncate_text",
    "validate_arguments",
]

"""Sizes a config may have, checked before any of it is parsed into values.

PyYAML's composer recurses once per nesting level (a few thousand ``[`` end in a RecursionError)
and its pure-Python scanner slows down with depth (a 400 KB line of ``[`` took minutes here),
and OmegaConf copies what an alias points at (a few nested aliases grow into millions of
nodes). So a YAML file, and the value of each ``key=value`` override, is first read as a
stream of events (libyaml's C parser where PyYAML has it, which also refuses very deep flow
collections by itself), which stops at the first limit passed: nesting depth, nodes counted
with every alias expanded to the size of what it names, bytes. Override keys are bounded in
length and in parts. Each refusal is one ``ConfigError`` naming the file or override.
"""

from __future__ import annotations

import yaml

from creditrl.errors import ConfigError

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_DEPTH",
    "MAX_KEY_PARTS",
    "MAX_NODES",
    "MAX_OVERRIDE_CHARS",
    "check_override",
    "check_yaml",
    "shorten",
]

MAX_CONFIG_BYTES = 1 << 20  # a YAML config file
MAX_OVERRIDE_CHARS = 64 * 1024  # one key=value override
MAX_DEPTH = 32  # nesting of YAML values (the schema itself is 4 deep)
MAX_NODES = 100_000  # scalars and collections, aliases expanded
MAX_KEY_PARTS = 16  # parts of a dotted override key
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_STARTS = (yaml.SequenceStartEvent, yaml.MappingStartEvent)
_ENDS = (yaml.SequenceEndEvent, yaml.MappingEndEvent)


def shorten(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters for an error line (the rest counted, not shown)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def check_yaml(text: str, where: str) -> None:
    """ConfigError naming ``where`` unless the YAML ``text`` is within ``MAX_CONFIG_BYTES``,
    ``MAX_DEPTH`` and ``MAX_NODES`` (aliases counted as the nodes they name); a syntax error
    is left to the loader, which names its line."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{where}: {size} bytes, above the limit of {MAX_CONFIG_BYTES}")
    anchored: dict[str, int] = {}
    open_nodes: list[tuple[int, str | None]] = []  # (nodes counted when it opened, anchor)
    nodes = 0
    try:
        for event in yaml.parse(text, Loader=_LOADER):
            if isinstance(event, _STARTS):
                nodes += 1
                open_nodes.append((nodes, event.anchor))
                if len(open_nodes) > MAX_DEPTH:
                    raise ConfigError(f"{where}: nested deeper than the limit of {MAX_DEPTH}")
            elif isinstance(event, _ENDS):
                began, anchor = open_nodes.pop()
                if anchor is not None:
                    anchored[anchor] = nodes - began + 1
            elif isinstance(event, yaml.ScalarEvent):
                nodes += 1
                if event.anchor is not None:
                    anchored[event.anchor] = 1
            elif isinstance(event, yaml.AliasEvent):
                nodes += anchored.get(event.anchor, 1)
            if nodes > MAX_NODES:
                raise ConfigError(
                    f"{where}: more than {MAX_NODES} values (aliases counted as what they name)"
                )
    except yaml.YAMLError as err:
        # libyaml refuses flow collections nested past its own limit as a syntax error; any
        # other syntax error is the loader's to report, with its line
        if "maximum nesting depth" in str(getattr(err, "problem", "")):
            raise ConfigError(f"{where}: nested deeper than the limit of {MAX_DEPTH}") from None


def check_override(item: str) -> None:
    """ConfigError unless the override ``item`` (``key=value``) is within
    ``MAX_OVERRIDE_CHARS`` and its key within ``MAX_KEY_PARTS`` parts; its value within
    ``check_yaml``'s limits."""
    if len(item) > MAX_OVERRIDE_CHARS:
        raise ConfigError(
            f"override '{shorten(item)}' is longer than the limit of {MAX_OVERRIDE_CHARS} "
            "characters; put large values in a YAML file"
        )
    key, _, value = item.partition("=")
    if key.count(".") >= MAX_KEY_PARTS:
        raise ConfigError(
            f"override '{shorten(item)}': its key has more than {MAX_KEY_PARTS} parts"
        )
    check_yaml(value, f"override '{shorten(item)}'")

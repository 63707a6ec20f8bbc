"""The config documents itself: every key with its type, default, allowed values and doc.

A field's doc is its attribute docstring in ``schema.py`` (the string on the line after the
field, as Sphinx and IDEs read it); a section's doc is its dataclass's docstring. Both are read
from the source with ``ast``, so ``python -OO`` keeps them. Allowed values come from the
field's metadata (``creditrl.config.fields``): its choices (registries included) or range.

``render_text`` is what ``creditrl config --doc [SECTION]`` prints; ``render_markdown`` is
``docs/config.md`` (``creditrl config --doc --markdown > docs/config.md``).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from creditrl.config import schema
from creditrl.config.fields import choices_of, choices_text, format_value
from creditrl.config.options import declared_keys
from creditrl.config.schema import Config
from creditrl.errors import ConfigError

__all__ = [
    "KeyDoc",
    "SectionDoc",
    "field_docs",
    "render_markdown",
    "render_text",
    "section_docs",
]

MARKDOWN_COMMAND = "creditrl config --doc --markdown > docs/config.md"


@dataclass(frozen=True)
class KeyDoc:
    """One setting: dotted key, annotation as written, default, allowed values, doc."""

    key: str
    type: str
    default: Any
    allowed: str
    doc: str


@dataclass(frozen=True)
class SectionDoc:
    """A section (``actor``, ``algorithm.rollout_is``): its doc and its own settings."""

    name: str
    doc: str
    keys: list[KeyDoc]


@functools.cache
def _class_docs(cls: type) -> tuple[str, dict[str, str]]:
    """(class docstring, {field name: attribute docstring}) read from ``cls``'s source."""
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(node, ast.ClassDef)
    docs = {}
    for stmt, after in zip(node.body, node.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return inspect.cleandoc(ast.get_docstring(node) or ""), docs


def field_docs(cls: type) -> dict[str, str]:
    """{field name: raw attribute docstring} of a config dataclass (bases included)."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(_class_docs(base)[1])
    return docs


def _plain(text: str) -> str:
    """Whitespace collapsed to single spaces, ``code`` marked with single backticks."""
    return " ".join(text.replace("``", "`").split())


def _paragraphs(text: str) -> list[str]:
    return [_plain(p) for p in re.split(r"\n\s*\n", text) if p.strip()]


def _allowed(metadata: Mapping[str, Any], is_list: bool) -> str:
    """'one of a, b' for a field with choices, its range for a numeric field, else ''."""
    choices = choices_of(metadata)
    if choices is not None:
        return f"{'each one of' if is_list else 'one of'} {choices_text(metadata, choices)}"
    return metadata["range"].text() if "range" in metadata else ""


def section_docs(root: Any = None) -> list[SectionDoc]:
    """Every section of ``root`` (default: ``Config()``), walked depth first, each with its
    own (non-section) settings; defaults are read from the instance, so ``actor.optim.lr``
    shows the actor's default."""
    out: list[SectionDoc] = []

    def walk(node: Any, name: str) -> None:
        cls = type(node)
        docs = field_docs(cls)
        keys, children = [], []
        for f in dataclasses.fields(cls):
            value = getattr(node, f.name)
            key = f"{name}.{f.name}" if name else f.name
            if dataclasses.is_dataclass(value):
                children.append((value, key))
                continue
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            allowed = _allowed(f.metadata, kind.startswith("list"))
            keys.append(KeyDoc(key, kind, value, allowed, _plain(docs.get(f.name, ""))))
            if "options_for" in f.metadata:
                keys += _option_docs(root_node, key, f.metadata["options_for"])
        if keys:
            out.append(SectionDoc(name, _class_docs(cls)[0], keys))
        for child, key in children:
            walk(child, key)

    root_node = root if root is not None else Config()
    walk(root_node, "")
    return out


def _option_docs(root: Any, key: str, selector: str) -> list[KeyDoc]:
    """The options registered entries declare under ``key`` (``creditrl.config.options``)."""
    return [
        KeyDoc(
            found.key,
            found.option.type_name,
            found.option.default,
            found.option.allowed(),
            _plain(f"{found.option.doc} (with {found.owner})".strip()),
        )
        for found in declared_keys(root, key, selector)
    ]


def _select(sections: list[SectionDoc], wanted: str | None) -> list[SectionDoc]:
    """The sections named ``wanted`` or below it, or the one key ``wanted``; all for None."""
    if not wanted:
        return sections
    chosen = [s for s in sections if s.name == wanted or s.name.startswith(f"{wanted}.")]
    if chosen:
        return chosen
    for section in sections:
        for key in section.keys:
            if key.key == wanted:
                return [SectionDoc(section.name, section.doc, [key])]
    names = [s.name for s in sections]
    close = difflib.get_close_matches(wanted, names + [k.key for s in sections for k in s.keys])
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise ConfigError(
        f"unknown config section '{wanted}'; choose one of {', '.join(names)} "
        f"(or one of their keys){hint}"
    )


def _wrap(text: str, width: int, indent: str = "") -> list[str]:
    """``text`` wrapped at spaces only (names such as seq-mean-token-mean stay whole)."""
    return textwrap.wrap(
        text,
        width,
        initial_indent=indent,
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
    )


def render_text(section: str | None = None, width: int = 100) -> str:
    """The docs of ``section`` (a section, its subsections, or one key; None: all) as aligned
    text ``width`` columns wide: a section's doc at column 0, each key at column 2 with its
    type and default, its doc and allowed values at column 6."""
    width = max(width, 60)
    lines: list[str] = []
    for sec in _select(section_docs(), section):
        if lines:
            lines.append("")
        first, *rest = _paragraphs(sec.doc) or [""]
        lines += _wrap(f"[{sec.name}] {first}", width)
        for paragraph in rest:
            lines += _wrap(paragraph, width)
        for key in sec.keys:
            lines.append(f"  {key.key}: {key.type} = {format_value(key.default)}")
            lines += _wrap(key.doc, width, "      ")
            if key.allowed:
                lines += _wrap(f"allowed: {key.allowed}", width, "      ")
    return "\n".join(lines) + "\n"


def _cell(text: str, code: bool = False) -> str:
    """``text`` made safe for a Markdown table cell (pipes escaped; '<' too outside code),
    optionally as code."""
    text = text.replace("|", "\\|")
    if code:
        return f"`{text}`" if text else text
    return text.replace("<", "\\<")


def render_markdown(section: str | None = None) -> str:
    """``docs/config.md``: an intro (``schema``'s module docstring), then one table per section
    (key, type, default, allowed, description)."""
    lines = [
        "# Configuration reference",
        "",
        f"Generated from `creditrl/config/schema.py` by `{MARKDOWN_COMMAND}`; do not edit by "
        "hand (`tests/test_config_doc.py` checks that it is current).",
        "",
        "Set a key as `section.key=value` on the command line or nested in a YAML file; `null` "
        "is YAML's None. `creditrl config --doc SECTION` (or `--doc KEY`) prints one section (or "
        "key) in the terminal.",
        "",
    ]
    module = ast.parse(inspect.getsource(schema))
    for paragraph in _paragraphs(ast.get_docstring(module) or ""):
        lines += [paragraph, ""]
    for sec in _select(section_docs(), section):
        lines += [f"## `{sec.name}`", ""]
        lines += [line for paragraph in _paragraphs(sec.doc) for line in (paragraph, "")]
        lines += ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
        for key in sec.keys:
            cells = (
                _cell(key.key, code=True),
                _cell(key.type, code=True),
                _cell(format_value(key.default), code=True),
                _cell(key.allowed),
                _cell(key.doc),
            )
            lines.append(f"| {' | '.join(cells)} |")
        lines.append("")
    return "\n".join(lines)

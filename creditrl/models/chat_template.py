"""A model directory's chat template, rendered once under a time and memory bound when its
tokenizer loads: ``check_chat_template``.

Jinja's sandbox keeps a template away from Python's internals but bounds no work: two nested
``range(100000)`` loops run for hours, and a growing output takes all the memory. So the
tokenizer's own ``apply_chat_template`` renders ``SAMPLE_CONVERSATION`` (a system prompt and
16 turns of 2048 characters, then the generation prompt), and again with ``SAMPLE_TOOLS`` and a
tool call and its result, in a forked child process per template (a tokenizer may hold several,
e.g. ``additional_chat_templates/tool_use.jinja``), which is killed after ``RENDER_TIME_S``
seconds and may grow by ``RENDER_MEMORY_BYTES`` at most. Real templates render these in
milliseconds; one that does not finish within the bounds is a one-line ``ModelError`` naming
its file. The check costs ~60 ms (fork and renders of the tiny model's template, 2-core dev
CPU) once per tokenizer and process; each prompt's render afterwards is transformers' own, at no
extra cost. An error the template raises itself (a role it does not support, say) is left to
the real render. Only a verdict of a few bytes crosses the process boundary.
"""

from __future__ import annotations

import os
import resource
import select
import signal
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from creditrl.models.model_dir import ModelError

__all__ = [
    "RENDER_MEMORY_BYTES",
    "RENDER_TIME_S",
    "SAMPLE_CONVERSATION",
    "SAMPLE_TOOLS",
    "check_chat_template",
    "template_file",
]

RENDER_TIME_S = 5.0
RENDER_MEMORY_BYTES = 1 << 30
_TURN = ("Compute 12 + 34 - 5 and explain each step. " * 48)[:2048]
SAMPLE_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    *({"role": role, "content": _TURN} for _ in range(8) for role in ("user", "assistant")),
    {"role": "user", "content": _TURN},
]
SAMPLE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
_TOOL_TURN = [
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "12+34"}},
            }
        ],
    },
    {"role": "tool", "content": "46"},
]
_OK, _MEMORY = b"ok", b"memory"


def check_chat_template(tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """``ModelError`` naming the template's file when rendering ``SAMPLE_CONVERSATION`` takes
    more than ``RENDER_TIME_S`` or ``RENDER_MEMORY_BYTES``; nothing for a tokenizer without a
    template."""
    templates = getattr(tokenizer, "chat_template", None) or {}
    if isinstance(templates, str):
        templates = {"default": templates}
    for name, template in templates.items():
        verdict = _render_in_child(tokenizer, template)
        if verdict is not None:
            raise ModelError(f"{template_file(directory, name)}: {_describe(verdict)}")


def _describe(verdict: bytes) -> str:
    if verdict == _MEMORY:
        what = f"needed more than {RENDER_MEMORY_BYTES >> 20} MiB of memory"
    elif verdict:
        what = f"did not finish within {RENDER_TIME_S:g} s"
    else:
        what = "crashed"
    return (
        f"the chat template {what} rendering a conversation of {len(SAMPLE_CONVERSATION)} "
        "messages; creditrl refuses a template whose work is unbounded"
    )


def template_file(directory: Path, name: str = "default") -> Path:
    """The file of ``directory`` that holds its chat template ``name``."""
    candidates = [f"additional_chat_templates/{name}.jinja"]
    if name == "default":
        candidates = ["chat_template.jinja", "chat_template.json"]
    for candidate in candidates:
        if (directory / candidate).is_file():
            return directory / candidate
    return directory / "tokenizer_config.json"


def _render_in_child(tokenizer: PreTrainedTokenizerBase, template: str) -> bytes | None:
    """None when the child rendered within the bounds; else ``_MEMORY``, b"time" or b"" (the
    child died without a verdict)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: render, write the verdict, exit without running any cleanup
        try:
            os.close(read_fd)
            os.write(write_fd, _render(tokenizer, template))
        finally:
            os._exit(0)
    os.close(write_fd)
    verdict = b"time"
    try:
        if select.select([read_fd], [], [], RENDER_TIME_S)[0]:
            verdict = os.read(read_fd, 16)
    finally:
        os.close(read_fd)
        if verdict == b"time":
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return None if verdict == _OK else verdict


def _render(tokenizer: PreTrainedTokenizerBase, template: str) -> bytes:
    size = _address_space()
    if size is not None:
        limit = size + RENDER_MEMORY_BYTES
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    for messages, tools in (
        (SAMPLE_CONVERSATION, None),
        ([*SAMPLE_CONVERSATION, *_TOOL_TURN], SAMPLE_TOOLS),
    ):
        try:
            tokenizer.apply_chat_template(
                messages,
                chat_template=template,
                tools=tools,
                tokenize=False,
                add_generation_prompt=True,
            )
        except MemoryError:
            return _MEMORY
        except Exception:  # the template's own error is the real render's to report
            continue
    return _OK


def _address_space() -> int | None:
    """This process's virtual memory size in bytes (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None

"""A model directory's chat template, rendered once under a time and memory bound when its
tokenizer loads: ``check_chat_template``.

Jinja's sandbox keeps a template away from Python's internals but bounds no work: two nested
``range(100000)`` loops run for hours, and a growing output takes all the memory. So the
tokenizer's own ``apply_chat_template`` renders ``SAMPLE_CONVERSATION`` (a system prompt and
16 turns of 2048 characters, then the generation prompt) in a forked child process, which is
killed after ``RENDER_TIME_S`` seconds and may grow by ``RENDER_MEMORY_BYTES`` at most. Real
templates render it in milliseconds; one that does not finish within the bounds is a one-line
``ModelError`` naming its file. The fork costs milliseconds once per tokenizer and process, and
the renders of each prompt afterwards are transformers' own, at no extra cost. An error the
template raises itself (a role it does not support, say) is left to the real render. Only a
verdict of a few bytes crosses the process boundary.
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
_OK, _MEMORY = b"ok", b"memory"


def check_chat_template(tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """``ModelError`` naming the template's file when rendering ``SAMPLE_CONVERSATION`` takes
    more than ``RENDER_TIME_S`` or ``RENDER_MEMORY_BYTES``; nothing for a tokenizer without a
    template."""
    if not getattr(tokenizer, "chat_template", None):
        return
    verdict = _render_in_child(tokenizer)
    if verdict is None:
        return
    if verdict == _MEMORY:
        what = f"needed more than {RENDER_MEMORY_BYTES >> 20} MiB of memory"
    elif verdict:
        what = f"did not finish within {RENDER_TIME_S:g} s"
    else:
        what = "crashed"
    raise ModelError(
        f"{template_file(directory)}: the chat template {what} rendering a conversation of "
        f"{len(SAMPLE_CONVERSATION)} messages; creditrl refuses a template whose work is "
        "unbounded"
    )


def template_file(directory: Path) -> Path:
    """The file of ``directory`` that holds its chat template."""
    for name in ("chat_template.jinja", "chat_template.json"):
        if (directory / name).is_file():
            return directory / name
    return directory / "tokenizer_config.json"


def _render_in_child(tokenizer: PreTrainedTokenizerBase) -> bytes | None:
    """None when the child rendered within the bounds; else ``_MEMORY``, b"time" or b"" (the
    child died without a verdict)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: render, write the verdict, exit without running any cleanup
        try:
            os.close(read_fd)
            os.write(write_fd, _render(tokenizer))
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


def _render(tokenizer: PreTrainedTokenizerBase) -> bytes:
    size = _address_space()
    if size is not None:
        limit = size + RENDER_MEMORY_BYTES
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        tokenizer.apply_chat_template(
            SAMPLE_CONVERSATION, tokenize=False, add_generation_prompt=True
        )
    except MemoryError:
        return _MEMORY
    except Exception:  # the template's own error is the real render's to report
        return _OK
    return _OK


def _address_space() -> int | None:
    """This process's virtual memory size in bytes (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None

"""The chat template's formats for the agent loop: tool-message text, assistant closing text.

The agent loop never re-renders the conversation. It needs, for each batch of new tool
messages, the *text* the chat template puts after an assistant turn's content: the end of that
turn, the tool messages, and the next assistant header. That text is found by rendering a probe
conversation whose last assistant content is a unique marker and taking what follows the marker;
only this text is encoded, and its ids are appended to the trajectory (``response_mask`` 0).
If the assistant's turn already ended with the template's end-of-turn token (e.g. ChatML's
``<|im_end|>`` sampled as EOS), that token's text is not repeated. Every render is bounded in
time on whichever thread runs it (``creditrl.data.render_bound``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from creditrl.data import render_bound
from creditrl.data.render_bound import time_bound

__all__ = ["ChatFormat"]

_MARKER = "CREDITRLTURNMARKER"
_PROBE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]


class ChatFormat:
    """Chat-template pieces for one tokenizer (ChatML, Llama 3, Qwen, ... any Jinja template
    that renders a ``tool`` role, or ``tool_role`` if it uses another name)."""

    def __init__(self, tokenizer: Any, tool_role: str = "tool") -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; the agent loop needs one")
        self.tokenizer = tokenizer
        self.tool_role = tool_role
        closed = self.render([*_PROBE, {"role": "assistant", "content": _MARKER}], False)
        self.closing_text = self._after_marker(closed)
        try:
            self.observation_text([{"role": tool_role, "content": "probe"}], None)
        except Exception as e:
            raise ValueError(
                f"the chat template cannot render a {tool_role!r} message ({e}); set "
                "agent.tool_role to the role name it uses for tool results"
            ) from e

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        """The template's text for ``messages``; ``RenderTimeout`` past
        ``render_bound.RENDER_TIME_S``, on any thread."""
        with time_bound(render_bound.RENDER_TIME_S):
            return self.tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )

    def ids(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> list[int]:
        """Token ids of the whole conversation rendered at once (what drift checks compare to);
        ``RenderTimeout`` past ``render_bound.RENDER_TIME_S``, on any thread."""
        with time_bound(render_bound.RENDER_TIME_S):
            out = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                tokenize=True,
                add_generation_prompt=add_generation_prompt,
                return_dict=False,
            )
        if isinstance(out, Mapping):
            out = out["input_ids"]
        return [int(t) for t in out]

    @staticmethod
    def _after_marker(text: str) -> str:
        at = text.rfind(_MARKER)
        if at < 0:
            raise ValueError("the chat template dropped the assistant content of a probe turn")
        return text[at + len(_MARKER) :]

    def observation_text(
        self, tool_messages: Sequence[Mapping[str, Any]], last_token_text: str | None
    ) -> str:
        """Text that follows an assistant turn's content: its end, ``tool_messages`` and the next
        assistant header. ``last_token_text``: the decoded last token of the turn when it is an
        end-of-turn (EOS) token; when the text starts with it, it is not repeated."""
        probe = [*_PROBE, {"role": "assistant", "content": _MARKER}, *tool_messages]
        text = self._after_marker(self.render(probe, True))
        if last_token_text and text.startswith(last_token_text):
            text = text[len(last_token_text) :]
        return text

    def observation_ids(
        self, tool_messages: Sequence[Mapping[str, Any]], last_token_text: str | None
    ) -> list[int]:
        """``observation_text`` encoded on its own (no special tokens added)."""
        text = self.observation_text(tool_messages, last_token_text)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def assistant_content(self, ids: Sequence[int], eos_token_ids: Sequence[int]) -> str:
        """A turn's text for parsing and logs: its ids decoded, a final EOS id left out."""
        ids = list(ids)
        if ids and ids[-1] in eos_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

"""One trajectory as the OpenAI-compatible endpoint records it: token in, token out.

A program sends its whole conversation with every request. The endpoint never trains on that
text re-encoded; it keeps the token ids it generated and appends only what is new:

1. first request: the messages rendered with the chat template (``add_generation_prompt``)
   are the prompt ids;
2. later request: its messages must start with the previous request's messages followed by the
   assistant reply the endpoint returned (same role and text). The messages after them (tool
   results, user turns) are new: rendered after the assistant turn's end exactly as the built-in
   agent loop renders observations (``ChatFormat.observation_ids``) and appended with
   ``response_mask`` 0 and the turn that produced them;
3. the whole request is also rendered at once and compared with the recorded ids: where they
   differ, the recorded ids win and the first diverging token is recorded (``drift``), as
   ``check-tokenization`` reports it;
4. a request that drops or edits an earlier turn (history rewritten) ends the recorded
   trajectory there (``stop_reason`` "rewritten"): the rest of the episode is generated from
   its own rendering and never trained on as if it were the same sequence.

The new turn is generated from the recorded ids by the rollout engine and appended with
``response_mask`` 1 and its sampling log-probs. Once recording has ended, what is generated
still counts against the budget (``unrecorded``), so an episode never generates more than
``rollout.max_response_length`` tokens in all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from creditrl.agents.chat import ChatFormat
from creditrl.agents.drift import first_divergence
from creditrl.agents.loop import Trajectory
from creditrl.data import render_bound
from creditrl.data.render_bound import time_bound
from creditrl.rollout.continuation import TurnOutput

__all__ = ["Transcript", "message_text", "render_ids"]


def message_text(message: Mapping[str, Any]) -> str:
    """A message's content as text (OpenAI content parts joined; None as "")."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return str(content)


def _plain(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them: role and text content (plus a tool message's
    ``tool_call_id`` and a message's ``name`` when given)."""
    out = []
    for m in messages:
        plain = {"role": str(m.get("role")), "content": message_text(m)}
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                plain[key] = m[key]
        out.append(plain)
    return out


def render_ids(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Any, generation: bool
) -> list[int]:
    """Token ids of ``messages`` (and ``tools``, for templates that render them) under the chat
    template; ``RenderTimeout`` past ``render_bound.RENDER_TIME_S`` (the endpoint renders on a
    worker thread: the bound holds there too)."""
    kwargs = {"tools": tools} if tools else {}
    with time_bound(render_bound.RENDER_TIME_S):
        out = tokenizer.apply_chat_template(
            _plain(messages),
            tokenize=True,
            add_generation_prompt=generation,
            return_dict=False,
            **kwargs,
        )
    if isinstance(out, Mapping):
        out = out["input_ids"]
    return [int(t) for t in out]


@dataclass
class Transcript:
    """The endpoint's record of one trajectory (see the module docstring).

    ``trajectory`` holds the trained ids (None until the first request); ``drift`` one
    divergence per request whose rendering differed from the recorded ids; ``stop_reason`` is
    set when recording ends ("length", "rewritten")."""

    index: int
    chat: ChatFormat
    eos_token_ids: Sequence[int]
    budget: int
    trajectory: Trajectory | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    reply_text: str | None = None
    turn: int = 0
    drift: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str = ""
    requests: int = 0
    unrecorded: int = 0
    length_refusals: int = 0  # requests refused because the budget or the context was spent
    refusal: str = ""  # the first request refused, and why

    @property
    def recording(self) -> bool:
        return not self.stop_reason

    def context(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Any,
        rendered: list[int] | None = None,
    ) -> list[int]:
        """The ids the next turn continues: the recorded ones with the new messages appended,
        or, once recording has ended, the request rendered on its own (``rendered``: the
        request already rendered with the generation prompt, else it is rendered here)."""
        self.requests += 1
        tokenizer = self.chat.tokenizer
        if rendered is None:
            rendered = render_ids(tokenizer, messages, tools, generation=True)
        if self.trajectory is None:
            self.trajectory = Trajectory(prompt_ids=rendered)
            self.messages = _plain(messages)
            return list(rendered)
        if not self.recording:
            return rendered
        plain = _plain(messages)
        n = len(self.messages)
        reply = plain[n] if len(plain) > n else None
        if (
            plain[:n] != self.messages
            or reply is None
            or reply["role"] != "assistant"
            or reply["content"] != self.reply_text
            or len(plain) == n + 1
        ):
            self.stop_reason = "rewritten"
            self._locate(rendered)
            return rendered
        traj = self.trajectory
        last = traj.response_ids[-1] if traj.response_ids else None
        last_text = (
            tokenizer.decode([last], skip_special_tokens=False)
            if last in self.eos_token_ids
            else None
        )
        observation = self.chat.observation_ids(plain[n + 1 :], last_text)
        room = self.budget - len(traj.response_ids)
        if len(observation) > room:
            traj.observation_truncated = True
            self.stop_reason = "length"
            observation = observation[: max(room, 0)]
        traj.append(observation, 0, self.turn, [0.0] * len(observation))
        traj.observation_token_ids.append(list(observation))
        self.messages = plain
        self._locate(rendered)
        return traj.prompt_ids + traj.response_ids

    def _locate(self, rendered: list[int]) -> None:
        """Record where ``rendered`` first differs from the recorded ids, if it does."""
        assert self.trajectory is not None
        recorded = self.trajectory.prompt_ids + self.trajectory.response_ids
        found = first_divergence(recorded, rendered, self.chat.tokenizer)
        if found is not None:
            self.drift.append({"turn": self.turn, **found.as_dict(("recorded", "rendered"))})

    def room(self) -> int:
        """Tokens the episode may still have generated: the budget less the recorded response
        and what was generated after recording ended (``unrecorded``)."""
        recorded = 0 if self.trajectory is None else len(self.trajectory.response_ids)
        return self.budget - recorded - self.unrecorded

    def record(self, out: TurnOutput, text: str) -> None:
        """Append a generated turn (``text``: the reply content the endpoint returns)."""
        if not self.recording or self.trajectory is None:
            self.unrecorded += len(out.ids)
            return
        self.turn += 1
        traj = self.trajectory
        traj.append(out.ids, 1, self.turn, out.log_probs, out.kept, out.versions)
        traj.turn_token_ids.append(list(out.ids))
        traj.num_turns = self.turn
        self.reply_text = text
        if self.room() <= 0:
            self.stop_reason = "length"

    def finish(self, messages: Sequence[Mapping[str, Any]] | None) -> None:
        """Close the record: the conversation as the program last sent it, plus the last
        reply (for the dump and the template drift check)."""
        traj = self.trajectory
        if traj is None:
            return
        final = _plain(messages) if messages else list(self.messages)
        if self.reply_text is not None and (not final or final[-1].get("role") != "assistant"):
            final = [*final, {"role": "assistant", "content": self.reply_text}]
        traj.messages = final
        traj.stop_reason = traj.stop_reason or self.stop_reason or "done"

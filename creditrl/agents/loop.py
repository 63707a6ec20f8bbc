"""The token-in-token-out agent loop (spec 004): one state machine per sample, run concurrently.

Per sample, turn k = 1, 2, ...:

1. generate from the token ids accumulated so far (prompt ids + every earlier turn's ids +
   observation ids), at most min(remaining budget, ``max_tokens_per_turn``) new tokens;
   append them with ``response_mask`` 1, ``turn_ids`` k and their sampling log-probs;
2. decode the turn for parsing only and find its ``<tool_call>`` blocks;
3. no call: stop (``answer`` if it holds ``<answer>...</answer>``, else ``no_call``);
   k = ``max_turns``: stop (``max_turns``; its calls are not run); budget used up: ``length``;
4. run the calls concurrently (registry timeout, at most ``max_parallel_calls`` running over
   the whole batch, at most ``max_calls_per_turn`` per turn); malformed calls, unknown tools,
   bad arguments, errors and timeouts become error observations;
5. render only the new tool messages with the chat template (``ChatFormat``), encode that text
   alone and append its ids with ``response_mask`` 0, ``turn_ids`` k, log-prob 0. If it does
   not fit in the budget it is cut to fit and the sample stops (``length``).

The trajectory's ids are therefore exactly the concatenation of every turn's sampled ids and
every observation's ids; nothing the policy produced is decoded and encoded again.

Concurrency: every sample is a coroutine. Generation requests are batched: the engine runs
when every unfinished sample is waiting for a turn (samples still running tools are waited
for), with requests in sample order, so a batch's random draws do not depend on tool timing.
A request's ``sample`` is the sample's row, so a generator may keep per-sample state between
turns (the HF engine's KV caches); the generator's ``end_run()``, where it has one, is called
when the run ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from creditrl.agents.chat import ChatFormat
from creditrl.agents.parsing import ParsedCall, extract_answer, parse_tool_calls
from creditrl.config.schema import AgentConfig
from creditrl.rollout.continuation import TurnGenerator, TurnOutput, TurnRequest
from creditrl.tools import ToolRegistry, ToolResult, truncate_text

__all__ = ["STOP_REASONS", "AgentLoop", "ToolCallRecord", "Trajectory", "run_sync", "turn_seed"]

STOP_REASONS = ("answer", "no_call", "max_turns", "length")
T = TypeVar("T")


@dataclass
class ToolCallRecord:
    """One tool call of a trajectory: where, what, and how it ended (``ToolResult.status``)."""

    turn: int
    name: str | None
    arguments: Any
    status: str
    output: str
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "turn": self.turn,
            "name": self.name,
            "arguments": self.arguments,
            "status": self.status,
            "output": self.output,
            "seconds": round(self.seconds, 4),
        }


@dataclass
class Trajectory:
    """One sample's rollout. ``response_ids`` = every turn's ids and observation ids in order;
    ``response_mask`` 1 on the policy's ids, 0 on observations; ``turn_ids`` the turn (1-based)
    of each id, an observation taking the turn whose calls produced it; ``log_probs`` the
    sampling log-prob of each policy id, 0 on observations; ``kept_counts`` the size of the
    set the sampler drew each policy id from under top-k/top-p/min-p (0: the whole
    vocabulary, and on observations); ``versions`` (None unless the turns recorded them: partial
    rollout) the weight version of each policy id, an observation taking the version before it
    (-1 before any: the sampler fills in the group's version)."""

    prompt_ids: list[int]
    messages: list[dict[str, Any]] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    kept_counts: list[int] = field(default_factory=list)
    versions: list[int] | None = None
    num_turns: int = 0
    stop_reason: str = ""
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    turn_token_ids: list[list[int]] = field(default_factory=list)
    observation_token_ids: list[list[int]] = field(default_factory=list)
    observation_truncated: bool = False

    def append(
        self,
        ids: Sequence[int],
        mask: int,
        turn: int,
        log_probs: Sequence[float],
        kept: Sequence[int] | None = None,
        versions: Sequence[int] | None = None,
    ) -> None:
        if len(log_probs) != len(ids) or (kept is not None and len(kept) != len(ids)):
            raise ValueError(f"{len(ids)} ids, {len(log_probs)} log-probs and kept-set sizes")
        if versions is not None and len(versions) != len(ids):
            raise ValueError(f"{len(ids)} ids and {len(versions)} weight versions")
        if versions is not None and self.versions is None:
            self.versions = [-1] * len(self.response_ids)
        if self.versions is not None:
            last = self.versions[-1] if self.versions else -1
            self.versions.extend([last] * len(ids) if versions is None else map(int, versions))
        self.response_ids.extend(int(t) for t in ids)
        self.response_mask.extend([mask] * len(ids))
        self.turn_ids.extend([turn] * len(ids))
        self.log_probs.extend(float(x) for x in log_probs)
        self.kept_counts.extend([0] * len(ids) if kept is None else [int(k) for k in kept])


def turn_seed(sample_seed: int, turn: int) -> int:
    """The sampling seed of a sample's turn: distinct per turn, in [0, 2**62)."""
    return (int(sample_seed) * 1_000_003 + turn) % (1 << 62)


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code (in a helper thread if this thread
    already runs an event loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class _Batcher:
    """Collects turn requests; runs the engine once every unfinished sample has asked."""

    def __init__(self, generator: TurnGenerator, active: int, greedy: bool, temperature) -> None:
        self.generator = generator
        self.active = active
        self.greedy = greedy
        self.temperature = temperature
        self.pending: list[tuple[int, TurnRequest, asyncio.Future[TurnOutput]]] = []
        self.calls = 0

    async def generate(self, index: int, request: TurnRequest) -> TurnOutput:
        future: asyncio.Future[TurnOutput] = asyncio.get_running_loop().create_future()
        self.pending.append((index, request, future))
        self._maybe_run()
        return await future

    def finish(self) -> None:
        self.active -= 1
        self._maybe_run()

    def _maybe_run(self) -> None:
        if not self.pending or len(self.pending) < self.active:
            return
        work, self.pending = sorted(self.pending, key=lambda p: p[0]), []
        self.calls += 1
        try:
            outputs = self.generator.generate_turns(
                [r for _, r, _ in work], greedy=self.greedy, temperature=self.temperature
            )
            if len(outputs) != len(work):
                raise RuntimeError(f"engine returned {len(outputs)} turns for {len(work)} requests")
        except Exception as e:
            for _, _, future in work:
                future.set_exception(e)
            return
        for (_, _, future), output in zip(work, outputs, strict=True):
            future.set_result(output)


class AgentLoop:
    """Runs trajectories for a batch of prompts; see the module docstring.

    ``max_response_length``: the budget of response tokens (turns + observations) per sample.
    """

    def __init__(
        self,
        generator: TurnGenerator,
        tokenizer: Any,
        tools: ToolRegistry,
        cfg: AgentConfig,
        max_response_length: int,
    ) -> None:
        if cfg.max_turns < 1:
            raise ValueError(f"agent.max_turns must be >= 1, got {cfg.max_turns}")
        if max_response_length < 1:
            raise ValueError(f"max_response_length must be >= 1, got {max_response_length}")
        self.generator = generator
        self.tokenizer = tokenizer
        self.tools = tools
        self.cfg = cfg
        self.budget = max_response_length
        self.chat = ChatFormat(tokenizer, cfg.tool_role)
        self.eos_token_ids = [int(t) for t in generator.eos_token_ids]
        truncate_text("", 0, cfg.truncate_side)  # fail at start on a bad side
        self.last_engine_calls = 0

    def run(
        self,
        prompt_ids: Sequence[Sequence[int]],
        raw_prompts: Sequence[list[dict[str, Any]] | None] | None = None,
        *,
        greedy: bool = False,
        temperature: float | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[Trajectory]:
        """One trajectory per prompt (ids without padding), in order. ``seeds`` (one per
        sample) give each turn its own sampling seed (``turn_seed``)."""
        raw = list(raw_prompts) if raw_prompts is not None else [None] * len(prompt_ids)
        return run_sync(
            self.arun(prompt_ids, raw, greedy=greedy, temperature=temperature, seeds=seeds)
        )

    async def arun(
        self,
        prompt_ids: Sequence[Sequence[int]],
        raw_prompts: Sequence[list[dict[str, Any]] | None],
        *,
        greedy: bool = False,
        temperature: float | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[Trajectory]:
        batcher = _Batcher(self.generator, len(prompt_ids), greedy, temperature)
        tasks = [
            self._sample(i, list(ids), raw_prompts[i], batcher, None if seeds is None else seeds[i])
            for i, ids in enumerate(prompt_ids)
        ]
        try:
            out = await asyncio.gather(*tasks)
        finally:
            end_run = getattr(self.generator, "end_run", None)  # optional in TurnGenerator
            if end_run is not None:
                end_run()
        self.last_engine_calls = batcher.calls
        return list(out)

    async def _sample(
        self,
        index: int,
        prompt_ids: list[int],
        raw_prompt: list[dict[str, Any]] | None,
        batcher: _Batcher,
        seed: int | None,
    ) -> Trajectory:
        traj = Trajectory(list(prompt_ids), messages=[dict(m) for m in raw_prompt or []])
        try:
            await self._turns(index, traj, batcher, seed)
        finally:
            batcher.finish()
        return traj

    async def _turns(
        self, index: int, traj: Trajectory, batcher: _Batcher, seed: int | None
    ) -> None:
        cfg = self.cfg
        for turn in range(1, cfg.max_turns + 1):
            room = self.budget - len(traj.response_ids)
            if room <= 0:
                traj.stop_reason = "length"
                return
            cap = min(room, cfg.max_tokens_per_turn) if cfg.max_tokens_per_turn > 0 else room
            out = await batcher.generate(
                index,
                TurnRequest(
                    traj.prompt_ids + traj.response_ids,
                    cap,
                    index,
                    turn,
                    None if seed is None else turn_seed(seed, turn),
                ),
            )
            ids = list(out.ids)[:cap]
            if not ids:
                traj.stop_reason = "no_call"
                return
            kept = None if out.kept is None else list(out.kept)[: len(ids)]
            versions = None if out.versions is None else list(out.versions)[: len(ids)]
            traj.append(ids, 1, turn, list(out.log_probs)[: len(ids)], kept, versions)
            traj.turn_token_ids.append(ids)
            traj.num_turns = turn
            text = self.chat.assistant_content(ids, self.eos_token_ids)
            traj.messages.append({"role": "assistant", "content": text})
            calls = parse_tool_calls(text)
            answer = extract_answer(text)
            traj.turns.append({"turn": turn, "text": text, "answer": answer, "calls": len(calls)})
            if not calls:
                cut_by_budget = ids[-1] not in self.eos_token_ids and len(ids) >= room
                traj.stop_reason = (
                    "answer" if answer is not None else "length" if cut_by_budget else "no_call"
                )
                return
            if turn == cfg.max_turns:
                traj.stop_reason = "max_turns"
                return
            if len(traj.response_ids) >= self.budget:
                traj.stop_reason = "length"
                return
            tool_messages = await self._run_calls(calls, turn, traj)
            last = ids[-1] if ids and ids[-1] in self.eos_token_ids else None
            last_text = None if last is None else self.tokenizer.decode([last])
            obs = self.chat.observation_ids(tool_messages, last_text)
            traj.messages.extend(tool_messages)
            room = self.budget - len(traj.response_ids)
            if len(obs) >= room:
                obs = obs[:room]
                traj.observation_truncated = True
            traj.append(obs, 0, turn, [0.0] * len(obs))
            traj.observation_token_ids.append(obs)
            if traj.observation_truncated:
                traj.stop_reason = "length"
                return
        traj.stop_reason = traj.stop_reason or "max_turns"

    async def _run_calls(
        self, calls: list[ParsedCall], turn: int, traj: Trajectory
    ) -> list[dict[str, Any]]:
        """Run a turn's calls concurrently; records go to ``traj``; returns tool messages."""
        limit = self.cfg.max_calls_per_turn

        async def one(i: int, call: ParsedCall) -> ToolResult:
            if not call.ok:
                return ToolResult("malformed", f"Error: malformed tool call: {call.error}")
            if limit > 0 and i >= limit:
                return ToolResult(
                    "skipped", f"Error: more than {limit} tool calls in one turn; not run"
                )
            return await self.tools.call(call.name or "", call.arguments)

        results = await asyncio.gather(*(one(i, c) for i, c in enumerate(calls)))
        messages = []
        for call, result in zip(calls, results, strict=True):
            output = truncate_text(
                result.output, self.cfg.tool_output_max_chars, self.cfg.truncate_side
            )
            traj.tool_calls.append(
                ToolCallRecord(
                    turn, call.name, call.arguments, result.status, output, result.seconds
                )
            )
            message: dict[str, Any] = {"role": self.cfg.tool_role, "content": output}
            if call.name:
                message["name"] = call.name
            messages.append(message)
        return messages

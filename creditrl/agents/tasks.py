"""Demo agent tasks: multi-turn arithmetic with the calculator, and KGQA over a shipped graph.

- ``calc_multiturn``: reasoning-gym arithmetic asked as "What is <expression>?" (``data.
  task_kwargs``: ``source``, the reasoning-gym task, default ``chain_sum``; ``few_shot``; the
  rest go to the source task, e.g. ``products`` with 3-digit factors), the calculator described
  in the system prompt; ``data_source`` ``calc_multiturn`` (structured reward:
  ``calc_structured_reward``).
- ``kgqa``: the questions of ``creditrl/agents/data/kgqa.jsonl`` (or
  ``data.task_kwargs.questions``) over ``kg_triples.tsv`` with the ``kg_lookup`` tool; every
  fifth question is held out for validation; ``data_source`` ``kgqa`` (spec 001's reward).

The system prompt lists the tools' OpenAI schemas inside ``<tools></tools>`` and shows the
``<tool_call>`` format (Hermes style), since not every chat template renders tools itself.
Worked example exchanges (call, tool result, answer) precede the question:
``data.task_kwargs.few_shot`` is how many (``true`` = 1, ``false`` = 0; the calculator has
``len(CALC_SHOTS)`` = 2, KGQA one). Measured on SmolLM2-135M, 16 validation questions: with
the tools described in words alone, or an example written into the system prompt's text, or
one calculator example, greedy decoding never calls the calculator (sampled at 0.7: 1 of 16
with one example); after two examples, greedy calls it for 9 and answers all 9 correctly.
Training fixes the one-example case quickly: ``preset=calculator_agent`` (one example) went
from validation 0.24 to 1.45 (every question: a call, then the right answer) by step 6, its
``agent/tool_then_correct`` 0, 0.44, 0.94 over steps 1-3.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from creditrl.agents.registries import AGENT_TASKS, register_agent_task
from creditrl.config.schema import Config
from creditrl.data import PromptDataset, PromptRow, build_task_rows
from creditrl.tools import ToolRegistry, build_registry

__all__ = [
    "AGENT_TASKS",
    "CALC_SHOT",
    "CALC_SHOTS",
    "DATA_DIR",
    "KGQA_QUESTIONS",
    "KGQA_SHOT",
    "build_agent_datasets",
    "calc_rows",
    "calc_shots",
    "kgqa_rows",
    "register_agent_task",
    "tool_system_prompt",
]

DATA_DIR = Path(__file__).resolve().parent / "data"
KGQA_QUESTIONS = DATA_DIR / "kgqa.jsonl"


def tool_system_prompt(registry: ToolRegistry, task_hint: str = "") -> str:
    """A system message: the tools' schemas inside ``<tools></tools>``, the call format, the
    answer format (kept short: every token of it is in every prompt)."""
    schemas = "\n".join(json.dumps(s, ensure_ascii=False) for s in registry.schemas())
    lines = [
        f"You can call tools, described inside <tools></tools>:\n<tools>\n{schemas}\n</tools>",
        'Call a tool with <tool_call>{"name": <tool name>, "arguments": {<arguments>}}'
        "</tool_call>; its result comes back in a tool message.",
    ]
    if task_hint:
        lines.append(task_hint)
    lines.append("Give the final answer inside <answer></answer> tags.")
    return "\n".join(lines)


def _shot(question: str, call: str, result: str, answer: str) -> list[dict[str, str]]:
    """A worked exchange (question, tool call, tool result, answer) shown before the question."""
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": f"<answer>{answer}</answer>"},
    ]


CALC_SHOT = _shot(
    "What is 48 + 27 - 19?",
    '{"name": "calculator", "arguments": {"expression": "48 + 27 - 19"}}',
    "56",
    "56",
)
CALC_SHOTS = (
    _shot(
        "What is 312 - 45 + 7?",
        '{"name": "calculator", "arguments": {"expression": "312 - 45 + 7"}}',
        "274",
        "274",
    ),
    CALC_SHOT,
)
"""The calculator's worked examples, in the order shown: ``few_shot: n`` shows the last n."""
KGQA_SHOT = _shot(
    "What is the capital of France?",
    '{"name": "kg_lookup", "arguments": {"entity": "France", "relation": "capital"}}',
    "France | capital | Paris",
    "Paris",
)


def _messages(system: str, shot: list[dict[str, str]], question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, *shot, {"role": "user", "content": question}]


def calc_shots(few_shot: bool | int) -> list[dict[str, str]]:
    """The messages of the last ``few_shot`` calculator examples (true = 1, false = 0)."""
    count = int(few_shot)
    if not 0 <= count <= len(CALC_SHOTS):
        raise ValueError(
            f"few_shot must be 0..{len(CALC_SHOTS)} for calc_multiturn, got {few_shot}"
        )
    return [m for shot in CALC_SHOTS[len(CALC_SHOTS) - count :] for m in shot]


def calc_rows(
    kwargs: dict[str, Any], train_size: int, val_size: int, seed: int, system_prompt: str
) -> tuple[list[PromptRow], list[PromptRow]]:
    """Rows of the reasoning-gym task ``source`` in ``kwargs`` (default ``chain_sum``; any task
    whose entries carry ``metadata.expression``) re-labelled ``calc_multiturn``: the tool
    system prompt, worked examples (``few_shot`` in ``kwargs``: how many of ``CALC_SHOTS``, the
    last ones, ``CALC_SHOT`` last; true = 1, false = 0) and the question as "What is a * b?"."""
    kwargs = dict(kwargs)
    shot = calc_shots(kwargs.pop("few_shot", True))
    source = kwargs.pop("source", "chain_sum")
    rows = build_task_rows(source, kwargs, train_size, val_size, seed, system_prompt)
    out = []
    for split in (rows.train, rows.val):
        for row in split:
            expression = row.extra["rg_entry"]["metadata"].get("expression")
            if not isinstance(expression, str):
                raise ValueError(f"calc_multiturn: {source} entries carry no expression")
            row.messages = _messages(system_prompt, shot, f"What is {expression}?")
            row.data_source = "calc_multiturn"
        out.append(split)
    return out[0], out[1]


def kgqa_rows(
    system_prompt: str, path: str | Path | None = None, few_shot: bool = True
) -> tuple[list[PromptRow], list[PromptRow]]:
    """(train, val) KGQA rows, each with the worked example ``KGQA_SHOT`` unless ``few_shot``
    is False; every fifth question (index % 5 == 4) is validation."""
    path = Path(path or KGQA_QUESTIONS)
    train, val = [], []
    lines = path.read_text(encoding="utf-8").splitlines()
    items = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    for i, (number, line) in enumerate(items):
        try:
            item = json.loads(line)
            question, answers = item["question"], list(item["answers"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path} line {number}: need question and answers ({e})") from e
        row = PromptRow(
            messages=_messages(system_prompt, KGQA_SHOT if few_shot else [], question),
            ground_truth=answers,
            data_source="kgqa",
            extra={"id": item.get("id", f"line{number}"), "hops": item.get("hops")},
            source=f"{path} line {number}",
        )
        (val if i % 5 == 4 else train).append(row)
    return train, val


def build_agent_datasets(
    cfg: Config, tokenizer: Any, registry: ToolRegistry | None = None
) -> tuple[PromptDataset, PromptDataset | None]:
    """Train and validation PromptDatasets of the agent task ``cfg.data.task``."""
    data, agent = cfg.data, cfg.agent
    if data.task not in AGENT_TASKS:
        raise ValueError(f"{data.task!r} is not an agent task; choose one of {AGENT_TASKS.names()}")
    registry = registry or build_registry(
        agent.tools, agent.tool_config, agent.tool_timeout_s, agent.max_parallel_calls
    )
    train, val = AGENT_TASKS.get(data.task)(cfg, registry)

    def dataset(rows: Sequence[PromptRow], split: str) -> PromptDataset:
        return PromptDataset(
            list(rows), tokenizer, data.max_prompt_length, data.overlong_prompt, split=split
        )

    return dataset(train, "train"), dataset(val, "val") if val else None


def _calc_task(cfg: Config, tools: ToolRegistry) -> tuple[list[PromptRow], list[PromptRow]]:
    data = cfg.data
    hint = "Use the calculator for the arithmetic."
    system = data.system_prompt or tool_system_prompt(tools, hint)
    return calc_rows(dict(data.task_kwargs), data.train_size, data.val_size, data.seed, system)


def _kgqa_task(cfg: Config, tools: ToolRegistry) -> tuple[list[PromptRow], list[PromptRow]]:
    data = cfg.data
    hint = "Look facts up in the knowledge graph; answer with the entity name only."
    system = data.system_prompt or tool_system_prompt(tools, hint)
    kwargs = data.task_kwargs
    train, val = kgqa_rows(system, kwargs.get("questions"), kwargs.get("few_shot", True))
    return train, val[: data.val_size] if data.val_size >= 0 else val

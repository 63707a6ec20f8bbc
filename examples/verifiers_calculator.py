"""A verifiers tool environment with a calculator, trained by creditrl unchanged:

    creditrl train examples/verifiers_calculator.yaml

``load_environment`` builds everything locally: the calculator preset's questions (chain_sum
arithmetic asked as "What is 48 + 27 - 19?", the calculator described in the system prompt,
``few_shot`` worked calls before the question: with one, the untrained model mostly calls tools
that do not exist) as a ``datasets.Dataset``, a ``vf.ToolEnv`` whose ``calculator`` tool
evaluates + - * / from the parsed syntax tree (never eval), and a rubric: 1 for the right
answer inside ``<answer></answer>`` plus 0.2 for calling the calculator.
ToolEnv adds its tool-call counts as metrics (``reward/vf_calculator_calls_mean``).
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

import verifiers as vf
from datasets import Dataset

from creditrl.agents.tasks import calc_rows, tool_system_prompt
from creditrl.tools import build_registry

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}  # fmt: skip
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / and parentheses
    """

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / are allowed")

    try:
        result = value(ast.parse(str(expression)[:200], mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"Error: {e}"
    return str(int(result)) if float(result).is_integer() else str(result)


def correct_answer(completion: Any, answer: str, **_: Any) -> float:
    """1 when the last assistant message's <answer> holds the right number."""
    for message in reversed(completion or []):
        if getattr(message, "role", None) == "assistant":
            found = ANSWER.findall(getattr(message, "content", None) or "")
            try:
                return float(bool(found) and float(found[-1].strip()) == float(answer))
            except ValueError:
                return 0.0
    return 0.0


def _with_call_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The worked example's call as OpenAI tool_calls with ids (verifiers' tool messages need
    them), its text kept as the assistant's content (templates without tools show that)."""
    out, calls = [], 0
    for message in messages:
        message = dict(message)
        text = message.get("content") or ""
        if message["role"] == "assistant" and text.startswith("<tool_call>"):
            call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
            calls += 1
            message["tool_calls"] = [
                {
                    "id": f"call_{calls}",
                    "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
                }
            ]
        elif message["role"] == "tool":
            message["tool_call_id"] = f"call_{calls}"
        out.append(message)
    return out


def calls_calculator(completion: Any, **_: Any) -> float:
    """1 when an assistant message called the calculator."""
    for message in completion or []:
        for call in getattr(message, "tool_calls", None) or []:
            if getattr(call, "name", None) == "calculator":
                return 1.0
    return 0.0


def load_environment(
    train_size: int = 2000, val_size: int = 32, seed: int = 0, max_turns: int = 3, few_shot: int = 2
) -> vf.Environment:
    """The calculator environment (the calculator preset's questions and prompt)."""
    system = tool_system_prompt(
        build_registry(["calculator"]), "Use the calculator for the arithmetic."
    )
    task = {"min_terms": 2, "max_terms": 3, "min_digits": 2, "max_digits": 3}
    train, val = calc_rows({**task, "few_shot": few_shot}, train_size, val_size, seed, system)

    def dataset(rows: list) -> Dataset:
        return Dataset.from_list(
            [
                {"prompt": _with_call_ids(row.messages), "answer": str(row.ground_truth)}
                for row in rows
            ]
        )

    return vf.ToolEnv(
        dataset=dataset(train),
        eval_dataset=dataset(val),
        tools=[calculator],
        max_turns=max_turns,
        rubric=vf.Rubric(funcs=[correct_answer, calls_calculator], weights=[1.0, 0.2]),
        sampling_args={"max_tokens": 48},
    )

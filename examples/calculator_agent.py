"""A calculator agent written only against the OpenAI client, trained by creditrl.

    creditrl train examples/calculator_agent.yaml

``episode(row, client)`` is an ordinary OpenAI-client agent: it sends the conversation with an
OpenAI-format tool, runs the calls the model makes with its own code, and returns its own
outcome reward (1.0 for the right final answer, else 0.0). creditrl gives it ``client``, an
``openai.AsyncOpenAI`` pointed at its endpoint, and trains on exactly the tokens the model
produced for these requests.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

TOOLS = [
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
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}  # fmt: skip


def calculate(expression: str) -> str:
    """+, -, *, / over numbers, from the parsed syntax tree (never eval)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / are allowed")

    try:
        result = value(ast.parse(expression[:200], mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"Error: {e}"
    return str(int(result)) if float(result).is_integer() else str(result)


def _answer(text: str) -> str | None:
    found = re.findall(r"<answer>(.*?)</answer>", text or "", re.DOTALL)
    return found[-1].strip() if found else None


async def episode(row: dict[str, Any], client: Any) -> float:
    """Up to 3 model calls; each tool call is answered by ``calculate``; 1.0 for the right
    final answer."""
    messages = list(row["messages"])
    reply_text = ""
    for _ in range(3):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=48
        )
        message = reply.choices[0].message
        reply_text = message.content or ""
        messages.append({"role": "assistant", "content": reply_text})
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (ValueError, AttributeError):
                expression = ""
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))}
            )
    answer = _answer(reply_text)
    try:
        return float(answer is not None and float(answer) == float(row["ground_truth"]))
    except ValueError:
        return 0.0

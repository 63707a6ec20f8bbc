"""Agent programs for tests/test_agent_program.py, written only against the OpenAI client."""

from __future__ import annotations

RECORDED: dict[str, list] = {}  # the ids and log-probs each episode was answered with


async def two_turns(row, client):
    """Ask, get a reply, add a tool result, ask again; reward 1.0. Keeps what it was sent."""
    messages = [*row["messages"]]
    got = []
    for turn in range(2):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, logprobs=True, max_tokens=6
        )
        choice = reply.choices[0]
        got.append((choice.model_extra["token_ids"], [c.logprob for c in choice.logprobs.content]))
        messages.append({"role": "assistant", "content": choice.message.content})
        if turn == 0:
            messages.append({"role": "tool", "content": "42"})
    RECORDED[str(row["messages"][-1]["content"]) + str(len(RECORDED))] = got
    return 1.0


async def rewrites_history(row, client):
    """Edits its first assistant message before the second call (drift)."""
    messages = [*row["messages"]]
    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages.append(
        {"role": "assistant", "content": reply.choices[0].message.content + " (edited)"}
    )
    messages.append({"role": "user", "content": "go on"})
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return None


async def raises(row, client):
    await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=2)
    raise RuntimeError("the agent crashed")


async def never_calls(row, client):
    return 0.5


async def sleeps(row, client):
    import asyncio

    await asyncio.sleep(60)


def not_async(row, client):
    return 1.0


async def long_first_request(row, client):
    """A first request far past data.max_prompt_length."""
    messages = [*row["messages"], {"role": "user", "content": "word " * 3000}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
    return 1.0


async def raises_first(row, client):
    """Raises before its first call: no model turn is recorded."""
    raise ValueError("the tool server is down")


async def huge_reward(row, client):
    await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=2)
    return 10**400

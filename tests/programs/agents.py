"""Agent programs for tests/test_agent_program.py, written only against the OpenAI client."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import openai

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


RELEASE = threading.Event()  # lets blocks_on_seven's blocked episodes go on
EVENTS: list[str] = []  # what blocks_on_seven's episodes did, in order


async def blocks_on_seven(row, client):
    """Blocks its thread (a synchronous wait, as time.sleep or blocking I/O would) on the
    question whose answer is 7, then asks the model with the synchronous OpenAI client (a
    blocking call too); answers the other question at once."""
    if row["ground_truth"] == "7":
        RELEASE.wait(60)
        EVENTS.append("unblocked")
        sync = openai.OpenAI(base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
        try:
            sync.chat.completions.create(model="policy", messages=row["messages"], max_tokens=2)
            EVENTS.append("answered after unblocking")
        except openai.APIStatusError as e:
            EVENTS.append(f"refused {e.status_code}")
        finally:
            sync.close()
        return 1.0
    await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=2)
    EVENTS.append("answered")
    return 1.0


async def swallows_cancel(row, client):
    """Catches the timeout's cancellation and goes on, for up to 20 s; then reward 1.0."""
    end = time.monotonic() + 20
    while time.monotonic() < end:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            continue
    return 1.0


async def exits(row, client):
    raise SystemExit(3)


async def interrupts(row, client):
    raise KeyboardInterrupt


async def cancels(row, client):
    raise asyncio.CancelledError


async def nan_reward(row, client):
    await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=2)
    return {"score": float("nan")}


BAD_REQUESTS: list[tuple[str, int, str]] = []  # (what was sent, HTTP status, error code)


async def sends_bad_requests(row, client):
    """Sends requests with content of the wrong type, and a lone surrogate; then one good one."""
    import aiohttp

    messages = row["messages"]
    bodies = {
        "tools=5": {"messages": messages, "tools": 5},
        "content=5": {"messages": [{"role": "user", "content": 5}]},
        "role=1": {"messages": [{"role": 1, "content": "hi"}]},
        "name=5": {"messages": [{"role": "user", "content": "hi", "name": 5}]},
        "no messages": {"messages": []},
    }
    url = f"{client.base_url}chat/completions"
    headers = {"Authorization": f"Bearer {client.api_key}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as http:
        sent = [(k, json.dumps({"model": "p", "max_tokens": 2, **b})) for k, b in bodies.items()]
        sent.append(("lone surrogate", '{"messages": [{"role": "user", "content": "\\ud800"}]}'))
        for what, data in sent:
            async with http.post(url, data=data, headers=headers) as response:
                body = await response.json()
                BAD_REQUESTS.append((what, response.status, body["error"]["code"]))
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
    return 1.0


SPENT: list[tuple[str, int]] = []  # keeps_asking: (outcome, completion tokens) per request


async def keeps_asking(row, client):
    """Rewrites its history after the first reply (recording stops), then keeps asking for
    more, then sends a conversation far past the context limit."""
    messages = [*row["messages"]]
    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    SPENT.append(("ok", reply.usage.completion_tokens))
    messages += [{"role": "assistant", "content": "(edited)"}, {"role": "user", "content": "go"}]
    for _ in range(6):
        try:
            reply = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=8
            )
            SPENT.append(("ok", reply.usage.completion_tokens))
        except openai.APIStatusError as e:
            SPENT.append((e.body.get("code") if isinstance(e.body, dict) else "?", 0))
    for size in (400, 200_000):  # ~2 kB, ~1 MB
        try:
            long = [*messages, {"role": "user", "content": "word " * size}]
            await client.chat.completions.create(model="policy", messages=long, max_tokens=4)
        except openai.APIStatusError as e:
            SPENT.append((e.body.get("code") if isinstance(e.body, dict) else "?", 0))
    return 1.0


async def asks_until_refused(row, client):
    """Three turns of up to 16 tokens each, catching nothing: with rollout.max_response_length
    24 the third request finds the budget spent and its 400 ends the program."""
    messages = [*row["messages"]]
    for _ in range(3):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=16
        )
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "Go on."}]  # fmt: skip
    return 1.0

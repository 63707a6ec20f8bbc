"""The endpoint's connection cap never costs the episodes their own connections (issue 40,
item 13): a local process flooding its port with half-sent requests used to have the
episodes' new, not yet keyed connections dropped with its own."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from pathlib import Path

import pytest

from creditrl.agents.endpoint import Endpoint

HALF_REQUEST = b"POST /t/x/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"


def _flood(port: int, stop: threading.Event) -> None:
    """Half-sent requests without the key, as fast as they connect; the oldest closed past
    200 open (the process's descriptors)."""
    open_now: list[socket.socket] = []
    while not stop.is_set():
        try:
            conn = socket.create_connection(("127.0.0.1", port), timeout=1)
            conn.sendall(HALF_REQUEST)
            open_now.append(conn)
        except OSError:
            continue
        if len(open_now) > 200:
            open_now.pop(0).close()
    for conn in open_now:
        conn.close()


def test_the_episodes_connections_never_lose_to_keyless_ones() -> None:
    async def handler(trajectory: str, body: dict) -> dict:
        return {"trajectory": trajectory}

    endpoint = Endpoint(
        handler, lambda t: True, "m", max_connections=4, max_unkeyed=4, idle_timeout_s=5.0
    )
    endpoint.start()
    stop = threading.Event()
    flooder = threading.Thread(target=_flood, args=(endpoint.port, stop), daemon=True)
    flooder.start()

    async def episode(i: int) -> list[int]:
        statuses = []
        for turn in range(5):  # a new client, so a new connection, each turn
            async with endpoint.http_client() as http:
                response = await http.post(
                    f"{endpoint.base_url(f'e{i}')}/chat/completions",
                    json={"messages": [{"role": "user", "content": f"turn {turn}"}]},
                    headers={"Authorization": f"Bearer {endpoint.key}"},
                    timeout=30,
                )
                statuses.append(response.status_code)
        return statuses

    async def episodes() -> list[list[int]]:
        return await asyncio.gather(*(episode(i) for i in range(4)))

    try:
        while sum(endpoint.refused.values()) < 50:  # the flood is past the cap
            threading.Event().wait(0.05)
        assert asyncio.run(episodes()) == [[200] * 5] * 4
        assert endpoint.refused["connection_dropped"]
    finally:
        stop.set()
        flooder.join(timeout=10)
        endpoint.close()


FLOOD_PROCESS = r"""
import os, socket, sys
port, keep, parent = int(sys.argv[1]), int(sys.argv[2]), os.getppid()
head = b"POST /t/x/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
open_now, n = [], 0
print("started", flush=True)
while n % 256 or os.getppid() == parent:  # until killed, or orphaned
    n += 1
    try:
        conn = socket.create_connection(("127.0.0.1", port), timeout=1)
        if n % 2:  # half of them send half a request head, half of them nothing at all
            conn.sendall(head)
    except OSError:
        continue
    open_now.append(conn)
    if len(open_now) > keep:
        open_now.pop(0).close()
"""

COMPLETION = {
    "id": "c",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "ok"},
        }
    ],
}


def test_a_programs_own_clients_never_lose_to_a_keyless_flood() -> None:
    """Issue 50, item 1: agent frameworks build their own client from the base URL and key
    (a plain ``AsyncOpenAI`` per request, through the TCP port, not the private socket). While
    another process keeps opening keyless connections (half of them half-sent requests, half
    silent) far past the unkeyed pool, every keyed request is answered, and the keyless
    connections dropped are counted. Before, 4 of 4 episodes failed: each new keyed
    connection, not yet seen to carry the key, was dropped with the flood's."""
    import subprocess
    import sys

    from openai import AsyncOpenAI

    async def handler(trajectory: str, body: dict) -> dict:
        return COMPLETION

    # the sizes the program rollout gives it: 4 concurrent episodes
    endpoint = Endpoint(handler, lambda t: True, "m", max_connections=2 * 4 + 32)
    endpoint.start()
    floods = [  # three processes: one alone lost 0 of 80 requests before, three 6 of 80
        subprocess.Popen(
            [sys.executable, "-c", FLOOD_PROCESS, str(endpoint.port), "800"],
            stdout=subprocess.PIPE,
        )
        for _ in range(3)
    ]

    async def episode(i: int) -> list[str]:
        answers = []
        for turn in range(10):  # the framework's own client, new for every request
            client = AsyncOpenAI(
                base_url=endpoint.base_url(f"e{i}"), api_key=endpoint.key, max_retries=0,
                timeout=30,
            )  # fmt: skip
            try:
                reply = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"turn {turn}"}]
                )
                answers.append(reply.choices[0].message.content)
            except Exception as e:  # what failed: the assertion's message
                answers.append(f"{type(e).__name__}: {e}")
            finally:
                await client.close()
        return answers

    async def episodes() -> list[list[str]]:
        return await asyncio.gather(*(episode(i) for i in range(4)))

    try:
        for flood in floods:
            assert flood.stdout is not None and flood.stdout.readline() == b"started\n"
        while endpoint.refused["connection_dropped"] < 500:  # the flood is far past the pool
            threading.Event().wait(0.05)
        assert asyncio.run(episodes()) == [["ok"] * 10] * 4
        assert endpoint.refused["connection_dropped"] >= 500
        assert endpoint.requests == 40
    finally:
        for flood in floods:
            flood.kill()
            flood.wait()
        endpoint.close()


def test_the_private_socket_folder_goes_when_the_process_exits_without_close(
    tmp_path: Path,
) -> None:
    """An endpoint its owner never closed (a run stopped by an exception, a test) leaves no
    ``creditrl-endpoint-*`` folder behind when its process exits: 8 were left per run of
    tests/test_verifiers.py before."""
    import subprocess
    import sys

    if not hasattr(socket, "SO_PEERCRED"):
        pytest.skip("no private socket on this platform")
    code = (
        "import asyncio\n"
        "from creditrl.agents.endpoint import Endpoint\n"
        "async def handler(trajectory, body):\n"
        "    return {}\n"
        "endpoint = Endpoint(handler, lambda t: True, 'm')\n"
        "endpoint.start()\n"
        "print(endpoint._socket_dir, flush=True)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    folder = Path(done.stdout.strip())
    assert folder.parent == tmp_path and folder.name.startswith("creditrl-endpoint-")
    assert not folder.exists()
    assert list(tmp_path.iterdir()) == []

"""The endpoint's connection cap never costs the episodes their own connections (issue 40,
item 13): a local process flooding its port with half-sent requests used to have the
episodes' new, not yet keyed connections dropped with its own."""

from __future__ import annotations

import asyncio
import socket
import threading

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

    endpoint = Endpoint(handler, lambda t: True, "m", max_connections=4, idle_timeout_s=5.0)
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
        assert endpoint.refused["connection_dropped"] + endpoint.refused["connection_refused"]
    finally:
        stop.set()
        flooder.join(timeout=10)
        endpoint.close()

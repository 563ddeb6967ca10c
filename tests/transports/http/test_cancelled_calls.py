"""Calls their clients cancel, many at once, against a live `bastion serve --http`.

What this proves: 8 real MCP clients (the SDK's, with a token from `bastion admin token`'s function) each start
40 mutating calls and give up on them at varied points, from before the send to mid-call (the SDK then
sends `notifications/cancelled` and the server cancels the call); afterwards every client's next call
answers, and the audit log verifies.
What it does not prove: the race that made this worth testing. A call cancelled while its audit record
waited behind a batch being synced once left every later call waiting for ever (found by the SIGTERM
fault test); this test and two heavier variants passed on that code too (3 runs each): the window
is a sync's length. tests/safety/test_audit.py reproduces that race deterministically.
"""

from __future__ import annotations

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from bastion.safety.audit import verify
from tests.helpers import call
from tests.load.driver import issue_tokens

from .live import LiveServer

pytestmark = pytest.mark.anyio
CLIENTS = 8
ROUNDS = 40


async def test_calls_cancelled_by_their_clients_under_load_leave_every_later_call_answered(
    server: LiveServer,
) -> None:
    (token,) = issue_tokens(server, 1)
    answered: list[int] = []

    async def one_client(n: int) -> None:
        async with (
            httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=30) as http,
            Client(streamable_http_client(server.mcp_url, http_client=http), mode="2026-07-28") as client,
        ):
            for i in range(ROUNDS):
                with anyio.move_on_after((i % 8) * 0.0005):  # from before the send to mid-call
                    await client.call_tool("write_file", {"path": f"cut-{n}-{i}.txt", "content": "x"})
            with anyio.fail_after(20):
                assert (await call(client, "write_file", path=f"after-{n}.txt", content="answered"))["ok"]
            answered.append(n)

    async with anyio.create_task_group() as tasks:
        for n in range(CLIENTS):
            tasks.start_soon(one_client, n)
    assert sorted(answered) == list(range(CLIENTS))
    assert verify(server.root / "state" / "audit.jsonl").ok

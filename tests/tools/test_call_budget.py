"""Each caller's audit budget, against a live `bastion serve --http` with two OAuth clients.

The attack (found by attack, 2026-12-07): one client sends calls to a tool that does not exist, eight at a
time, each with three arguments of 4,096 control characters (each written as six bytes, ``\\u0001``). Every
refused call is a record of ~59 KB: the log grew by 14.5 MB/s, and once the state filesystem was full every
call of every client was AUDIT_UNAVAILABLE. What must hold, with 32 calls at a time: the flooder's records
stay within its budget (burst plus rate over the flood's time), its calls past it are RESOURCE_LIMIT with
nothing recorded but their count (``calls_throttled``), and another client's calls run and are recorded
meanwhile.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from bastion.safety.audit import verify
from tests.helpers import write_cheap_hash
from tests.load.driver import issue_tokens
from tests.transports.http.live import PASSWORD, free_port, serve_config, write_config

pytestmark = pytest.mark.anyio

RATE = 64 * 1024
BURST = 1024 * 1024
FLOOD_S = 3.0
AT_ONCE = 32
HIDDEN = "\x01" * 4096


async def _calls(url: str, token: str, calls: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        answers = []
        for name, arguments in calls:
            result = await client.call_tool(name, arguments)
            answers.append(dict(result.structured_content or {}))
        return answers


async def _flood(url: str, token: str, until: float) -> list[str]:
    codes: list[str] = []
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):

        async def one() -> None:
            while time.monotonic() < until:
                result = await client.call_tool("no_such_tool", {"a": HIDDEN, "b": HIDDEN, "c": HIDDEN})
                codes.append(str((result.structured_content or {}).get("code")))

        async with anyio.create_task_group() as tasks:
            for _ in range(AT_ONCE):
                tasks.start_soon(one)
    return codes


async def test_one_clients_flood_of_refused_calls_is_held_to_its_audit_budget_and_others_still_run(
    tmp_path: Path,
) -> None:
    port = free_port()
    config = write_config(tmp_path, port)
    text = config.read_text().replace(
        "[audit]\n", f"[audit]\ncaller_bytes_per_s = {RATE}\ncaller_burst_bytes = {BURST}\n", 1
    )
    config.write_text(text)
    write_cheap_hash(tmp_path / "state" / "admin-password.argon2", PASSWORD)
    with serve_config(tmp_path, config, port) as server:
        flooder, other = await anyio.to_thread.run_sync(issue_tokens, server, 2)
        audit = tmp_path / "state" / "audit.jsonl"
        before = audit.stat().st_size
        started = time.monotonic()
        async with anyio.create_task_group() as tasks:
            flood: list[str] = []

            async def run_flood() -> None:
                flood.extend(await _flood(server.mcp_url, flooder, started + FLOOD_S))

            tasks.start_soon(run_flood)
            await anyio.sleep(FLOOD_S / 2)  # the flood is past its burst by now
            writes = [("write_file", {"path": f"mine-{n}.txt", "content": "mine"}) for n in range(5)]
            mine = await _calls(server.mcp_url, other, writes)
        elapsed = time.monotonic() - started
        await anyio.sleep(1.5)  # not a timing: the throttle's count is written a second after its first refusal
        log = server.log()
    lines = audit.read_bytes().splitlines(keepends=True)
    records = [json.loads(line) for line in lines]
    flooded = [r for r in records if r.get("tool") == "no_such_tool"]
    flooded_bytes = sum(len(line) for line, r in zip(lines, records, strict=True) if r.get("tool") == "no_such_tool")
    throttled = [r for r in records if r.get("event") == "calls_throttled"]

    assert [answer["code"] for answer in mine] == ["OK"] * 5, mine
    assert {r["args"]["path"] for r in records if r.get("tool") == "write_file" and r["event"] == "end"} >= {
        f"mine-{n}.txt" for n in range(5)
    }
    assert set(flood) == {"INVALID_REQUEST", "RESOURCE_LIMIT"}, set(flood)
    # Each call holds the most its record may take before it runs: calls at once cannot pass the check together
    # before any is charged (found by review: 200 at once wrote 15 times a 128 KiB burst).
    assert flooded_bytes <= BURST + RATE * elapsed, (flooded_bytes, elapsed)
    assert len(flooded) == flood.count("INVALID_REQUEST")  # every answered call recorded
    assert sum(r["refused"] for r in throttled) == flood.count("RESOURCE_LIMIT")  # every refusal counted
    assert {r["caller"] for r in throttled} == {flooded[0]["caller"]}
    assert audit.stat().st_size - before < 2 * BURST + RATE * elapsed
    assert verify(audit).ok
    assert "Traceback" not in log

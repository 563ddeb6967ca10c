"""A caller's audit budget covers the gateway's approval requests (2026-07-28 elicitation), over live HTTP.

`_ActionTool._to_ask` is the SDK's resolver for a gateway action that needs approval: it runs before the call
body, so its ``approval_requested`` record never passed `CallRunner`. Found by review (twenty-sixth session): a
client out of budget, every answer RESOURCE_LIMIT, called `biscuit_deploy` with a new version each time, 8 at a
time, and wrote 74 to 97 KB/s of durable records, 95 times its budget (the queue's cap of 16 pending requests was
checked after the record). What must hold: those records are charged to the caller and refused with it, and a
caller with 16 requests waiting writes no more of them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import ElicitResult

from bastion.safety.approvals import MAX_PENDING_PER_REQUESTER
from bastion.transports.http.password import write_hash
from tests.transports.http.live import PASSWORD, free_port, get_tokens, serve_config, write_config

from .lab import GatewayLab, point_demo_at_lab

pytestmark = pytest.mark.anyio

RATE = 1024
BURST = 256 * 1024
HIDDEN = "\x01" * 4096
FLOOD_S = 4.0
RECORD_SLACK = 512  # a calls_throttled record, written once a second


async def _declines(context: object, params: object) -> ElicitResult:
    return ElicitResult(action="decline")


async def test_a_caller_out_of_audit_budget_cannot_flood_approval_requests(tmp_path: Path, lab: GatewayLab) -> None:
    port = free_port()
    config = write_config(tmp_path, port, http_extra="registrations_per_ip_per_hour = 10000")
    point_demo_at_lab(config, lab)
    text = config.read_text()
    text = text.replace("# elicitation = true", "elicitation = true", 1)
    text = text.replace("[audit]\n", f"[audit]\ncaller_bytes_per_s = {RATE}\ncaller_burst_bytes = {BURST}\n", 1)
    config.write_text(text)
    write_hash(tmp_path / "state" / "admin-password.argon2", PASSWORD)
    audit = tmp_path / "state" / "audit.jsonl"
    with serve_config(tmp_path, config, port) as server:
        client_id = server.register(client_name="flooder")["client_id"]
        token = get_tokens(server, client_id, scopes=["gateway:deploy"])["access_token"]
        async with (
            httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http,
            Client(streamable_http_client(server.mcp_url, http_client=http), elicitation_callback=_declines) as client,
        ):
            codes: list[str] = []
            while "RESOURCE_LIMIT" not in codes:  # the budget spent
                spent = await client.call_tool("no_such_tool", {"a": HIDDEN, "b": HIDDEN, "c": HIDDEN})
                codes.append(str((spent.structured_content or {}).get("code")))
            before = audit.stat().st_size
            started = time.monotonic()
            versions = iter(range(10**9))

            async def one() -> None:
                while time.monotonic() < started + FLOOD_S:
                    arguments = {"project": "biscuit", "version": f"v{next(versions)}.0.0"}
                    result = await client.call_tool("biscuit_deploy", arguments)
                    codes.append(str((result.structured_content or {}).get("code")))

            async with anyio.create_task_group() as tasks:
                for _ in range(8):
                    tasks.start_soon(one)
            elapsed = time.monotonic() - started
        grown = audit.stat().st_size - before
        log = server.log()
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    asked = [r for r in records if r.get("event") == "approval_requested"]
    assert grown <= RATE * elapsed + RECORD_SLACK * (elapsed + 2), (grown, elapsed, len(asked))
    assert len(asked) <= MAX_PENDING_PER_REQUESTER, len(asked)
    assert "RESOURCE_LIMIT" in codes[-10:], codes[-10:]
    assert "Traceback" not in log

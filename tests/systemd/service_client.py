"""Drive a bastion service over HTTP through the tools its hardening must leave working (used by
scripts/test-service.sh against a real systemd). Prints one line per call; exits 0 if all succeeded.

Usage: python -m tests.systemd.service_client http://127.0.0.1:PORT/mcp  (the service's auth off, loopback)
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client


class Session:
    def __init__(self, client: Client) -> None:
        self.client = client
        self.failed: list[str] = []

    async def call(self, tool: str, **args: object) -> dict[str, Any]:
        result = await self.client.call_tool(tool, args)
        payload: dict[str, Any] = json.loads(result.content[0].text)  # type: ignore[union-attr]
        detail: dict[str, Any] = payload.get("detail") or {}
        shown = str(detail.get("stdout", detail.get("output", "")))[:100].replace("\n", "|")
        print(f"{tool}: {payload['code']} {payload.get('reason', '')[:200]} {shown}".rstrip())
        if not payload["ok"]:
            self.failed.append(tool)
        return detail


async def exercise(session: Session) -> None:
    await session.call("run_command", command="ls -la")  # the default host workspace
    sandbox = (await session.call("create_sandbox")).get("sandbox_id")
    if sandbox is None:
        return
    script = "id; df -h /workspace | tail -1; echo kept > /workspace/f; cat /workspace/f"
    await session.call("run_command", sandbox_id=sandbox, command=script)
    await session.call("execute_code", sandbox_id=sandbox, code="print(6 * 7)")
    background = await session.call("run_command", sandbox_id=sandbox, command="sleep 300", background=True)
    await session.call("kill_process", sandbox_id=sandbox, pid=background.get("pid"))
    terminal = (await session.call("open_terminal", sandbox_id=sandbox)).get("terminal_id")
    if terminal is not None:
        await session.call("terminal_send", terminal_id=terminal, text="echo term-$((6*7))\n")
        await session.call("terminal_read", terminal_id=terminal, wait_for="term-42")
        await session.call("close_terminal", terminal_id=terminal)
    await session.call("pause_sandbox", sandbox_id=sandbox)
    await session.call("resume_sandbox", sandbox_id=sandbox)
    snapshot = (await session.call("snapshot_sandbox", sandbox_id=sandbox)).get("snapshot_id")
    if snapshot is not None:
        restored = (await session.call("restore_sandbox", snapshot_id=snapshot)).get("sandbox_id")
        if restored is not None:
            await session.call("run_command", sandbox_id=restored, command="cat /workspace/f")
            await session.call("close_sandbox", sandbox_id=restored)
    await session.call("close_sandbox", sandbox_id=sandbox)


async def main(url: str) -> int:
    async with httpx2.AsyncClient(timeout=60) as http, Client(streamable_http_client(url, http_client=http)) as client:
        session = Session(client)
        await exercise(session)
    print("all calls succeeded" if not session.failed else f"FAILED: {', '.join(session.failed)}")
    return 0 if not session.failed else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1])))

"""`CountCalls`: the /mcp POSTs in flight, which decide whether an audit record may be written inline."""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path

import anyio
import pytest
from starlette.types import Receive, Scope, Send

from bastion.safety import audit as audit_mod
from bastion.safety.audit import AuditLog
from bastion.safety.redact import Redactor
from bastion.safety.results import OperationResult
from bastion.tools._call import CallRunner
from bastion.transports.http.app import CountCalls


def _scope(method: str, path: str) -> Scope:
    return {"type": "http", "method": method, "path": path, "headers": []}


async def _receive() -> dict[str, object]:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _send(message: object) -> None:
    return None


@pytest.mark.anyio
async def test_counts_mcp_posts_while_served_and_forgets_them_after_errors(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.jsonl", redactor=Redactor())
    runner = CallRunner(audit, caller="http")
    seen: list[int] = []
    release = anyio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(runner.requests_in_flight)
        if scope["path"] == "/mcp" and scope["method"] == "POST":
            await release.wait()
            raise RuntimeError("the handler failed")

    counted = CountCalls(app, runner)

    async def post() -> None:
        with pytest.raises(RuntimeError):
            await counted(_scope("POST", "/mcp"), _receive, _send)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(post)
        tasks.start_soon(post)
        await anyio.wait_all_tasks_blocked()
        assert runner.requests_in_flight == 2
        # Other requests are not calls: a GET stream, the token endpoint, an admin page.
        await counted(_scope("GET", "/mcp"), _receive, _send)
        await counted(_scope("POST", "/token"), _receive, _send)
        assert seen[-2:] == [2, 2]
        release.set()
    assert runner.requests_in_flight == 0


def test_a_call_with_other_requests_in_flight_syncs_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alone in the runner is not alone in the server: with another /mcp POST still on its way, the
    record's fdatasync runs on the worker thread, so the loop serves that request meanwhile (inline,
    every call synced alone: 1.1 records per fdatasync with 32 HTTP clients; off the loop, about 5)."""
    threads: list[int] = []
    real = os.fdatasync

    def record_thread(fd: int) -> None:
        threads.append(threading.get_ident())
        real(fd)

    monkeypatch.setattr(os, "fdatasync", record_thread)
    monkeypatch.setattr(audit_mod, "INLINE_SYNC_MAX_S", math.inf)  # any disk counts as fast here
    audit = AuditLog(tmp_path / "audit.jsonl", redactor=Redactor())
    audit.open()
    runner = CallRunner(audit, caller="http")

    async def ok() -> OperationResult:
        return OperationResult.success("explain_command")

    async def main() -> int:
        await runner.run("explain_command", {}, ok, mutating=False)
        runner.requests_in_flight = 2
        await runner.run("explain_command", {}, ok, mutating=False)
        return threading.get_ident()

    try:
        loop_thread = anyio.run(main)
    finally:
        audit.close()
    assert threads[0] == loop_thread
    assert threads[1] != loop_thread

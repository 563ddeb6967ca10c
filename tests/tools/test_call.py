"""`CallRunner`: what the audit log says about a call that never finished.

What this proves: a call cancelled mid-operation (uvicorn cancels what is still running when its
graceful shutdown ends; a client can go away) still writes its end record, with UNAVAILABLE and a
reason saying it was cancelled, so no start record is left without an end; the cancellation itself
goes on. What it does not prove: the same through a real server (tests/load/test_fault_sigterm.py).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import anyio
import pytest

from bastion.safety.audit import AuditLog, verify
from bastion.safety.redact import Redactor
from bastion.safety.results import OperationResult, ResultCode
from bastion.tools._call import CANCELLED_REASON, NO_THREAD_REASON, CallRunner

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("mutating", [True, False], ids=["mutating", "read-only"])
async def test_cancelled_call_still_writes_its_end_record(tmp_path: Path, mutating: bool) -> None:
    """Invariant: cancel a call while its operation runs: one end record, code UNAVAILABLE, reason
    CANCELLED_REASON; for a mutating call it follows the start record; the chain verifies."""
    audit = AuditLog(tmp_path / "audit.jsonl", redactor=Redactor())
    audit.open()
    runner = CallRunner(audit, caller="test")
    running = anyio.Event()

    async def forever() -> OperationResult:
        running.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async with anyio.create_task_group() as tasks:
        call = functools.partial(runner.run, "run_command", {"command": "sleep 1000"}, forever, mutating=mutating)
        tasks.start_soon(call)
        await running.wait()
        tasks.cancel_scope.cancel()
    audit.close()
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records] == (["start", "end"] if mutating else ["end"])
    end = records[-1]
    assert (end["code"], end["reason"], end["args"]) == ("UNAVAILABLE", CANCELLED_REASON, {"command": "sleep 1000"})
    assert len({r["call"] for r in records}) == 1
    assert verify(tmp_path / "audit.jsonl").ok


async def test_a_tool_whose_thread_cannot_start_is_answered_unavailable_not_internal_error(tmp_path: Path) -> None:
    """Found by attack (the server's cgroup at its pids limit): a tool's worker thread could not be started,
    `threading.Thread.start`'s RuntimeError reached the runner, and the client got INTERNAL_ERROR with a traceback
    in the server log. Invariant: UNAVAILABLE with a reason to try again, recorded as such; another RuntimeError
    is still an internal error."""
    audit = AuditLog(tmp_path / "audit.jsonl", redactor=Redactor())
    audit.open()
    runner = CallRunner(audit, caller="test")

    async def no_thread() -> OperationResult:
        raise RuntimeError("can't start new thread")  # `threading.Thread.start`'s, at the host's limit

    async def other() -> OperationResult:
        raise RuntimeError("something else")

    refused = await runner.run("write_file", {"path": "x"}, no_thread, mutating=True)
    assert (refused.code, refused.reason) == (ResultCode.UNAVAILABLE, NO_THREAD_REASON)
    assert (await runner.run("write_file", {"path": "x"}, other, mutating=True)).code == ResultCode.INTERNAL_ERROR
    audit.close()
    ends = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()][1::2]
    assert [end["code"] for end in ends] == ["UNAVAILABLE", "INTERNAL_ERROR"]

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
from bastion.safety.results import OperationResult
from bastion.tools._call import CANCELLED_REASON, CallRunner

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

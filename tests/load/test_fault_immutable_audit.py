"""Fault: the audit log made immutable (`chattr +i`) under three clients, then made writable again.

What this proves: while the file is immutable every call is refused with AUDIT_UNAVAILABLE and a clear
line, and a refused write_file wrote nothing; a call whose start record was written before the flag
says instead that it ran and its end record is missing (and its file is there); once `chattr -i` runs,
calls work again without a restart, the chain verifies, and every answer that names a record has it
exactly once. What it does not prove: an immutable flag set before the start (the open for append fails:
the server refuses to start, as for any audit log it cannot open).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from mcp import Client

from bastion.safety.audit import verify

from .fault_server import (
    Load,
    Served,
    answered_calls_are_logged,
    audit_records,
    fault_config,
    internal_errors,
    open_starts,
    until,
)

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.bwrap,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="chattr +i needs CAP_LINUX_IMMUTABLE"),
    pytest.mark.skipif(shutil.which("chattr") is None, reason="chattr (e2fsprogs) is not installed"),
]

CLIENTS = 3
RAN_WITHOUT_END = "the operation ran, but its end record could not be written"


def _chattr(flag: str, path: Path) -> None:
    subprocess.run(["chattr", flag, str(path)], check=True, capture_output=True)


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "demo"
    yield root
    audit = root / "state" / "audit.jsonl"
    if audit.exists():
        _chattr("-i", audit)  # whatever happened: pytest must be able to remove it


async def _writes(load: Load, client: Client, index: int) -> None:
    count = 0
    while not load.stop.is_set():
        count += 1
        await load.call(client, "write_file", path=f"c{index}-{count}.txt", content="x")
        await load.call(client, "read_file", path="README.md")


async def test_immutable_audit_log_fails_closed_and_recovers(root: Path) -> None:
    """Invariant: with the log immutable nothing runs and the answer says why; after chattr -i the
    same server accepts calls again and the chain is unbroken."""
    server = Served(fault_config(root, with_sandboxes=False))
    server.start()
    audit = root / "state" / "audit.jsonl"
    workspace = root / "workspace"
    try:
        load = Load(server.mcp_url)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(load.run, CLIENTS, _writes)
            await until(lambda: len(load.answers) >= 4 * CLIENTS, what="calls before the fault")
            _chattr("+i", audit)
            try:
                await until(lambda: load.codes()["AUDIT_UNAVAILABLE"] >= 4 * CLIENTS, what="refusals")
                async with load.session() as client:
                    probe = await load.call(client, "explain_command", command="ls")
            finally:
                _chattr("-i", audit)
            assert probe["code"] == "AUDIT_UNAVAILABLE", probe
            assert f"audit log unavailable: {audit} is immutable (chattr +i): run `chattr -i`" in probe["reason"]
            assert "\n" not in probe["reason"]
            ok_again = load.codes()["OK"]
            await until(lambda: load.codes()["OK"] >= ok_again + 4 * CLIENTS, what="calls after chattr -i")
            load.stop.set()
        assert load.broken == []
        assert internal_errors(server.log()) == []
    finally:
        server.stop()
    assert set(load.codes()) == {"OK", "AUDIT_UNAVAILABLE"}, load.codes()
    refused = [a for a in load.answers if a["code"] == "AUDIT_UNAVAILABLE"]
    assert all("nothing was done" in a["reason"] or RAN_WITHOUT_END in a["reason"] for a in refused), refused
    report = verify(audit)
    assert report.ok, report.first_error
    answered_calls_are_logged(load.answers, audit, complete=False)
    print(load.summary("audit log chattr +i"))
    _starts_without_end_were_answered_so(load, audit, workspace)


def _starts_without_end_were_answered_so(load: Load, audit: Path, workspace: Path) -> None:
    """A start record with no end is a call that ran and was told so; a refusal that says nothing was
    done left no file."""
    records = audit_records(audit)
    unfinished = open_starts(audit)
    ran = [a for a in load.answers if RAN_WITHOUT_END in a["reason"]]
    assert len(unfinished) == len(ran), (unfinished, ran)
    for start in unfinished:
        assert (workspace / start["args"]["path"]).exists(), start
    written = {r["args"]["path"] for r in records if r["event"] == "start" and r["tool"] == "write_file"}
    on_disk = {p.name for p in workspace.glob("c*-*.txt")}
    assert on_disk == written, on_disk ^ written

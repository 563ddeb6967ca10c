"""Fault: the state filesystem fills up under three clients, then space comes back.

The state folder is a 4 MiB tmpfs mounted in the test's folder (unmounted in teardown). What this
proves: once the audit log cannot grow, every call is refused with AUDIT_UNAVAILABLE (fail-closed: a
refused write_file wrote nothing, a call whose start record made it says it ran), no torn record is left,
the server answers every request (no traceback, no hang), and once the filler is deleted the same server
accepts calls again with the chain unbroken. What it does not prove: a disk that fails rather than fills
(EIO: tests/e2e/test_audit_faults.py shuts an ext4 image down).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from mcp import Client

from bastion.cli import EXIT_CONFIG
from bastion.safety.audit import verify
from tests.helpers import fill, mounts_under, tmpfs

from .fault_server import (
    Load,
    Served,
    answered_calls_are_logged,
    audit_records,
    descendants,
    fault_config,
    internal_errors,
    open_starts,
    settled_leftovers,
    unmount_all,
    until,
)

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.bwrap,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root"),
]

CLIENTS = 3
RAN_WITHOUT_END = "the operation ran, but its end record could not be written"


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "state", "4m") as mountpoint:
        yield mountpoint


async def _writes(load: Load, client: Client, index: int) -> None:
    count = 0
    while not load.stop.is_set():
        count += 1
        await load.call(client, "write_file", path=f"c{index}-{count}.txt", content="x")
        await load.call(client, "run_command", command=f"touch r{index}-{count}.txt")
        await load.call(client, "read_file", path="README.md")


async def test_full_state_filesystem_fails_closed_and_recovers(tmp_path: Path, state: Path) -> None:
    """Invariant: a full state filesystem refuses every call (nothing runs) and the server recovers
    by itself when space returns, with every answered call logged once and the chain intact."""
    server = Served(fault_config(tmp_path / "demo", state_dir=state, with_sandboxes=False))
    server.start()
    workspace = tmp_path / "demo" / "workspace"
    audit = state / "audit.jsonl"
    try:
        load = Load(server.mcp_url)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(load.run, CLIENTS, _writes)
            await until(lambda: len(load.answers) >= 6 * CLIENTS, what="calls before the fault")
            fill(state)
            await until(lambda: load.codes()["AUDIT_UNAVAILABLE"] >= 6 * CLIENTS, what="refusals")
            refused = [a for a in load.answers if a["code"] == "AUDIT_UNAVAILABLE"]
            (state / "filler").unlink()
            ok_again = load.codes()["OK"]
            await until(lambda: load.codes()["OK"] >= ok_again + 6 * CLIENTS, what="calls after space returned")
            load.stop.set()
        assert load.broken == []
        assert internal_errors(server.log()) == []
    finally:
        server.stop()
    assert mounts_under(state) == [str(state)]
    assert set(load.codes()) == {"OK", "AUDIT_UNAVAILABLE"}, load.codes()
    assert any("No space left on device" in a["reason"] for a in refused), refused
    assert all("nothing was done" in a["reason"] or RAN_WITHOUT_END in a["reason"] for a in refused), refused
    report = verify(audit)
    assert report.ok, report.first_error
    answered_calls_are_logged(load.answers, audit, complete=False)
    print(load.summary("state filesystem full"))
    records = audit_records(audit)
    assert len(open_starts(audit)) == len([a for a in load.answers if RAN_WITHOUT_END in a["reason"]])
    # What ran is what has a start record: nothing refused ran.
    started = {r["args"]["path"] for r in records if r["event"] == "start" and r["tool"] == "write_file"}
    touched = {
        r["args"]["command"][len("touch ") :] for r in records if r["event"] == "start" and r["tool"] == "run_command"
    }
    assert {p.name for p in workspace.glob("c*-*.txt")} == started
    assert {p.name for p in workspace.glob("r*-*.txt")} == touched


@pytest.fixture
def big_state(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "state", "96m", "0711") as mountpoint:
        try:
            yield mountpoint
        finally:
            unmount_all(mountpoint)  # the sandboxes' disks mounted in it, deepest first


async def _churn(load: Load, client: Client, index: int) -> None:
    while not load.stop.is_set():
        created = await load.call(client, "create_sandbox")
        if created["ok"]:
            box = created["detail"]["sandbox_id"]
            await load.call(client, "write_file", path="f.txt", content="x" * 1000, sandbox_id=box)
            await load.call(client, "close_sandbox", sandbox_id=box)


async def test_full_state_filesystem_with_sandboxes_refuses_and_leaves_no_half_made_sandbox(
    tmp_path: Path, big_state: Path
) -> None:
    """Invariant: sandboxes created and closed without pause while the state filesystem (which holds
    their disk images) fills: every call is OK or a typed refusal, the warm pool's failed refills
    leave no mount, loop device or folder behind, creating works again once space returns, and the
    server stops with nothing left."""
    config = fault_config(tmp_path / "demo", state_dir=big_state)
    text = config.read_text().replace("disk_bytes = 2147483648", "disk_bytes = 33554432")
    config.write_text(text.replace("state_reserve_bytes = 268435456", "state_reserve_bytes = 0"))
    server = Served(config)
    server.start()
    try:
        load = Load(server.mcp_url)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(load.run, CLIENTS, _churn)
            await until(lambda: load.codes("close_sandbox")["OK"] >= 2 * CLIENTS, what="sandboxes before the fault")
            fill(big_state)
            await until(lambda: load.codes()["AUDIT_UNAVAILABLE"] >= 3 * CLIENTS, what="refusals")
            (big_state / "filler").unlink()
            ok_again = load.codes("close_sandbox")["OK"]
            await until(lambda: load.codes("close_sandbox")["OK"] >= ok_again + 2 * CLIENTS, 30, "sandboxes after")
            load.stop.set()
        assert load.broken == []
        pid, processes = server.pid, descendants(server.pid)
        server.signal(signal.SIGTERM)
        assert server.wait() == 0, server.log()
    finally:
        server.stop()
    print(load.summary("state filesystem full, with sandboxes"))
    assert internal_errors(server.log()) == []
    assert "INTERNAL_ERROR" not in load.codes(), load.codes()
    gone = settled_leftovers(tmp_path, pid, processes)
    assert (gone.processes, gone.loops, gone.cgroups) == ([], [], []), gone
    assert gone.mounts == [str(big_state)], gone.mounts
    assert [p.name for p in (big_state / "sandboxes").iterdir() if p.name.startswith("sb-")] == []
    assert verify(big_state / "audit.jsonl").ok
    answered_calls_are_logged(load.answers, big_state / "audit.jsonl", complete=False)


async def test_kill_9_on_a_full_state_filesystem_recovers_once_space_returns(tmp_path: Path, big_state: Path) -> None:
    """Invariant: a server killed while the state filesystem is full restarts (recovery keeps each
    crashed workspace as it is rather than fail the start, one error line each) or, when SQLite
    cannot open the state database without room, refuses with one line; after space returns,
    the next start makes them `recovered` snapshots with their files; nothing is left at the end."""
    config = fault_config(tmp_path / "demo", state_dir=big_state)
    text = config.read_text().replace("disk_bytes = 2147483648", "disk_bytes = 33554432")
    text = text.replace("state_reserve_bytes = 268435456", "state_reserve_bytes = 0")
    # No warm pool: recovery discarding its empty disk would free room for the others' snapshots.
    config.write_text(text.replace("[sandboxes]\nenabled = true\n", "[sandboxes]\nenabled = true\nwarm_pool = 0\n"))
    server = Served(config)
    server.start()
    try:
        load = Load(server.mcp_url)
        boxes: list[str] = []

        async def work(load: Load, client: Client, index: int) -> None:
            box = (await load.call(client, "create_sandbox"))["detail"]["sandbox_id"]
            assert (await load.call(client, "write_file", path="kept.txt", content=box, sandbox_id=box))["ok"]
            boxes.append(box)

        await load.run(CLIENTS, work)
        fill(big_state)
        server.signal(signal.SIGKILL)
        server.wait()
        try:
            server.start()  # on the full disk
        except RuntimeError:
            # SQLite may need room to open the state database after a kill (its WAL): one line, exit 78.
            assert server.wait() == EXIT_CONFIG, server.log()
            assert "bastion.db cannot be opened" in server.log(), server.log()
            assert internal_errors(server.log()) == []
        else:
            kept = [line for line in server.log().splitlines() if "left by a crash kept as is" in line]
            assert len(kept) == CLIENTS, server.log()
            server.signal(signal.SIGTERM)
            assert server.wait() == 0
        (big_state / "filler").unlink()
        server.start()
        async with load.session() as client:
            listed = await load.call(client, "list_snapshots")
            recovered = {s["sandbox_id"]: s["snapshot_id"] for s in listed["detail"]["snapshots"] if s["recovered"]}
            assert set(recovered) == set(boxes)
            restored = await load.call(client, "restore_sandbox", snapshot_id=recovered[boxes[0]])
            back = await load.call(client, "read_file", path="kept.txt", sandbox_id=restored["detail"]["sandbox_id"])
            assert back["detail"]["content"] == boxes[0]
        pid, processes = server.pid, descendants(server.pid)
        server.signal(signal.SIGTERM)
        assert server.wait() == 0, server.log()
    finally:
        server.stop()
    print(load.summary("kill -9 on a full state filesystem"))
    gone = settled_leftovers(tmp_path, pid, processes)
    assert (gone.processes, gone.loops, gone.cgroups) == ([], [], []), gone
    assert gone.mounts == [str(big_state)], gone.mounts
    assert verify(big_state / "audit.jsonl").ok

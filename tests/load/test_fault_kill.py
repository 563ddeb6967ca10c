"""Fault: `kill -9` of the server while three clients work in their sandboxes, then a restart.

What this proves: the killed server's sandbox processes die with it (a fourth client creating and
closing sandboxes without pause makes the kill find some half made or half closed); the restarted server's crash
recovery removes every cgroup, mount and loop device the dead one left, keeps each crashed sandbox's
workspace as a `recovered` snapshot that restores with its files, and the audit log verifies, with every
answer a client got present in it exactly once. A torn last line (a write cut by a power loss: kill -9
cannot tear one) stops the next start with one line, and `bastion audit verify` names it and nothing
before it. What it does not prove: recovery after the host itself rebooted (tests/e2e/test_crash_recovery.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from glob import glob
from pathlib import Path

import anyio
import pytest
from mcp import Client

from bastion.safety.audit import AuditLog, verify
from bastion.safety.redact import Redactor
from tests.helpers import BASTION, mounts_under

from .fault_server import (
    Load,
    Served,
    answered_calls_are_logged,
    audit_records,
    cgroups_of,
    descendants,
    fault_config,
    internal_errors,
    loops_under,
    open_starts,
    settled_leftovers,
    unmount_all,
    until,
    verify_cli,
)

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.bwrap,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="sandbox disks and cgroups need root"),
]

CLIENTS = 3
CALLS_BEFORE_KILL = 8  # per client, after its sandbox exists


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "demo"
    unmount_all(tmp_path)


async def _work_in_own_sandbox(boxes: dict[int, str], load: Load, client: Client, index: int) -> None:
    created = await load.call(client, "create_sandbox", labels={"client": str(index)})
    assert created["ok"], created
    box = created["detail"]["sandbox_id"]
    wrote = await load.call(client, "write_file", path="kept.txt", content=f"client {index}\n", sandbox_id=box)
    assert wrote["ok"], wrote
    boxes[index] = box
    count = 0
    while True:  # until the server dies under it
        count += 1
        ran = await load.call(client, "run_command", command=f"echo {count} >> counted.txt", sandbox_id=box)
        assert ran["ok"], ran
        read = await load.call(client, "read_file", path="kept.txt", sandbox_id=box)
        assert read["ok"], read


async def _churn(load: Load, client: Client, index: int) -> None:
    """Sandboxes created and closed without pause: the kill finds some half made or half closed."""
    while True:
        created = await load.call(client, "create_sandbox", labels={"churn": "yes"})
        assert created["ok"], created
        closed = await load.call(client, "close_sandbox", sandbox_id=created["detail"]["sandbox_id"])
        assert closed["ok"], closed


async def test_kill_9_under_load_then_restart_recovers_everything(root: Path) -> None:
    """Invariant: kill -9 under load loses nothing that was answered and leaves nothing after the
    next start: no process, cgroup, mount or loop device of the dead server; every crashed sandbox
    is a `recovered` snapshot that restores; the audit chain verifies before and after."""
    server = Served(fault_config(root))
    server.start()
    try:
        load, churn = Load(server.mcp_url), Load(server.mcp_url)
        boxes: dict[int, str] = {}
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(load.run, CLIENTS, lambda ld, c, i: _work_in_own_sandbox(boxes, ld, c, i))
            tasks.start_soon(churn.run, 1, _churn)
            await until(lambda: len(boxes) == CLIENTS and len(load.answers) >= CLIENTS * (2 + CALLS_BEFORE_KILL))
            await until(lambda: len(churn.answers) >= 4, what="sandboxes churned")
            dead_pid, processes = server.pid, descendants(server.pid)
            server.signal(signal.SIGKILL)
        assert server.wait() == -signal.SIGKILL
        assert len(load.broken) == CLIENTS, load.broken  # every session saw the server go
        assert len(churn.broken) == 1, churn.broken
        gone = settled_leftovers(root, dead_pid, processes)
        assert gone.processes == [], "a sandbox process outlived the server"
        # Its mounts stay until the next start (its cgroups too, unless another server's recovery on
        # this machine got there first: any start removes the groups of a pid that is gone).
        assert gone.mounts, "the dead server left no mount: the fault did not bite"

        report = verify_cli(server.config_path)
        assert report.returncode == 0, report.stdout + report.stderr
        audit = root / "state" / "audit.jsonl"
        answered_calls_are_logged(load.answers + churn.answers, audit, complete=False)
        print(
            load.summary("kill -9"),
            ";",
            churn.summary("kill -9 (create/close churn)"),
            f"; {len(open_starts(audit))} calls in flight killed",
        )
        assert len(open_starts(audit)) <= CLIENTS + 1  # at most the one call each client had in flight
        killed = open_starts(audit)
        before = load.answers + churn.answers

        server.start()  # the same state folder: crash recovery runs at start-up
        assert cgroups_of(dead_pid) == []
        sandboxes = root / "state" / "sandboxes"
        for box in boxes.values():
            assert mounts_under(sandboxes / box) == []
            assert loops_under(sandboxes / box) == []
            assert not (sandboxes / box).exists()
        load = Load(server.mcp_url)
        async with load.session() as client:
            listed = await load.call(client, "list_snapshots")
            recovered = {s["sandbox_id"]: s for s in listed["detail"]["snapshots"] if s["recovered"]}
            assert set(recovered) == set(boxes.values()), listed["detail"]["snapshots"]
            # Each is in the audit log, as the start's own record (found by attack: told on stderr only).
            records = [r for r in audit_records(audit) if r.get("event") == "recovery" and r["phase"] == "end"]
            assert {r["snapshot_id"] for r in records} == {s["snapshot_id"] for s in recovered.values()}
            index, box = next(iter(boxes.items()))
            restored = await load.call(client, "restore_sandbox", snapshot_id=recovered[box]["snapshot_id"])
            assert restored["ok"], restored
            kept = await load.call(client, "read_file", path="kept.txt", sandbox_id=restored["detail"]["sandbox_id"])
            assert kept["detail"]["content"] == f"client {index}\n"
        live_pid, processes = server.pid, descendants(server.pid)
        server.signal(signal.SIGTERM)
        assert server.wait() == 0, server.log()
        assert settled_leftovers(root, live_pid, processes).none
        assert settled_leftovers(root, dead_pid, set()).none
    finally:
        server.stop()
    for started in (1, 2):
        assert internal_errors((root / f"server-{started}.log").read_text()) == []
    chain = verify(audit)
    assert chain.ok, chain.first_error
    answered_calls_are_logged(before + load.answers, audit, complete=False)
    assert open_starts(audit) == killed  # the restarted server finished every call it began


def test_torn_last_record_stops_the_next_start_with_one_line(root: Path) -> None:
    """Invariant: an audit log ending in a torn record (a write cut short, as a power loss leaves it)
    is never appended to: the next start exits with one line naming `bastion audit verify`, and that
    command reports the torn line and no earlier one. The administrator decides (the record may be
    evidence); the server never truncates it on its own."""
    config_path = fault_config(root, with_sandboxes=False)
    audit = root / "state" / "audit.jsonl"
    log = AuditLog(audit, redactor=Redactor())
    log.open()
    for n in range(3):
        log.append({"tool": "explain_command", "event": "end", "n": n})
    log.close()
    with open(audit, "ab") as torn:
        torn.write(b'{"id": "torn-by-a-power-loss", "seq": ')
    started = subprocess.run(
        [str(BASTION), "serve", "--config", str(config_path), "--http"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert started.returncode != 0
    assert "Traceback" not in started.stderr
    assert f"ends in a torn record: run `bastion audit verify {audit}`" in started.stderr
    report = verify_cli(config_path)
    assert report.returncode != 0
    assert report.stdout.startswith(f"BROKEN at {audit}:4: "), report.stdout
    assert "torn record" in report.stdout


class _PidOne(Served):
    """The server as pid 1 of a pid namespace of its own, as in a container: the same pid at every start."""

    def start(self) -> None:
        self.starts += 1
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
        argv += [str(BASTION), "serve", "--config", str(self.config_path), "--http"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        self.wait_ready()

    @property
    def inner(self) -> int:
        """The server's pid as the host sees it (the child of `unshare`)."""
        found = subprocess.run(["pgrep", "-P", str(self.pid)], capture_output=True, text=True, check=False)
        return int(found.stdout.split()[0])


def _pid_one_groups() -> list[str]:
    """The sandbox groups a pid-1 server made, in every hierarchy."""
    paths = glob("/sys/fs/cgroup/bastion/sb-1-*") + glob("/sys/fs/cgroup/*/bastion/sb-1-*")
    return sorted({Path(path).name for path in paths})


async def test_kill_9_of_a_server_that_is_pid_1_then_restart_removes_its_groups(root: Path) -> None:
    """Found by attack: recovery removed a dead server's cgroups only when no process had its pid. A server
    that is pid 1 of a container has the same pid at every start: its dead groups stayed for ever, and the
    restarted one asked for the same names, so its first create_sandbox was refused (CONFLICT, "cgroup sb-1-2
    already exists") and its warm pool was not refilled. Now a group whose owner is the server itself, or a
    process younger than the group, is a dead server's."""
    assert _pid_one_groups() == []
    server = _PidOne(fault_config(root))
    server.start()
    try:
        load = Load(server.mcp_url)
        async with load.session() as client:
            assert (await load.call(client, "create_sandbox"))["ok"]
        assert _pid_one_groups()
        os.kill(server.inner, signal.SIGKILL)
        server.wait()
        server.start()  # the same names again: sb-1-1, sb-1-2...
        async with load.session() as client:
            for _ in range(3):
                assert (await load.call(client, "create_sandbox"))["ok"]
        assert "already exists" not in server.log()
        os.kill(server.inner, signal.SIGTERM)
        assert server.wait() == 0, server.log()
    finally:
        if server.process is not None and server.process.poll() is None:
            os.kill(server.inner, signal.SIGTERM)
            server.wait()
        left = _pid_one_groups()
        _remove_pid_one_groups()  # a failure's leftovers: every process of the namespace is gone
    assert left == []


def _remove_pid_one_groups() -> None:
    for group in glob("/sys/fs/cgroup/bastion/sb-1-*") + glob("/sys/fs/cgroup/*/bastion/sb-1-*"):
        for folder, _, _ in sorted(os.walk(group), key=lambda entry: -len(entry[0])):
            os.rmdir(folder)


async def test_two_servers_that_are_pid_1_of_their_containers_leave_each_others_sandboxes_alone(
    tmp_path: Path,
) -> None:
    """Found by review: a group's pid names a process only in its server's own pid namespace. A server that is
    pid 1 of a container, starting, read another container's pid-1 groups as its own dead predecessor's and
    destroyed them, killing that server's live sandboxes. Group names now carry their state folder's token."""
    assert _pid_one_groups() == []
    first, second = _PidOne(fault_config(tmp_path / "first")), _PidOne(fault_config(tmp_path / "second"))
    first.start()
    try:
        load = Load(first.mcp_url)
        async with load.session() as client:
            box = (await load.call(client, "create_sandbox"))["detail"]["sandbox_id"]
            assert (await load.call(client, "run_command", command="true", sandbox_id=box))["ok"]
            token = (tmp_path / "first" / "state" / "cgroup-owner").read_text().split()[0]
            held = {name for name in _pid_one_groups() if name.endswith(f"-{token}")}
            assert held
            second.start()  # its recovery runs
            assert held <= set(_pid_one_groups())
            ran = await load.call(client, "run_command", command="echo still here", sandbox_id=box)
            assert ran["detail"]["stdout"] == "still here\n"
    finally:
        for server in (second, first):
            if server.process is not None and server.process.poll() is None:
                os.kill(server.inner, signal.SIGTERM)
                server.wait()
        left = _pid_one_groups()
        _remove_pid_one_groups()
        unmount_all(tmp_path)
    assert left == []

"""The cgroup boundary of a sandbox: limits hold, freeze stops, kill leaves nothing, destroy cleans every hierarchy.

These use real cgroups under a base group of their own, bastion-test-<pid>, so they
never touch a real server's groups; every group made here is destroyed, and the
base removed, even when a test fails. They prove what the kernel enforces for a
process attached before it starts work, not that the server attaches in time.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import mmap
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bastion.safety.errors import Conflict, InvalidRequest, NotFound, OperationFailed, Timeout, Unavailable
from bastion.sandbox import cgroups
from bastion.sandbox._cgroupfs import poll_until, write_file
from bastion.sandbox._hierarchies import Hierarchy, Roles, own_dir, parse_mountinfo, parse_self_cgroup
from bastion.sandbox.cgroups import (
    CgroupLayout,
    Limits,
    SandboxCgroup,
    Usage,
    fd_migration_supported,
    owner_pid,
    owner_token,
)
from tests.helpers import TCP_FILL

pytestmark = pytest.mark.root

BASE_NAME = f"bastion-test-{os.getpid()}"
MIB = 1024 * 1024
UNLIMITED = Limits(memory_bytes=None, pids=None, cpu_cores=None)
# The child waits for one line on stdin before it does anything, so it is in the group before it works.
GATE = "import sys\nsys.stdin.readline()\n"
KILL_TREE = "read go; setsid sleep 1000 & (sleep 1000 &); sleep 1000"

MakeGroup = Callable[..., SandboxCgroup]
Spawn = Callable[[SandboxCgroup, list[str]], subprocess.Popen[bytes]]


@pytest.fixture(scope="module")
def layout() -> Iterator[CgroupLayout]:
    try:
        found = CgroupLayout.detect(BASE_NAME)
    except Unavailable as exc:
        if os.geteuid() != 0:
            pytest.skip(f"needs root or a delegated cgroup subtree (systemd Delegate=yes): {exc.reason}")
        raise
    try:
        yield found
    finally:
        for name in found.existing():
            found.open(name).destroy()
        found.release()


@pytest.fixture
def make_group(layout: CgroupLayout, spawn: Spawn) -> Iterator[MakeGroup]:
    """Groups destroyed at teardown. It depends on `spawn` so that groups go first, then processes are reaped."""
    made: list[SandboxCgroup] = []

    def make(limits: Limits = UNLIMITED, name: str | None = None, on: CgroupLayout = layout) -> SandboxCgroup:
        group = on.create(name or f"t-{uuid.uuid4().hex[:12]}", limits)
        made.append(group)
        return group

    yield make
    for group in made:
        group.destroy()


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start argv (reading one gate line first), attach it, then open the gate."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(group: SandboxCgroup, argv: list[str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        procs.append(proc)
        group.attach(proc.pid)
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=5)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def python(code: str) -> list[str]:
    return [sys.executable, "-I", "-S", "-c", GATE + code]


def wait_for(predicate: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def is_cgroup2(path: str) -> bool:
    mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    return any(m.point == path and m.fstype == "cgroup2" for m in mounts)


def test_detect_finds_every_role(layout: CgroupLayout) -> None:
    """memory, pids, cpu, freeze and kill each have a home; on a hybrid host freeze/kill are in the v2 mount."""
    where = layout.locations
    assert {"memory", "pids", "cpu", "cpu_usage", "freeze"} <= set(where)
    if is_cgroup2("/sys/fs/cgroup/unified"):
        assert layout.mode == "hybrid"
        # As root, at the top of each hierarchy; unprivileged, under our delegated cgroup.
        for role, mount in (("memory", "memory"), ("pids", "pids"), ("freeze", "unified"), ("kill", "unified")):
            assert where[role].startswith(f"/sys/fs/cgroup/{mount}/"), role
            assert where[role].endswith(f"/{BASE_NAME}"), role
            if os.geteuid() == 0:
                assert where[role] == f"/sys/fs/cgroup/{mount}/{BASE_NAME}", role
        assert where["cpu"].startswith("/sys/fs/cgroup/cpu")
        assert layout.has_cgroup_kill
    for path in where.values():
        assert os.path.isdir(path)


def test_memory_limit_oom_kills_a_256_mib_allocation(make_group: MakeGroup, spawn: Spawn) -> None:
    """A 256 MiB allocation in a 64 MiB group dies by SIGKILL from the OOM killer, not by swapping."""
    group = make_group(Limits(memory_bytes=64 * MIB, pids=None, cpu_cores=None))
    proc = spawn(group, python("block = b'x' * (256 << 20)\nprint('survived')"))
    assert proc.wait(timeout=10) == -9
    assert group.oom_kills() >= 1


def test_pids_limit_stops_a_fork_loop(make_group: MakeGroup, spawn: Spawn) -> None:
    """A fork loop in a 16-task group gets EAGAIN at about 16 tasks; the group never exceeds 16."""
    group = make_group(Limits(memory_bytes=None, pids=16, cpu_cores=None))
    code = """
import os, time
forked = 0
try:
    while forked < 1000:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        forked += 1
except OSError as exc:
    print(forked, exc.errno, flush=True)
sys.stdin.readline()
"""
    proc = spawn(group, python(code))
    assert proc.stdout is not None
    forked, err = (int(field) for field in proc.stdout.readline().split())
    assert err == errno.EAGAIN
    assert 8 <= forked <= 15
    assert group.usage().pids <= 16
    group.kill()
    assert proc.wait(timeout=5) == -9


def memory_dir(group: SandboxCgroup) -> Path:
    """The group's folder in the hierarchy that holds its memory limit."""
    found = [
        Path(p) for p in group.paths if any((Path(p) / f).exists() for f in ("memory.max", "memory.limit_in_bytes"))
    ]
    assert len(found) == 1, group.paths
    return found[0]


def test_loopback_tcp_buffers_past_the_memory_limit_are_refused(make_group: MakeGroup, spawn: Spawn) -> None:
    """Attack (found by attack): on cgroup v1 TCP buffers are counted only once memory.kmem.tcp.limit_in_bytes
    is written; 54 loopback pairs queued 402 MB with the group at 4 of 128 MiB, and tcp_mem is one budget for
    every socket on the host. Invariant: 60 pairs in a 64 MiB group queue no more than about 64 MiB (v1: the
    TCP limit is the memory limit; v2: memory.max counts them), and the group's socket memory is back to 0
    once the process is gone. Without the limit the same pairs queue over 100 MiB here."""
    group = make_group(Limits(memory_bytes=64 * MIB, pids=None, cpu_cores=None))
    memory = memory_dir(group)
    v1 = (memory / "memory.limit_in_bytes").exists()
    if v1 and not (memory / "memory.kmem.tcp.limit_in_bytes").exists():
        pytest.skip("this kernel's v1 memory controller has no TCP accounting")
    if v1:
        assert (memory / "memory.kmem.tcp.limit_in_bytes").read_text().strip() == str(64 * MIB)
    proc = spawn(group, python(TCP_FILL))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert int(out) <= 72, f"{int(out)} MiB queued in a 64 MiB group"

    def socket_memory() -> int:
        if v1:
            return int((memory / "memory.kmem.tcp.usage_in_bytes").read_text())
        return int(dict(line.split() for line in (memory / "memory.stat").read_text().splitlines())["sock"])

    wait_for(lambda: socket_memory() == 0)


def test_v1_tcp_buffer_limit_is_written_and_a_refusal_stops_the_start(tmp_path: Path) -> None:
    """The v1 branch against plain files laid out like cgroupfs: memory.kmem.tcp.limit_in_bytes gets the
    memory limit (-1 for none); where it exists but cannot be written (here a folder), set_limits fails with
    OperationFailed naming it, so the sandbox does not start with its TCP buffers counted nowhere; a kernel
    without the file is left alone."""
    group_dir = tmp_path / "base" / "box"
    group_dir.mkdir(parents=True)
    for name in ("memory.limit_in_bytes", "memory.swappiness", "pids.max", "cpu.cfs_period_us", "cpu.cfs_quota_us"):
        (group_dir / name).write_text("")
    v1 = Hierarchy(1, str(tmp_path / "base"))
    group = SandboxCgroup("box", Roles(v1, v1, v1, v1, v1, None, False, (v1,)))
    group.set_limits(Limits(memory_bytes=64 * MIB, pids=16, cpu_cores=None))  # no TCP file: left alone
    assert not (group_dir / "memory.kmem.tcp.limit_in_bytes").exists()
    (group_dir / "memory.kmem.tcp.limit_in_bytes").write_text("")
    group.set_limits(Limits(memory_bytes=64 * MIB, pids=16, cpu_cores=None))
    assert (group_dir / "memory.kmem.tcp.limit_in_bytes").read_text() == str(64 * MIB)
    (group_dir / "memory.kmem.tcp.limit_in_bytes").write_text("")
    group.set_limits(UNLIMITED)
    assert (group_dir / "memory.kmem.tcp.limit_in_bytes").read_text() == "-1"
    (group_dir / "memory.kmem.tcp.limit_in_bytes").unlink()
    (group_dir / "memory.kmem.tcp.limit_in_bytes").mkdir()
    with pytest.raises(OperationFailed, match="cannot limit the TCP buffers of cgroup box"):
        group.set_limits(Limits(memory_bytes=64 * MIB, pids=16, cpu_cores=None))


def test_cpu_limit_holds_a_busy_loop_to_a_fifth_of_a_core(make_group: MakeGroup, spawn: Spawn) -> None:
    """At 0.2 cores, one second of busy looping gets about 0.2 s of CPU (bound 0.35 s)."""
    group = make_group(Limits(memory_bytes=None, pids=None, cpu_cores=0.2))
    before = group.usage().cpu_usec
    proc = spawn(group, python("import time\nend = time.monotonic() + 1.0\nwhile time.monotonic() < end:\n    pass\n"))
    assert proc.wait(timeout=10) == 0
    used = group.usage().cpu_usec - before
    assert 50_000 < used <= 350_000


def test_freeze_stops_cpu_use_and_thaw_resumes_it(make_group: MakeGroup, spawn: Spawn) -> None:
    """While frozen a busy loop gains under 20 ms of CPU in 300 ms; after thaw it runs again."""
    group = make_group()
    spawn(group, python("while True:\n    pass\n"))
    wait_for(lambda: group.usage().cpu_usec > 20_000)
    group.freeze()
    assert group.usage().frozen
    frozen_at = group.usage().cpu_usec
    time.sleep(0.3)
    thawed_at = group.usage().cpu_usec
    assert thawed_at - frozen_at < 20_000
    group.thaw()
    assert not group.usage().frozen
    wait_for(lambda: group.usage().cpu_usec - thawed_at > 50_000)


def _state(pid: int) -> str:
    """The kernel's one-letter state of a process (/proc/PID/stat, after the parenthesized name)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def test_freeze_waits_for_the_groups_own_processes_beside_an_empty_command_group(
    make_group: MakeGroup, spawn: Spawn
) -> None:
    """Three groups, each with processes of its own (as a sandbox's bubblewrap and agent) and an empty command
    group, held back by a 1% CPU quota, frozen once. Invariant: freeze() returns once every process is stopped
    (none left runnable, "R", on its way to the freezer) and the group reads frozen. Before, the kernel reported
    the group frozen as soon as the empty command group was (kernel/cgroup/freezer.c: cgroup_propagate_frozen
    does not count the group's own processes): freeze() returned at once, and the report fell to "not frozen"
    when the first of the two stopped. Does not prove: a syscall already running ends first (the kernel
    finishes it, then stops the process)."""
    for _ in range(3):
        _freeze_busy_and_idle_once(make_group(Limits(memory_bytes=None, pids=None, cpu_cores=0.01)), spawn)


def _freeze_busy_and_idle_once(group: SandboxCgroup, spawn: Spawn) -> None:
    group.command_group("c1")
    busy = spawn(group, python("while True:\n    pass\n"))
    idle = spawn(group, python("sys.stdin.readline()\n"))
    wait_for(lambda: group.usage().cpu_usec > 5_000)  # the quota is spent: the next wake waits for a period
    group.freeze()
    states = [_state(busy.pid), _state(idle.pid)]
    assert "R" not in states, states
    assert group.usage().frozen
    group.thaw()
    assert not group.usage().frozen
    assert busy.poll() is None
    assert idle.poll() is None


def _frozen_report(directory: str) -> bool:
    text = Path(directory, "cgroup.events").read_text()
    return dict(line.split() for line in text.splitlines()).get("frozen") == "1"


def test_a_command_started_in_a_group_made_mid_freeze_is_stopped_when_freeze_returns(
    make_group: MakeGroup, spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command starts while its sandbox is being frozen: its command group is made after freeze() listed the
    command groups and before it froze the sandbox's group, and a busy process (held back by a 1% CPU quota, so
    it stops late) joins it, as the agent's command does. Invariant: freeze() returns once that process is
    stopped too (not runnable, its group reads frozen), and thaw() lets it and the sandbox's own idle process
    run on. Before, the group's report counted its own processes only: freeze() returned with the command still
    running, and a snapshot copied files it changed. Does not prove: a syscall already running ends first."""
    for _ in range(3):
        _start_a_command_mid_freeze_once(
            make_group(Limits(memory_bytes=None, pids=None, cpu_cores=0.01)), spawn, monkeypatch
        )


def _start_a_command_mid_freeze_once(group: SandboxCgroup, spawn: Spawn, monkeypatch: pytest.MonkeyPatch) -> None:
    group.command_group("c1")
    idle = spawn(group, python("sys.stdin.readline()\n"))  # as the agent, waiting for a request
    busy = spawn(group, python("while True:\n    pass\n"))
    wait_for(lambda: group.usage().cpu_usec > 5_000)  # the quota is spent: the next wake waits for a period
    listing = cgroups._tree
    late: list[str] = []

    def list_then_start_a_command(directory: str) -> list[str]:
        listed = listing(directory)
        if not late:
            late.append(group.command_group("late").path)
            Path(late[0], "cgroup.procs").write_text(str(busy.pid))
        return listed

    monkeypatch.setattr(cgroups, "_tree", list_then_start_a_command)
    group.freeze()
    monkeypatch.undo()
    assert late
    assert _state(busy.pid) != "R"
    assert _frozen_report(late[0])
    assert group.usage().frozen
    group.thaw()
    assert not group.usage().frozen
    assert not _frozen_report(late[0])
    used = group.usage().cpu_usec
    wait_for(lambda: group.usage().cpu_usec > used)  # the command runs again
    assert busy.poll() is None
    assert idle.poll() is None


def test_a_command_started_in_a_frozen_sandbox_does_not_run_until_thaw(
    make_group: MakeGroup, spawn: Spawn, tmp_path: Path
) -> None:
    """A command starts while its sandbox is paused: its command group, made under the frozen group, starts
    frozen (the kernel gives a new group its parent's freeze), and a running process that joins it stops there
    before it runs a line of its own. Invariant: nothing it would do happens before thaw(), and all of it
    after. Pins the kernel's behaviour that freeze() relies on for groups made once the group is frozen."""
    group = make_group()
    idle = spawn(group, python("sys.stdin.readline()\n"))
    group.freeze()
    late = group.command_group("late")
    assert _frozen_report(late.path)
    marker = tmp_path / "ran"
    joiner = subprocess.Popen(python(f"open({str(marker)!r}, 'w').close()\n"), stdin=subprocess.PIPE)
    try:
        Path(late.path, "cgroup.procs").write_text(str(joiner.pid))
        assert joiner.stdin is not None
        joiner.stdin.write(b"go\n")
        joiner.stdin.flush()
        wait_for(lambda: _frozen_report(late.path))
        assert group.usage().frozen
        assert not marker.exists()
        assert _state(joiner.pid) != "R"
        group.thaw()
        assert joiner.wait(timeout=10) == 0
        assert marker.exists()
        assert idle.poll() is None
    finally:
        if joiner.stdin is not None:
            joiner.stdin.close()
        if joiner.poll() is None:
            joiner.kill()  # a frozen process still takes SIGKILL
        joiner.wait(timeout=5)


@pytest.fixture
def v1_freezer(layout: CgroupLayout) -> Iterator[CgroupLayout]:
    """The layout with the v1 freezer for freeze and command groups (pure v1's), where this host mounts one."""
    if layout.mode == "v1":
        yield layout
        return
    mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    mount = next((m.point for m in mounts if m.fstype == "cgroup" and "freezer" in m.super_options), None)
    if mount is None:
        pytest.skip("no v1 freezer hierarchy on this host")
    freezer = Hierarchy(1, os.path.join(mount, BASE_NAME))
    try:
        os.mkdir(freezer.base)
    except PermissionError:
        pytest.skip("the v1 freezer hierarchy is not this user's to write (the unprivileged pass)")
    old = layout._roles
    v1_only = tuple(h for h in old.all if h.version == 1)
    roles = dataclasses.replace(old, freeze=freezer, unified=None, cgroup_kill=False, all=(*v1_only, freezer))
    try:
        yield CgroupLayout(layout.base_name, "v1", roles)
    finally:
        os.rmdir(freezer.base)


def _v1_state(directory: str) -> str:
    return Path(directory, "freezer.state").read_text().strip()


def test_a_command_started_in_a_v1_group_made_mid_freeze_is_stopped_when_freeze_returns(
    v1_freezer: CgroupLayout, make_group: MakeGroup, spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The v1 freezer: a command group is made, and a busy process (1% CPU quota) joins it, after the sandbox's
    freezer.state was written and before it read FROZEN. Invariant: freeze() returns once that process is stopped
    too, and thaw() lets it run on. The v1 freezer walks the child groups at each read of freezer.state
    (cgroup_freezer.c: update_if_frozen) and gives a new group its parent's freezing, so this holds without
    the v2 path's listing: the test pins it."""
    group = make_group(Limits(memory_bytes=None, pids=None, cpu_cores=0.01), on=v1_freezer)
    idle = spawn(group, python("sys.stdin.readline()\n"))
    busy = spawn(group, python("while True:\n    pass\n"))
    wait_for(lambda: group.usage().cpu_usec > 5_000)
    late: list[str] = []

    def start_a_command_then_poll(done: Callable[[], bool], timeout_s: float) -> bool:
        if not late:
            late.append(group.command_group("late").path)
            Path(late[0], "cgroup.procs").write_text(str(busy.pid))
        return poll_until(done, timeout_s)

    monkeypatch.setattr("bastion.sandbox.cgroups.poll_until", start_a_command_then_poll)
    group.freeze()
    monkeypatch.undo()
    assert late
    assert _state(busy.pid) != "R"
    assert _v1_state(late[0]) == "FROZEN"
    assert group.usage().frozen
    group.thaw()
    assert not group.usage().frozen
    used = group.usage().cpu_usec
    wait_for(lambda: group.usage().cpu_usec > used)
    assert busy.poll() is None
    assert idle.poll() is None


def sleeps_in(group: SandboxCgroup) -> list[int]:
    found = []
    for pid in group.pids():
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "sleep":
                found.append(pid)
        except (FileNotFoundError, ProcessLookupError):  # exited since the listing (ESRCH mid-exit)
            continue
    return found


def assert_tree_killed(group: SandboxCgroup, proc: subprocess.Popen[bytes]) -> None:
    wait_for(lambda: len(sleeps_in(group)) >= 3)  # setsid'd, double-forked (orphaned), foreground
    victims = group.pids()
    group.kill()
    assert group.pids() == []
    assert proc.wait(timeout=5) == -9
    for pid in victims:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        assert state in ("Z", "X"), f"pid {pid} survived in state {state}"
    paths = group.paths
    group.destroy()
    assert not any(os.path.exists(path) for path in paths)


def test_kill_ends_setsid_and_double_forked_children(make_group: MakeGroup, spawn: Spawn) -> None:
    """cgroup.kill ends a tree that left the session and its parent; destroy removes the group everywhere."""
    group = make_group()
    assert_tree_killed(group, spawn(group, ["sh", "-c", KILL_TREE]))


def test_kill_without_cgroup_kill_freezes_and_signals_each_pid(
    layout: CgroupLayout, make_group: MakeGroup, spawn: Spawn
) -> None:
    """The fallback for kernels before 5.14 (freeze, SIGKILL each pid, thaw) also leaves nothing."""
    old_kernel = CgroupLayout(layout.base_name, layout.mode, dataclasses.replace(layout._roles, cgroup_kill=False))
    group = make_group(on=old_kernel)
    assert_tree_killed(group, spawn(group, ["sh", "-c", KILL_TREE]))


def test_existing_lists_a_leftover_and_create_refuses_its_name(layout: CgroupLayout, make_group: MakeGroup) -> None:
    """A group left behind is found for crash recovery; creating it again is a Conflict, never a reuse."""
    name = f"leftover-{uuid.uuid4().hex[:8]}"
    make_group(name=name)
    assert name in layout.existing()
    with pytest.raises(Conflict):
        layout.create(name, UNLIMITED)
    assert layout.open(name).name == name


def test_names_are_checked_and_missing_groups_are_not_found(layout: CgroupLayout) -> None:
    """A name that could walk the tree is refused; opening a group that is not there is NotFound."""
    for bad in ("../escape", "Upper", "", "a" * 65, "a/b"):
        with pytest.raises(InvalidRequest):
            layout.create(bad, UNLIMITED)
    with pytest.raises(NotFound):
        layout.open("never-made")


def test_limits_refuse_nonsense() -> None:
    with pytest.raises(InvalidRequest):
        Limits(memory_bytes=0, pids=None, cpu_cores=None)
    with pytest.raises(InvalidRequest):
        Limits(memory_bytes=None, pids=-1, cpu_cores=None)
    with pytest.raises(InvalidRequest):
        Limits(memory_bytes=None, pids=None, cpu_cores=float("nan"))


def test_pure_v2_files_are_written_in_the_v2_format(tmp_path: Path) -> None:
    """The pure-v2 branch (not reachable on a hybrid host), against plain files laid out like cgroupfs."""
    group_dir = tmp_path / "base" / "box"
    group_dir.mkdir(parents=True)
    files = {
        "memory.max": "",
        "memory.swap.max": "",
        "pids.max": "",
        "cpu.max": "",
        "memory.current": "4096\n",
        "pids.current": "3\n",
        "cpu.stat": "usage_usec 1234\nuser_usec 1000\n",
        "cgroup.events": "populated 1\nfrozen 0\n",
        "memory.events": "low 0\nhigh 0\nmax 5\noom 2\noom_kill 2\n",
    }
    for name, text in files.items():
        (group_dir / name).write_text(text)
    v2 = Hierarchy(2, str(tmp_path / "base"))
    group = SandboxCgroup("box", Roles(v2, v2, v2, v2, v2, v2, True, (v2,)))
    group.set_limits(Limits(memory_bytes=64 * MIB, pids=16, cpu_cores=0.2))
    assert (group_dir / "memory.max").read_text() == str(64 * MIB)
    assert (group_dir / "memory.swap.max").read_text() == "0"
    assert (group_dir / "pids.max").read_text() == "16"
    assert (group_dir / "cpu.max").read_text() == "20000 100000"
    assert group.usage() == Usage(memory_bytes=4096, pids=3, cpu_usec=1234, frozen=False)
    assert group.oom_kills() == 2
    for name in ("memory.max", "pids.max", "cpu.max"):
        (group_dir / name).write_text("")
    group.set_limits(UNLIMITED)
    assert (group_dir / "memory.max").read_text() == "max"
    assert (group_dir / "pids.max").read_text() == "max"
    assert (group_dir / "cpu.max").read_text() == "max 100000"


def test_mountinfo_and_own_cgroup_of_a_delegated_pure_v2_service() -> None:
    """Parsing of a systemd host (pure v2) and of a mount whose root is not the hierarchy root."""
    mountinfo = (
        "24 1 0:22 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
        "30 24 0:23 / /sys/fs/cgroup/with\\040space rw - cgroup cgroup rw,cpu,cpuacct\n"
        "40 1 0:22 /system.slice /mnt/cg rw - cgroup2 cgroup2 rw\n"
        "50 1 0:5 / /proc rw - proc proc rw\n"
    )
    mounts = parse_mountinfo(mountinfo)
    assert [(m.point, m.fstype) for m in mounts] == [
        ("/sys/fs/cgroup", "cgroup2"),
        ("/sys/fs/cgroup/with space", "cgroup"),
        ("/mnt/cg", "cgroup2"),
    ]
    assert mounts[1].super_options >= {"cpu", "cpuacct"}
    own = parse_self_cgroup("0::/system.slice/bastion.service\n")
    assert own == {"": "/system.slice/bastion.service"}
    assert own_dir(mounts[0], own[""]) == "/sys/fs/cgroup/system.slice/bastion.service"
    assert own_dir(mounts[2], own[""]) == "/mnt/cg/bastion.service"
    assert own_dir(mounts[2], "/user.slice/x") is None
    hybrid = parse_self_cgroup("4:memory:/a/b\n2:cpu,cpuacct:/\n1:name=systemd:/x\n0::/\n")
    assert hybrid == {"memory": "/a/b", "cpu": "/", "cpuacct": "/", "": "/"}


@pytest.mark.parametrize(
    ("release", "supported"),
    [("6.18.0-1-amd64", True), ("5.16.0", True), ("5.15.170-generic", False), ("4.19.0", False), ("odd", False)],
)
def test_command_groups_need_a_kernel_that_checks_the_fd_opener(release: str, supported: bool) -> None:
    """Before 5.16 a cgroup.procs write was checked against the writer: the agent's moves would fail."""
    assert fd_migration_supported(release) is supported


@pytest.mark.parametrize(
    ("name", "owner", "token"),
    [
        ("sb-7082-1", 7082, None),
        ("vm-12-300", 12, None),
        ("sb-1-2-0a1b2c3d", 1, "0a1b2c3d"),
        ("sb-x-1", None, None),
        ("sb-7082", None, None),
        ("sb-1-2-3", None, None),
        ("sb-1-2-0A1B2C3D", None, None),
        ("base", None, None),
    ],
)
def test_owner_pid_is_read_from_a_sandbox_groups_name_only(name: str, owner: int | None, token: str | None) -> None:
    """Crash recovery removes the groups of servers that are gone, and the doctor counts only its own:
    both read the server's pid from the name (and its state folder's token, `owner_of`), and a name of
    another shape names no server."""
    assert owner_pid(name) == owner
    assert owner_token(name) == token


def test_a_freeze_that_times_out_leaves_nothing_frozen(
    make_group: MakeGroup, spawn: Spawn, layout: CgroupLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: command groups whose processes a tiny CPU limit keeps from reaching the freezer in time
    made `freeze` time out with some of them (or the whole group) left frozen, while the sandbox was not
    paused: no resume could thaw them. A freeze that times out thaws everything it froze, then says so."""
    if layout._roles.freeze.version != 2:
        pytest.skip("the v1 freezer freezes the group in one write")
    monkeypatch.setattr(cgroups, "FREEZE_WAIT_S", 0.05)  # the busy processes below take longer to stop
    group = make_group(Limits(memory_bytes=None, pids=None, cpu_cores=0.01))
    spawn(group, python("sys.stdin.readline()\n"))
    children = [group.command_group(f"c{index}") for index in range(12)]
    for child in children:
        for _ in range(2):
            busy = spawn(group, python("while True:\n    pass\n"))
            Path(child.path, "cgroup.procs").write_text(str(busy.pid))
    wait_for(lambda: group.usage().cpu_usec > 5_000)
    with pytest.raises(Timeout, match="thawed again"):
        group.freeze()
    parent = os.path.dirname(children[0].path)
    assert [Path(path, "cgroup.freeze").read_text().strip() for path in (parent, *(c.path for c in children))] == [
        "0"
    ] * 13
    used = group.usage().cpu_usec
    wait_for(lambda: group.usage().cpu_usec > used)  # its processes run again


def test_a_freeze_that_fails_midway_leaves_nothing_frozen(
    make_group: MakeGroup, spawn: Spawn, layout: CgroupLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a freeze that raised once some command groups were frozen (a write refused: EMFILE, a
    group gone) left them frozen with the sandbox not paused. A failing freeze thaws what it froze."""
    if layout._roles.freeze.version != 2:
        pytest.skip("the v1 freezer freezes the group in one write")
    group = make_group(Limits(memory_bytes=None, pids=None, cpu_cores=None))
    spawn(group, python("sys.stdin.readline()\n"))
    children = [group.command_group(f"c{index}") for index in range(3)]
    for child in children:
        Path(child.path, "cgroup.procs").write_text(str(spawn(group, python("sys.stdin.readline()\n")).pid))
    parent = os.path.dirname(children[0].path)

    def refused_at_the_parent(path: str, value: str) -> None:
        if path == os.path.join(parent, "cgroup.freeze") and value == "1":
            raise OperationFailed(f"cannot write {path}: Too many open files")
        write_file(path, value)

    monkeypatch.setattr(cgroups, "write_file", refused_at_the_parent)
    with pytest.raises(OperationFailed, match="Too many open files"):
        group.freeze()
    states = [Path(path, "cgroup.freeze").read_text().strip() for path in (parent, *(c.path for c in children))]
    assert states == ["0"] * 4


PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident_pages(path: Path) -> int:
    """How many of `path`'s pages are in the page cache: mincore(2) on a private mapping, which faults none in."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    vector = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
    with path.open("rb") as file, mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        view = (ctypes.c_char * size).from_buffer(mapped)
        try:
            assert libc.mincore(ctypes.addressof(view), size, vector) == 0, os.strerror(ctypes.get_errno())
        finally:
            del view
    return sum(byte & 1 for byte in vector)


def _fstype_of(path: Path) -> str:
    """The type of the filesystem `path` is on (the longest mount point above it, proc(5)'s mountinfo)."""
    best, fstype = "", ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        point = left.split(" ")[4]
        if f"{path}/".startswith(point.rstrip("/") + "/") and len(point) >= len(best):
            best, fstype = point, right.split(" ")[0]
    return fstype


def test_page_cache_a_destroyed_group_read_is_released_not_left_pinning_a_dying_memory_cgroup(
    make_group: MakeGroup, spawn: Spawn, tmp_path: Path
) -> None:
    """Found by attack (twenty-seventh session): an agent's create_sandbox, a read of host files nobody had
    cached, close_sandbox. The pages it read are charged to its memory cgroup, and a removed memory cgroup stays
    in the kernel ("dying": out of the tree, still in /proc/cgroups) as long as they stay cached: one a cycle
    (200 for 200), with no bound until memory pressure, and the kernel's reclaim walks them all; a sandbox put to
    sleep and woken left one too (its disk image's pages). Invariant: what a group's processes read is no longer
    cached, so charged to nothing, once the group is destroyed (v1's memory.force_empty, v2's memory.reclaim)."""
    if _fstype_of(tmp_path) == "tmpfs":
        pytest.skip("tmp_path is on a tmpfs, whose pages are not reclaimed without swap")
    data = tmp_path / "never-cached.bin"
    with data.open("wb") as out:
        out.write(os.urandom(4 * MIB))
        out.flush()
        os.fsync(out.fileno())
        os.posix_fadvise(out.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert _resident_pages(data) == 0
    group = make_group()
    reader = spawn(group, python(f"open({str(data)!r}, 'rb').read()"))
    assert reader.wait(timeout=30) == 0
    pages = _resident_pages(data)
    assert pages == 4 * MIB // PAGE  # read into the cache, charged to the group
    group.destroy()
    assert _resident_pages(data) == 0, "the group's page cache outlived it, pinning its memory cgroup"

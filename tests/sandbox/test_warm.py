"""The warm bubblewrap sandbox: what a command inside can and cannot see or leave behind.

These run real bubblewrap sandboxes; they prove the kernel boundary, not the policy. The
promises every backend makes (run, spawn, pause, limits, close) are in test_backend_conformance.py;
what is here is bubblewrap's own: namespaces, capabilities, seccomp, landlock, its tmpfs, its cgroup.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import selectors
import socket
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import pytest

from bastion.safety.errors import Conflict, Unavailable
from bastion.sandbox._spawn import SANDBOX_PATH, SandboxSpec
from bastion.sandbox.cgroups import CgroupLayout, Limits, SandboxCgroup
from bastion.sandbox.warm import BubblewrapBackend, RunOutcome, WarmSandbox
from tests.helpers import processes_with

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

ENV = {"PATH": SANDBOX_PATH, "HOME": "/workspace", "LANG": "C.UTF-8"}


async def sh(box: WarmSandbox, script: str, *, timeout_s: float = 10, cap: int = 65536) -> RunOutcome:
    return await box.run(
        "/bin/sh", ["sh", "-c", script], cwd="/workspace", env=ENV, timeout_s=timeout_s, max_output_bytes=cap
    )


async def test_command_has_no_capabilities_and_no_new_privs(sandbox: WarmSandbox) -> None:
    outcome = await sh(sandbox, "grep -E '^(Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs):' /proc/self/status")
    fields = dict(line.split(":\t") for line in outcome.stdout.decode().splitlines())
    assert fields.pop("NoNewPrivs") == "1"
    assert set(fields.values()) == {"0000000000000000"}
    assert len(fields) == 5


async def test_command_sees_only_its_three_standard_fds(sandbox: WarmSandbox) -> None:
    """Invariant: nothing of the agent (its socket to the host, its namespace and wakeup fds)
    leaks into a command: ls of /proc/self/fd shows 0, 1, 2 and the fd ls opened to list it."""
    outcome = await sandbox.run(
        "/bin/ls", ["ls", "/proc/self/fd"], cwd="/workspace", env=ENV, timeout_s=10, max_output_bytes=4096
    )
    assert outcome.stdout.split() == [b"0", b"1", b"2", b"3"]


async def test_no_network_but_loopback(sandbox: WarmSandbox) -> None:
    """Invariant: a host service on loopback is unreachable from inside (own network namespace)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        outcome = await sh(
            sandbox,
            f"cat /proc/net/dev | tail -n +3 | cut -d: -f1; (echo x > /dev/tcp/127.0.0.1/{port}) 2>&1 || echo refused",
        )
    finally:
        listener.close()
    lines = [line.strip() for line in outcome.stdout.decode().splitlines()]
    assert lines[0] == "lo"
    assert lines[-1] == "refused"


async def test_host_secrets_and_home_are_not_visible(sandbox: WarmSandbox) -> None:
    outcome = await sh(sandbox, "ls /root /home /etc/shadow /etc/ssh /var 2>&1; echo done")
    text = outcome.stdout.decode()
    assert text.count("No such file or directory") == 5
    assert text.endswith("done\n")


async def test_system_folders_are_read_only(sandbox: WarmSandbox) -> None:
    outcome = await sh(sandbox, "touch /usr/bastion-probe 2>&1; touch /workspace/ok && echo wrote")
    assert b"Read-only file system" in outcome.stdout
    assert outcome.stdout.endswith(b"wrote\n")
    assert not Path("/usr/bastion-probe").exists()


async def test_tmp_is_size_capped(sandbox: WarmSandbox) -> None:
    outcome = await sh(sandbox, "head -c 80000000 /dev/zero > /tmp/big; echo $?")
    assert b"No space left on device" in outcome.stderr
    assert outcome.stdout.rstrip().endswith(b"1")


async def test_dev_shm_flood_is_enospc_at_its_size_cap_without_server_tmpfs(sandbox: WarmSandbox) -> None:
    """Without the server's tmpfs (an unprivileged server), bwrap's own /dev/shm has a size cap too."""
    outcome = await sh(sandbox, "head -c 80M /dev/zero > /dev/shm/big; stat -c %s /dev/shm/big")
    assert b"No space left on device" in outcome.stderr
    assert int(outcome.stdout) <= sandbox.spec.shm_size_bytes


async def test_file_in_dev_shm_keeps_an_idle_sandbox_awake_without_server_tmpfs(sandbox: WarmSandbox) -> None:
    """bwrap's own /dev/shm dies with the sandbox: a file there is state that sleep would lose."""
    await sh(sandbox, "echo kept > /dev/shm/x")
    assert not sandbox.sleep()
    assert (await sh(sandbox, "cat /dev/shm/x; rm /dev/shm/x")).stdout == b"kept\n"
    assert sandbox.sleep()


async def test_each_command_is_pid_1_of_its_own_namespace(sandbox: WarmSandbox) -> None:
    """Two commands alive at once (the first waits for the second) both see themselves as PID 1."""
    waiting = sh(sandbox, "echo $$; while [ ! -e go ]; do sleep 0.01; done")
    going = sh(sandbox, "touch go; echo $$")
    results = await asyncio.gather(waiting, going)
    assert [r.stdout for r in results] == [b"1\n"] * 2


async def test_landlock_confines_writes_to_workspace_and_tmp(sandbox: WarmSandbox) -> None:
    """Invariant: root inside the user namespace still cannot write bwrap's own tmpfs: /dev, writable as a
    mount, by Landlock; / by the mount itself, read-only since bwrap set it up; only the sandbox's trees."""
    script = "touch /dev/probe; mkdir /dev/probe2; mkdir /probe; touch /tmp/ok /workspace/ok && echo wrote"
    outcome = await sh(sandbox, script)
    errors = outcome.stderr.decode()
    assert errors.count("Permission denied") == 2, errors
    assert "mkdir: cannot create directory ‘/probe’: Read-only file system" in errors
    assert outcome.stdout == b"wrote\n"


# The mount flags of each path, and what chmod and a write of bastion's own programs and /etc files get.
READ_ONLY_PROBE = """
import errno, os
for path in ("/", "/etc", "/opt/bastion", "/dev", "/tmp", "/workspace"):
    print(path, "ro" if os.statvfs(path).f_flag & os.ST_RDONLY else "rw")
for path in ("/opt/bastion/agent.py", "/etc/passwd", "/etc/ld.so.cache"):
    for attempt in (lambda: os.chmod(path, 0o777), lambda: os.open(path, os.O_WRONLY | os.O_TRUNC)):
        try:
            attempt()
            print(path, "CHANGED")
        except OSError as exc:
            print(path, errno.errorcode[exc.errno])
"""


async def test_command_cannot_rewrite_the_programs_or_etc_files_bastion_puts_inside(sandbox: WarmSandbox) -> None:
    """Attack: a command chmods or truncates /opt/bastion/agent.py, the sandbox's /etc/passwd or a host
    /etc file copied in. Invariant: refused by the read-only root mount (EROFS), not only by Landlock; the
    root's read-only flag does not reach /dev, /tmp or /workspace (their own mounts)."""
    outcome = await sh(sandbox, f"/usr/bin/python3 -I -S -c '{READ_ONLY_PROBE}'")
    lines = outcome.stdout.decode().splitlines()
    assert lines[:6] == ["/ ro", "/etc ro", "/opt/bastion ro", "/dev rw", "/tmp rw", "/workspace rw"], lines
    files = ("/opt/bastion/agent.py", "/etc/passwd", "/etc/ld.so.cache")
    assert lines[6:] == [f"{path} EROFS" for path in files for _attempt in ("chmod", "write")]


async def test_host_etc_files_are_copies_on_the_root_not_binds(sandbox: WarmSandbox) -> None:
    """Invariant: the host's regular /etc files a sandbox sees are byte-for-byte the host's, on the
    sandbox's own root (its device), not bind mounts: a bind costs every start a read of the host's mount
    table. /etc/ld.so.conf.d, a folder (libc-bin's: on every Debian), stays a bind (the host's device)."""
    probe = "import os; print(*(os.stat(p).st_dev for p in ('/', '/etc/ld.so.cache', '/etc/ld.so.conf.d')))"
    outcome = await sh(sandbox, f'/usr/bin/python3 -I -S -c "{probe}"; sha256sum /etc/ld.so.cache /etc/nsswitch.conf')
    lines = outcome.stdout.decode().splitlines()
    root, copied, folder = lines[0].split()
    assert copied == root
    assert folder != root
    for line in lines[1:]:
        digest, path = line.split()
        assert digest == hashlib.sha256(Path(path).read_bytes()).hexdigest(), path


async def test_seccomp_filter_is_on_for_commands(sandbox: WarmSandbox) -> None:
    """Invariant: every command runs under the filter: no new user namespace, no mount."""
    outcome = await sh(sandbox, "grep '^Seccomp:' /proc/self/status; unshare -U true 2>&1; echo unshare=$?")
    text = outcome.stdout.decode()
    assert "Seccomp:\t2" in text
    assert "Operation not permitted" in text
    assert "unshare=1" in text


@pytest.fixture
async def limited(tmp_path: Path) -> AsyncIterator[WarmSandbox]:
    ws = tmp_path / "limited"
    ws.mkdir()
    layout = CgroupLayout.detect(base_name=f"bastion-test-{os.getpid()}")
    box = WarmSandbox(
        SandboxSpec(workspace=str(ws)), cgroups=layout, limits=Limits(memory_bytes=96 << 20, pids=32, cpu_cores=1.0)
    )
    yield box
    box.close()
    layout.release()


async def test_close_removes_the_cgroup(limited: WarmSandbox) -> None:
    await sh(limited, "true")
    group = limited._group
    assert group is not None
    paths = group.paths
    assert all(os.path.isdir(p) for p in paths)
    limited.close()
    assert not any(os.path.exists(p) for p in paths)


def _descendants(pid: int) -> list[int]:
    found = [pid]
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as handle:
            for child in handle.read().split():
                found += _descendants(int(child))
    return found


async def test_an_idle_sandbox_holds_only_its_agent(sandbox: WarmSandbox) -> None:
    """Invariant: between commands nothing waits in the sandbox but the agent (commands are
    spawned on demand), a background process lives on, and commands at once all run."""
    assert (await sh(sandbox, "true")).status == 0
    assert sandbox._proc is not None
    idle = len(_descendants(sandbox._proc.pid))
    marker = "4249.25"  # unique among the tests: processes_with sees every worker's processes
    background = await sandbox.spawn("/bin/sleep", ["sleep", marker], cwd="/", env=ENV, ring_bytes=1024)
    outcomes = await asyncio.gather(*(sh(sandbox, f"echo {n}") for n in range(3)))
    assert [o.stdout for o in outcomes] == [b"0\n", b"1\n", b"2\n"]
    assert processes_with(marker), "the background process lives between commands"
    assert len(_descendants(sandbox._proc.pid)) == idle + 1, "only the background process was added"
    await sandbox.kill(background)
    assert len(_descendants(sandbox._proc.pid)) == idle


def test_limits_without_cgroups_are_refused_at_once(tmp_path: Path) -> None:
    """A limit bubblewrap cannot enforce (no cgroups) is refused, never silently dropped."""
    limits = Limits(memory_bytes=96 << 20, pids=32, cpu_cores=1.0)
    with pytest.raises(Unavailable):
        BubblewrapBackend(None).sandbox(SandboxSpec(workspace=str(tmp_path)), limits=limits)
    with pytest.raises(Unavailable):
        BubblewrapBackend(None).sandbox(SandboxSpec(workspace=str(tmp_path)), limits=None).set_limits(limits)


def test_a_second_event_loop_sees_the_commands_exit(tmp_path: Path) -> None:
    """A program that embeds bastion may drive one sandbox from two event loops one after the other
    (a test harness, a bench calling `anyio.run` twice). Invariant: the agent's messages are read on
    the loop running now, so a command's exit is seen at once, not at its time limit."""
    ws = tmp_path / "two-loops"
    ws.mkdir()
    box = WarmSandbox(SandboxSpec(workspace=str(ws)))
    try:
        first = asyncio.run(sh(box, "echo first"))
        second = asyncio.run(sh(box, "echo second", timeout_s=30))
        assert (first.stdout, first.status) == (b"first\n", 0)
        assert (second.stdout, second.status, second.timed_out) == (b"second\n", 0, False)
    finally:
        box.close()


def test_a_background_process_is_killed_from_a_second_event_loop(tmp_path: Path) -> None:
    """Invariant: `kill` waits for the exit the agent reports on the loop running now; left on the
    first loop, it would wait out its grace time and then end the whole sandbox."""
    ws = tmp_path / "two-loops-kill"
    ws.mkdir()
    box = WarmSandbox(SandboxSpec(workspace=str(ws)))
    try:
        process = asyncio.run(box.spawn("/bin/sleep", ["sleep", "60"], cwd="/", env=ENV, ring_bytes=1024))
        asyncio.run(box.kill(process))
        assert process.exited
        assert box.alive, "the kill ended the whole sandbox"
    finally:
        box.close()


async def test_a_connect_while_the_agent_starts_leaves_its_hello_to_the_start(sandbox: WarmSandbox) -> None:
    """A preview request may reach a sandbox waking from sleep. Invariant: the connect does not take
    the agent's socket from the start waiting for its hello: the start succeeds, the connect gets
    its own answer, and commands run."""
    starting = asyncio.create_task(sandbox.start())
    while sandbox._sock is None:  # started: bwrap runs, the agent has not said hello yet
        assert not starting.done(), starting
        await asyncio.sleep(0)
    with pytest.raises(Unavailable, match="nothing accepts connections"):
        await sandbox.connect(1)  # nothing listens on port 1 in it
    await starting
    assert (await sh(sandbox, "echo up")).stdout == b"up\n"


async def test_a_start_cancelled_before_the_agents_hello_is_undone(tmp_path: Path) -> None:
    """Found by a review: a start (a sleeping sandbox's wake-up) cancelled while it waited for the agent's
    hello kept its process and socket with no reader on the socket: the sandbox counted as alive, and every
    command then waited out its time limit. Invariant: the cancelled start is undone (nothing left
    running), and the next command starts the sandbox again and runs."""
    box = WarmSandbox(SandboxSpec(workspace=str(tmp_path)))
    try:
        starting = asyncio.ensure_future(box.start())
        while box._proc is None:  # spawned, waiting for the hello
            await asyncio.sleep(0)
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        assert not box.alive
        await box.settled()
        # bwrap's child, killed with bwrap while it was still setting up, did not always die with it.
        assert _sandbox_processes(tmp_path) == []
        outcome = await box.run(
            "/bin/echo",
            ["echo", "woke"],
            cwd="/workspace",
            env={"PATH": SANDBOX_PATH},
            timeout_s=20,
            max_output_bytes=1024,
        )
        assert outcome.stdout == b"woke\n", outcome
    finally:
        await box.aclose(final=True)


def _sandbox_processes(workspace: Path) -> list[int]:
    """The host pids of processes whose /workspace is `workspace` (their mount table names it)."""
    found = []
    for pid in processes_with("/opt/bastion/agent.py"):
        try:
            if f" {workspace}" in Path(f"/proc/{pid}/mountinfo").read_text():
                found.append(pid)
        except OSError:
            continue
    return found


# A listener whose backlog is full and which never accepts: a connect to it waits for the agent's time limit.
_FULL_LISTENER = (
    "import socket, time\n"
    "s = socket.socket()\n"
    "s.bind(('127.0.0.1', 0))\n"
    "s.listen(0)\n"
    "port = s.getsockname()[1]\n"
    "held = []\n"
    "for _ in range(4):\n"
    "    c = socket.socket()\n"
    "    c.setblocking(False)\n"
    "    c.connect_ex(('127.0.0.1', port))\n"
    "    held.append(c)\n"
    "print(port, flush=True)\n"
    "time.sleep(600)\n"
)
_FILLERS = 12
_FILLER_ENV_BYTES = 28_000  # under the tools' 32 KB of environment per call


async def test_a_kill_behind_a_busy_agent_and_a_full_socket_is_sent_and_answered(limited: WarmSandbox) -> None:
    """Attack: the agent is busy for 2 s (a connect to a listener that never accepts), a client queues a
    command, then a dozen with big environments (its socket fills: sends wait for room), then cancels the
    first. The kill found no room and was dropped, so the command, started later, was never killed; and of
    two sends waiting for room at once, one waited for ever. Now the kill waits for room, the agent answers
    it once it has started the command, and the group dies then: the command and what it started are gone,
    every queued command ran, and the sandbox lives on (its listener still runs)."""
    listener = await limited.spawn(
        "/usr/bin/python3", ["python3", "-c", _FULL_LISTENER], cwd="/", env=ENV, ring_bytes=1024
    )
    async with asyncio.timeout(10):
        while not (printed := listener.stdout.read(0, 64)[1]).endswith(b"\n"):
            assert not listener.exited, listener.stderr.read(0, 1024)
            await asyncio.sleep(0.01)
    port = int(printed)
    marker = f"4251.{os.getpid()}"
    busy = asyncio.ensure_future(limited.connect(port))  # the first connect of a run goes through the agent
    first = asyncio.ensure_future(sh(limited, f"setsid sleep {marker} & exec sleep {marker}", timeout_s=60))
    await asyncio.sleep(0)  # its hand-off, before the fillers'
    filler_env = {**ENV, "FILLER": "x" * _FILLER_ENV_BYTES}
    fillers = [
        asyncio.ensure_future(
            limited.run("/bin/true", ["true"], cwd="/", env=filler_env, timeout_s=60, max_output_bytes=1024)
        )
        for _ in range(_FILLERS)
    ]
    async with asyncio.timeout(10):
        while len(limited._writables) < 2:  # two sends at least wait for room
            await asyncio.sleep(0.01)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    with pytest.raises(Unavailable):
        await busy
    async with asyncio.timeout(30):
        outcomes = await asyncio.gather(*fillers)
    assert [outcome.status for outcome in outcomes] == [0] * _FILLERS
    async with asyncio.timeout(10):
        while processes_with(marker):
            await asyncio.sleep(0.05)
    assert not listener.exited
    await limited.kill(listener)


def _limited_box(tmp_path: Path) -> tuple[WarmSandbox, CgroupLayout]:
    ws = tmp_path / "limited-sync"
    ws.mkdir()
    layout = CgroupLayout.detect(base_name=f"bastion-test-{os.getpid()}")
    limits = Limits(memory_bytes=96 << 20, pids=32, cpu_cores=1.0)
    return WarmSandbox(SandboxSpec(workspace=str(ws)), cgroups=layout, limits=limits), layout


def _until_gone(marker: str, limit_s: float = 10) -> list[int]:
    """Poll (from a thread with no event loop) until no process has `marker`; what is left after `limit_s`."""
    deadline = time.monotonic() + limit_s
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _agent_out_of(box: WarmSandbox, pids: list[int]) -> bool:
    """Whether two or more `pids` run and the sandbox's agent is in none of their cgroups."""
    agent = box._agent_pid
    if len(pids) < 2 or agent is None:
        return False
    try:
        home = Path(f"/proc/{agent}/cgroup").read_text()
        return all(Path(f"/proc/{pid}/cgroup").read_text() != home for pid in pids)
    except OSError:  # one ended meanwhile: look again
        return False


def test_a_run_cancelled_as_its_event_loop_ends_leaves_nothing_running(tmp_path: Path) -> None:
    """Attack (review): a program embedding bastion ends its event loop (`asyncio.run` returns) while a
    command runs. The cancel's kill then waited for the agent's answer on a loop that was gone, and what
    the command had started (`setsid sleep`) lived on. A started command's group is killed at once when the
    agent is out of it; nothing is left, and the sandbox still answers on the next loop."""
    box, layout = _limited_box(tmp_path)
    marker = f"4252.{os.getpid()}"

    left: list[asyncio.Future[object]] = []  # cancelled by the end of their loop

    async def start_and_leave() -> None:
        left.append(asyncio.ensure_future(sh(box, f"setsid sleep {marker} & exec sleep {marker}", timeout_s=60)))
        async with asyncio.timeout(10):
            # Both sleeps run, and the agent has gone home from their group: it enters it only to start the
            # command, and on a loaded machine both sleeps were seen before it left (then the group is
            # killed on the agent's answer, which a loop that has ended never reads: until the next one).
            while not _agent_out_of(box, processes_with(marker)):
                await asyncio.sleep(0.02)

    try:
        asyncio.run(start_and_leave())
        assert _until_gone(marker) == []
        assert asyncio.run(sh(box, "echo next")).stdout == b"next\n"
    finally:
        box.close()
        layout.release()


def test_a_kill_left_waiting_by_an_ended_loop_is_sent_on_the_next_and_close_works(tmp_path: Path) -> None:
    """Attack (review): the agent busy and its socket full, the loop ends while a queued command is
    cancelled. Its kill, waiting for room on that loop, was never sent: the command started later and
    lived on. The send left waiting also made `close` raise ("Event loop is closed") and kept the next
    loop's sends from ever being woken. Now the next loop sends the kill again, its sends run, nothing
    of the command is left, and the sandbox closes."""
    box, layout = _limited_box(tmp_path)
    marker = f"4253.{os.getpid()}"

    left: list[asyncio.Future[object]] = []  # cancelled by the end of their loop

    async def fill_and_leave() -> None:
        listener = await box.spawn(
            "/usr/bin/python3", ["python3", "-c", _FULL_LISTENER], cwd="/", env=ENV, ring_bytes=64
        )
        async with asyncio.timeout(10):
            while not (printed := listener.stdout.read(0, 64)[1]).endswith(b"\n"):
                await asyncio.sleep(0.01)
        left.append(asyncio.ensure_future(box.connect(int(printed))))  # the agent waits 2 s for it
        left.append(asyncio.ensure_future(sh(box, f"setsid sleep {marker} & exec sleep {marker}", timeout_s=60)))
        await asyncio.sleep(0)
        filler_env = {**ENV, "FILLER": "x" * _FILLER_ENV_BYTES}
        left.extend(
            asyncio.ensure_future(
                box.run("/bin/true", ["true"], cwd="/", env=filler_env, timeout_s=60, max_output_bytes=64)
            )
            for _ in range(_FILLERS)
        )
        async with asyncio.timeout(10):
            while len(box._writables) < 2:
                await asyncio.sleep(0.01)

    try:
        asyncio.run(fill_and_leave())  # its end cancels them all, the queued command among them
        filler_env = {**ENV, "FILLER": "x" * _FILLER_ENV_BYTES}

        async def next_loop() -> list[RunOutcome]:
            async with asyncio.timeout(30):
                return await asyncio.gather(
                    *(
                        box.run(
                            "/bin/echo", ["echo", "next"], cwd="/", env=filler_env, timeout_s=30, max_output_bytes=64
                        )
                        for _ in range(_FILLERS)
                    )
                )

        assert [outcome.stdout for outcome in asyncio.run(next_loop())] == [b"next\n"] * _FILLERS
        assert _until_gone(marker) == []
        assert box.alive
    finally:
        box.close()
        layout.release()


async def test_the_agent_pid_the_host_trusts_is_the_agents(limited: WarmSandbox) -> None:
    """A killed command's group is killed at once only when it holds the command and not the agent: the pid
    taken for the agent's must be PID 1 of the sandbox, running the agent (else the check could pass while
    the agent is inside, and a kill end the sandbox)."""
    await sh(limited, "true")
    pid = limited._agent_pid
    assert pid is not None
    with open(f"/proc/{pid}/status") as status:
        nspid = next(line.split()[1:] for line in status if line.startswith("NSpid:"))
    assert nspid[-1] == "1"
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        assert b"/opt/bastion/agent.py" in cmdline.read().split(b"\0")


async def test_a_pause_landing_while_a_command_awaits_the_start_answers_conflict_and_runs_nothing(
    limited: WarmSandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: `run` checked for a pause, then awaited the sandbox's start; a pause that came in that
    await (the start lock held by another call, a sleeping sandbox waking) queued the command in the frozen agent,
    and it ran at the resume with its time limit spent and no CONFLICT. It is refused now, and never runs."""
    await sh(limited, "true")
    started, go = asyncio.Event(), asyncio.Event()
    real_start = limited.start

    async def start_then_hold() -> None:
        await real_start()
        started.set()
        await go.wait()

    monkeypatch.setattr(limited, "start", start_then_hold)
    command = asyncio.create_task(sh(limited, "touch /workspace/ran"))
    await started.wait()
    limited.pause()
    go.set()
    try:
        with pytest.raises(Conflict, match="paused"):
            await command
    finally:
        limited.resume()
    monkeypatch.setattr(limited, "start", real_start)
    assert (await sh(limited, "echo alive")).stdout == b"alive\n"
    assert not (tmp_path / "limited" / "ran").exists()


async def test_a_run_ending_while_it_is_frozen_is_not_left_paused(
    limited: WarmSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a pause freezes in a worker thread, and a run that ended meanwhile (the agent killed by an
    OOM, its socket closed) had its state cleared by the loop before the thread marked it paused; the sandbox
    then stayed "paused" with nothing to resume, refusing every command until closed. Invariant: the pause is
    refused (CONFLICT), the sandbox is not paused, and the next command starts it again."""
    await sh(limited, "true")
    group = limited._group
    assert group is not None
    real = group.freeze

    def freeze_then_the_run_ends() -> None:
        real()
        limited._on_agent_gone()  # what the loop does at the agent's end, between the freeze and the mark

    monkeypatch.setattr(group, "freeze", freeze_then_the_run_ends)
    with pytest.raises(Conflict, match="ended while it was being paused"):
        limited.pause()
    assert not limited.paused
    assert (await sh(limited, "echo alive")).stdout == b"alive\n"


async def test_a_run_timing_out_in_a_paused_sandbox_answers_and_leaves_the_sandbox(limited: WarmSandbox) -> None:
    """A command's time limit passes while its sandbox is paused: its agent, frozen, cannot report the exit.
    The host waited 5 s for it and then ended the whole sandbox, every process in it. The answer now comes as
    a timeout with no status, and after the resume the sandbox and a process started before still run."""
    witness = await limited.spawn("/bin/cat", ["cat"], cwd="/", env=ENV, ring_bytes=64)
    marker = f"4254.{os.getpid()}"
    running = asyncio.ensure_future(sh(limited, f"exec sleep {marker}", timeout_s=1))
    async with asyncio.timeout(10):
        while not processes_with(marker):
            await asyncio.sleep(0.02)
    limited.pause()
    try:
        async with asyncio.timeout(30):
            outcome = await running
        assert outcome.timed_out
        assert outcome.status is None
    finally:
        limited.resume()
    assert not witness.exited
    assert (await sh(limited, "echo alive")).stdout == b"alive\n"
    async with asyncio.timeout(10):
        while processes_with(marker):
            await asyncio.sleep(0.05)
    await limited.kill(witness)


async def test_a_sandbox_whose_command_groups_cannot_be_set_up_is_refused(
    limited: WarmSandbox, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Fault: the agent's way home from a command's group cannot be opened (EMFILE, a cgroup gone). The
    sandbox used to start anyway with its commands in the agent's PID namespace and no group of their own: a
    kill reached a command's first process only, and what it started lived on. The start is refused now,
    leaving no process and no cgroup. (The path is the only thing faked: the sandbox and kernel are real.)"""
    monkeypatch.setattr(SandboxCgroup, "home_procs", lambda _self: str(tmp_path / "gone" / "cgroup.procs"))
    with pytest.raises(Unavailable, match="command groups cannot be set up") as refused:
        await sh(limited, "true")
    assert "No such file or directory" in refused.value.detail
    assert not limited.alive
    await limited.settled()
    assert limited._group is None


# What a command does to give other users write permission, then the mask it ran with.
OPEN_TO_OTHERS = """umask 0; mkdir d; touch f; mkfifo p
python3 -I -S -c 'import os; os.umask(0); os.mkdir("py", 0o777)'
mkdir -m 777 m; chmod 777 . || echo chmod refused; chmod 777 d || echo chmod refused
chmod o+w f || echo chmod refused; chmod 1777 d || echo sticky refused
chmod 775 d && chmod 1775 d && echo group and sticky allowed
grep Umask /proc/self/status
"""


def others_may_write(folder: Path) -> list[str]:
    """The entries of `folder`, itself included, that other users may write, as seen from the host."""
    found = [folder, *folder.rglob("*")]
    return sorted(str(path.relative_to(folder)) for path in found if path.lstat().st_mode & stat.S_IWOTH)


async def test_host_folder_commands_cannot_give_other_users_write(tmp_path: Path) -> None:
    """Attack (p5_world_writable_root.py): a host workspace's commands act as its folder's owner, and
    ``umask 0`` then ``mkdir``, ``chmod 777`` or ``tar -xpf`` of a 0777 ``./`` opened the administrator's
    folder to every local user. Invariant: in a host folder's sandbox, even started by a server whose own
    umask is 0, nothing a command makes or changes is others' to write: the mask starts with S_IWOTH and
    ``umask 0`` leaves it, chmod of a mode with S_IWOTH fails (EPERM, the tool says so); group write and the
    sticky bit still work. Does not prove the start check of a folder opened before (test_workspace)."""
    folder = tmp_path / "ws"
    folder.mkdir(mode=0o755)
    box = WarmSandbox(SandboxSpec(workspace=str(folder), host_folder=True))
    server_umask = os.umask(0)  # the sandbox's processes inherit it: the start must add S_IWOTH itself
    try:
        outcome = await sh(box, OPEN_TO_OTHERS)
    finally:
        os.umask(server_umask)
        box.close()
    out = outcome.stdout.decode()
    assert out.count("refused") == 4, out
    assert "group and sticky allowed" in out
    assert "Umask:\t0002" in out
    assert outcome.stderr.decode().count("Operation not permitted") == 5  # mkdir -m and the four chmods
    assert others_may_write(folder) == []
    assert sorted(p.name for p in folder.iterdir()) == ["d", "f", "m", "p", "py"]


async def test_agent_sandbox_commands_may_still_give_other_users_write(tmp_path: Path) -> None:
    """Control: an agent sandbox's own workspace is no other user's to reach, so there ``umask 0``,
    ``mkdir -m 777`` and ``chmod 777`` work as on any machine."""
    folder = tmp_path / "ws"
    folder.mkdir(mode=0o755)
    box = WarmSandbox(SandboxSpec(workspace=str(folder)))
    try:
        outcome = await sh(box, OPEN_TO_OTHERS)
    finally:
        box.close()
    assert "refused" not in outcome.stdout.decode()
    assert others_may_write(folder) == [".", "f", "m", "p", "py"]


async def test_a_held_start_closed_before_its_start_runs_nothing_and_leaves_no_cgroup(
    limited: WarmSandbox, tmp_path: Path
) -> None:
    """`hold` begins a start while the manager makes the sandbox's folders; a create that fails or is cancelled
    then closes it. Invariant: the waiting process (already in the sandbox's cgroup) is gone, its cgroup is
    removed, no agent ever ran for the workspace, and the sandbox does not count as alive meanwhile."""
    limited.hold()
    holding = limited._holding
    assert holding is not None
    group = limited._group
    assert group is not None
    paths = group.paths
    assert not limited.alive
    limited.close()
    assert holding.proc.poll() is not None
    assert not any(os.path.exists(p) for p in paths)
    assert _sandbox_processes(tmp_path / "limited") == []


async def test_a_held_start_becomes_a_sandbox_in_its_cgroup_once_started(limited: WarmSandbox) -> None:
    """Invariant: `start` after `hold` lets the held process go on: the agent runs in the group `hold` made
    (its commands counted there), and commands run as in a sandbox started at once."""
    limited.hold()
    group = limited._group
    await limited.start()
    assert limited._group is group
    assert limited.alive
    assert (await sh(limited, "echo held")).stdout == b"held\n"
    usage = limited.usage()
    assert usage is not None
    assert usage.pids >= 1


async def test_a_socket_opened_right_after_a_close_during_a_start_gets_its_reader(tmp_path: Path) -> None:
    """Found by review: close a sandbox while its start waits for the agent's hello; in the same turn of the loop,
    open a socket (it takes the freed fd number, as a preview's connection or another sandbox's start would), read it.
    `_on_agent_gone` cancels the hello's task and closes the socket at once, but the task's `sock_recv` leaves its
    selector key for the fd until its done-callback runs a turn later: the new socket's `add_reader` only replaces
    the key's data (no epoll_ctl), and the new fd is never watched. Invariant: the new socket's reader runs."""
    ws = tmp_path / "ws"
    ws.mkdir()
    box = WarmSandbox(SandboxSpec(workspace=str(ws)))
    loop = asyncio.get_running_loop()
    start = loop.create_task(box.start())
    while not (box._starting and box.alive and box._greeting is not None):
        await asyncio.sleep(0)
    assert box._sock is not None
    freed = box._sock.fileno()
    selector = cast(selectors.BaseSelector, loop._selector)  # type: ignore[attr-defined]
    while selector.get_map().get(freed) is None:  # the hello's read is registered with the loop
        await asyncio.sleep(0)
    box.close()
    fillers: list[socket.socket] = []
    mine, theirs = socket.socketpair()
    while freed not in (mine.fileno(), theirs.fileno()):  # lower free fds first: the freed one comes in order
        fillers += (mine, theirs)
        mine, theirs = socket.socketpair()
    if theirs.fileno() == freed:
        mine, theirs = theirs, mine
    for filler in fillers:
        filler.close()
    try:
        mine.setblocking(False)
        heard: asyncio.Future[bytes] = loop.create_future()

        def readable() -> None:
            if not heard.done():
                heard.set_result(mine.recv(16))

        loop.add_reader(mine.fileno(), readable)
        theirs.send(b"hello")
        try:
            got = await asyncio.wait_for(asyncio.shield(heard), 3)
        finally:
            loop.remove_reader(mine.fileno())
        assert got == b"hello"
    finally:
        mine.close()
        theirs.close()
        with pytest.raises(Unavailable):
            await start

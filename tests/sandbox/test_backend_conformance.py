"""The backend conformance suite: the promises of `bastion.sandbox.backend`, for every backend.

Each test uses a sandbox only through the protocol (`Backend`, `Sandbox`, `Process`). A new
backend joins by adding its name to `BACKENDS` and a branch to `harness`: how to make it, and
how to see whether a process of its sandboxes is still running (on the host for bubblewrap; for
a microVM, inside each running guest: its processes are not the host's).

The microVM runs are marked `microvm` (real guests under software emulation: about half a minute
per boot here) and left out of the default run: `make test-microvm` runs them. Every test here
runs for both backends.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bastion.safety.errors import Conflict, Unavailable
from bastion.sandbox import EGRESS_DIR, EGRESS_SOCKET_NAME, FORWARDER_PATH
from bastion.sandbox._spawn import SANDBOX_PATH, SandboxSpec
from bastion.sandbox.backend import Backend, Process, RunOutcome, Sandbox
from bastion.sandbox.cgroups import CgroupLayout, Limits
from bastion.sandbox.microvm import MicroVMBackend, MicroVMSandbox
from bastion.sandbox.processes import RingCapture
from bastion.sandbox.warm import BubblewrapBackend
from tests.helpers import processes_with
from tests.sandbox.egress_helpers import BIG, FETCH, EgressSetup, egress_setup
from tests.sandbox.microvm_helpers import guest_processes_with, microvm_settings

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

BACKENDS = ["bubblewrap", pytest.param("microvm", marks=pytest.mark.microvm)]
ENV = {"PATH": SANDBOX_PATH, "HOME": "/workspace", "LANG": "C.UTF-8"}
LIMITS = Limits(memory_bytes=96 << 20, pids=32, cpu_cores=1.0)


def unique_marker(seconds: int) -> str:
    """A `sleep` duration found on no other process: the leftover checks look at every process of the host,
    and both backends' variants of a test (and other workers) run at once under xdist."""
    return f"{seconds}.{secrets.randbelow(10**6):06d}"


@dataclass
class Harness:
    backend: Backend
    workspace: Path
    find: Callable[[Harness, str], Awaitable[list[int]]]
    made: list[Sandbox]
    wait_s: float = 10
    """How long `until` polls: a microVM that boots under the check takes its boot time more."""

    async def leftovers(self, marker: str) -> list[int]:
        """Processes of any of its sandboxes whose command line holds the marker."""
        return await self.find(self, marker)

    def sandbox(self, limits: Limits | None = None, binds: tuple[tuple[str, str], ...] = ()) -> Sandbox:
        spec = SandboxSpec(workspace=str(self.workspace), read_only_binds=binds)
        box = self.backend.sandbox(spec, limits=limits)
        self.made.append(box)
        return box


async def on_host(_harness: Harness, marker: str) -> list[int]:
    return processes_with(marker)


async def in_guests(harness: Harness, marker: str) -> list[int]:
    found = processes_with(marker)  # none may reach the host either
    for box in harness.made:
        if isinstance(box, MicroVMSandbox) and box.alive and not box.paused:
            found += await guest_processes_with(box, marker)
    return found


@pytest.fixture(params=BACKENDS)
def harness(
    request: pytest.FixtureRequest, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Harness]:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    layout = CgroupLayout.detect(base_name=f"bastion-test-{os.getpid()}")
    if request.param == "microvm":
        settings = microvm_settings(tmp_path_factory)
        made = Harness(MicroVMBackend(settings, layout), workspace, in_guests, [], 10 + settings.boot_timeout_s)
    else:
        made = Harness(BubblewrapBackend(layout), workspace, on_host, [])
    yield made
    for box in made.made:
        box.close()
    layout.release()


@pytest.fixture
def box(harness: Harness) -> Sandbox:
    return harness.sandbox()


@pytest.fixture
def limited(harness: Harness) -> Sandbox:
    return harness.sandbox(LIMITS)


@pytest.fixture(params=["cgroups", "no-cgroups"])
def either(request: pytest.FixtureRequest, harness: Harness) -> Sandbox:
    """With limits (commands in cgroups of their own) and without (a PID namespace each)."""
    return harness.sandbox(LIMITS if request.param == "cgroups" else None)


async def sh(
    box: Sandbox, script: str, *, timeout_s: float = 10, cap: int = 65536, cwd: str = "/workspace"
) -> RunOutcome:
    return await box.run("/bin/sh", ["sh", "-c", script], cwd=cwd, env=ENV, timeout_s=timeout_s, max_output_bytes=cap)


async def until(check: Callable[[], bool | Awaitable[bool]], limit_s: float = 10) -> None:
    """Poll `check` (no event tells when another process has started) for at most `limit_s`."""
    async with asyncio.timeout(limit_s):
        while True:
            result = check()
            if await result if inspect.isawaitable(result) else result:
                return
            await asyncio.sleep(0.01)


async def none_left(harness: Harness, marker: str) -> bool:
    return not await harness.leftovers(marker)


async def some_left(harness: Harness, marker: str, count: int = 1) -> bool:
    return len(await harness.leftovers(marker)) >= count


# run

STALL_S = 3.0
"""How long a test holds the event loop: a guest under software emulation ends `echo done` well within it."""


async def test_run_reports_exit_status_and_both_streams(box: Sandbox) -> None:
    outcome = await sh(box, "echo out; echo err >&2; exit 3")
    assert (outcome.status, outcome.stdout, outcome.stderr) == (3, b"out\n", b"err\n")
    assert not outcome.timed_out
    assert not outcome.truncated


async def test_command_that_cannot_start_exits_127_with_one_line(box: Sandbox) -> None:
    """Invariant: a missing program or cwd is the command's failure (127 and a line on its
    stderr), and the sandbox runs the next command normally."""
    missing = await box.run(
        "/usr/bin/no-such-program", ["no-such-program"], cwd="/workspace", env=ENV, timeout_s=10, max_output_bytes=4096
    )
    assert missing.status == 127
    assert missing.stderr.startswith(b"bastion: cannot start 'no-such-program': ")
    no_cwd = await box.run("/bin/true", ["true"], cwd="/workspace/gone", env=ENV, timeout_s=10, max_output_bytes=4096)
    assert no_cwd.status == 127
    assert b"No such file or directory" in no_cwd.stderr
    assert (await sh(box, "echo fine")).stdout == b"fine\n"


async def test_environment_and_cwd_are_exactly_what_was_given(harness: Harness, box: Sandbox) -> None:
    (harness.workspace / "sub").mkdir()
    outcome = await box.run("/usr/bin/env", ["env"], cwd="/workspace", env=ENV, timeout_s=10, max_output_bytes=65536)
    assert sorted(line.split("=", 1)[0] for line in outcome.stdout.decode().splitlines()) == ["HOME", "LANG", "PATH"]
    assert (await sh(box, "pwd", cwd="/workspace/sub")).stdout == b"/workspace/sub\n"


async def test_the_workspace_is_the_host_folder(harness: Harness, box: Sandbox) -> None:
    """Files and snapshots act on the host folder: what one side writes, the other reads."""
    (harness.workspace / "from-host").write_text("host\n")
    outcome = await sh(box, "cat from-host; echo inside > from-inside")
    assert outcome.stdout == b"host\n"
    assert (harness.workspace / "from-inside").read_text() == "inside\n"


async def test_output_is_capped_and_counted(box: Sandbox) -> None:
    outcome = await sh(box, "head -c 1000000 /dev/zero; head -c 10 /dev/zero >&2", cap=4096)
    assert len(outcome.stdout) == 4096
    assert outcome.stdout_total == 1_000_000
    assert (outcome.stderr, outcome.stderr_total) == (b"\0" * 10, 10)
    assert outcome.truncated


async def test_timeout_kills_setsid_and_double_forked_processes(harness: Harness, either: Sandbox) -> None:
    """Invariant: after a timeout no process the command started survives, however it detached."""
    marker = unique_marker(4242)
    script = f"setsid sleep {marker} & (sleep {marker} &) ; nohup sleep {marker} >/dev/null 2>&1 & sleep {marker}"
    outcome = await sh(either, script, timeout_s=0.5)
    assert outcome.timed_out
    assert outcome.status is not None
    assert await harness.leftovers(marker) == []


async def test_a_command_that_ended_while_the_loop_stalled_past_its_deadline_is_answered_as_it_ran(
    box: Sandbox,
) -> None:
    """Attack (a stalled server: a loaded host, a paused VM, SIGSTOP; found for bubblewrap in the twenty-seventh
    session, for the microVM in the twenty-eighth): the event loop was held past a command's deadline while the
    command ended well within it. Its exit waited in the sandbox's channel, the deadline came first, and the
    command was answered timed out, killed. Here the loop is held in the command's own output sink.
    Invariant: the outcome is the command's own."""
    assert (await sh(box, "true")).status == 0  # started: the stall is not the start's

    def stall(chunk: bytes) -> None:
        if b"started" in chunk:
            time.sleep(STALL_S)  # the loop held: the command ends meanwhile, then its deadline passes

    outcome = await box.run(
        "/bin/sh",
        ["sh", "-c", "echo started; echo done"],
        cwd="/workspace",
        env=ENV,
        timeout_s=STALL_S / 2,
        max_output_bytes=4096,
        on_output=(stall, lambda _: None),
    )
    assert not outcome.timed_out, outcome
    assert (outcome.status, outcome.stdout) == (0, b"started\ndone\n")


async def test_without_cgroups_a_normal_exit_leaves_no_background_process(harness: Harness, box: Sandbox) -> None:
    """`box` has no limits, so no cgroups: each command has a PID namespace of its own. With them,
    what it leaves running lives on (tests/sandbox/test_command_groups.py)."""
    marker = unique_marker(4243)
    outcome = await sh(box, f"setsid sleep {marker} & echo started")
    assert outcome.status == 0
    assert outcome.stdout == b"started\n"
    assert await harness.leftovers(marker) == []


async def test_cancellation_kills_the_tree(harness: Harness, either: Sandbox) -> None:
    marker = unique_marker(4244)
    task = asyncio.create_task(sh(either, f"(sleep {marker} &) ; sleep {marker}"))
    await until(lambda: some_left(harness, marker), harness.wait_s)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: none_left(harness, marker), harness.wait_s)


async def test_commands_run_concurrently(box: Sandbox) -> None:
    """The first command can only finish once the second has run."""
    waiting = sh(box, "while [ ! -e go ]; do sleep 0.01; done; echo waited")
    going = sh(box, "touch go; echo went")
    first, second = await asyncio.gather(waiting, going)
    assert (first.stdout, second.stdout) == (b"waited\n", b"went\n")
    assert not first.timed_out


# spawn


async def test_spawned_command_reads_stdin_and_writes_its_rings(box: Sandbox) -> None:
    process = await box.spawn("/bin/cat", ["cat"], cwd="/workspace", env=ENV, ring_bytes=1024)
    assert not process.exited
    assert process.stdin_open
    assert await process.write(b"hello\n", timeout_s=10) == 6
    process.close_stdin()
    await process.wait_exit()
    await process.wait_output(10)
    assert process.status == 0
    assert process.stdout.read(0, 100) == (0, b"hello\n")
    assert process.stdout.closed
    assert not process.stdin_open
    with pytest.raises(Conflict):
        await process.write(b"late", timeout_s=1)


async def test_a_ring_keeps_the_newest_bytes_and_counts_all(box: Sandbox) -> None:
    process = await box.spawn(
        "/bin/sh", ["sh", "-c", "head -c 5000 /dev/zero >&2; echo done"], cwd="/", env=ENV, ring_bytes=1024
    )
    await process.wait_exit()
    await process.wait_output(10)
    assert process.stderr.total == 5000
    assert process.stderr.start == 5000 - 1024
    assert process.stderr.read(0, 4096) == (5000 - 1024, b"\0" * 1024)
    assert process.stdout.read(0, 100)[1] == b"done\n"


async def test_spawn_reads_stdout_with_the_given_reader(box: Sandbox) -> None:
    readers: list[RingCapture] = []

    def reader(fd: int) -> RingCapture:
        readers.append(RingCapture(fd, 3))
        return readers[-1]

    process = await box.spawn("/bin/echo", ["echo", "abcdef"], cwd="/", env=ENV, ring_bytes=1024, stdout=reader)
    await process.wait_exit()
    await process.wait_output(10)
    assert process.stdout is readers[0]
    assert process.stdout.read(0, 10) == (4, b"ef\n")


async def test_kill_ends_a_background_command_and_what_it_started(harness: Harness, either: Sandbox) -> None:
    marker = unique_marker(4245)
    process = await either.spawn(
        "/bin/sh", ["sh", "-c", f"setsid sleep {marker} & exec sleep {marker}"], cwd="/", env=ENV, ring_bytes=1024
    )
    await until(lambda: some_left(harness, marker, 2), harness.wait_s)
    await either.kill(process)
    assert process.exited
    assert process.status == 128 + 9  # a kill is a signal: 128 + its number
    await until(lambda: none_left(harness, marker), harness.wait_s)
    await either.kill(process)  # a no-op once it has exited


async def test_a_kill_after_the_first_process_exited_ends_what_it_left_and_its_output(
    harness: Harness, either: Sandbox
) -> None:
    """Found by attack: a background `sh -c` that exits leaving a child that writes to its stdout, then
    `kill`: a no-op, since its first process had exited, and the child wrote on until the sandbox closed.
    Invariant: `kill` ends everything the command started, its first process exited or not: nothing of it
    runs after, its output ends, and it returns whether anything was running (in a microVM or without
    cgroups, nothing: the child ended with sh's PID namespace). A process started before lives on."""
    witness = await either.spawn("/bin/cat", ["cat"], cwd="/", env=ENV, ring_bytes=1024)
    marker = unique_marker(4260)
    # sh exits once the child has written (without cgroups the child then ends with it).
    flag = f"/tmp/written-{marker}"
    script = (
        f"sleep {marker} & (echo x; : > {flag}; while :; do echo x; sleep 0.1; done) & until [ -e {flag} ]; do :; done"
    )
    process = await either.spawn("/bin/sh", ["sh", "-c", script], cwd="/", env=ENV, ring_bytes=1024)
    await process.wait_exit()
    assert process.status == 0
    left = await harness.leftovers(marker)
    assert await either.kill(process) is bool(left)
    await until(functools.partial(none_left, harness, marker), harness.wait_s)
    await process.wait_output(harness.wait_s)
    assert process.stdout.closed
    assert process.stderr.closed
    assert process.stdout.read(0, 2) == (0, b"x\n")  # the child did run
    assert await either.kill(process) is False
    assert not witness.exited
    assert await either.kill(witness) is True


KILLS_RIGHT_AFTER_THE_START = 10


async def test_a_kill_sent_right_after_the_spawn_still_ends_the_command_and_reports_its_exit(
    harness: Harness, either: Sandbox
) -> None:
    """A client may kill a command right after starting it. With cgroups the agent starts a command from
    inside the command's group and then moves back: a kill of the group landing meanwhile ended the agent,
    and with it the whole sandbox (status None), about one kill in three. The group is now killed once
    the agent has answered the kill, from outside it. Each time: the exit is the kill's, nothing is left,
    and the sandbox lives on (a process started before is still running)."""
    witness = await either.spawn("/bin/cat", ["cat"], cwd="/", env=ENV, ring_bytes=1024)
    for attempt in range(KILLS_RIGHT_AFTER_THE_START):
        marker = unique_marker(4248 + attempt)
        process = await either.spawn(
            "/bin/sh", ["sh", "-c", f"setsid sleep {marker} & exec sleep {marker}"], cwd="/", env=ENV, ring_bytes=1024
        )
        await either.kill(process)
        assert process.exited
        assert process.status == 128 + 9, (attempt, process.status)
        await until(functools.partial(none_left, harness, marker), harness.wait_s)
    assert not witness.exited
    await either.kill(witness)


async def test_a_run_cancelled_right_after_its_start_leaves_the_sandbox_running(
    harness: Harness, either: Sandbox
) -> None:
    """The same race on `run`'s side: a call cancelled right after its command went to the agent kills the
    command's group at once. Cancelled after 0, 1 and 2 passes of the event loop (before, at and after the
    hand-off): each time the command is gone with what it started, and the sandbox lives on."""
    witness = await either.spawn("/bin/cat", ["cat"], cwd="/", env=ENV, ring_bytes=1024)
    for attempt in range(KILLS_RIGHT_AFTER_THE_START):
        marker = unique_marker(4348 + attempt)
        running = asyncio.ensure_future(sh(either, f"setsid sleep {marker} & exec sleep {marker}"))
        for _ in range(attempt % 3):
            await asyncio.sleep(0)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        await until(functools.partial(none_left, harness, marker), harness.wait_s)
    assert not witness.exited
    await either.kill(witness)


async def test_a_background_command_outlives_the_call_and_other_commands(box: Sandbox) -> None:
    process = await box.spawn("/bin/cat", ["cat"], cwd="/", env=ENV, ring_bytes=1024)
    assert (await sh(box, "echo between")).stdout == b"between\n"
    assert not process.exited
    await process.write(b"still here\n", timeout_s=10)
    await until(lambda: process.stdout.total == 11)
    await box.kill(process)


# pause, resume, usage, limits


async def test_pause_needs_a_running_sandbox(limited: Sandbox, box: Sandbox) -> None:
    with pytest.raises(Conflict):
        limited.pause()
    with pytest.raises(Conflict):
        limited.resume()
    await sh(box, "true")
    with pytest.raises(Conflict):
        box.pause()  # no limits: nothing can freeze it


async def test_pause_freezes_and_resume_thaws(limited: Sandbox) -> None:
    process = await limited.spawn("/bin/cat", ["cat"], cwd="/", env=ENV, ring_bytes=1024)
    limited.pause()
    assert limited.paused
    # pause() returns once the kernel reports the group frozen, but that can drop back for a moment: a
    # parent waiting in vfork (the agent's posix_spawn of cat, if the pause caught it) counts as frozen,
    # and leaves that count when the child's exec completes, until it traps in the freezer (3 in 300).
    await until(lambda: is_frozen(limited))
    with pytest.raises(Conflict):
        await sh(limited, "true")
    with pytest.raises(Conflict):
        await limited.spawn("/bin/true", ["true"], cwd="/", env=ENV, ring_bytes=64)
    with pytest.raises(Conflict):
        await limited.kill(process)
    await process.write(b"queued\n", timeout_s=10)  # into the pipe; cat reads it once thawed
    limited.resume()
    assert not limited.paused
    usage = limited.usage()
    assert usage is not None
    assert not usage.frozen
    process.close_stdin()
    await process.wait_exit()
    await process.wait_output(10)
    assert process.stdout.read(0, 100)[1] == b"queued\n"


def is_frozen(box: Sandbox) -> bool:
    usage = box.usage()
    assert usage is not None
    return usage.frozen


async def test_usage_measures_a_running_sandbox(limited: Sandbox, box: Sandbox) -> None:
    assert limited.usage() is None
    await sh(limited, "true")
    usage = limited.usage()
    assert usage is not None
    assert usage.memory_bytes > 0
    assert usage.pids >= 1
    assert usage.cpu_usec >= 0
    await sh(box, "true")
    assert box.usage() is None  # no limits: nothing measures it


async def test_memory_hog_is_killed_and_reported(limited: Sandbox) -> None:
    # A guest under software emulation takes tens of seconds to fill 96 MiB: the timeout is not the test.
    outcome = await sh(limited, "x=$(head -c 400000000 /dev/zero | tr '\\0' a); echo ${#x}", timeout_s=180)
    assert outcome.oom_killed
    assert outcome.status == 137
    assert outcome.memory_note
    assert limited.oom_kills() >= 1
    assert (await sh(limited, "echo alive")).stdout == b"alive\n"


async def kill_leftovers(box: Sandbox) -> None:
    for left in box.leftovers():
        await box.kill_leftover(left.pid)


async def test_fork_bomb_stops_at_the_pids_limit(limited: Sandbox) -> None:
    outcome = await sh(limited, "for i in $(seq 60); do sleep 3 & done 2>&1; echo done", timeout_s=10)
    assert b"Cannot fork" in outcome.stdout + outcome.stderr
    assert not outcome.oom_killed
    await kill_leftovers(limited)  # the sleeps it started live on, as on a machine
    assert (await sh(limited, "echo alive")).stdout == b"alive\n"


async def test_limits_change_live(limited: Sandbox) -> None:
    assert (await sh(limited, "for i in $(seq 12); do sleep 3 & done 2>&1; echo done")).stdout == b"done\n"
    await kill_leftovers(limited)
    limited.set_limits(Limits(memory_bytes=96 << 20, pids=8, cpu_cores=1.0))
    outcome: RunOutcome | None = None

    async def the_shell_starts() -> bool:
        # The agent reaps the killed sleeps when it hears of their end; until then they count against the new
        # limit and the shell itself cannot start (seen once under a full test run).
        nonlocal outcome
        outcome = await sh(limited, "for i in $(seq 12); do sleep 3 & done 2>&1; echo done")
        return b"cannot start 'sh'" not in outcome.stderr

    await until(the_shell_starts)
    assert outcome is not None
    assert b"Cannot fork" in outcome.stdout + outcome.stderr


# sleep and close


async def test_an_idle_sandbox_sleeps_and_the_next_command_wakes_it(harness: Harness, box: Sandbox) -> None:
    assert not box.sleep()  # never started: nothing to stop
    await sh(box, "echo kept > file")
    process = await box.spawn("/bin/cat", ["cat"], cwd="/", env=ENV, ring_bytes=64)
    assert not box.sleep()  # a background command runs
    await box.kill(process)
    assert box.sleep()
    assert box.asleep
    assert (await sh(box, "cat file")).stdout == b"kept\n"
    assert not box.asleep


async def test_an_idle_sandbox_with_scratch_files_stays_awake(box: Sandbox) -> None:
    """A sleep would lose /tmp (a microVM's is the guest's own tmpfs): files there keep it running."""
    await sh(box, "echo scratch > /tmp/kept")
    assert not box.sleep()
    await sh(box, "rm /tmp/kept")
    assert box.sleep()
    assert box.asleep


async def test_close_leaves_nothing_running_and_a_new_command_starts_it_again(harness: Harness, box: Sandbox) -> None:
    marker = unique_marker(4246)
    process = await box.spawn("/bin/sleep", ["sleep", marker], cwd="/", env=ENV, ring_bytes=64)
    await until(lambda: some_left(harness, marker), harness.wait_s)
    box.close()
    assert await harness.leftovers(marker) == []
    assert process.exited
    assert process.status is None
    assert (await sh(box, "echo again")).stdout == b"again\n"


async def test_aclose_final_is_for_good(harness: Harness, box: Sandbox) -> None:
    marker = unique_marker(4247)
    await box.spawn("/bin/sleep", ["sleep", marker], cwd="/", env=ENV, ring_bytes=64)
    await until(lambda: some_left(harness, marker), harness.wait_s)
    await box.aclose(final=True)
    assert await harness.leftovers(marker) == []
    with pytest.raises(Unavailable):
        await box.start()
    with pytest.raises(Unavailable):
        await sh(box, "true")
    with pytest.raises(Unavailable):
        await box.spawn("/bin/true", ["true"], cwd="/", env=ENV, ring_bytes=64)


# egress: no network device or route; the forwarder on 127.0.0.1:3128 leads to the host's proxy only


@pytest.fixture
def egress(tmp_path: Path) -> Iterator[EgressSetup]:
    with egress_setup(tmp_path) as made:
        yield made


async def start_forwarder(box: Sandbox) -> Process:
    """As workbench.network starts it: a background command relaying 127.0.0.1:3128 to /run/bastion."""
    argv = ["python3", "-I", "-S", FORWARDER_PATH, "3128", f"{EGRESS_DIR}/{EGRESS_SOCKET_NAME}"]
    process = await box.spawn("/usr/bin/python3", argv, cwd="/", env=ENV, ring_bytes=4096)
    await until(lambda: b"ready" in process.stdout.read(0, 64)[1] or process.exited, 60)
    assert b"ready" in process.stdout.read(0, 64)[1], process.stderr.read(0, 4096)
    return process


async def fetch(box: Sandbox, url: str, *, proxy: bool = True) -> str:
    env = {**ENV, "http_proxy": "http://127.0.0.1:3128"} if proxy else ENV
    outcome = await box.run(
        "/usr/bin/python3", ["python3", "-c", FETCH, url], cwd="/", env=env, timeout_s=60, max_output_bytes=4096
    )
    return outcome.stdout.decode().strip()


async def test_egress_is_decided_and_audited_by_the_proxy_and_has_no_other_route(
    harness: Harness, egress: EgressSetup
) -> None:
    box = harness.sandbox(binds=((str(egress.socket_dir), EGRESS_DIR),))
    forwarder = await start_forwarder(box)
    web = egress.port
    assert await fetch(box, f"http://allowed.test:{web}/") == "hello from the host"
    refused = "refused HTTP Error 403: Forbidden"
    assert (await fetch(box, f"http://denied.test:{web}/")).startswith(refused)
    assert (await fetch(box, "http://meta.test/latest/")).startswith(refused)  # a blocked range
    assert (await fetch(box, f"http://127.0.0.1:{web}/", proxy=False)).startswith("refused")
    assert egress.web.paths == ["/"]
    records = await asyncio.to_thread(egress.records, 3)
    # An allowed connection is audited when it ends, which may be after the next refusal: compare sorted.
    assert sorted(records) == [("allowed.test", web, "allow"), ("denied.test", web, "deny"), ("meta.test", 80, "deny")]
    await box.kill(forwarder)


async def test_a_large_download_through_the_proxy_arrives_whole(harness: Harness, egress: EgressSetup) -> None:
    box = harness.sandbox(binds=((str(egress.socket_dir), EGRESS_DIR),))
    await start_forwarder(box)
    script = (
        "import hashlib, sys, urllib.request\n"
        "print(hashlib.sha256(urllib.request.urlopen(sys.argv[1], timeout=60).read()).hexdigest())"
    )
    env = {**ENV, "http_proxy": "http://127.0.0.1:3128"}
    url = f"http://allowed.test:{egress.port}/big"
    outcome = await box.run(
        "/usr/bin/python3", ["python3", "-c", script, url], cwd="/", env=env, timeout_s=120, max_output_bytes=4096
    )
    assert outcome.stdout.decode().strip() == hashlib.sha256(BIG).hexdigest(), outcome.stderr


# previews and terminals: a connected socket, a terminal's host end


# Listens on 127.0.0.1:PORT in the sandbox, answers each connection with "inside\n", prints "up".
LISTENER = (
    "import socket,sys\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); print('up', flush=True)\n"
    "while True:\n c,_=s.accept(); c.sendall(b'inside\\n'); c.close()\n"
)


async def test_connect_reaches_the_sandboxs_own_loopback_and_a_closed_port_is_refused(
    harness: Harness, box: Sandbox
) -> None:
    """A host server on the same port is never what answers; a closed port is `Unavailable`, one line."""
    with socket.socket() as host_server:
        host_server.bind(("127.0.0.1", 0))
        host_server.listen()
        port = host_server.getsockname()[1]
        server = await box.spawn(
            "/usr/bin/python3", ["python3", "-c", LISTENER, str(port)], cwd="/", env=ENV, ring_bytes=64
        )
        await until(lambda: b"up" in server.stdout.read(0, 64)[1], harness.wait_s)
        with await box.connect(port) as conn:
            conn.setblocking(False)
            async with asyncio.timeout(harness.wait_s):
                assert await asyncio.get_running_loop().sock_recv(conn, 100) == b"inside\n"
    with pytest.raises(Unavailable, match="nothing accepts connections on that port"):
        await box.connect(9)
    await box.kill(server)


def wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def tty_until(fd: int, seen: bytearray, texts: tuple[bytes, ...], after: int = 0) -> int:
    """Read a terminal's host end until one of `texts` appears past `after`; where it ends."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(60):
        while not any(text in seen[after:] for text in texts):
            readable = loop.create_future()
            loop.add_reader(fd, wake, readable)
            try:
                await readable
            finally:
                loop.remove_reader(fd)
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            assert chunk, bytes(seen)
            seen += chunk
    found = next(text for text in texts if text in seen[after:])
    return seen.index(found, after) + len(found)


async def test_a_terminal_has_its_size_a_resize_and_ctrl_c_for_its_job(box: Sandbox) -> None:
    pty = await box.open_pty("/bin/sh", ["sh"], cwd="/workspace", env=ENV, rows=24, cols=80)
    seen = bytearray()
    try:
        os.write(pty.fd, b"tty; stty size\n")
        await tty_until(pty.fd, seen, (b"24 80",), await tty_until(pty.fd, seen, (b"/dev/pts/",)))
        pty.resize(30, 100)
        os.write(pty.fd, b"stty size; sh -c 'echo ar\"\"med; exec sleep 100'\n")
        await tty_until(pty.fd, seen, (b"armed",), await tty_until(pty.fd, seen, (b"30 100",)))
        os.write(pty.fd, b"\x03")  # once the job holds the terminal (it says so)
        await tty_until(pty.fd, seen, (b"$ ", b"# "), await tty_until(pty.fd, seen, (b"^C",)))
        os.write(pty.fd, b"echo status=$?\n")
        await tty_until(pty.fd, seen, (b"status=130",))
        await box.kill(pty)
        assert pty.exited
    finally:
        os.close(pty.fd)


async def test_a_read_only_bind_is_seen_cannot_be_written_and_its_links_resolve_inside(
    harness: Harness, tmp_path: Path
) -> None:
    """A link in the folder to a host file outside it is followed inside the sandbox, where that path
    does not exist: never on the host (for a microVM, QEMU's 9p server opens no link)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "table.csv").write_text("a,b\n")
    (tmp_path / "secret").write_text("host only\n")
    (data / "link").symlink_to(tmp_path / "secret")
    box = harness.sandbox(binds=((str(data), "/data"),))
    script = "cat /data/table.csv; touch /data/new || echo refused; cat /data/link || echo unseen"
    outcome = await sh(box, script, timeout_s=60)
    assert outcome.stdout == b"a,b\nrefused\nunseen\n", outcome.stderr
    assert not (data / "new").exists()

"""The host's pipes of a warm sandbox's commands: how many it holds, and what it does at its fd limit.

Real bubblewrap sandboxes with cgroups (command groups), as the server runs them. The fd limit is
reached by lowering this process's RLIMIT_NOFILE and filling what is left with /dev/null fds; it
is restored before anything is asserted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bastion.safety.errors import BastionError, Unavailable
from bastion.sandbox._spawn import SANDBOX_PATH, SandboxSpec
from bastion.sandbox.cgroups import CgroupLayout, Limits
from bastion.sandbox.processes import OUTPUT_BURST_BYTES, OUTPUT_BYTES_PER_S, READ_CHUNK_BYTES
from bastion.sandbox.warm import MAX_HELD_PIPES, RunOutcome, WarmSandbox
from tests.helpers import fds_left, open_fds

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

ENV = {"PATH": SANDBOX_PATH, "HOME": "/workspace", "LANG": "C.UTF-8"}
LIMITS = Limits(memory_bytes=96 << 20, pids=32, cpu_cores=1.0)

# Keeps every fd that comes to its socket, and on a "w" writes a byte to each and says how many were broken.
COLLECT = r"""
import array, os, socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind("coll.sock")
print("ready", flush=True)
held = []
while True:
    msg, anc, flags, addr = s.recvmsg(1, socket.CMSG_SPACE(64))
    for level, kind, data in anc:
        fds = array.array("i")
        fds.frombytes(data[: len(data) - len(data) % 4])
        held.extend(fds)
    if msg == b"w":
        broken = 0
        for fd in held:
            try:
                os.write(fd, b".")
            except BrokenPipeError:
                broken += 1
        print(f"held={len(held)} broken={broken}", flush=True)
"""
# Hands its own stdout and stderr (the server's pipes) to the collector, and exits.
SEND = r"""
import array, socket, sys
rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [1, 2]))] if sys.argv[1] == "x" else []
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.sendmsg([sys.argv[1].encode()], rights, 0, "coll.sock")
"""


def _box(tmp_path: Path, name: str, layout: CgroupLayout) -> WarmSandbox:
    ws = tmp_path / name
    ws.mkdir()
    return WarmSandbox(SandboxSpec(workspace=str(ws)), cgroups=layout, limits=LIMITS)


@pytest.fixture
async def limited(tmp_path: Path) -> AsyncIterator[WarmSandbox]:
    layout = CgroupLayout.detect(base_name=f"bastion-test-{os.getpid()}")
    box = _box(tmp_path, "ws", layout)
    yield box
    box.close()
    layout.release()


async def sh(box: WarmSandbox, script: str) -> RunOutcome:
    return await box.run(
        "/bin/sh", ["sh", "-c", script], cwd="/workspace", env=ENV, timeout_s=20, max_output_bytes=4096
    )


async def _until(check: object, limit_s: float = 10) -> None:
    assert callable(check)
    async with asyncio.timeout(limit_s):
        while not check():
            await asyncio.sleep(0.02)


async def test_commands_handing_their_pipes_to_one_collector_hold_at_most_max_held_pipes(
    limited: WarmSandbox,
) -> None:
    """Attack: each command passes its stdout and stderr (the server's pipes) over a unix socket to one
    collector process and exits; the server kept reading both until they closed, 2 fds per command, for as
    long as the sandbox lived. Invariant: the pipes held after their commands returned stay under
    MAX_HELD_PIPES; the oldest are closed, and the collector's writes to them fail with EPIPE, while the
    newest still work. Does not prove anything about background processes (their table bounds them)."""
    (Path(limited.spec.workspace) / "collect.py").write_text(COLLECT)
    (Path(limited.spec.workspace) / "send.py").write_text(SEND)
    collector = await limited.spawn(
        "/usr/bin/python3", ["python3", "collect.py"], cwd="/workspace", env=ENV, ring_bytes=4096
    )
    await _until(lambda: b"ready" in collector.stdout.read(0, 64)[1])
    before = len(open_fds())
    commands = MAX_HELD_PIPES // 2 + 20
    for _ in range(commands):
        assert (await sh(limited, "exec python3 send.py x")).status == 0
    held = len(open_fds()) - before
    assert (await sh(limited, "python3 send.py w")).status == 0
    await _until(lambda: b"held=" in collector.stdout.read(0, 4096)[1])
    report = collector.stdout.read(0, 4096)[1].decode().split()
    assert held <= MAX_HELD_PIPES
    assert report[1] == f"held={2 * commands}"
    assert int(report[2].removeprefix("broken=")) >= 2 * commands - MAX_HELD_PIPES - 2  # the last run's may count
    await limited.kill(collector)
    await _until(lambda: len(open_fds()) <= before)
    assert (await sh(limited, "echo still")).stdout == b"still\n"


FLOOD_S = 3.0


@pytest.mark.parametrize("writer", ["cat /dev/zero", "python3 -c 'import os\nwhile 1: os.write(1, b\"x\")'"])
async def test_a_command_printing_past_its_cap_is_read_at_the_sandboxs_rate_not_the_servers_cpu(
    limited: WarmSandbox, writer: str
) -> None:
    """Found by attack: one `run_command("cat /dev/zero")` had the server read its output at full speed for the
    command's whole timeout, 0.4 to 0.6 cores of the server's CPU (not the sandbox's cgroup) for bytes it then
    dropped; a writer of one byte at a time cost up to 0.9 cores, and another sandbox's `run_command("true")` p50
    went from 11.6 to 19.9 ms. Invariant: what the cap keeps is kept and the rest counted, the server reads past
    the cap at the sandbox's rate (a read counts as a whole chunk), so its CPU stays a small share of a core."""
    cpu = os.times()
    began = time.monotonic()
    outcome = await limited.run(
        "/bin/sh", ["sh", "-c", writer], cwd="/workspace", env=ENV, timeout_s=FLOOD_S, max_output_bytes=4096
    )
    spent = os.times()
    elapsed = time.monotonic() - began
    cores = (spent.user + spent.system - cpu.user - cpu.system) / elapsed
    assert outcome.timed_out
    assert len(outcome.stdout) == 4096
    assert set(outcome.stdout) == ({0} if "zero" in writer else {ord("x")})
    reads_allowed = (OUTPUT_BURST_BYTES + OUTPUT_BYTES_PER_S * elapsed) / READ_CHUNK_BYTES + 2
    assert 4096 < outcome.stdout_total <= reads_allowed * READ_CHUNK_BYTES
    assert cores < 0.2, f"the server spent {cores:.2f} cores reading one command's output past its cap"


async def test_a_command_writing_a_byte_at_a_time_within_its_cap_is_read_at_the_sandboxs_rate(
    limited: WarmSandbox,
) -> None:
    """Found by review: reads within the cap were free, and commands writing a byte at a time up to their caps (the
    server's reader then finds a byte at each wake-up) cost 0.46 cores of the server's CPU; the cap may be 16 MiB.
    Invariant: each read spends at least `READ_COST_BYTES` of the sandbox's rate, the paced reader finds more at
    each read, so the server's CPU stays a small share of a core, and every byte is kept."""
    writer = "import os, time\nend = time.monotonic() + 2\nwhile time.monotonic() < end: os.write(1, b'x')"
    cpu, began = os.times(), time.monotonic()
    outcome = await limited.run(
        "/usr/bin/python3",
        ["python3", "-c", writer],
        cwd="/workspace",
        env=ENV,
        timeout_s=20,
        max_output_bytes=16 << 20,
    )
    spent, elapsed = os.times(), time.monotonic() - began
    cores = (spent.user + spent.system - cpu.user - cpu.system) / elapsed
    assert outcome.status == 0
    assert len(outcome.stdout) == outcome.stdout_total > 0
    assert set(outcome.stdout) == {ord("x")}
    assert cores < 0.2, f"the server spent {cores:.2f} cores reading one command's output a byte at a time"


async def test_background_processes_writing_a_byte_at_a_time_are_read_at_the_sandboxs_rate(
    limited: WarmSandbox,
) -> None:
    """Found by attack (twenty-eighth session): background processes' pipes were read with no rate, and a ring is
    paced only once it has dropped unread bytes; 16 processes writing a byte at a time each (the ring never full)
    cost 0.46 to 0.58 cores of the server's CPU, and another caller's `run_command` p50 went from 4.4 to 8.3 ms.
    Invariant: each read spends at least `READ_COST_BYTES` of the sandbox's rate, as a command's pipes do, so the
    server's CPU stays a small share of a core, and every byte is kept."""
    writer = (
        "import os, time\nn = 0\nend = time.monotonic() + 2\n"
        "while time.monotonic() < end:\n    os.write(1, b'x'); n += 1\nos.write(2, str(n).encode())"
    )
    cpu, began = os.times(), time.monotonic()
    processes = [
        await limited.spawn(
            "/usr/bin/python3", ["python3", "-c", writer], cwd="/workspace", env=ENV, ring_bytes=16 << 20
        )
        for _ in range(8)
    ]
    for process in processes:
        await process.wait_exit()
        await process.wait_output(20)
    spent, elapsed = os.times(), time.monotonic() - began
    cores = (spent.user + spent.system - cpu.user - cpu.system) / elapsed
    for process in processes:
        _, written = process.stderr.read(0, 64)
        assert process.stdout.total == int(written) > 0
    assert cores < 0.2, f"the server spent {cores:.2f} cores reading background output a byte at a time"


async def test_a_command_printing_a_little_past_its_cap_still_ends_at_once(limited: WarmSandbox) -> None:
    """What the rate must not cost: a command whose output passes its cap by less than the burst ends as before,
    its bytes counted."""
    began = time.monotonic()
    outcome = await limited.run(
        "/bin/sh",
        ["sh", "-c", "head -c 8388608 /dev/zero"],
        cwd="/workspace",
        env=ENV,
        timeout_s=20,
        max_output_bytes=4096,
    )
    assert outcome.status == 0
    assert outcome.stdout_total == 8 << 20
    assert len(outcome.stdout) == 4096
    assert time.monotonic() - began < 5


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
async def test_run_command_at_the_fd_limit_is_refused_and_leaks_no_pipe(
    limited: WarmSandbox, background: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Attack: the server is at its fd limit (other sandboxes' and connections' fds) when a command starts:
    the second or third pipe failed with EMFILE, the first pipes were never closed, and the client got
    INTERNAL_ERROR (a traceback in the log). Invariant: with 0 to 8 fds free, a start either works or is a
    typed refusal, leaves no fd behind, and the sandbox works once fds are free again."""
    assert (await sh(limited, "true")).status == 0
    before = open_fds()
    refused = []
    for free in range(9):
        process = None
        with fds_left(free):
            try:
                if background:
                    process = await limited.spawn(
                        "/bin/echo", ["echo", "hi"], cwd="/workspace", env=ENV, ring_bytes=4096
                    )
                else:
                    await sh(limited, "echo hi")
            except BastionError as exc:
                refused.append(exc)
        if process is not None:
            await limited.kill(process)
            await process.wait_output(10)
        await _until(lambda: open_fds() <= before)
        assert open_fds() == before, f"{free} fds free"
    assert any(isinstance(exc, Unavailable) and "pipes" in exc.reason for exc in refused)
    assert not [record for record in caplog.records if record.exc_info]
    assert (await sh(limited, "echo works")).stdout == b"works\n"


def test_a_sandbox_closed_at_the_fd_limit_has_its_cgroup_removed_by_the_next_close(tmp_path: Path) -> None:
    """Attack: a sandbox closes while the server is out of fds: writing its cgroup.kill failed (EMFILE),
    the error was logged and its cgroups stayed for ever. Invariant: the next close (of any sandbox)
    removes them once fds are free; the layout then releases (no group is left)."""
    layout = CgroupLayout.detect(base_name=f"bastion-test-{os.getpid()}")
    first, second = _box(tmp_path, "first", layout), _box(tmp_path, "second", layout)
    try:
        asyncio.run(sh(second, "true"))
        others = open_fds()
        asyncio.run(sh(first, "true"))
        group = first._group
        assert group is not None
        with fds_left(0, below=min(int(fd) for fd in open_fds() - others)):
            first.close()  # no event loop: the cgroup's removal runs here, under the limit
        assert any(os.path.exists(path) for path in group.paths)
        second.close()
        deadline = time.monotonic() + 10
        while any(os.path.exists(path) for path in group.paths) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(os.path.exists(path) for path in group.paths)
    finally:
        first.close()
        second.close()
        layout.release()


def test_a_cgroup_left_by_a_close_at_the_fd_limit_is_removed_by_destroy_left_groups(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The manager's reaper's way (`destroy_left_groups`): no other sandbox has to close first."""
    from bastion.sandbox.warm import destroy_left_groups

    layout = CgroupLayout.detect(base_name=f"bastion-test-{os.getpid()}")
    box = _box(tmp_path, "only", layout)
    try:
        others = open_fds()
        asyncio.run(sh(box, "true"))
        group = box._group
        assert group is not None
        below = min(int(fd) for fd in open_fds() - others)
        with caplog.at_level(logging.ERROR, logger="bastion.sandbox"), fds_left(0, below=below):
            box.close()
        assert any("tried again later" in record.getMessage() for record in caplog.records)
        destroy_left_groups()
        assert not any(os.path.exists(path) for path in group.paths)
    finally:
        box.close()
        layout.release()

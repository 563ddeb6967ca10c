"""The agent's pseudo-terminals (op "pty") and what the host accepts from inside in answer.

The first tests run real bubblewrap sandboxes. The hostile-agent tests start one, then put a
socket pair in place of the agent's socket and speak for a compromised agent: the one fd the host
ever accepts from inside must come in answer to its own request and be a terminal's master.
"""

from __future__ import annotations

import asyncio
import json
import marshal
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bastion.safety.errors import Unavailable
from bastion.sandbox._spawn import SANDBOX_PATH
from bastion.sandbox.warm import WarmSandbox

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

ENV = {"PATH": SANDBOX_PATH, "HOME": "/workspace", "LANG": "C.UTF-8", "TERM": "dumb"}


async def read_until(fd: int, marker: bytes) -> bytes:
    """Read a terminal's master until `marker` appears (event-driven, bounded by the caller's timeout)."""
    loop = asyncio.get_running_loop()
    seen = b""
    while marker not in seen:
        readable: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _settle, readable)
        try:
            await readable
        finally:
            loop.remove_reader(fd)
        try:
            seen += os.read(fd, 4096)
        except BlockingIOError:
            continue
    return seen


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def host_fd_targets() -> list[str]:
    targets = []
    for name in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            continue
    return targets


async def test_terminal_program_leads_its_session_on_its_controlling_tty(sandbox: WarmSandbox) -> None:
    """Invariant: the program is a session leader whose controlling tty is the terminal (tcgetpgrp
    on it answers, with its own group in the foreground), and `tty` names a /dev/pts of the sandbox."""
    check = "import os; print(os.getsid(0) == os.getpid(), os.tcgetpgrp(0) == os.getpgrp())"
    script = f"tty; exec python3 -c '{check}'"
    pty = await sandbox.open_pty("/bin/sh", ["sh", "-c", script], cwd="/workspace", env=ENV, rows=24, cols=80)
    try:
        async with asyncio.timeout(20):
            out = (await read_until(pty.fd, b"True True\r\n")).decode()
        assert out.split("\r\n")[0].startswith("/dev/pts/")
    finally:
        await sandbox.kill(pty)
        os.close(pty.fd)


async def test_host_holds_the_master_and_never_the_slave(sandbox: WarmSandbox) -> None:
    await sandbox.start()
    before = host_fd_targets()
    pty = await sandbox.open_pty("/bin/cat", ["cat"], cwd="/workspace", env=ENV, rows=24, cols=80)
    try:
        added = [target for target in host_fd_targets() if target not in before or target.startswith("/dev/pts")]
        assert added == ["/dev/pts/ptmx"], added
        assert not sandbox.sleep()  # an idle sandbox with a terminal open keeps running
    finally:
        await sandbox.kill(pty)
        os.close(pty.fd)


async def test_program_that_cannot_start_is_a_clear_error(sandbox: WarmSandbox) -> None:
    with pytest.raises(Unavailable, match="did not start"):
        await sandbox.open_pty("/nonexistent", ["nope"], cwd="/workspace", env=ENV, rows=24, cols=80)
    outcome = await sandbox.run(
        "/bin/true", ["true"], cwd="/workspace", env=ENV, timeout_s=10, max_output_bytes=100
    )  # the sandbox lives on
    assert outcome.status == 0


class FakeAgent:
    """A compromised agent: the host's socket is swapped for one end of a pair; the test holds the other."""

    def __init__(self, box: WarmSandbox) -> None:
        self.box = box
        self.host, self.inside = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        loop = asyncio.get_running_loop()
        assert box._sock is not None
        loop.remove_reader(box._sock.fileno())
        self.real = box._sock
        self.host.setblocking(False)
        self.inside.setblocking(False)
        box._sock = self.host
        loop.add_reader(self.host.fileno(), box._on_message)

    def say(self, message: dict[str, object], fds: list[int]) -> None:
        socket.send_fds(self.inside, [json.dumps(message).encode()], fds)

    async def request(self) -> dict[str, object]:
        loop = asyncio.get_running_loop()
        data = await loop.sock_recv(self.inside, 65536)
        return dict(marshal.loads(data))

    def close(self) -> None:
        self.inside.close()
        self.real.close()


@pytest.fixture
async def fake(sandbox: WarmSandbox) -> AsyncIterator[FakeAgent]:
    await sandbox.start()
    agent = FakeAgent(sandbox)
    yield agent
    agent.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def settle() -> None:
    """Let the host's reader handle what the fake agent sent (one loop turn each way)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_fd_the_host_did_not_ask_for_is_closed(fake: FakeAgent) -> None:
    """Attack: a compromised agent pushes an fd with a terminal answer for a request never made,
    or with an exit message. Invariant: the host closes it and registers nothing."""
    before = open_fds()
    for message in ({"event": "pty", "id": 999, "pid": 5}, {"event": "exit", "id": 1, "status": 0}):
        read_end, write_end = os.pipe()
        fake.say(message, [read_end])
        os.close(read_end)
        os.close(write_end)
        await settle()
    assert open_fds() == before
    assert fake.box._ptys == {}
    assert fake.box.alive


async def test_answer_with_a_file_instead_of_a_terminal_is_refused(fake: FakeAgent, tmp_path: Path) -> None:
    """Attack: the answer to a real request carries a file (or two fds, or none) instead of a
    terminal's master. Invariant: the host closes what came, kills what may have started, and the
    open fails as UNAVAILABLE."""
    secret = tmp_path / "host-file"
    secret.write_text("host data")
    before = open_fds()
    for fds in ([os.open(secret, os.O_RDWR)], [os.open(secret, os.O_RDONLY), os.open(secret, os.O_RDONLY)], []):
        opening = asyncio.ensure_future(
            fake.box.open_pty("/bin/cat", ["cat"], cwd="/workspace", env=ENV, rows=24, cols=80)
        )
        request = await fake.request()
        assert request["op"] == "pty"
        fake.say({"event": "pty", "id": request["id"], "pid": 7}, fds)
        for fd in fds:
            os.close(fd)
        with pytest.raises(Unavailable):
            await opening
        # It may have started: the host kills it (with cgroups, its group too).
        assert await fake.request() == {"op": "kill", "id": request["id"]}
    assert open_fds() == before


async def test_more_fds_than_room_ends_the_sandbox(fake: FakeAgent) -> None:
    """Attack: a message with more fds than the host reads (MSG_CTRUNC). Invariant: the kernel closes
    those without room, the host closes the rest and ends the sandbox: the agent is not what it was."""
    before = open_fds()
    pipes = [os.pipe() for _ in range(4)]
    fake.say({"event": "pty", "id": 1, "pid": 7}, [read_end for read_end, _ in pipes])
    for read_end, write_end in pipes:
        os.close(read_end)
        os.close(write_end)
    await settle()
    assert not fake.box.alive
    assert open_fds() <= before


async def test_crossed_late_and_duplicate_answers_of_a_hostile_agent_are_closed(fake: FakeAgent) -> None:
    """Attack: a compromised agent answers a terminal request with a "connected" event carrying a socket,
    a connect with a terminal master, a connect after the host stopped waiting, and the same connect twice.
    Invariant: each fd is closed unless it is the right kind for the request of that id, still awaited;
    nothing is kept, the waiting calls fail as UNAVAILABLE, and no fd leaks."""
    box = fake.box
    before = open_fds()
    server = socket.create_server(("127.0.0.1", 0))
    tcp = socket.create_connection(server.getsockname())
    master, slave = os.openpty()

    opening = asyncio.ensure_future(box.open_pty("/bin/cat", ["cat"], cwd="/workspace", env=ENV, rows=24, cols=80))
    pty_request = await fake.request()
    fake.say({"event": "connected", "id": pty_request["id"]}, [tcp.fileno()])  # a socket for a terminal
    connecting = asyncio.ensure_future(box.connect(8000))
    assert await fake.request() == {"op": "netns"}  # asked with a run's first connect; never answered here
    connect_request = await fake.request()
    fake.say({"event": "connected", "id": connect_request["id"]}, [master])  # a terminal for a connect
    with pytest.raises(Unavailable, match="other than a connected TCP socket"):
        await connecting
    fake.say({"event": "connected", "id": connect_request["id"]}, [tcp.fileno()])  # a duplicate, late
    fake.say({"event": "pty", "id": connect_request["id"], "pid": 9}, [master])  # a terminal for a connect's id
    await settle()
    assert not opening.done()  # the crossed answer settled nothing
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    assert await fake.request() == {"op": "kill", "id": pty_request["id"]}
    assert (box._connects, box._pty_openings, box._ptys) == ({}, {}, {})

    for fd in (master, slave):
        os.close(fd)
    tcp.close()
    server.close()
    await settle()
    assert open_fds() <= before

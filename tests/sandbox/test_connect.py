"""The agent's connect op: a host gets a socket to 127.0.0.1:PORT inside a sandbox, and nothing else.

These run real bubblewrap sandboxes. What this proves: the socket the agent hands over reaches a server
listening on the sandbox's own loopback (not the host's), a closed port and a bad port are refused with a
typed error, and no fd is left open on the host. What it does not prove: HTTP over it (tests/preview).
"""

from __future__ import annotations

import asyncio
import contextlib
import marshal
import os
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

from bastion.safety.errors import InvalidRequest, Unavailable
from bastion.sandbox._spawn import SANDBOX_PATH, SandboxSpec
from bastion.sandbox.warm import CONNECT_TIMEOUT_S, WarmSandbox
from tests.helpers import open_fds

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

ROOT = os.geteuid() == 0  # only root may enter a sandbox's network namespace (CAP_SYS_ADMIN)
ENV = {"PATH": SANDBOX_PATH, "HOME": "/workspace", "LANG": "C.UTF-8"}
# Listens on 127.0.0.1:PORT inside the sandbox, answers each connection with "inside\n", prints "up".
SERVER = (
    "import socket,sys\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); print('up', flush=True)\n"
    "while True:\n c,_=s.accept(); c.sendall(b'inside\\n'); c.close()\n"
)


@pytest.fixture
async def sandbox(tmp_path: Path) -> AsyncIterator[WarmSandbox]:
    ws = tmp_path / "ws"
    ws.mkdir()
    box = WarmSandbox(SandboxSpec(workspace=str(ws)))
    await box.start()
    yield box
    box.close()


async def serve(box: WarmSandbox, port: int) -> None:
    process = await box.spawn(
        "/usr/bin/python3", ["python3", "-c", SERVER, str(port)], cwd="/workspace", env=ENV, ring_bytes=4096
    )
    with anyio.fail_after(10):
        while b"up" not in process.stdout.read(0, 100)[1]:
            await anyio.sleep(0.01)  # polls the ring for the server's "up" line


async def test_connect_reaches_a_server_on_the_sandbox_loopback_not_the_hosts(sandbox: WarmSandbox) -> None:
    """Invariant: the socket reaches 127.0.0.1:PORT of the sandbox's network namespace. A host server on
    the same port (a different answer) is never what answers."""
    with socket.socket() as host_server:
        host_server.bind(("127.0.0.1", 0))
        host_server.listen()
        port = host_server.getsockname()[1]
        await serve(sandbox, port)
        conn = await sandbox.connect(port)
        with conn:
            conn.setblocking(True)
            assert conn.recv(100) == b"inside\n"


async def test_connect_to_a_closed_port_is_unavailable_and_leaks_no_fd(sandbox: WarmSandbox) -> None:
    """Invariant: refused both ways (the run's first connect by the agent, the next by the host in the
    sandbox's namespace); the only fd kept is that namespace's, and it goes when the sandbox ends."""
    before = open_fds()
    with pytest.raises(Unavailable, match="nothing accepts connections"):
        await sandbox.connect(9)
    held = open_fds()
    assert sandbox._netns is not None
    assert len(held - before) == 1  # the namespace's fd
    with pytest.raises(Unavailable, match="nothing accepts connections"):
        await sandbox.connect(9)
    # Without CAP_SYS_ADMIN (the unprivileged pass) the host cannot enter it, lets it go and asks the agent.
    # With it, the host keeps spare sockets made in it, and nothing else.
    if ROOT:
        now = await settled(held)  # the duplicate the refill of spares works on, until it is done
        assert all(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in now - held)
    else:
        assert open_fds() == before
    sandbox.close()
    with anyio.fail_after(5):  # a refill of spares in flight at the close closes what it made when it ends
        while open_fds() - before:
            await anyio.sleep(0.01)


async def test_connects_after_the_first_are_made_in_the_sandboxs_namespace_and_reach_its_loopback(
    sandbox: WarmSandbox,
) -> None:
    """Invariant: the host's own sockets (made in the namespace the agent handed over) reach the sandbox's
    loopback, never the host's, also after the sandbox restarts with a new namespace."""
    with socket.socket() as host_server:
        host_server.bind(("127.0.0.1", 0))
        host_server.listen()
        port = host_server.getsockname()[1]
        for run in range(2):
            await serve(sandbox, port)
            for _ in range(3):
                with await sandbox.connect(port) as conn:
                    conn.setblocking(True)
                    assert conn.recv(100) == b"inside\n"
            assert (sandbox._netns is not None) == ROOT
            if run == 0:
                await sandbox.aclose()  # asleep; the next spawn starts a new run
                assert sandbox._netns is None
                await sandbox.start()


@pytest.mark.parametrize("port", [0, -1, 65536, 2**40, True, "80"])
async def test_connect_refuses_a_port_outside_1_to_65535(sandbox: WarmSandbox, port: object) -> None:
    with pytest.raises(InvalidRequest, match="1 to 65535"):
        await sandbox.connect(port)  # type: ignore[arg-type]


async def test_connect_to_a_stopped_sandbox_is_unavailable(tmp_path: Path) -> None:
    box = WarmSandbox(SandboxSpec(workspace=str(tmp_path)))
    with pytest.raises(Unavailable, match="not running"):
        await box.connect(80)


def net_fds() -> set[str]:
    """The fds open on a network namespace (the spares' thread may close one while this looks)."""
    found = set()
    for fd in open_fds():
        with contextlib.suppress(FileNotFoundError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith("net:"):
                found.add(fd)
    return found


async def settled(expected: set[str]) -> set[str]:
    """The open fds, once the thread that makes spare sockets has let go of every fd beyond `expected`'s."""
    with anyio.fail_after(5):
        while net_fds() - expected:
            await anyio.sleep(0.01)
    return open_fds()


@contextlib.contextmanager
def other_netns() -> Iterator[int]:
    """An fd of a fresh network namespace (`unshare` holding it while the test uses it; no root needed)."""
    holder = subprocess.Popen(["unshare", "--map-root-user", "--net", "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while os.stat(f"/proc/{holder.pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino:
            assert time.monotonic() < deadline, "unshare never entered its namespace"
            time.sleep(0.01)  # polls until the child has unshared (it execs sleep after)
        fd = os.open(f"/proc/{holder.pid}/ns/net", os.O_RDONLY)
        try:
            yield fd
        finally:
            os.close(fd)
    finally:
        holder.kill()
        holder.wait()


def pipe_closed_by_reader(write_end: int) -> bool:
    """Whether every read end of the pipe is closed (a write fails with EPIPE)."""
    try:
        os.write(write_end, b"x")
    except BrokenPipeError:
        return True
    return False


async def test_fds_from_a_hostile_agent_are_closed_unless_they_answer_a_connect(sandbox: WarmSandbox) -> None:
    """Invariant: the host keeps an fd from inside only as the answer to its own pending connect, and only a
    connected TCP socket; an unsolicited fd, an answer to an unknown id, a second fd in a message and a
    pipe passed off as the answer are all closed unread. Likewise a namespace: only as the answer to its
    own ask, and never the server's own (which would make a preview's connect reach the host's loopback).
    The agent is played by the test on the host's socket (a compromised agent), since the real one never
    sends these."""
    loop = asyncio.get_running_loop()
    real = sandbox._sock
    assert real is not None
    loop.remove_reader(real.fileno())
    host, agent = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    host.setblocking(False)
    agent.setblocking(False)
    sandbox._sock = host
    loop.add_reader(host.fileno(), sandbox._on_message)
    try:
        nets_before = net_fds()
        pipes = [os.pipe() for _ in range(6)]
        host_netns = os.open("/proc/self/ns/net", os.O_RDONLY)
        socket.send_fds(agent, [b'{"event": "connected", "id": 999}'], [pipes[0][0]])
        socket.send_fds(agent, [b'{"event": "exit", "id": 998, "status": 0}'], [pipes[1][0], pipes[2][0]])
        socket.send_fds(agent, [b'{"event": "netns"}'], [pipes[4][0]])  # not asked for yet
        pending = asyncio.ensure_future(sandbox.connect(8000))
        assert marshal.loads(await loop.sock_recv(agent, 65536)) == {"op": "netns"}
        request = marshal.loads(await loop.sock_recv(agent, 65536))
        assert request == {"op": "connect", "id": request["id"], "port": 8000}
        socket.send_fds(agent, [b'{"event": "netns"}'], [pipes[5][0]])  # asked, but a pipe
        socket.send_fds(agent, [b'{"event": "netns"}'], [host_netns])  # the server's own (and a second answer)
        os.close(host_netns)
        with other_netns() as foreign:  # a real namespace, but a second answer to one ask
            socket.send_fds(agent, [b'{"event": "netns"}'], [foreign])
        socket.send_fds(agent, [f'{{"event": "connected", "id": {request["id"]}}}'.encode()], [pipes[3][0]])
        with pytest.raises(Unavailable, match="other than a connected TCP socket"):
            await pending
        assert sandbox._netns is None
        for read_end, _ in pipes:
            os.close(read_end)  # the test's own copy; the host's must be closed already
        assert all(pipe_closed_by_reader(write_end) for _, write_end in pipes)
        assert net_fds() == nets_before
    finally:
        loop.remove_reader(host.fileno())
        sandbox._sock = real
        host.close()
        agent.close()


async def test_an_agent_that_never_answers_a_connect_is_unavailable_in_bounded_time(sandbox: WarmSandbox) -> None:
    """Invariant: a silent (compromised or stuck) agent costs a preview request CONNECT_TIMEOUT_S, not forever."""
    loop = asyncio.get_running_loop()
    real = sandbox._sock
    assert real is not None
    loop.remove_reader(real.fileno())
    host, agent = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    host.setblocking(False)
    sandbox._sock = host
    try:
        with anyio.fail_after(CONNECT_TIMEOUT_S + 5), pytest.raises(Unavailable, match="did not answer"):
            await sandbox.connect(8000)
        assert sandbox._connects == {}
    finally:
        sandbox._sock = real
        host.close()
        agent.close()


async def test_a_send_waiting_for_room_in_the_agents_socket_fails_typed_when_the_agent_goes(tmp_path: Path) -> None:
    """Found by a review: a send waiting for room in the agent's socket (the agent not reading: stuck, or
    killed for memory) when the agent went away found its socket closed under it: removing the writer of
    fd -1 raised ValueError (INTERNAL_ERROR, a traceback), or, closed from elsewhere, the send waited for
    ever and left the number registered in the selector. Invariant: the waiting send fails with an OSError
    (which the callers answer as UNAVAILABLE), at once, and the selector no longer holds the number."""
    box = WarmSandbox(SandboxSpec(workspace=str(tmp_path)))
    ours, agents = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    box._sock = ours  # an agent that never reads
    with contextlib.suppress(BlockingIOError):
        while True:
            ours.send(b"x" * 4096)
    number = ours.fileno()
    try:
        send = asyncio.ensure_future(box._send_fds(ours, b"a request", []))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not send.done()  # waiting for room
        box._on_agent_gone()
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(send, 5)
        selector = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
        assert number not in selector.get_map()
    finally:
        agents.close()

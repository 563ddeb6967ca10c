"""The agent's connect op: a host gets a socket to 127.0.0.1:PORT inside a sandbox, and nothing else.

These run real bubblewrap sandboxes. What this proves: the socket the agent hands over reaches a server
listening on the sandbox's own loopback (not the host's), a closed port and a bad port are refused with a
typed error, and no fd is left open on the host. What it does not prove: HTTP over it (tests/preview).
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from bastion.safety.errors import InvalidRequest, Unavailable
from bastion.sandbox._spawn import SANDBOX_PATH, SandboxSpec
from bastion.sandbox.warm import WarmSandbox

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

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


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


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
    before = open_fds()
    with pytest.raises(Unavailable, match="nothing accepts connections"):
        await sandbox.connect(9)
    assert open_fds() == before


@pytest.mark.parametrize("port", [0, -1, 65536, 2**40, True, "80"])
async def test_connect_refuses_a_port_outside_1_to_65535(sandbox: WarmSandbox, port: object) -> None:
    with pytest.raises(InvalidRequest, match="1 to 65535"):
        await sandbox.connect(port)  # type: ignore[arg-type]


async def test_connect_to_a_stopped_sandbox_is_unavailable(tmp_path: Path) -> None:
    box = WarmSandbox(SandboxSpec(workspace=str(tmp_path)))
    with pytest.raises(Unavailable, match="not running"):
        await box.connect(80)

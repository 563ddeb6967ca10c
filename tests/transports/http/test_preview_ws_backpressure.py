"""A preview WebSocket whose browser does not read (found by attack): a live `bastion serve --http`, a real
sandbox whose app pushes 1 MiB messages as fast as it can, and real WebSocket clients (wsproto over sockets).

200 such WebSockets held 3.4 MB of the server's memory and ~6 MB of kernel socket memory each, counted by
no limit (`max_unsent_mib` stopped at the upgrade), for as long as the browsers stayed. Now the relay reads
the app only once the browser took the message before (one message at most held per WebSocket), and resets
a browser that takes nothing for `send_stall_timeout_s`. A browser that reads still gets every message.
"""

from __future__ import annotations

import fcntl
import random
import re
import socket
import struct
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import BytesMessage, CloseConnection, Request

from .test_preview import APPS, SESSION_COOKIE, WAIT_LISTENING, Preview, serving_preview
from .test_preview_ws_live import Client

pytestmark = pytest.mark.bwrap

STALL_S = 3.0
"""`send_stall_timeout_s` of the server: how long a browser may take nothing."""
SOCKETS = 50
PER_SOCKET_BOUND = 3 << 19
"""The server's memory growth allowed per WebSocket that does not read: one 1 MiB message, with margin (about
0.7 MiB measured; 2.2 MiB, and 3.4 MB in the attack's run, before the fix)."""
MESSAGE_BYTES = 1 << 20
READ_MESSAGES = 8
FLOOD_PORT, COUNTED_PORT = 8003, 8004
WAIT_S = 60.0
"""The bound on any one wait for the server (a failure, never a pace)."""
TCP_TIME_WAIT = "06"


@pytest.fixture(scope="module")
def preview(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Preview]:
    with serving_preview(tmp_path_factory, "preview-ws-backpressure", f"send_stall_timeout_s = {STALL_S}\n") as served:
        yield served


@pytest.fixture(scope="module")
def sandbox_id(preview: Preview) -> Iterator[str]:
    """A sandbox running ws_numbered.py twice: an endless flood on `FLOOD_PORT`, `READ_MESSAGES` on `COUNTED_PORT`."""
    created = preview.tool("create_sandbox")
    assert created["ok"], created
    sandbox_id = str(created["detail"]["sandbox_id"])
    for name in ("ws_numbered.py", "ws_handshake.py"):
        content = Path(APPS / name).read_text()
        assert preview.tool("write_file", sandbox_id=sandbox_id, path=name, content=content)["ok"]
    preview.run(
        sandbox_id,
        f"python3 ws_numbered.py {FLOOD_PORT} 1000000000 >/dev/null 2>&1 &\n"
        f"python3 ws_numbered.py {COUNTED_PORT} {READ_MESSAGES} >/dev/null 2>&1 &",
    )
    preview.run(sandbox_id, WAIT_LISTENING.replace("(8000, 8001)", f"({FLOOD_PORT}, {COUNTED_PORT})"))
    yield sandbox_id
    assert preview.tool("close_sandbox", sandbox_id=sandbox_id)["ok"]


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _held_by_server(socks: list[socket.socket]) -> int:
    """How many of `socks` the server still has its end of (the kernel's table: a client whose window is
    closed may never see the server's reset)."""
    ends = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, state = line.split()[1:4]
        if state != TCP_TIME_WAIT:
            ends.add((int(local.split(":")[1], 16), int(remote.split(":")[1], 16)))
    return sum((sock.getpeername()[1], sock.getsockname()[1]) in ends for sock in socks)


def _queued(sock: socket.socket) -> int:
    """Bytes the server sent that wait in `sock`'s receive queue, unread (FIONREAD: none is read)."""
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4)))[0])


def _message(client: Client) -> bytes:
    """The next whole binary message (wsproto gives one in pieces, as they arrive)."""
    data = bytearray()
    while True:
        event = client.next()
        assert isinstance(event, BytesMessage), event
        data += event.data
        if event.message_finished:
            return bytes(data)


def _non_reader(preview: Preview, url: str) -> socket.socket:
    """A browser's WebSocket that reads the handshake's answer and nothing after it."""
    host, port, path = re.fullmatch(r"http://([^:]+):(\d+)(/.*)", url).groups()  # type: ignore[union-attr]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window from the start
    sock.settimeout(WAIT_S)
    sock.connect((host, int(port)))
    ws = WSConnection(ConnectionType.CLIENT)
    extra = [(b"cookie", f"{SESSION_COOKIE}={preview.session}".encode()), (b"origin", preview.origin.encode())]
    sock.sendall(ws.send(Request(host=f"{host}:{port}", target=path, extra_headers=extra)))
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)  # byte by byte: nothing of the messages after it is taken
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def test_websockets_that_never_read_an_app_flood_hold_one_message_each_then_are_reset(
    preview: Preview, sandbox_id: str
) -> None:
    url = preview.expose(sandbox_id, FLOOD_PORT)
    pid = preview.server.process.pid
    with Client(preview, url) as warm:  # the relay's code and buffers in use once before the baseline
        for _ in range(2):
            assert len(_message(warm)) == MESSAGE_BYTES
    baseline = _rss(pid)
    held = [_non_reader(preview, url) for _ in range(SOCKETS)]
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not all(_queued(sock) for sock in held):
            time.sleep(0.05)  # a poll of the condition (data reached every browser), not a pace
        peak = baseline
        while time.monotonic() < deadline and _held_by_server(held):
            peak = max(peak, _rss(pid))
            time.sleep(0.05)  # a poll of the condition (every browser reset), not a pace
        grown = peak - baseline
        assert grown < SOCKETS * PER_SOCKET_BOUND, f"{grown / SOCKETS / (1 << 20):.2f} MiB per WebSocket"
        assert not _held_by_server(held), "browsers that took nothing were not reset"
    finally:
        for sock in held:
            sock.close()
    # Nothing lost for a browser that reads: the flood still reaches a new WebSocket.
    with Client(preview, url) as after:
        assert _message(after) == random.Random(0).randbytes(MESSAGE_BYTES)
    assert "Traceback" not in preview.server.log()


def test_a_browser_that_reads_gets_every_message_of_an_app_flood_intact(preview: Preview, sandbox_id: str) -> None:
    url = preview.expose(sandbox_id, COUNTED_PORT)
    with Client(preview, url) as client:
        for i in range(READ_MESSAGES):
            assert _message(client) == random.Random(i).randbytes(MESSAGE_BYTES), f"message {i} lost or altered"
        closed = client.next()
    assert isinstance(closed, CloseConnection)
    assert closed.code == 1000
    assert "Traceback" not in preview.server.log()

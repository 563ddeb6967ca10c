"""Streams the host opens into a microVM, without the VM: a preview's connection and a terminal.

The guest's end (inside/egress_port.py) runs as a real subprocess on a socket pair standing for the
virtio-serial port, with the host's end (`_vmegress.EgressPort`); a server on the host's loopback
stands for one on the guest's, and a host pty for the guest's terminal (handed over on the control
socket as inside/relay.py hands it). Then the host's end against a hostile guest: a connect it never
answers, ids it may not use, bytes before it accepted, a flood past the window, a port that dies.
Through a booted guest: test_microvm.py and test_microvm_templates.py (`microvm`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import termios
from collections.abc import AsyncIterator, Iterator

import pytest

from bastion.sandbox._vmegress import HOST_IDS, MAX_HOST_STREAMS, WINDOW, EgressPort
from bastion.sandbox.inside import egress_port
from tests.helpers import open_fds
from tests.sandbox.egress_helpers import HEADER, HostileGuest, frame

pytestmark = pytest.mark.anyio

ECHO = "import socket,sys\nc=socket.socket(fileno=int(sys.argv[1]))\nwhile d:=c.recv(65536): c.sendall(d)\n"


SHELL = (
    "import os,signal\n"
    "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    "signal.pthread_sigmask(signal.SIG_SETMASK, [])\n"
    "os.execvp('setsid', ['setsid', '-c', 'sh', '-i'])"
)


class Guest:
    """The guest's real stream port program, its control socket, and the host's end of its port."""

    def __init__(self) -> None:
        guest_end, host_end = socket.socketpair()
        host_end.setblocking(False)
        self.host_end = host_end
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0bastion-test-streams-" + str(os.getpid()) + "-" + str(id(self)))
        listener.listen()
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = (guest_end.fileno(), listener.fileno(), theirs.fileno())
        argv = [sys.executable, "-I", "-S", egress_port.__file__, *map(str, fds)]
        self.mux = subprocess.Popen(argv, pass_fds=fds)
        for sock in (guest_end, listener, theirs):
            sock.close()
        self.port = EgressPort(host_end, None, "test")
        self.port.start()

    def close(self) -> None:
        self.port.close()
        self.host_end.close()
        self.control.close()
        self.mux.kill()
        self.mux.wait()


@pytest.fixture
async def guest() -> AsyncIterator[Guest]:
    made = Guest()
    yield made
    made.close()


@pytest.fixture
def server() -> Iterator[socket.socket]:
    """An echo server on the loopback (the guest's, in a real VM): each connection echoed by a child."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener


async def echo_once(listener: socket.socket) -> subprocess.Popen[bytes]:
    conn, _ = await asyncio.to_thread(listener.accept)
    with conn:
        return subprocess.Popen([sys.executable, "-c", ECHO, str(conn.fileno())], pass_fds=(conn.fileno(),))


async def exchange(sock: socket.socket, data: bytes) -> bytes:
    """Send `data` and read as much back, both at once (the echo holds less than a window)."""
    loop = asyncio.get_running_loop()
    got = bytearray()

    async def read() -> None:
        while len(got) < len(data):
            chunk = await loop.sock_recv(sock, 65536)
            assert chunk, "the stream ended early"
            got.extend(chunk)

    await asyncio.gather(loop.sock_sendall(sock, data), read())
    return bytes(got)


async def test_a_preview_connection_carries_many_windows_both_ways_and_leaves_nothing(
    guest: Guest, server: socket.socket
) -> None:
    before = open_fds()
    accepting = asyncio.get_running_loop().create_task(echo_once(server))
    sock = await guest.port.open_tcp(server.getsockname()[1], 10)
    echo = await accepting
    try:
        data = os.urandom(8 * WINDOW)  # 1 MiB: the window is credited back many times
        assert await exchange(sock, data) == data
        sock.shutdown(socket.SHUT_WR)  # the echo sees EOF, ends, and so does the stream
        assert await asyncio.get_running_loop().sock_recv(sock, 10) == b""
    finally:
        sock.close()
        echo.wait(10)
    async with asyncio.timeout(10):
        while guest.port.streams:
            await asyncio.sleep(0.01)
    assert open_fds() <= before


async def test_a_connect_to_a_closed_port_is_refused_and_leaks_no_fd(guest: Guest, server: socket.socket) -> None:
    port = server.getsockname()[1]
    server.close()
    before = open_fds()
    with pytest.raises(ConnectionRefusedError):
        await guest.port.open_tcp(port, 10)
    assert guest.port.streams == 0
    assert open_fds() <= before


async def test_a_terminal_handed_over_carries_keys_output_and_its_new_size(guest: Guest) -> None:
    """The relay's part played here: a pty master (with a shell on its slave) handed over on the control
    socket, named by the stream the host reserved. Ctrl-C reaches the shell's foreground; a resize is
    set on the master, where `stty size` reads it."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # as the agent sets it
    # A session of its own whose controlling tty is the slave, as the agent starts a terminal's program.
    # SIGINT as the guest's agent leaves it (a test runner started in the background ignores it).
    shell = subprocess.Popen([sys.executable, "-c", SHELL], stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    stream_id = guest.port.reserve()
    socket.send_fds(guest.control, [stream_id.to_bytes(4, "big")], [master])
    os.close(master)
    sock = await guest.port.attach(stream_id, 10)
    loop = asyncio.get_running_loop()
    seen = bytearray()

    async def until(text: bytes, after: int = 0) -> int:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                while text not in seen[after:]:
                    seen.extend(await loop.sock_recv(sock, 65536))
        assert text in seen[after:], bytes(seen)
        return seen.index(text, after) + len(text)

    try:
        # A signal key only once the job holds the terminal (it says so), as in test_terminals.py.
        await loop.sock_sendall(sock, b"stty size; sh -c 'echo ar\"\"med; exec sleep 100'\n")
        await until(b"armed", await until(b"24 80"))
        guest.port.resize(stream_id, 30, 100)
        await loop.sock_sendall(sock, b"\x03")
        # Typed only at the next prompt: the tty flushes what was typed ahead of an interrupt.
        await until(b"# ", await until(b"^C"))
        await loop.sock_sendall(sock, b"echo status=$?; stty size\n")
        await until(b"30 100")
        assert b"status=130" in seen
    finally:
        sock.close()
        os.killpg(shell.pid, signal.SIGKILL)  # the session: the shell and its sleep
        shell.wait()


async def test_a_terminal_handed_over_for_a_stream_never_reserved_is_closed(guest: Guest) -> None:
    """A pty master for an id the host did not reserve gets an A the host ignores, and is never carried."""
    master, slave = os.openpty()
    socket.send_fds(guest.control, [(HOST_IDS | 77).to_bytes(4, "big")], [master])
    os.close(master)
    os.close(slave)
    stream_id = guest.port.reserve()  # the next reserved stream still works
    sock_a, sock_b = socket.socketpair()
    with sock_a, sock_b:
        socket.send_fds(guest.control, [stream_id.to_bytes(4, "big")], [sock_a.fileno()])
        carried = await guest.port.attach(stream_id, 10)
        with carried:
            await asyncio.to_thread(sock_b.sendall, b"hi")
            assert await asyncio.get_running_loop().sock_recv(carried, 10) == b"hi"
    assert guest.port.streams <= 1


@pytest.fixture
async def hostile() -> AsyncIterator[HostileGuest]:
    made = HostileGuest(None)
    yield made
    made.close()


async def test_a_connect_the_guest_never_answers_is_given_up_on_in_time(hostile: HostileGuest) -> None:
    with pytest.raises(TimeoutError):
        await hostile.port.open_tcp(8000, 0.3)
    kind, stream_id, payload = await hostile.next_frame()
    assert (kind, payload) == (b"T", (8000).to_bytes(2, "big"))
    assert stream_id & HOST_IDS
    assert await hostile.next_frame() == (b"X", stream_id, b"")  # the guest is told the host gave up
    assert hostile.port.streams == 0


async def test_a_guest_cannot_open_a_host_id_nor_accept_what_was_never_asked(hostile: HostileGuest) -> None:
    await hostile.send(frame(b"C", HOST_IDS | 5))
    assert await hostile.next_frame() == (b"X", HOST_IDS | 5, b"")
    await hostile.send(frame(b"A", HOST_IDS | 6) + frame(b"D", HOST_IDS | 6, b"unasked"))  # ignored
    assert hostile.port.streams == 0


async def test_bytes_before_the_guest_accepted_end_the_stream(hostile: HostileGuest) -> None:
    opening = asyncio.get_running_loop().create_task(hostile.port.open_tcp(8000, 10))
    kind, stream_id, _ = await hostile.next_frame()
    assert kind == b"T"
    await hostile.send(frame(b"D", stream_id, b"early"))
    assert await hostile.next_frame() == (b"X", stream_id, b"")
    with pytest.raises(ConnectionRefusedError):
        await opening
    assert hostile.port.streams == 0


async def test_a_guest_flooding_a_preview_past_its_window_has_the_stream_ended(hostile: HostileGuest) -> None:
    """The caller reads nothing: the host keeps at most a window unread, then ends the stream (X)."""
    opening = asyncio.get_running_loop().create_task(hostile.port.open_tcp(8000, 10))
    _, stream_id, _ = await hostile.next_frame()
    await hostile.send(frame(b"A", stream_id))
    sock = await opening
    with sock:
        await hostile.send(b"".join(frame(b"D", stream_id, b"x" * 65536) for _ in range(12)))
        while (found := await hostile.next_frame())[0] != b"X":
            assert found[:2] == (b"K", stream_id)
        assert found == (b"X", stream_id, b"")
        assert hostile.port.streams == 0


async def test_host_streams_past_the_cap_are_refused(hostile: HostileGuest) -> None:
    for _ in range(MAX_HOST_STREAMS):
        hostile.port.reserve()
    with pytest.raises(ConnectionResetError, match="open already"):
        hostile.port.reserve()


async def test_a_guest_whose_port_dies_refuses_a_waiting_connect_at_once(hostile: HostileGuest) -> None:
    """The guest's program killed (its port closes) while a connect waits: refused now, not at the timeout."""
    opening = asyncio.get_running_loop().create_task(hostile.port.open_tcp(8000, 60))
    await hostile.next_frame()
    hostile.sock.close()
    async with asyncio.timeout(5):
        with pytest.raises(ConnectionRefusedError):
            await opening
    with pytest.raises(ConnectionResetError, match="ended"):
        hostile.port.reserve()
    with contextlib.suppress(OSError):
        hostile.sock.close()


async def test_a_kind_only_the_host_sends_ends_the_guests_stream(hostile: HostileGuest) -> None:
    opening = asyncio.get_running_loop().create_task(hostile.port.open_tcp(8000, 10))
    _, stream_id, _ = await hostile.next_frame()
    await hostile.send(frame(b"A", stream_id))
    sock = await opening
    with sock:
        await hostile.send(frame(b"W", stream_id, b"\0\x18\0\x50"))
        assert await hostile.next_frame() == (b"X", stream_id, b"")
        assert hostile.port.streams == 0
        assert await asyncio.get_running_loop().sock_recv(sock, 10) == b""  # the caller sees the end


async def test_an_oversized_frame_ends_every_open_preview_and_terminal_stream(hostile: HostileGuest) -> None:
    """The port ends: each caller's socket reads its end (no fd left waiting on a guest), and no new
    stream can be opened on it."""
    before = open_fds()
    opening = asyncio.get_running_loop().create_task(hostile.port.open_tcp(8000, 10))
    _, stream_id, _ = await hostile.next_frame()
    await hostile.send(frame(b"A", stream_id))
    sock = await opening
    with sock:
        await hostile.send(HEADER.pack(1 << 30, b"D", stream_id))
        async with asyncio.timeout(5):
            assert await asyncio.get_running_loop().sock_recv(sock, 10) == b""
    assert hostile.port.streams == 0
    with pytest.raises(ConnectionResetError):
        hostile.port.reserve()
    assert open_fds() <= before


async def test_resizes_to_a_guest_that_stops_reading_are_not_queued_without_bound(hostile: HostileGuest) -> None:
    hostile.host_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    hostile.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    opening = asyncio.get_running_loop().create_task(hostile.port.open_tcp(8000, 10))
    _, stream_id, _ = await hostile.next_frame()
    await hostile.send(frame(b"A", stream_id))
    with await opening:
        for _ in range(20_000):  # the guest reads none of them
            hostile.port.resize(stream_id, 24, 80)
            await asyncio.sleep(0)
        assert len(hostile.port._later) <= MAX_HOST_STREAMS


async def test_a_frame_cut_by_the_ports_close_is_an_oserror_not_a_stray_cancellation() -> None:
    """Found by a review: the port's close cancels the frames being written (a frame cut now is read by
    nobody), and a sender waiting on one got CancelledError although nobody cancelled it: a tool call then
    read as cancelled ("the client went away") and a preview's error passed its handler. Invariant: the
    sender gets an OSError (ConnectionResetError), which every caller already answers; its own
    cancellation still goes on as one."""
    host_end, guest_end = socket.socketpair()  # a guest that never reads its port
    host_end.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            host_end.send(b"\0" * 65536)
    port = EgressPort(host_end, None, "test")
    try:
        sending = asyncio.ensure_future(port._send(b"D", 1, b"x" * 1024))
        cancelled = asyncio.ensure_future(port._send(b"D", 2, b"y"))  # waits for the lock behind it
        for _ in range(5):
            await asyncio.sleep(0)
        assert not sending.done()
        cancelled.cancel()
        port.close()
        with pytest.raises(ConnectionResetError):
            await sending
        with pytest.raises(asyncio.CancelledError):
            await cancelled
    finally:
        host_end.close()
        guest_end.close()

"""sandbox/inside/forwarder.py as the sandbox runs it: ``python3 -I -S -c SOURCE PORT SOCKET``, a real subprocess.

It relays 127.0.0.1:PORT to a unix socket, both ways, with half-close; it decides nothing.
Each test runs with splice(2) and with the plain buffer fallback.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bastion.sandbox.inside import forwarder as _forwarder

SOURCE = Path(_forwarder.__file__).read_text()
Handler = Callable[[socket.socket], None]


class UnixServer:
    """A unix socket server running `handler` on each connection, in a thread."""

    def __init__(self, path: Path, handler: Handler) -> None:
        self.path = path
        self.handler = handler
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(64)
        self.threads: list[threading.Thread] = []
        self.accepter = threading.Thread(target=self._accept, daemon=True)
        self.accepter.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _handle(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            self.handler(conn)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.accepter.join(5)
        for thread in self.threads:
            thread.join(5)


def echo(conn: socket.socket) -> None:
    while data := conn.recv(1 << 20):
        conn.sendall(data)
    conn.shutdown(socket.SHUT_WR)


@pytest.fixture(params=[True, False], ids=["splice", "buffer"])
def source(request: pytest.FixtureRequest) -> str:
    if request.param:
        return SOURCE
    assert 'SPLICE = hasattr(posix, "splice")' in SOURCE
    return SOURCE.replace('SPLICE = hasattr(posix, "splice")', "SPLICE = False")


@contextlib.contextmanager
def forwarder(source: str, sock_path: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", source, "0", str(sock_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready "), proc.stderr.read()
        yield proc, int(line.split()[1])
        assert proc.poll() is None, f"the forwarder died: {proc.stderr.read()}"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


@contextlib.contextmanager
def relay(tmp_path: Path, source: str, handler: Handler) -> Iterator[int]:
    path = tmp_path / "egress.sock"
    server = UnixServer(path, handler)
    try:
        with forwarder(source, path) as (_, port):
            yield port
    finally:
        server.close()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def test_bytes_arrive_intact_both_ways(tmp_path: Path, source: str) -> None:
    payload = os.urandom(6 * 1024 * 1024)
    with relay(tmp_path, source, echo) as port, connect(port) as sock:

        def send() -> None:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        got = read_all(sock)
        sender.join()
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()


def test_client_half_close_reaches_the_server_which_can_still_answer(tmp_path: Path, source: str) -> None:
    def count_then_answer(conn: socket.socket) -> None:
        total = 0
        while data := conn.recv(65536):
            total += len(data)
        conn.sendall(f"got {total}".encode())

    with relay(tmp_path, source, count_then_answer) as port, connect(port) as sock:
        sock.sendall(b"x" * 100_000)
        sock.shutdown(socket.SHUT_WR)
        assert read_all(sock) == b"got 100000"


def test_server_half_close_lets_the_client_keep_sending(tmp_path: Path, source: str) -> None:
    received: list[bytes] = []
    done = threading.Event()

    def greet_then_listen(conn: socket.socket) -> None:
        conn.sendall(b"hello")
        conn.shutdown(socket.SHUT_WR)
        received.append(read_all(conn))
        done.set()

    with relay(tmp_path, source, greet_then_listen) as port:
        with connect(port) as sock:
            assert read_all(sock) == b"hello"
            sock.sendall(b"still talking")
            sock.shutdown(socket.SHUT_WR)
        assert done.wait(10)  # before the forwarder is stopped
    assert received == [b"still talking"]


def test_many_concurrent_connections(tmp_path: Path, source: str) -> None:
    with relay(tmp_path, source, echo) as port:
        socks = [connect(port) for _ in range(40)]
        try:
            for i, sock in enumerate(socks):
                sock.sendall(f"message {i}".encode())
                sock.shutdown(socket.SHUT_WR)
            assert [read_all(sock) for sock in socks] == [f"message {i}".encode() for i in range(40)]
        finally:
            for sock in socks:
                sock.close()


def test_missing_proxy_socket_ends_the_client_quietly_and_the_forwarder_survives(tmp_path: Path, source: str) -> None:
    path = tmp_path / "egress.sock"
    with forwarder(source, path) as (_, port):
        with connect(port) as sock, contextlib.suppress(ConnectionResetError):
            assert sock.recv(10) == b""
        server = UnixServer(path, echo)
        try:
            with connect(port) as sock:
                sock.sendall(b"now it works")
                sock.shutdown(socket.SHUT_WR)
                assert read_all(sock) == b"now it works"
        finally:
            server.close()


def test_server_vanishing_mid_stream_ends_the_pair_only(tmp_path: Path, source: str) -> None:
    def vanish(conn: socket.socket) -> None:
        conn.recv(10)  # leaves unread data behind: closing resets the connection

    with relay(tmp_path, source, vanish) as port:
        with connect(port) as sock:
            with contextlib.suppress(OSError):
                sock.sendall(b"y" * 4_000_000)
            with contextlib.suppress(ConnectionResetError):
                read_all(sock)
        with connect(port) as other:
            # The forwarder still accepts and relays (the handler reads a bit, then closes).
            other.sendall(b"z")
            with contextlib.suppress(ConnectionResetError):
                assert read_all(other) == b""


def test_bad_arguments_print_usage() -> None:
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", SOURCE, "port"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage:")


def test_source_imports_only_the_standard_library() -> None:
    """It runs with -I -S inside the sandbox: no bastion, no site-packages."""
    imports = [line for line in SOURCE.splitlines() if line.startswith(("import ", "from "))]
    assert imports
    assert all(line.split()[1].split(".")[0] in sys.stdlib_module_names | {"__future__"} for line in imports)

"""Connections a live `bastion serve --http` over TLS closes, against clients that never send close_notify.

Found by attack: asyncio's TLS transport, once the server closes a connection, waits up to 30 s for the
client's close_notify, and the connection keeps its place under `[http] max_connections` all that time,
where it cannot be evicted (it is closing already). 16 clients sending one `Connection: close` request
each and never a close_notify held a 16-connection cap, and the server refused everyone else for 30 s;
16 silent clients did the same once the head timeout closed them. A connection the server closes now
ends once all it wrote is in the kernel's queue, as a plain one does.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .live import LiveServer, live_tls_server

CAP = 16
"""The smallest `max_connections` the config accepts."""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    with live_tls_server(
        tmp_path, http_extra=f"max_connections = {CAP}\nrequest_head_timeout_s = 1", auth=False
    ) as live:
        yield live


@contextlib.contextmanager
def tls_clients(server: LiveServer, count: int, request: bytes = b"") -> Iterator[list[ssl.SSLSocket]]:
    """`count` TLS connections (handshake done), each sending `request`, then nothing: no close_notify."""
    assert server.tls is not None
    opened: list[ssl.SSLSocket] = []
    try:
        for _ in range(count):
            raw = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            opened.append(server.tls.wrap_socket(raw, server_hostname="127.0.0.1"))
            opened[-1].sendall(request)
        yield opened
    finally:
        for sock in opened:
            sock.close()


def ended_by_server(sock: ssl.SSLSocket, within_s: float = 10) -> bytes:
    """What `sock` receives until the server's end (its close_notify or FIN), within `within_s`."""
    received = bytearray()
    sock.settimeout(within_s)
    with contextlib.suppress(ssl.SSLZeroReturnError, ssl.SSLEOFError):
        while chunk := sock.recv(65536):
            received += chunk
    return bytes(received)


def served(server: LiveServer) -> None:
    """A new client is answered at once, and the server refused no connection."""
    started = time.monotonic()
    with server.http() as http:
        assert http.get("/healthz").status_code == 200
    assert time.monotonic() - started < 5
    assert "refused new connections" not in server.log()
    assert "Traceback" not in server.log()


def request(server: LiveServer) -> bytes:
    return (f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nConnection: close\r\n\r\n").encode()


def test_tls_clients_asking_close_and_never_sending_close_notify_do_not_hold_every_slot(server: LiveServer) -> None:
    with tls_clients(server, CAP + 4, request(server)) as clients:
        for sock in clients:
            assert ended_by_server(sock).startswith(b"HTTP/1.1 200")  # the whole answer, then the end
        served(server)


def test_silent_tls_clients_closed_at_the_head_timeout_do_not_hold_every_slot(server: LiveServer) -> None:
    with tls_clients(server, CAP) as clients:
        for sock in clients:
            assert ended_by_server(sock) == b""  # closed by the head timeout (1 s), not by the client
        served(server)


def test_tls_clients_kept_alive_then_silent_do_not_hold_every_slot(tmp_path: Path) -> None:
    """Found by review: with a head timeout longer than uvicorn's keep-alive (15 s), uvicorn closes an idle
    kept-alive connection itself, and that close waited 30 s for the TLS client's close_notify as the
    server's own did: 16 clients that each read an answer and went silent held a 16-connection cap."""
    extra = f"max_connections = {CAP}\nrequest_head_timeout_s = 120"
    with live_tls_server(tmp_path, http_extra=extra, auth=False) as server:
        kept_alive = request(server).replace(b"Connection: close\r\n", b"")
        with tls_clients(server, CAP, kept_alive) as clients:
            for sock in clients:
                assert ended_by_server(sock, within_s=30).startswith(b"HTTP/1.1 200")  # at the keep-alive's end
            served(server)

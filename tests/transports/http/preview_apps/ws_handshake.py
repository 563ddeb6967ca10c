"""The server side of a WebSocket handshake (RFC 6455 §4.2) and the accept loop, for the preview tests' apps
(stdlib only, runs INSIDE a sandbox, written beside the app that imports it)."""

import base64
import hashlib
import socket
import threading

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def accept(conn):
    """Read the client's upgrade request from `conn` and answer 101 Switching Protocols."""
    head = b""
    while b"\r\n\r\n" not in head:
        head += conn.recv(4096)
    key = next(
        line.split(b":", 1)[1].strip() for line in head.split(b"\r\n") if line.lower().startswith(b"sec-websocket-key:")
    )
    accepted = base64.b64encode(hashlib.sha1(key + GUID.encode()).digest())
    conn.sendall(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: "
        + accepted
        + b"\r\n\r\n"
    )


def serve_forever(port, handle, *args, backlog=128):
    """Accept connections on 127.0.0.1:`port` for ever, each handled as `handle(conn, *args)` in a thread."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(backlog)
    while True:
        threading.Thread(target=handle, args=(server.accept()[0], *args), daemon=True).start()

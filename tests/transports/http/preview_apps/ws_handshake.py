"""The server side of a WebSocket handshake (RFC 6455 §4.2), for the preview tests' apps (stdlib only, runs
INSIDE a sandbox, written beside the app that imports it)."""

import base64
import hashlib

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

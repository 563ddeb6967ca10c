"""A hostile WebSocket server for the preview tests (stdlib only, runs INSIDE a sandbox): once a client
connects it begins a text message, sends N empty continuation frames (2 bytes each) and never ends it."""

import base64
import hashlib
import socket
import sys
import threading

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def serve(conn, frames):
    head = b""
    while b"\r\n\r\n" not in head:
        head += conn.recv(4096)
    key = next(
        line.split(b":", 1)[1].strip() for line in head.split(b"\r\n") if line.lower().startswith(b"sec-websocket-key:")
    )
    accept = base64.b64encode(hashlib.sha1(key + GUID.encode()).digest())
    conn.sendall(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: "
        + accept
        + b"\r\n\r\n"
    )
    try:
        conn.sendall(b"\x01\x00" + b"\x00\x00" * frames)
        while conn.recv(4096):  # until bastion closes
            pass
    except OSError:
        pass
    finally:
        conn.close()


server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", int(sys.argv[1])))
server.listen()
while True:
    threading.Thread(target=serve, args=(server.accept()[0], int(sys.argv[2])), daemon=True).start()

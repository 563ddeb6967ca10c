"""A WebSocket server for the preview tests (stdlib only, runs INSIDE a sandbox): once a client connects it
sends COUNT binary messages of 1 MiB, message i being `random.Random(i).randbytes(1 MiB)`, as fast as the
connection takes them, then a close (1000). Usage: ws_numbered.py PORT COUNT"""

import base64
import hashlib
import random
import socket
import struct
import sys
import threading

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
SIZE = 1 << 20


def serve(conn, count):
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
        for i in range(count):
            conn.sendall(b"\x82\x7f" + struct.pack("!Q", SIZE) + random.Random(i).randbytes(SIZE))
        conn.sendall(b"\x88\x02" + struct.pack("!H", 1000))
        while conn.recv(4096):  # until bastion closes
            pass
    except OSError:
        pass
    finally:
        conn.close()


server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", int(sys.argv[1])))
server.listen(256)
while True:
    threading.Thread(target=serve, args=(server.accept()[0], int(sys.argv[2])), daemon=True).start()

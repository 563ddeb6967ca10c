"""A WebSocket echo server for the preview tests (stdlib only, runs INSIDE a sandbox; RFC 6455)."""

import struct
import sys

from ws_handshake import accept, serve_forever


def read_exact(conn, n):
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def serve(conn):
    accept(conn)
    try:
        while True:
            b1, b2 = read_exact(conn, 2)
            opcode, length = b1 & 0x0F, b2 & 0x7F
            if length == 126:
                length = struct.unpack("!H", read_exact(conn, 2))[0]
            elif length == 127:
                length = struct.unpack("!Q", read_exact(conn, 8))[0]
            mask = read_exact(conn, 4) if b2 & 0x80 else b"\0\0\0\0"
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(read_exact(conn, length)))
            if opcode == 8:
                conn.sendall(b"\x88\x00")
                return
            size = bytes([len(payload)]) if len(payload) < 126 else b"\x7e" + struct.pack("!H", len(payload))
            conn.sendall(bytes([0x80 | opcode]) + size + payload)
    except (EOFError, OSError):
        pass
    finally:
        conn.close()


serve_forever(int(sys.argv[1]), serve)

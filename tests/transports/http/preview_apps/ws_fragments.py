"""A hostile WebSocket server for the preview tests (stdlib only, runs INSIDE a sandbox): once a client
connects it begins a text message, sends N empty continuation frames (2 bytes each) and never ends it."""

import sys

from ws_handshake import accept, serve_forever


def serve(conn, frames):
    accept(conn)
    try:
        conn.sendall(b"\x01\x00" + b"\x00\x00" * frames)
        while conn.recv(4096):  # until bastion closes
            pass
    except OSError:
        pass
    finally:
        conn.close()


serve_forever(int(sys.argv[1]), serve, int(sys.argv[2]))

"""A hostile WebSocket server for the preview tests (stdlib only, runs INSIDE a sandbox): once a client
connects it begins a text message, sends N empty continuation frames (2 bytes each) and never ends it."""

import socket
import sys
import threading

from ws_handshake import accept


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


server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", int(sys.argv[1])))
server.listen()
while True:
    threading.Thread(target=serve, args=(server.accept()[0], int(sys.argv[2])), daemon=True).start()

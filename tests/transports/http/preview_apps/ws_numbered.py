"""A WebSocket server for the preview tests (stdlib only, runs INSIDE a sandbox): once a client connects it
sends COUNT binary messages of 1 MiB, message i being `random.Random(i).randbytes(1 MiB)`, as fast as the
connection takes them, then a close (1000). Usage: ws_numbered.py PORT COUNT"""

import random
import struct
import sys

from ws_handshake import accept, serve_forever

SIZE = 1 << 20


def serve(conn, count):
    accept(conn)
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


serve_forever(int(sys.argv[1]), serve, int(sys.argv[2]), backlog=256)

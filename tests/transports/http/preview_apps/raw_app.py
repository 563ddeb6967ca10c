"""A hostile app for the preview body tests (stdlib only, runs INSIDE a sandbox), writing its answers byte by
byte as no framework would: /tinychunks?n=N (N chunks of one byte), /smallfirst?n=N (a chunk of 10 bytes,
then N bytes in chunks of 64 KiB), /short (a Content-Length of 100 and 10
bytes), /status999, /trickle (a one-byte chunk every 0.1 s until the proxy goes away), /sink (reads nothing
past the head, answers nothing), /upload?name=NAME (the request's body appended to NAME as it comes, flushed at
each piece, then a 200)."""

import contextlib
import socket
import sys
import threading
import time
from urllib.parse import parse_qs, urlsplit


def receive_body(conn: socket.socket, head: bytes, name: str) -> None:
    """The body after `head` (its Content-Length's worth), appended to the file `name` as it comes."""
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in lines if line.lower().startswith(b"content-length:"))
    received = head.split(b"\r\n\r\n", 1)[1]
    with open(name, "ab") as log:
        log.write(received)
        log.flush()
        left = length - len(received)
        while left > 0 and (data := conn.recv(65536)):
            log.write(data)
            log.flush()
            left -= len(data)


def answer(conn: socket.socket, target: str, head: bytes) -> None:
    url = urlsplit(target)
    if url.path == "/upload":
        receive_body(conn, head, parse_qs(url.query)["name"][0])
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    elif url.path == "/tinychunks":
        n = int(parse_qs(url.query)["n"][0])
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1\r\nx\r\n" * n + b"0\r\n\r\n")
    elif url.path == "/smallfirst":
        n = int(parse_qs(url.query)["n"][0])
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\na\r\n0123456789\r\n")
        for at in range(0, n, 65536):
            piece = b"y" * min(65536, n - at)
            conn.sendall(b"%x\r\n%b\r\n" % (len(piece), piece))
        conn.sendall(b"0\r\n\r\n")
    elif url.path == "/short":
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nCache-Control: max-age=3600\r\n\r\n0123456789")
    elif url.path == "/status999":
        conn.sendall(b"HTTP/1.1 999 Odd\r\nContent-Length: 2\r\n\r\nok")
    elif url.path == "/trickle":
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            conn.sendall(b"1\r\nt\r\n")
            time.sleep(0.1)
    elif url.path == "/sink":
        time.sleep(3600)
    else:
        conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")


def serve(conn: socket.socket) -> None:
    with conn:
        head = b""
        while b"\r\n\r\n" not in head:
            data = conn.recv(65536)
            if not data:
                return
            head += data
        with contextlib.suppress(OSError):  # the proxy went away
            answer(conn, head.split(b" ", 2)[1].decode(), head)


listener = socket.create_server(("127.0.0.1", int(sys.argv[1])))
while True:
    threading.Thread(target=serve, args=(listener.accept()[0],), daemon=True).start()

"""A sandbox's app for the preview tests (stdlib only, runs INSIDE a sandbox): echoes request headers
and tries to set cookies beyond its preview (/headers), answers never (/slow), sends N bytes (/big?n=N),
redirects to an absolute path (/redirect), resets a POST unread (/reset), and serves files of its folder otherwise."""

import http.server
import socket
import struct
import sys
import time
from urllib.parse import parse_qs, urlsplit


class Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        url = urlsplit(self.path)
        if url.path == "/headers":
            body = "".join(f"{k}: {v}\n" for k, v in self.headers.items()).encode()
            self.send_response(200)
            for cookie in (
                "__Host-bastion-admin=evil; Path=/; Secure",
                "tossed=1; Path=/; Domain=127.0.0.1",
                "Bastion-x=1; Path=/",
                "app=ok; Path=/admin; HttpOnly",
            ):
                self.send_header("Set-Cookie", cookie)
            self.send_header("Clear-Site-Data", '"cookies"')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif url.path == "/slow":
            time.sleep(3600)
        elif url.path == "/big":
            n = int(parse_qs(url.query)["n"][0])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            chunk = b"x" * 65536
            while n > 0:
                self.wfile.write(chunk[:n])
                n -= len(chunk)
        elif url.path == "/hugeheaders":
            self.send_response(200)
            self.send_header("X-Huge", "h" * 300_000)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif url.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/landing")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            super().do_GET()

    def do_POST(self):
        if urlsplit(self.path).path == "/reset":  # reads no body: resets the connection, then says so
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            for stream in (self.rfile, self.wfile, self.connection):
                stream.close()
            with open("reset-done", "w") as done:
                done.write("1")
            return
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()

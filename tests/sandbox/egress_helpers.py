"""An egress path for sandbox tests: the real proxy (EgressService) on a unix socket, its audit log,
and an HTTP server on the host's loopback that allowed names reach (127.0.0.0/8 unblocked here only)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bastion.config import DEFAULT_BLOCKED_RANGES, parse_allow_rules
from bastion.egress.proxy import EgressService
from bastion.safety.audit import AuditLog, verify
from bastion.safety.redact import Redactor
from bastion.sandbox._vmegress import EgressPort

SANDBOX = "sb-0123456789ab"
OPEN_RANGES = tuple(r for r in DEFAULT_BLOCKED_RANGES if r != "127.0.0.0/8")
HOSTS = {"allowed.test": ["127.0.0.1"], "denied.test": ["127.0.0.1"], "meta.test": ["169.254.169.254"]}
BIG = bytes(range(256)) * (4 * 4096)  # 4 MiB: many windows of the microVM's egress port
FETCH = (
    "import sys, urllib.request\n"
    "try:\n"
    "    print(urllib.request.urlopen(sys.argv[1], timeout=30).read().decode()[:40])\n"
    "except Exception as exc:\n"
    "    print('refused', exc)\n"
)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        server: Web = self.server  # type: ignore[assignment]
        server.paths.append(self.path)
        body = BIG if self.path == "/big" else b"hello from the host"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class Web(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.paths: list[str] = []


@dataclass
class EgressSetup:
    socket_dir: Path
    """Holds the proxy's `egress.sock`: a sandbox sees this folder at /run/bastion."""
    web: Web
    audit_path: Path

    @property
    def port(self) -> int:
        return self.web.server_address[1]

    def records(self, count: int) -> list[tuple[str, int, str]]:
        """(domain, port, decision) of the egress records, once `count` are written (an allowed
        connection's record is written when it ends, just after the client has its answer)."""
        deadline = time.monotonic() + 10
        while True:
            lines = self.audit_path.read_text().split("\n")[:-1]
            found = [r for r in map(json.loads, lines) if r.get("event") == "egress"]
            if len(found) >= count or time.monotonic() > deadline:
                return [(r["domain"], r["port"], r["decision"]) for r in found]
            time.sleep(0.01)


@contextlib.contextmanager
def egress_setup(tmp: Path) -> Iterator[EgressSetup]:
    """The proxy of sandbox SANDBOX, allowing allowed.test (at the web server's port) and meta.test:80."""
    web = Web()
    threading.Thread(target=web.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    socket_dir = tmp / "net"
    socket_dir.mkdir(mode=0o711)
    audit = AuditLog(tmp / "audit.jsonl", redactor=Redactor())
    audit.open()
    service = EgressService(audit, blocked_ranges=OPEN_RANGES, hosts=HOSTS)
    rules = parse_allow_rules([f"allowed.test:{web.server_address[1]}", "meta.test"])
    try:
        service.start(SANDBOX, rules, socket_dir / "egress.sock")
        yield EgressSetup(socket_dir, web, tmp / "audit.jsonl")
    finally:
        service.close()
        web.shutdown()
        web.server_close()
        audit.close()
        report = verify(tmp / "audit.jsonl")
        assert report.ok, report


HEADER = struct.Struct(">IcI")
"""A stream port frame's head: length, kind, stream id (inside/egress_port.py)."""


def frame(kind: bytes, stream_id: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload) + 5, kind, stream_id) + payload


class HostileGuest:
    """The test plays the guest: raw frames on the host end's socket pair."""

    def __init__(self, proxy: str | None) -> None:
        self.sock, host_end = socket.socketpair()
        host_end.setblocking(False)
        self.host_end = host_end
        self.port = EgressPort(host_end, proxy, "hostile")
        self.port.start()
        self.sock.settimeout(10)
        self.inbox = b""

    async def send(self, data: bytes) -> None:
        await asyncio.to_thread(self.sock.sendall, data)

    async def next_frame(self) -> tuple[bytes, int, bytes]:
        while len(self.inbox) < 4 or len(self.inbox) < 4 + int.from_bytes(self.inbox[:4], "big"):
            data = await asyncio.to_thread(self.sock.recv, 65536)
            assert data, "the host ended the port"
            self.inbox += data
        size = int.from_bytes(self.inbox[:4], "big")
        _, kind, stream_id = HEADER.unpack_from(self.inbox)
        payload, self.inbox = self.inbox[9 : 4 + size], self.inbox[4 + size :]
        return kind, stream_id, payload

    def close(self) -> None:
        self.port.close()
        self.host_end.close()
        self.sock.close()

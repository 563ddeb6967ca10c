"""Egress figure (issue #4): a 50 MiB download through the egress path against the same download direct.

Path measured: curl -> sandbox/inside/forwarder.py (a real subprocess, as inside a sandbox) -> unix socket
-> the egress proxy (EgressService, its own thread) -> a loopback HTTP server (a subprocess
sending a file with sendfile). The baseline is curl straight to the server. Runs alternate,
and the medians are compared. Target: proxied throughput >= 50% of direct, measured with the sandbox's
byte budget lifted (the relay's own speed). Then the same downloads with the default budget
(`[sandboxes.network] bytes_per_s`, 64 MiB/s, bursts of 16 MiB): their rate, and the CPU the proxy's
process spent meanwhile (the relay is the server's CPU, not the sandbox's).

Without curl, a small Python client (HTTP/1.1 GET with 1 MiB reads) is used for both.

Run: .venv/bin/python bench/bench_egress.py [--rounds N] [--mib N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bastion.config import DEFAULT_BLOCKED_RANGES, DEFAULT_BYTE_BURST, DEFAULT_BYTES_PER_S, parse_allow_rules
from bastion.egress import proxy as egress
from bastion.safety.audit import AuditLog, verify
from bastion.safety.redact import Redactor

REPO = Path(__file__).resolve().parent.parent
FORWARDER = REPO / "src" / "bastion" / "sandbox" / "inside" / "forwarder.py"
MIB = 1024 * 1024
SANDBOX = "sb-000000bench0"

SERVER = r"""
import os, socket, sys
path = sys.argv[1]
size = os.path.getsize(path)
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(16)
print(listener.getsockname()[1], flush=True)
while True:
    conn, _ = listener.accept()
    head = b""
    while b"\r\n\r\n" not in head:
        data = conn.recv(65536)
        if not data:
            break
        head += data
    if head:
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n".encode())
        with open(path, "rb") as f:
            conn.sendfile(f)
    conn.close()
"""

CLIENT = r"""
import socket, sys, time
host, port, name, proxy = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
started = time.perf_counter()
sock = socket.create_connection((host, int(proxy) if proxy != "-" else port))
target = f"http://{name}:{port}/file" if proxy != "-" else "/file"
sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {name}:{port}\r\n\r\n".encode())
buf = bytearray(1 << 20)
total = 0
while True:
    n = sock.recv_into(buf)
    if not n:
        break
    total += n
print(total, time.perf_counter() - started)
"""


def download(port: int, proxy_port: int | None, name: str) -> tuple[int, float]:
    """Bytes received (headers included for the Python client) and seconds taken."""
    if shutil.which("curl"):
        argv = ["curl", "-sS", "-o", "/dev/null", "-w", "%{size_download} %{time_total}"]
        if proxy_port is not None:
            argv += ["--proxy", f"http://127.0.0.1:{proxy_port}", f"http://{name}:{port}/file"]
        else:
            argv += [f"http://127.0.0.1:{port}/file"]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    else:
        proxy = str(proxy_port) if proxy_port is not None else "-"
        argv = [sys.executable, "-c", CLIENT, "127.0.0.1", str(port), name, proxy]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    size, seconds = out.split()
    return int(size), float(seconds)


def wait_port(port: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.02)
    raise SystemExit(f"port {port} never opened")


@contextmanager
def proxied(root: Path, audit: AuditLog, port: int, name: str, bytes_per_s: int, byte_burst: int) -> Iterator[int]:
    """An egress service and a forwarder to it for one sandbox allowed `name:port`; yields the forwarder's port."""
    # The server is on loopback, so this run un-blocks 127.0.0.0/8 and maps a name to it.
    ranges = [r for r in DEFAULT_BLOCKED_RANGES if r != "127.0.0.0/8"]
    service = egress.EgressService(
        audit, blocked_ranges=ranges, hosts={name: ["127.0.0.1"]}, bytes_per_s=bytes_per_s, byte_burst=byte_burst
    )
    sock_path = root / f"egress-{bytes_per_s}.sock"
    service.start(SANDBOX, parse_allow_rules([f"{name}:{port}"]), sock_path)
    forwarder = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", FORWARDER.read_text(), "0", str(sock_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert forwarder.stdout is not None
    try:
        yield int(forwarder.stdout.readline().split()[1])
    finally:
        forwarder.kill()
        forwarder.wait()
        service.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--mib", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bastion-egress-") as tmp:
        os.chmod(tmp, 0o711)  # passable by the sandboxes' own ids, as a state folder's parents must be
        root = Path(tmp)
        blob = root / "blob"
        with blob.open("wb") as f:
            f.truncate(args.mib * MIB)
        server = subprocess.Popen([sys.executable, "-c", SERVER, str(blob)], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None
        port = int(server.stdout.readline())
        audit = AuditLog(root / "audit.jsonl", redactor=Redactor())
        audit.open()
        direct: list[float] = []
        proxied_rates: list[float] = []
        budgeted: list[float] = []
        try:
            with proxied(root, audit, port, "bench.test", 1 << 40, 1 << 40) as fport:
                for i in range(args.rounds + 1):
                    size_d, secs_d = download(port, None, "bench.test")
                    size_p, secs_p = download(port, fport, "bench.test")
                    if min(size_d, size_p) < args.mib * MIB:
                        raise SystemExit(f"short download: {size_d} direct, {size_p} proxied")
                    if i:  # the first round warms caches
                        direct.append(size_d / secs_d / MIB)
                        proxied_rates.append(size_p / secs_p / MIB)
            with proxied(root, audit, port, "bench.test", DEFAULT_BYTES_PER_S, DEFAULT_BYTE_BURST) as fport:
                cpu_before, wall_before = _cpu_s(), time.perf_counter()
                for _ in range(args.rounds):
                    size_b, secs_b = download(port, fport, "bench.test")
                    budgeted.append(size_b / secs_b / MIB)
                cores = (_cpu_s() - cpu_before) / (time.perf_counter() - wall_before)
        finally:
            server.kill()
            server.wait()
            audit.close()
        report = verify(root / "audit.jsonl")
    client = "curl" if shutil.which("curl") else "python client"
    d, p = statistics.median(direct), statistics.median(proxied_rates)
    print(f"{args.mib} MiB download over loopback ({client}, {args.rounds} alternating rounds, medians):")
    print(f"  direct {d:.0f} MiB/s, through forwarder + proxy {p:.0f} MiB/s, ratio {p / d:.2f} (byte budget lifted)")
    print(
        f"  (best rounds: direct {max(direct):.0f} MiB/s, proxied {max(proxied_rates):.0f} MiB/s, ratio "
        f"{max(proxied_rates) / max(direct):.2f}; the target is judged on the medians)"
    )
    print(
        f"  with the default byte budget ({DEFAULT_BYTES_PER_S // MIB} MiB/s, bursts of {DEFAULT_BYTE_BURST // MIB} "
        f"MiB), back to back: {statistics.median(budgeted):.0f} MiB/s, the proxy's process {cores:.3f} cores"
    )
    print(f"  target >= 0.50; audit records {report.records}, chain {'intact' if report.ok else 'BROKEN'}")
    sys.exit(0 if p / d >= 0.5 and report.ok else 1)


def _cpu_s() -> float:
    """This process's CPU seconds (the proxy's thread and the audit's; curl, forwarder and server are others)."""
    times = os.times()
    return times.user + times.system


if __name__ == "__main__":
    main()

"""The egress proxy's name lookups against a DNS server that never answers, in namespaces the test makes.

The proxy resolves with the host's resolver (glibc), which no timeout can interrupt. These tests give the
proxy's thread a mount and network namespace of its own (`unshare`, as the attacker's ``unshare -mn``):
there /etc/resolv.conf points at 127.0.0.1:53, where a server reads queries and answers none until told
to, and /etc/hosts names ``b.test``. Everything the proxy starts inherits them; the test's own thread,
the forwarders and the host keep theirs. The namespaces go with the last thread in them, so the mounts
are never seen or left on the host. Needs root (unshare, mount).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import fcntl
import json
import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from bastion.config import parse_allow_rules
from bastion.egress import _throttle
from bastion.egress.proxy import EgressService
from bastion.safety.audit import AuditLog, verify
from bastion.safety.redact import Redactor
from tests.egress.test_proxy import OPEN_RANGES, _Server, start_forwarder, status_line, stop_process, wait_for

pytestmark = pytest.mark.root

T = TypeVar("T")
_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_FS, _CLONE_NEWNS, _CLONE_NEWNET = 0x200, 0x20000, 0x40000000
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sH22x"  # struct ifreq: the name, then ifr_flags in the 24-byte union

SANDBOX_A = "sb-00000000000a"
SANDBOX_B = "sb-00000000000b"
TIMEOUT_S = 3.0  # the proxy's connect timeout, its lookups' included
FLOOD = 20  # A's attempts at once: within its burst (200), past its lookups at once (8)
LOOKUPS = 8  # EgressService's default max_lookups


def _checked(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _in_new_namespaces(tmp: Path, work: Callable[[], T]) -> tuple[T, str]:
    """`work()` on a new thread with a mount and network namespace of its own; the namespace's id with it.

    There: the mounts are private (nothing propagates to the host), /etc/resolv.conf names 127.0.0.1 only
    (glibc waiting up to 30 s for an answer), /etc/hosts has ``b.test``, loopback is up.
    """
    (tmp / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:30 attempts:1\n")
    (tmp / "hosts").write_text("127.0.0.1 b.test\n")
    out: list[tuple[T, str]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _checked(_libc.unshare(_CLONE_FS | _CLONE_NEWNS | _CLONE_NEWNET), "unshare")
            _checked(_libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
            for name in ("resolv.conf", "hosts"):
                source, target = os.fsencode(tmp / name), f"/etc/{name}".encode()
                _checked(_libc.mount(source, target, None, _MS_BIND, None), f"bind {name}")
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as control:
                flags = struct.unpack(_IFREQ, fcntl.ioctl(control, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
                fcntl.ioctl(control, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))
            out.append((work(), os.readlink("/proc/thread-self/ns/net")))
        except BaseException as exc:  # raised again in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="test-namespaces")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def _refused_answer(query: bytes) -> bytes:
    """The REFUSED answer to a DNS query (RFC 1035 §4.1.1): same id and question, QR set, RCODE 5."""
    return query[:2] + bytes([query[2] | 0x80, 0x05]) + query[4:6] + bytes(6) + query[12:]


def _query_name(query: bytes) -> str:
    labels, at = [], 12
    while query[at]:
        labels.append(query[at + 1 : at + 1 + query[at]].decode())
        at += 1 + query[at]
    return ".".join(labels)


class _SilentDns:
    """A DNS server on `sock` that notes the names asked and answers none, until `release`: then it answers
    every query, held or new, REFUSED, and glibc gives up on the name at once. Its reader is a thread of the
    caller's, so no thread of its own stays in the namespace the socket was made in."""

    def __init__(self, sock: socket.socket) -> None:
        self.names: set[str] = set()
        self._sock = sock
        self._sock.settimeout(0.05)  # how often the reader looks at `_closed`
        self._lock = threading.Lock()
        self._held: list[tuple[bytes, tuple[str, int]]] = []
        self._released = False
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._serve, name="test-silent-dns", daemon=True)
        self._reader.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                query, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            with self._lock:
                self.names.add(_query_name(query))
                if self._released:
                    self._sock.sendto(_refused_answer(query), peer)
                else:
                    self._held.append((query, peer))

    def asked(self, suffix: str) -> set[str]:
        with self._lock:
            return {name for name in self.names if name.endswith(suffix)}

    def release(self) -> None:
        with self._lock:
            self._released = True
            for query, peer in self._held:
                self._sock.sendto(_refused_answer(query), peer)
            self._held.clear()

    def close(self) -> None:
        self._closed.set()
        self._reader.join()
        self._sock.close()


@dataclass
class _Two:
    """Two sandboxes' egress paths on one service, its thread in the test's namespaces."""

    service: EgressService
    dns: _SilentDns
    server: _Server
    a_port: int  # A's forwarder, on the host's loopback
    b_port: int

    def lookup_threads(self, sandbox: str) -> int:
        return sum(t.name.startswith(f"egress-lookup-{sandbox}_") for t in threading.enumerate())

    def lookups_running(self, sandbox: str) -> int:
        return self.service._proxy._proxies[sandbox].lookups.running

    def attempts_in_proxy(self, sandbox: str) -> int:
        return len(self.service._proxy._proxies[sandbox].connections)


def _threads_in(namespace: str) -> int:
    count = 0
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            count += os.readlink(f"/proc/self/task/{tid}/ns/net") == namespace
    return count


@contextlib.contextmanager
def _two_sandboxes(tmp: Path) -> Iterator[_Two]:
    if os.geteuid() != 0:
        pytest.skip("needs root: unshare and mount")
    host_files = {name: Path(f"/etc/{name}").read_bytes() for name in ("resolv.conf", "hosts")}
    audit = AuditLog(tmp / "audit.jsonl", redactor=Redactor())
    audit.open()

    def start() -> tuple[EgressService, socket.socket, _Server]:
        dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        dns.bind(("127.0.0.1", 53))  # the namespace's, which its resolv.conf names
        server = _Server()  # on the namespace's loopback, where the proxy connects
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        # No `hosts` mapping: every name goes through glibc. Loopback unblocked: B's server is there.
        service = EgressService(audit, blocked_ranges=OPEN_RANGES, connect_timeout_s=TIMEOUT_S)
        return service, dns, server

    (service, dns_socket, server), namespace = _in_new_namespaces(tmp, start)
    dns = _SilentDns(dns_socket)
    port = server.server_address[1]
    forwarders: list[subprocess.Popen[str]] = []
    try:
        ports = []
        for sandbox, rule, name in ((SANDBOX_A, "*.slow.test:80", "a.sock"), (SANDBOX_B, f"b.test:{port}", "b.sock")):
            service.start(sandbox, parse_allow_rules([rule]), tmp / name)
            forwarder, forwarder_port = start_forwarder(tmp / name)
            forwarders.append(forwarder)
            ports.append(forwarder_port)
        yield _Two(service, dns, server, *ports)
    finally:
        for proc in forwarders:
            stop_process(proc)
        service.close()
        server.shutdown()
        server.server_close()
        dns.release()  # lookups still waiting on it end at once
        wait_for(lambda: _threads_in(namespace) == 0)  # the namespaces, and their mounts, are gone
        dns.close()
        audit.close()
    assert verify(tmp / "audit.jsonl").ok
    assert {name: Path(f"/etc/{name}").read_bytes() for name in host_files} == host_files


def _ask(port: int, request: bytes) -> tuple[str, bytes, float]:
    """The status line, the whole answer and the seconds it took, for one request through a forwarder."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S * 5) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return status_line(answer), answer, time.monotonic() - started


def _connect_a(two: _Two, index: int) -> tuple[str, bytes, float]:
    return _ask(two.a_port, f"CONNECT h{index}.slow.test:80 HTTP/1.1\r\nHost: h{index}.slow.test:80\r\n\r\n".encode())


def _get_b(two: _Two) -> tuple[str, bytes, float]:
    port = two.server.server_address[1]
    return _ask(two.b_port, f"GET http://b.test:{port}/probe HTTP/1.1\r\nHost: b.test\r\n\r\n".encode())


def test_sandbox_flooding_slow_dns_names_cannot_starve_another_sandboxs_lookups(tmp_path: Path) -> None:
    """Attack: sandbox A, within its attempt rate, asks at once for many of its own allowed names whose DNS
    server never answers. Its lookups held every thread of the loop's shared executor (a timeout gives up the
    wait, not the thread), and sandbox B's name, answered from /etc/hosts, queued behind them until B got 504.

    Invariant: B is served at once while A's lookups hang; A has at most 8 lookups in progress (8 names reach
    the DNS server, 8 threads), each holding its slot past its timeout until its thread returns, and A's
    further attempts are refused 503 naming the cap; once the resolver returns, the slots and threads are
    A's again. Not proven here: the same from inside real sandboxes (clients stand in, through the real
    forwarder), nor anything about the threads of a proxy stopped while its lookups hang (they end with glibc)."""
    with _two_sandboxes(tmp_path) as two, concurrent.futures.ThreadPoolExecutor(FLOOD) as clients:
        flood = [clients.submit(_connect_a, two, i) for i in range(FLOOD)]
        wait_for(lambda: two.attempts_in_proxy(SANDBOX_A) == FLOOD and bool(two.dns.asked(".slow.test")))

        b_status, b_answer, b_seconds = _get_b(two)
        assert b_status == "HTTP/1.1 200 OK", b_answer
        assert b"\r\n\r\nhello /probe host=b.test:" in b_answer, b_answer
        assert b_seconds < TIMEOUT_S, b_seconds

        wait_for(lambda: len(two.dns.asked(".slow.test")) == LOOKUPS and two.lookup_threads(SANDBOX_A) == LOOKUPS)
        answers = sorted((status, answer) for status, answer, _ in (f.result() for f in flood))
        assert [status.split(" ")[1] for status, _ in answers] == ["503"] * (FLOOD - LOOKUPS) + ["504"] * LOOKUPS
        for status, _ in answers[: FLOOD - LOOKUPS]:
            assert f"for one of this sandbox's {LOOKUPS} name lookups in progress to end" in status, status
        for status, _ in answers[FLOOD - LOOKUPS :]:
            assert f"took longer than {TIMEOUT_S:g} s" in status, status
        # Every attempt has ended; the lookups have not, and hold their slots: no ninth name was asked.
        assert (two.lookups_running(SANDBOX_A), two.lookup_threads(SANDBOX_A)) == (LOOKUPS, LOOKUPS)
        assert len(two.dns.asked(".slow.test")) == LOOKUPS
        assert _get_b(two)[0] == "HTTP/1.1 200 OK"

        two.dns.release()
        wait_for(lambda: two.lookups_running(SANDBOX_A) == 0 and two.lookup_threads(SANDBOX_A) == 0)
        a_status, _, a_seconds = _connect_a(two, FLOOD)  # a slot at once; the name itself is refused
        assert a_status.startswith("HTTP/1.1 502 Bad Gateway: h20.slow.test cannot be resolved"), a_status
        assert a_seconds < TIMEOUT_S, a_seconds
        assert _get_b(two)[0] == "HTTP/1.1 200 OK"
    records = [r for r in _records(tmp_path) if r.get("event") == "egress"]
    assert sorted(str(r["decision"]) for r in records if r["sandbox"] == SANDBOX_B) == ["allow"] * 3
    assert [r["decision"] for r in records if r["sandbox"] == SANDBOX_A] == ["error"] * (FLOOD + 1)


def _records(tmp: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (tmp / "audit.jsonl").read_text().splitlines()]


def test_closing_and_making_sandboxes_whose_lookups_hang_cannot_grow_the_servers_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a sandbox's lookups outlive its proxy (glibc cannot be interrupted), and each new
    proxy had 8 fresh slots, so closing and making sandboxes whose lookups hang added 8 stuck threads each
    time, against the server's task limit. Lookups in the resolver are counted for the whole process (here
    capped at 12): past it, an attempt is refused 503 naming the reason, and no thread is made."""
    cap = 12
    monkeypatch.setattr(_throttle, "MAX_IN_RESOLVER", cap)
    with _two_sandboxes(tmp_path) as two, concurrent.futures.ThreadPoolExecutor(LOOKUPS) as clients:
        flood = [clients.submit(_connect_a, two, i) for i in range(LOOKUPS)]
        wait_for(lambda: two.lookups_running(SANDBOX_A) == LOOKUPS)
        two.service.stop(SANDBOX_A)  # its 8 lookups go on in the resolver
        [f.result() for f in flood]
        again = tmp_path / "a2.sock"
        two.service.start(SANDBOX_A, parse_allow_rules(["*.slow.test:80"]), again)
        forwarder, port = start_forwarder(again)
        try:
            second = [clients.submit(_ask_a, port, i) for i in range(LOOKUPS)]
            statuses = sorted(f.result()[0] for f in second)
            lookup_threads = sum(t.name.startswith("egress-lookup-") for t in threading.enumerate())
            assert _throttle._in_resolver == cap
            assert lookup_threads <= cap, lookup_threads
            full = [s for s in statuses if "name lookups of all sandboxes are still waiting" in s]
            assert len(full) == 2 * LOOKUPS - cap, statuses
            assert all(s.startswith("HTTP/1.1 503") for s in full), statuses
            # B too, while the resolver is full: the price of bounding the server's threads (SECURITY.md).
            assert _get_b(two)[0].startswith("HTTP/1.1 503"), "B is refused while the resolver is full"
            two.dns.release()
            wait_for(lambda: _throttle._in_resolver == 0)
            assert _ask_a(port, LOOKUPS)[0].startswith("HTTP/1.1 502 Bad Gateway"), "a slot again"
            assert _get_b(two)[0] == "HTTP/1.1 200 OK"
        finally:
            stop_process(forwarder)


def _ask_a(port: int, index: int) -> tuple[str, bytes, float]:
    return _ask(port, f"CONNECT h{index}.slow.test:80 HTTP/1.1\r\nHost: h{index}.slow.test:80\r\n\r\n".encode())


def test_a_proxy_stopped_while_its_lookups_start_gives_back_every_count() -> None:
    """Found by review: lookups ran on a pool that queued the work before starting a thread, and stopping a
    proxy cancelled queued work, so its count of lookups in the resolver was never given back (65 of 200
    stops); a thread that could not start gave it back twice. Each lookup now has a thread of its own:
    stopped however early, every count comes back, and no thread is left."""

    async def churn() -> None:
        for round_ in range(200):
            lookups = _throttle.NameLookups(8, f"test-churn-{round_}")
            deadline = asyncio.get_running_loop().time() + 10
            tasks = [asyncio.ensure_future(lookups.getaddrinfo("localhost", 80, deadline)) for _ in range(4)]
            await asyncio.sleep(0)  # the lookups take their slots and start their threads
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            lookups.close()

    asyncio.run(churn())
    wait_for(lambda: _throttle._in_resolver == 0)
    wait_for(lambda: not any(t.name.startswith("test-churn-") for t in threading.enumerate()))

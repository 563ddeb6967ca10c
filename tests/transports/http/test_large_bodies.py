"""Large request bodies at /mcp held at once, against a live `bastion serve --http` (found by attack).

One client (auth off: one grant, as any approved client is) opened 150 connections, each sending a 4 MiB
tools/call body but its last byte: the server read and held every body, 615 MiB (1,024 connections: over
4 GiB, in the cgroup the sandboxes share). What holds now: large bodies are read only while they fit
`[http] max_request_bodies_mib` (one grant: half of it); the rest wait their turn, unread, then get 503
with Retry-After; small requests are served all along; a body that was let in is answered, its call run.
"""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from bastion.transports.http.bodies import BodyBudget

from .live import LiveServer, live_server
from .test_unread_answers import server_session

CONNECTIONS = 24
BODY_BYTES = 4 * 1024 * 1024 - 512
LIMIT_MIB = 8
WAIT_S = 3


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) // 1024


@contextlib.contextmanager
def peak_rss(pid: int) -> Iterator[list[int]]:
    """The server's largest RSS (MiB) while the block runs, sampled on a thread: `[peak]` after it."""
    peak = [rss_mib(pid)]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], rss_mib(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()


@contextlib.contextmanager
def bodies_but_the_last_byte(
    server: LiveServer, headers: dict[str, str]
) -> Iterator[list[tuple[socket.socket, bytes]]]:
    """`CONNECTIONS` write_file calls of about 4 MiB each, all at once (a thread each: a body the server does
    not read blocks its sender), every one sent but its last byte (kept to send)."""
    opened: list[tuple[socket.socket, bytes]] = []
    senders: list[threading.Thread] = []

    def send(sock: socket.socket, data: bytes) -> None:
        with contextlib.suppress(OSError):  # refused (503) and closed before the body was all sent
            sock.sendall(data)

    try:
        for n in range(CONNECTIONS):
            call = {
                "jsonrpc": "2.0",
                "id": n + 1,
                "method": "tools/call",
                "params": {"name": "write_file", "arguments": {"path": f"big-{n}.txt", "content": "x" * BODY_BYTES}},
            }
            body = json.dumps(call).encode()
            head = f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Length: {len(body)}\r\n"
            head += "".join(f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n"
            sock = socket.create_connection(("127.0.0.1", server.port))
            opened.append((sock, body[-1:]))
            senders.append(threading.Thread(target=send, args=(sock, head.encode() + body[:-1]), daemon=True))
            senders[-1].start()
        yield opened
    finally:
        for sock, _ in opened:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a sender still blocked in sendall
            sock.close()
        for sender in senders:
            sender.join()


def answers_until(calls: list[tuple[socket.socket, bytes]], count: int, within_s: float) -> dict[socket.socket, bytes]:
    """What the server sent on each connection, read until `count` of them have a whole answer (or closed)."""
    received = {sock: b"" for sock, _ in calls}
    done: set[socket.socket] = set()
    deadline = time.monotonic() + within_s
    with selectors.DefaultSelector() as selector:
        for sock in received:
            selector.register(sock, selectors.EVENT_READ)
        while len(done) < count and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.2):
                ready = key.fileobj
                assert isinstance(ready, socket.socket)
                try:
                    chunk = ready.recv(65536)
                except OSError:
                    chunk = b""
                received[ready] += chunk
                if not chunk or b"server_busy" in received[ready]:
                    done.add(ready)
                    selector.unregister(ready)
    return received


def answer_of(sock: socket.socket, within_s: float) -> bytes:
    """What the server sent on `sock` until it closed it or `within_s` passed."""
    sock.settimeout(within_s)
    received = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
            if b"\r\n0\r\n\r\n" in received or b"server_busy" in received:
                break
    return received


def test_large_bodies_past_the_budget_wait_unread_then_get_503(tmp_path: Path) -> None:
    extra = f"max_request_bodies_mib = {LIMIT_MIB}\nrequest_body_timeout_s = {WAIT_S}"
    with live_server(tmp_path, http_extra=extra, auth=False) as server:
        headers = server_session(server)
        idle = rss_mib(server.process.pid)
        with peak_rss(server.process.pid) as peak, bodies_but_the_last_byte(server, headers) as calls:
            # Small calls are served while the large ones wait.
            with server.http() as http:
                listed = {"jsonrpc": "2.0", "id": 99, "method": "tools/list", "params": {}}
                assert http.post("/mcp", json=listed, headers=headers).status_code == 200
            # One grant holds half the budget: one body of 4 MiB is read, the others wait and are refused.
            answers = answers_until(calls, CONNECTIONS - 1, within_s=WAIT_S + 30)
            busy = [sock for sock, answer in answers.items() if answer.startswith(b"HTTP/1.1 503")]
            assert len(busy) == CONNECTIONS - 1, [a[:80] for a in answers.values()]
            assert all(b"retry-after: 1" in answers[sock].lower() and b"server_busy" in answers[sock] for sock in busy)
            ((first, last_byte),) = [(sock, last) for sock, last in calls if sock not in busy]
            first.sendall(last_byte)
            assert b'"ok\\":true' in answer_of(first, 30).replace(b" ", b"")
        # The waiting bodies were never read into the server (615 MiB for 150 of them before).
        assert peak[0] - idle < 40, f"the server grew by {peak[0] - idle} MiB"
        assert (tmp_path / "workspace" / "big-0.txt").stat().st_size == BODY_BYTES
        log = server.log()
        assert "Traceback" not in log


def test_a_body_let_in_is_given_back_when_answered(tmp_path: Path) -> None:
    """Large calls one after another, each under the budget, are all served: what one held is given back."""
    with live_server(tmp_path, http_extra=f"max_request_bodies_mib = {LIMIT_MIB}", auth=False) as server:
        headers = server_session(server)
        with server.http() as http:
            for n in range(6):
                call = {
                    "jsonrpc": "2.0",
                    "id": n + 1,
                    "method": "tools/call",
                    "params": {"name": "write_file", "arguments": {"path": f"n{n}.txt", "content": "y" * BODY_BYTES}},
                }
                answer = http.post("/mcp", json=call, headers=headers)
                assert answer.status_code == 200, answer.text[:300]
        assert all((tmp_path / "workspace" / f"n{n}.txt").stat().st_size == BODY_BYTES for n in range(6))


def test_a_body_cut_by_a_disconnect_is_never_run(tmp_path: Path) -> None:
    """Attack (found by review): a client declares a write_file body of 200 kB, sends half and goes away. The
    half was run as the whole request (the file written with what had come, an audit `end` record "OK").
    Now a body cut short runs nothing."""
    with live_server(tmp_path, auth=False) as server:
        headers = server_session(server)
        call = {
            "jsonrpc": "2.0",
            "id": 7,
            "method": "tools/call",
            "params": {"name": "write_file", "arguments": {"path": "cut.txt", "content": "z" * 100}},
        }
        body = json.dumps(call).encode() + b" " * 200_000  # JSON may end in spaces: the cut falls in them
        head = f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Length: {len(body)}\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n"
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head.encode() + body[: len(body) // 2])
        deadline = time.monotonic() + 30
        while "POST /mcp 0 " not in server.log():  # the access line of the request whose client left
            assert time.monotonic() < deadline, "the cut request never ended"
            time.sleep(0.05)
        assert not (tmp_path / "workspace" / "cut.txt").exists()
        audit = (tmp_path / "state" / "audit.jsonl").read_text()
        assert '"write_file"' not in audit


@pytest.mark.anyio
async def test_a_large_body_waits_its_turn_before_smaller_ones_that_came_later() -> None:
    """Found by review: every waiter was woken at once and took room as it came, so smaller bodies from other
    clients passed a large one again and again until it got 503. Now the first that waits for the whole
    budget keeps its turn; one that only its own grant's half holds back does not hold back the others."""
    mib = 1 << 20
    budget = BodyBudget(8 * mib, wait_s=30)
    assert await budget.take("a", 4 * mib)
    assert await budget.take("c", 2 * mib)
    order: list[str] = []

    async def waits(grant: str, size: int) -> None:
        assert await budget.take(grant, size)
        order.append(grant)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(waits, "b", 4 * mib)  # needs the whole budget to have room: waits first
        await anyio.wait_all_tasks_blocked()
        tasks.start_soon(waits, "d", 2 * mib)  # would fit now, but b came first
        await anyio.wait_all_tasks_blocked()
        assert order == []
        budget.give("c", 2 * mib)  # room for b (4 + 4), not for both
        await anyio.wait_all_tasks_blocked()
        assert order == ["b"]
        budget.give("a", 4 * mib)
    assert order == ["b", "d"]
    assert budget.used == 8 * mib - 2 * mib  # b and d hold theirs: what was given came back


@pytest.mark.anyio
async def test_a_grant_at_its_half_does_not_hold_back_another() -> None:
    mib = 1 << 20
    budget = BodyBudget(8 * mib, wait_s=30)
    assert await budget.take("a", 4 * mib)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(budget.take, "a", 1 * mib)  # a is at its half: waits
        await anyio.wait_all_tasks_blocked()
        assert await budget.take("b", 4 * mib)  # not held back by a's waiter
        budget.give("a", 4 * mib)
        budget.give("b", 4 * mib)
    assert budget.used == 1 * mib

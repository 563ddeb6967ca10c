"""`bastion serve` speaks systemd's readiness protocol (sd_notify(3)) to a real unix datagram socket.

What this proves: a real `bastion serve` subprocess, with $NOTIFY_SOCKET naming a socket this test
bound (a path, or an abstract `@name`), sends READY=1 only once it answers (the first request after
the datagram succeeds, no retry), then STOPPING=1 when stopped (stdin closed, or SIGTERM), and exits
0; the variable leaves the environment when read, so no command bastion starts can speak for the
service; a socket that is gone or an address that is not a unix one costs a warning, never the
server. What it does not prove: systemd's own handling (no systemd runs as PID 1 here).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from bastion.systemd.notify import NOTIFY_SOCKET_ENV, Notifier, notify_address
from tests.helpers import BASTION, INITIALIZE_REQUEST, write_cheap_hash
from tests.transports.http.live import free_port, write_config

DEADLINE_S = 60


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket, as systemd makes one, and the $NOTIFY_SOCKET value naming it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        path = tmp_path / "notify.sock"
        sock.bind(str(path))
        sock.settimeout(DEADLINE_S)  # every wait below is bounded by this deadline
        yield sock, str(path)


def receive(sock: socket.socket) -> dict[str, str]:
    fields = sock.recv(4096).decode().split("\n")
    return dict(field.split("=", 1) for field in fields)


@contextlib.contextmanager
def serve(config: Path, transport: str, notify: str) -> Iterator[subprocess.Popen[bytes]]:
    """`bastion serve` with $NOTIFY_SOCKET set; its stderr in the config's folder; killed if still running."""
    env = {**os.environ, NOTIFY_SOCKET_ENV: notify}
    argv = [str(BASTION), "serve", "--config", str(config), transport]
    with (
        (config.parent / "stderr.log").open("wb") as stderr,
        subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr) as process,
    ):
        try:
            yield process
        finally:
            process.kill()
            process.wait()


def set_password(config: Path) -> None:
    path = config.parent / "state" / "admin-password.argon2"
    write_cheap_hash(path, "a long enough password")


def test_stdio_server_notifies_ready_then_stopping(tmp_path: Path, notify_socket: tuple[socket.socket, str]) -> None:
    sock, address = notify_socket
    config = write_config(tmp_path / "demo", free_port())
    with serve(config, "--stdio", address) as process:
        ready = receive(sock)
        assert ready["READY"] == "1"
        assert ready["STATUS"] == f"serving MCP over stdio from {config}"
        assert process.stdin is not None
        assert process.stdout is not None
        process.stdin.write(json.dumps(INITIALIZE_REQUEST).encode() + b"\n")
        process.stdin.flush()
        assert json.loads(process.stdout.readline())["id"] == 1
        process.stdin.close()  # the client goes away: the server stops
        assert receive(sock)["STOPPING"] == "1"
        assert process.wait(DEADLINE_S) == 0


def test_http_server_notifies_ready_only_once_it_answers(tmp_path: Path) -> None:
    """An abstract address (`@name`), which sd_notify(3) accepts besides a path."""
    port = free_port()
    config = write_config(tmp_path / "demo", port)
    set_password(config)
    name = f"bastion-test-notify-{secrets.token_hex(8)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(DEADLINE_S)
        with serve(config, "--http", "@" + name) as process:
            ready = receive(sock)
            assert ready["READY"] == "1"
            assert ready["STATUS"] == f"serving MCP over HTTP on 127.0.0.1:{port}"
            # No retry: READY=1 means the listener answers now.
            response = httpx2.get(f"http://127.0.0.1:{port}/.well-known/oauth-protected-resource/mcp", timeout=10)
            assert response.status_code == 200
            process.send_signal(signal.SIGTERM)
            stopping = receive(sock)
            assert stopping["STOPPING"] == "1"
            assert process.wait(DEADLINE_S) == 0


def test_http_server_that_cannot_start_never_says_ready(
    tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    """A port in use: exit 1 with one line, and no READY=1 (systemd then reports the start as failed)."""
    sock, address = notify_socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = write_config(tmp_path / "demo", taken.getsockname()[1])
        set_password(config)
        with serve(config, "--http", address) as process:
            assert process.wait(DEADLINE_S) == 1
    assert "cannot listen on" in (config.parent / "stderr.log").read_text()
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(4096)


def test_notify_socket_leaves_the_environment_when_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process bastion starts afterwards (a host workspace's command, ssh for the gateway)
    inherits os.environ: it must not find the socket to send READY=1 or MAINPID= for the service."""
    monkeypatch.setenv(NOTIFY_SOCKET_ENV, "/run/systemd/notify")
    notifier = Notifier.from_environment()
    assert notifier.active
    assert NOTIFY_SOCKET_ENV not in os.environ
    child = subprocess.run(["env"], capture_output=True, text=True, check=True)
    assert NOTIFY_SOCKET_ENV not in child.stdout


def test_notify_addresses() -> None:
    assert notify_address("/run/systemd/notify") == "/run/systemd/notify"
    assert notify_address("@abstract") == "\0abstract"
    assert notify_address("@") is None
    assert notify_address("vsock:2:1234") is None
    assert notify_address("relative/path") is None


def test_unreachable_notify_socket_costs_a_warning_not_the_server(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING)
    Notifier(str(tmp_path / "gone.sock")).ready("serving")
    assert "cannot notify systemd (READY=1)" in caplog.text
    monkeypatch.setenv(NOTIFY_SOCKET_ENV, "vsock:2:1234")
    notifier = Notifier.from_environment()
    assert not notifier.active
    notifier.ready("serving")  # nothing to send to, nothing raised
    assert "is not a unix socket address" in caplog.text


def test_each_state_is_sent_once(notify_socket: tuple[socket.socket, str]) -> None:
    sock, address = notify_socket
    notifier = Notifier(address)
    notifier.stopping()
    notifier.stopping()  # uvicorn's shutdown and serve_http's `finally` both say it
    assert receive(sock)["STOPPING"] == "1"
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(4096)

"""A loopback server holds every loopback name a client may use for it.

What this proves, with the real command: `bastion serve --http` on 127.0.0.1:P also listens on [::1]:P
(where `localhost` may resolve), answering there as the same server; and when another process holds
[::1]:P first (a local user posing as bastion's login page to take the password and bearer tokens), the
start is refused with one line naming the address, and nothing is left listening. What it does not
prove: a host without IPv6, where nobody can bind ::1 (the twin is skipped; `loopback_twins` below).
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import httpx2
import pytest

from bastion.serve import loopback_twins
from bastion.transports.http.password import write_hash

from .live import PASSWORD, free_port, refused_start, serve_config, write_config


def has_ipv6_loopback() -> bool:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError as exc:
            if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                return False
            raise
    return True


pytestmark = pytest.mark.skipif(not has_ipv6_loopback(), reason="this machine has no ::1")


def config_at(root: Path) -> tuple[Path, int]:
    port = free_port()
    config = write_config(root, port)
    write_hash(root / "state" / "admin-password.argon2", PASSWORD)
    return config, port


def test_a_neighbour_holding_the_ipv6_loopback_port_stops_the_start(tmp_path: Path) -> None:
    """The attack: another local user binds [::1]:P before bastion serves 127.0.0.1:P, and answers the
    administrator's browser and MCP clients that reach `http://[::1]:P` or `http://localhost:P` (which the
    README calls the same server). Before, bastion started anyway and never noticed. Invariant: the start is
    refused, one line names [::1]:P and what to do, and nothing of bastion's listens on 127.0.0.1:P."""
    config, port = config_at(tmp_path / "demo")
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as squatter:
        squatter.bind(("::1", port))
        squatter.listen(1)
        result = refused_start(config)
        assert result.returncode != 0, result.stderr
        lines = [line for line in result.stderr.splitlines() if f"[::1]:{port}" in line]
        assert len(lines) == 1, result.stderr
        assert "another process there could pose as it" in lines[0]
        assert "Traceback" not in result.stderr
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_a_loopback_server_answers_as_itself_on_every_loopback_name(tmp_path: Path) -> None:
    """Invariant: a server on 127.0.0.1:P answers at [::1]:P too, the same server (its protected-resource
    metadata names the URL asked for, an alias of the same `public_url`), so no other process can take it."""
    config, port = config_at(tmp_path / "demo")
    with serve_config(tmp_path / "demo", config, port):
        for host in ("127.0.0.1", "[::1]"):
            answer = httpx2.get(f"http://{host}:{port}/.well-known/oauth-protected-resource/mcp", timeout=10)
            assert answer.status_code == 200, (host, answer.text)
            assert answer.json()["resource"] == f"http://{host}:{port}/mcp"
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as squatter:
            with pytest.raises(OSError, match="in use") as taken:
                squatter.bind(("::1", port))
            assert taken.value.errno == errno.EADDRINUSE


def test_loopback_twins_are_only_for_a_loopback_listen() -> None:
    """A non-loopback or wildcard listen gets no twin; a twin that exists is closed by its caller."""
    assert loopback_twins("192.0.2.10", free_port(), 8) == []
    assert loopback_twins("0.0.0.0", free_port(), 8) == []
    port = free_port()
    twins = loopback_twins("127.0.0.1", port, 8)
    try:
        assert [sock.getsockname()[:2] for sock in twins] == [("::1", port)]
    finally:
        for sock in twins:
            sock.close()

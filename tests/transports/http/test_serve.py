"""`bastion serve --http` start-up, built-in TLS, and the `bastion admin` commands.

What this proves: the server refuses to start without an admin password, with auth off on a
non-loopback address, or with half a TLS pair; `--listen` overrides the config; with a certificate and
key it serves https (the issuer and resource then being https too); `admin set-password` reads stdin,
stores only an argon2id hash, and `--generate --if-unset` prints a password once; `make run`'s sequence
prints a password that logs in, then the MCP URL and how to connect Claude Code, Claude Desktop and the
Inspector; `admin clients`, `tokens` and `revoke` list and revoke what the live server issued; a code
lifetime outside 60-120 s is refused. Test keys are made at test time.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import subprocess
import time
from pathlib import Path

import httpx2
import pytest

from bastion.cli import main
from bastion.config import HttpConfig
from bastion.serve import listen_socket
from tests.helpers import mounts_under, passable_folder, write_cheap_hash

from .live import BASTION, Browser, free_port, get_tokens, live_server, pkce, serve_config, write_config
from .tls import self_signed


def bastion(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BASTION), *args], input=stdin, capture_output=True, text=True, timeout=60, check=False)


def set_password(config: Path) -> None:
    path = config.parent / "state" / "admin-password.argon2"
    write_cheap_hash(path, "a long enough password")


def test_serve_refuses_without_a_password(tmp_path: Path) -> None:
    config = write_config(tmp_path / "demo", free_port())
    result = bastion("serve", "--config", str(config), "--http")
    assert result.returncode == 78
    assert "admin set-password" in result.stderr


def test_serve_refuses_auth_off_on_a_public_address(tmp_path: Path) -> None:
    config = write_config(tmp_path / "demo", free_port(), auth=False)
    result = bastion("serve", "--config", str(config), "--http", "--listen", "0.0.0.0:9")
    assert result.returncode == 78
    assert "auth = false" in result.stderr


def test_serve_refuses_half_a_tls_pair(tmp_path: Path) -> None:
    config = write_config(tmp_path / "demo", free_port(), http_extra='tls_cert = "cert.pem"')
    set_password(config)
    result = bastion("serve", "--config", str(config), "--http")
    assert result.returncode == 78
    assert "tls_cert and tls_key" in result.stderr


def test_serve_needs_exactly_one_transport(tmp_path: Path) -> None:
    config = write_config(tmp_path / "demo", free_port())
    assert bastion("serve", "--config", str(config)).returncode == 2
    assert bastion("serve", "--config", str(config), "--stdio", "--http").returncode == 2


def test_plain_http_public_url_must_be_loopback(tmp_path: Path) -> None:
    config = write_config(tmp_path / "demo", free_port())
    config.write_text(
        config.read_text().replace('public_url = "http://127.0.0.1:', 'public_url = "http://bastion.example:')
    )
    result = bastion("admin", "tokens", "--config", str(config))
    assert result.returncode == 78
    assert "use https" in result.stderr


def test_trusted_proxies_must_be_addresses_and_trust_none_by_default(tmp_path: Path) -> None:
    """`*` (believe anyone) or a host name is refused at load with one line naming the entry."""
    for entry in ("*", "proxy.example"):
        config = write_config(tmp_path / f"demo-{len(entry)}", free_port(), http_extra=f'trusted_proxies = ["{entry}"]')
        result = bastion("admin", "tokens", "--config", str(config))
        assert result.returncode == 78
        assert f"trusted_proxies entry {entry!r}" in result.stderr
    assert HttpConfig().trusted_proxies == ()


def test_builtin_tls(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    cert, key = self_signed(tmp_path)
    port = free_port()
    config = write_config(tmp_path / "demo", port, http_extra=f'tls_cert = "{cert}"\ntls_key = "{key}"')
    config.write_text(
        config.read_text().replace(
            f'public_url = "http://127.0.0.1:{port}"', f'public_url = "https://127.0.0.1:{port}"'
        )
    )
    set_password(config)
    process = subprocess.Popen([str(BASTION), "serve", "--config", str(config), "--http"], stderr=subprocess.PIPE)
    try:
        context = ssl.create_default_context(cafile=str(cert))
        with httpx2.Client(verify=context, timeout=5) as client:
            for _ in range(300):
                try:
                    response = client.get(f"https://127.0.0.1:{port}/.well-known/oauth-protected-resource/mcp")
                    break
                except httpx2.TransportError:
                    if process.poll() is not None:
                        raise
                    time.sleep(0.05)
            assert response.status_code == 200
            assert response.json()["resource"] == f"https://127.0.0.1:{port}/mcp"
            meta = client.get(f"https://127.0.0.1:{port}/.well-known/oauth-authorization-server").json()
            assert meta["issuer"] == f"https://127.0.0.1:{port}"
        with httpx2.Client(timeout=5) as plain:
            try:
                plain.get(f"http://127.0.0.1:{port}/mcp")
                raise AssertionError("plain http must not be served on the TLS port")
            except httpx2.TransportError:
                pass
    finally:
        process.terminate()
        status = process.wait(10)
        assert process.stderr is not None
        process.stderr.close()
    assert status == 0
    assert mounts_under(tmp_path) == []


def test_serve_refuses_a_tls_key_others_may_read(tmp_path: Path) -> None:
    """Anyone who may read the TLS key can pose as the server and read the password on its way in."""
    tmp_path.mkdir(exist_ok=True)
    with passable_folder() as keys:
        cert, key = self_signed(keys)
        os.chmod(key, 0o644)
        config = write_config(tmp_path / "demo", free_port(), http_extra=f'tls_cert = "{cert}"\ntls_key = "{key}"')
        set_password(config)
        result = bastion("serve", "--config", str(config), "--http")
        doctor = bastion("doctor", "--config", str(config))
    assert result.returncode == 78, result.stderr
    assert f"[http] tls_key {key} is not the server's alone" in result.stderr
    assert "any user: they may read" in result.stderr
    assert "Traceback" not in result.stderr
    assert "http-tls" in doctor.stdout
    assert "not the server's alone" in doctor.stdout


def test_set_password_stores_a_hash_and_generate_prints_once(tmp_path: Path) -> None:
    config = write_config(tmp_path / "demo", free_port())
    hash_path = tmp_path / "demo" / "state" / "admin-password.argon2"
    short = bastion("admin", "set-password", "--config", str(config), stdin="short\n")
    assert short.returncode == 78
    assert not hash_path.exists()
    generated = bastion("admin", "set-password", "--config", str(config), "--generate", "--if-unset")
    assert generated.returncode == 0
    password = generated.stdout.strip()
    assert len(password) >= 16
    assert hash_path.read_text().startswith("$argon2id$")
    assert password not in hash_path.read_text()
    assert oct(hash_path.stat().st_mode & 0o777) == "0o600"
    again = bastion("admin", "set-password", "--config", str(config), "--generate", "--if-unset")
    assert again.returncode == 0
    assert again.stdout == ""  # already set: nothing printed, nothing changed


def test_admin_clients_tokens_revoke(tmp_path: Path) -> None:
    with live_server(tmp_path / "demo") as server, server.http() as raw:
        client_id = server.register(client_name="listed client")["client_id"]
        tokens = get_tokens(server, client_id)
        config = str(server.config_path)
        clients = bastion("admin", "clients", "--config", config)
        assert client_id in clients.stdout
        assert "listed client" in clients.stdout
        listed = bastion("admin", "tokens", "--config", config)
        grant_id = listed.stdout.split()[0]
        assert client_id in listed.stdout
        assert tokens["access_token"] not in listed.stdout + clients.stdout
        revoked = bastion("admin", "revoke", "--config", config, grant_id)
        assert revoked.stdout.strip() == "revoked 1 grant(s)"
        headers = {"Authorization": f"Bearer {tokens['access_token']}"}
        assert raw.post("/mcp", json={}, headers=headers).status_code == 401
        assert bastion("admin", "tokens", "--config", config).stdout.strip() == "no active grants"
        unknown = bastion("admin", "revoke", "--config", config, "nope")
        assert unknown.returncode == 1  # not found


def test_listen_overrides_the_config_and_moves_a_loopback_public_url(tmp_path: Path) -> None:
    """`serve --listen 127.0.0.1:OTHER` with `public_url = http://127.0.0.1:PORT`: the server announces
    and accepts the port it listens on (the old port's Host is another server's: 421), and says so."""
    port = free_port()
    config = write_config(tmp_path / "demo", port)
    set_password(config)
    other = free_port()
    process = subprocess.Popen(
        [str(BASTION), "serve", "--config", str(config), "--http", "--listen", f"127.0.0.1:{other}"],
        stderr=subprocess.PIPE,
    )
    try:
        metadata = f"http://127.0.0.1:{other}/.well-known/oauth-protected-resource"
        with httpx2.Client(timeout=5) as client:
            for _ in range(300):
                try:
                    response = client.get(metadata)
                    break
                except httpx2.TransportError:
                    if process.poll() is not None:
                        raise
                    time.sleep(0.05)
            assert response.status_code == 200
            assert response.json()["resource"] == f"http://127.0.0.1:{other}/mcp"
            assert response.json()["authorization_servers"] == [f"http://127.0.0.1:{other}"]
            stale = client.get(metadata, headers={"Host": f"127.0.0.1:{port}"})
            assert stale.status_code == 421
    finally:
        process.terminate()
        status = process.wait(10)
        assert process.stderr is not None
        said = process.stderr.read().decode()
        process.stderr.close()
    assert f"public_url follows --listen: http://127.0.0.1:{other}" in said
    assert f"MCP URL: http://127.0.0.1:{other}/mcp" in said
    # A clean stop (uvicorn re-raised SIGTERM, which ended the process before the services closed).
    assert status == 0
    assert mounts_under(tmp_path) == []


def test_make_run_sequence_prints_the_password_once_and_how_to_connect(tmp_path: Path) -> None:
    """`make run`: a password generated if unset (printed once, hash kept), then serve, saying how to connect."""
    root = tmp_path / "demo"
    port = free_port()
    config = write_config(root, port)
    generated = bastion("admin", "set-password", "--config", str(config), "--generate", "--if-unset")
    assert generated.returncode == 0, generated.stderr
    password = generated.stdout.strip()
    assert "shown once" in generated.stderr
    assert password not in (root / "state" / "admin-password.argon2").read_text()
    with serve_config(root, config, port) as server:
        mcp_url = f"http://127.0.0.1:{port}/mcp"
        log = server.log()
        assert f"MCP URL: {mcp_url}" in log
        assert f"claude mcp add --transport http bastion {mcp_url}" in log  # Claude Code
        assert "Claude Desktop: Settings > Connectors" in log
        assert "@modelcontextprotocol/inspector" in log
        assert password not in log
        # The printed password is the administrator's: it logs in and approves a client.
        browser = Browser(server)
        try:
            client_id = server.register()["client_id"]
            location = browser.approve(browser.authorize_url(client_id, pkce()[1]), password=password)
        finally:
            browser.close()
        assert "code=" in location
    again = bastion("admin", "set-password", "--config", str(config), "--generate", "--if-unset")
    assert again.returncode == 0
    assert again.stdout == ""  # second run: nothing printed, the password unchanged


def test_code_lifetime_is_bounded_to_60_120_s(tmp_path: Path) -> None:
    for value, ok in (("59", False), ("60", True), ("120", True), ("121", False)):
        config = write_config(tmp_path / f"demo{value}", free_port(), http_extra=f"code_lifetime_s = {value}")
        result = bastion("admin", "tokens", "--config", str(config))
        assert (result.returncode == 0) is ok, (value, result.stderr)


def test_listen_with_an_invalid_port_or_address_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--listen localhost:99999` used to bind a random port; a port outside 1-65535, no port, or a
    non-loopback address for a loopback public_url is refused with one line saying what to do.

    The first case runs the real command; the others run the same CLI (`main`) in this process, where a
    refusal costs no interpreter start (about 1 s of CPU each). A start that got past its checks there
    fails the test at `build_services` instead of serving; an exception (a traceback) fails it too."""
    config = write_config(tmp_path / "demo", free_port())
    set_password(config)
    cases = [
        ("localhost:99999", "port from 1 to 65535"),
        ("127.0.0.1:0", "port from 1 to 65535"),
        ("localhost", "HOST:PORT"),
        (":8765", "HOST:PORT"),
        ("192.0.2.10:8765", "set [http] public_url"),
        # Found by attack: `str.isdigit` passed both, then int() raised (a traceback), or took the
        # Arabic-Indic digits, bound port 19002 and crashed when the URL was built.
        ("127.0.0.1:\u00b2", "port from 1 to 65535"),
        ("127.0.0.1:\u0661\u0669\u0660\u0660\u0662", "port from 1 to 65535"),
    ]
    listen, says = cases[0]
    result = bastion("serve", "--config", str(config), "--http", "--listen", listen)
    assert result.returncode == 78, (listen, result.stderr)
    assert says in result.stderr, (listen, result.stderr)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr

    def started(*_args: object) -> None:
        raise AssertionError("serve got past its start-up checks")

    monkeypatch.setattr("bastion.app.build_services", started)
    for listen, says in cases[1:]:
        capsys.readouterr()
        code = main(["serve", "--config", str(config), "--http", "--listen", listen])
        stderr = capsys.readouterr().err
        assert code == 78, (listen, stderr)
        assert says in stderr, (listen, stderr)
        assert len(stderr.strip().splitlines()) == 1, stderr


@pytest.mark.anyio
async def test_the_listener_serves_without_nagle_delays() -> None:
    """Regression: a listener made with proto 0 gave asyncio's transports no TCP_NODELAY, so every small
    response waited ~40 ms for a delayed ACK (a preview request took 44 ms instead of 2.5). Each accepted
    connection of `listen_socket` has Nagle off, as asyncio sets it for sockets that say TCP."""
    listener = listen_socket("127.0.0.1", 0, 8)
    nodelay: list[int] = []

    async def accepted(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nodelay.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(accepted, sock=listener)
    async with server:
        reader, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        await reader.read()
        writer.close()
    assert nodelay == [1]

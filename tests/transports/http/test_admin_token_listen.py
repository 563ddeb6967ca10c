"""`bastion admin token --listen` for a server whose URL `serve --listen` moved (issue 20).

What this proves, with the real CLI beside a real `bastion serve --http --listen 127.0.0.1:OTHER` (its
loopback public_url follows the listen address): a token issued without `--listen` names the config's
URL and is refused there (401: tokens are bound to one resource, RFC 8707), and one issued with the same
`--listen` works for an MCP session; a malformed `--listen` issues nothing. What it does not prove:
non-loopback servers (their public_url never moves).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx2

from bastion.transports.http.password import write_hash
from tests.helpers import INITIALIZE_REQUEST, MCP_HEADERS

from .live import BASTION, PASSWORD, START_TIMEOUT_S, free_port, write_config


def admin(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(BASTION), "admin", *args, "--config", str(config)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False, stdin=subprocess.DEVNULL)


def test_admin_token_for_a_server_moved_by_listen(tmp_path: Path) -> None:
    config = write_config(tmp_path / "demo", free_port())
    write_hash(tmp_path / "demo" / "state" / "admin-password.argon2", PASSWORD)
    other = free_port()
    log = (tmp_path / "server.log").open("wb")
    process = subprocess.Popen(
        [str(BASTION), "serve", "--config", str(config), "--http", "--listen", f"127.0.0.1:{other}"],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{other}"
    try:
        with httpx2.Client(base_url=base, timeout=10) as raw:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                try:
                    raw.get("/.well-known/oauth-protected-resource")
                    break
                except httpx2.TransportError:
                    assert process.poll() is None, (tmp_path / "server.log").read_text()
                    assert time.monotonic() < deadline, "the server did not start"
                    time.sleep(0.05)

            def status(token: str) -> int:
                headers = {**MCP_HEADERS, "Authorization": f"Bearer {token}"}
                return raw.post("/mcp", json=INITIALIZE_REQUEST, headers=headers).status_code

            unmoved = admin(config, "token", "--client", "script", "--scope", "organizer")
            assert unmoved.returncode == 0, unmoved.stderr
            assert f"on http://127.0.0.1:{other}/mcp" not in unmoved.stderr
            assert status(unmoved.stdout.strip()) == 401

            moved = admin(
                config, "token", "--client", "script", "--scope", "organizer", "--listen", f"127.0.0.1:{other}"
            )
            assert moved.returncode == 0, moved.stderr
            assert f"on http://127.0.0.1:{other}/mcp" in moved.stderr
            assert status(moved.stdout.strip()) == 200

            for bad in ("127.0.0.1", "127.0.0.1:99999", ":80"):
                refused = admin(config, "token", "--client", "script", "--scope", "organizer", "--listen", bad)
                assert refused.returncode == 2, refused.stderr  # usage: a bad value
                assert refused.stdout == ""
                assert "--listen" in refused.stderr
    finally:
        process.terminate()
        process.wait(10)
        log.close()

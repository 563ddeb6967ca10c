"""`bastion serve --http` will not serve its password login in plain http beyond loopback.

What this proves, with the real command: a plain-http loopback `public_url` (the demo's) with a
wildcard or other non-loopback listen address, from `--listen` or from the config, is refused at start
with one line saying how to proceed, before anything is bound; an https `public_url` (a TLS reverse
proxy in front) may still listen on every interface; the same config on loopback serves, and a client
is approved and gets its tokens. What it does not prove: the TLS setups themselves (test_serve.py).
Nothing here binds a non-loopback address: the refusal comes first, and the https case stops at the
missing admin password, the check that comes after.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.helpers import write_cheap_hash

from .live import PASSWORD as ADMIN_PASSWORD
from .live import free_port, get_tokens, refused_start, serve_config, write_config

EX_CONFIG = 78


def nothing_listens(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def set_password(config: Path) -> None:
    path = config.parent / "state" / "admin-password.argon2"
    write_cheap_hash(path, ADMIN_PASSWORD)


@pytest.mark.parametrize("listen", ["0.0.0.0", "[::]", "192.0.2.10", "config"])
def test_wildcard_listen_with_a_plain_http_public_url_is_refused(tmp_path: Path, listen: str) -> None:
    """The attack: `--listen 0.0.0.0:P` (or `listen = "0.0.0.0:P"` in the config) with the default
    loopback `public_url`. Before, bastion served the password login in plain http on every interface
    with no warning (any host reaching the port sent `Host: 127.0.0.1:P`). Invariant: refused at start,
    exit 78, one line naming TLS, a TLS reverse proxy with an https public_url, or loopback; nothing
    listens. Then the same config on loopback serves, and a client is approved and redeems its code."""
    port = free_port()
    config = write_config(tmp_path / "demo", port)
    set_password(config)
    if listen == "config":
        text = config.read_text()
        config.write_text(text.replace(f'listen = "127.0.0.1:{port}"', f'listen = "0.0.0.0:{port}"'))
        result = refused_start(config)
    else:
        result = refused_start(config, "--listen", f"{listen}:{port}")
    assert result.returncode == EX_CONFIG, result.stderr
    lines = [line for line in result.stderr.splitlines() if "plain http" in line]
    assert len(lines) == 1, result.stderr
    assert all(words in lines[0] for words in ("tls_cert and tls_key", "https URL", "listen on 127.0.0.1"))
    assert nothing_listens(port)
    config.write_text(config.read_text().replace(f'listen = "0.0.0.0:{port}"', f'listen = "127.0.0.1:{port}"'))
    with serve_config(tmp_path / "demo", config, port) as server:
        client_id = server.register(client_name="after the refusal")["client_id"]
        assert get_tokens(server, client_id, scopes=["organizer"])["scope"] == "organizer"


def test_https_public_url_may_still_listen_on_every_interface(tmp_path: Path) -> None:
    """A TLS reverse proxy in front (public_url https): bastion may listen on 0.0.0.0 in plain http, the
    proxy's leg. The listen check lets it through; the start stops at the next check (no admin password
    yet), so nothing is bound here."""
    port = free_port()
    config = write_config(tmp_path / "demo", port)
    text = config.read_text()
    config.write_text(text.replace(f'public_url = "http://127.0.0.1:{port}"', 'public_url = "https://bastion.example"'))
    result = refused_start(config, "--listen", f"0.0.0.0:{port}")
    assert result.returncode == EX_CONFIG, result.stderr
    assert "admin set-password" in result.stderr
    assert "plain http" not in result.stderr
    assert nothing_listens(port)

"""Preview URLs of a stdio server (issue 16): `bastion serve --stdio` with `[http] preview_listen` set runs
the HTTP front beside stdio (the administrator's login and the preview listener), in the process that owns
the sandboxes.

What this proves, with a real stdio MCP client, a real server process and real sandboxes: the preview tools
are listed over stdio; a page served in a sandbox loads through the URL with the administrator's session
(logged in on the HTTP listener of that same process) and is refused without it; after `close_sandbox`
the URL is 404; when the client ends stdio the listeners close with the process. What it does not prove:
the browser side (tests/transports/http/test_preview.py does that with Chromium, for `serve --http`).
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from typing import cast

import anyio
import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client

from tests.helpers import call, create, sh, spawned_env

from .live import BASTION, Browser, LiveServer, free_port
from .test_preview import APPS, SESSION_COOKIE, WAIT_LISTENING, config_text

pytestmark = [pytest.mark.bwrap, pytest.mark.anyio]


def admin_session(root: Path, port: int, config: Path) -> str:
    """Log in as the administrator on the stdio server's HTTP listener; the session cookie."""
    # Only `base` and `http()` are used by the browser: the stdio client owns the process.
    server = LiveServer(root, port, config, cast(subprocess.Popen[bytes], None), root / "unused.log")
    browser = Browser(server)
    try:
        browser.login(browser.open("/admin/login"))
        return browser.cookies[SESSION_COOKIE]
    finally:
        browser.close()


def fetch(url: str, session: str | None) -> httpx2.Response:
    headers = {"cookie": f"{SESSION_COOKIE}={session}"} if session else {}
    with httpx2.Client(timeout=30) as client:
        return client.get(url, headers=headers)


def refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return True
    return False


async def test_a_stdio_server_serves_its_sandboxes_previews_behind_the_admin_login(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    port, preview_port = free_port(), free_port()
    config = config_text(root, port, preview_port)
    params = StdioServerParameters(
        command=str(BASTION), args=["serve", "--config", str(config), "--stdio"], env=spawned_env()
    )
    with open(tmp_path / "stderr.log", "w") as errlog:
        async with Client(stdio_client(params, errlog=errlog)) as client:
            names = {tool.name for tool in (await client.list_tools()).tools}
            assert {"expose_port", "unexpose_port", "list_exposed_ports"} <= names
            assert "preview_listen is not set" not in (client.instructions or "")
            sandbox_id = await create(client)
            page = (APPS / "index.html").read_text()
            assert (await call(client, "write_file", sandbox_id=sandbox_id, path="index.html", content=page))["ok"]
            started = await sh(client, sandbox_id, "python3 -m http.server 8000 >/dev/null 2>&1 &")
            assert started["ok"], started
            waited = await sh(client, sandbox_id, WAIT_LISTENING.replace("(8000, 8001)", "(8000,)"))
            assert waited["ok"], waited
            exposed = await call(client, "expose_port", sandbox_id=sandbox_id, port=8000)
            assert exposed["ok"], exposed
            url = str(exposed["detail"]["url"])
            assert url.startswith(f"http://127.0.0.1:{preview_port}/preview/")

            session = await anyio.to_thread.run_sync(admin_session, root, port, config)
            loaded = await anyio.to_thread.run_sync(fetch, url + "index.html", session)
            assert loaded.status_code == 200
            assert loaded.text == page
            refused = await anyio.to_thread.run_sync(fetch, url + "index.html", None)
            assert refused.status_code == 403

            assert (await call(client, "close_sandbox", sandbox_id=sandbox_id))["ok"]
            gone = await anyio.to_thread.run_sync(fetch, url + "index.html", session)
            assert gone.status_code == 404
    log = (tmp_path / "stderr.log").read_text()
    assert f"preview URLs are served at http://127.0.0.1:{preview_port}" in log
    assert "Traceback" not in log
    assert refuses_connections(port)
    assert refuses_connections(preview_port)


async def test_without_an_admin_password_a_stdio_server_with_previews_refuses_to_start(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    config = config_text(root, free_port(), free_port())
    (root / "state" / "admin-password.argon2").unlink()
    done = await anyio.run_process([str(BASTION), "serve", "--config", str(config), "--stdio"], input=b"", check=False)
    assert done.returncode == 78
    err = done.stderr.decode()
    assert "no admin password is set: run 'bastion admin set-password" in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


async def test_a_stdio_server_whose_http_front_has_auth_off_warns_that_its_mcp_is_open(tmp_path: Path) -> None:
    """With `auth = false` the HTTP front beside stdio serves every tool at /mcp to any process on this
    host, as `serve --http` does; that server warns, and so must this one (the user asked for stdio)."""
    root = tmp_path / "demo"
    config = config_text(root, free_port(), free_port(), extra_http="auth = false\n")
    done = await anyio.run_process([str(BASTION), "serve", "--config", str(config), "--stdio"], input=b"", check=False)
    err = done.stderr.decode()
    assert done.returncode == 0, err
    assert "[http] auth = false: anyone reaching this address can call every tool" in err
    assert "Traceback" not in err

"""Preview URLs against a live `bastion serve --http` with sandboxes, a preview listener and Chromium (issue 16).

What this proves: a page and a WebSocket echo served by processes in a real sandbox load in headless
Chromium through expose_port's URL with the administrator's login; the same URL without it is refused
(403) and a dead token (closed sandbox, unexposed, never existed) is the same bare 404; a hostile page
cannot read /admin or the login cookie; a token reaches only its own port of its own sandbox; path,
Host and request-line tricks, a closed port (502), a slow (504) or huge (capped) response, a large
body (413) and a burst (429) are each handled; only the app's own cookies reach it (never bastion's, nor
other cookies of the host) and no Authorization, and the app cannot set cookies beyond its preview; every
request is audited without the token.
What it does not prove: other browsers, or previews behind a TLS reverse proxy.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, RejectConnection, TextMessage
from wsproto.events import Request as WsRequest

from bastion.demo import init_demo
from bastion.transports.http.password import write_hash
from bastion.transports.http.preview import cookie_prefix
from bastion.workbench.previews import token_id
from tests.sandbox.microvm_helpers import microvm_settings, with_vm_template

from .chromium import CHROMIUM, launch
from .live import BASTION, PASSWORD, Browser, LiveServer, call_tool, free_port, serve_config

pytestmark = pytest.mark.bwrap

APPS = Path(__file__).with_name("preview_apps")
MAX_BODY = 65_536
MAX_RESPONSE = 1 << 20
PER_MINUTE = 150
SESSION_COOKIE = "__Host-bastion-admin"


def config_text(root: Path, port: int, preview_port: int, extra_http: str = "") -> Path:
    """The demo config with sandboxes on, INFO logs, and a preview listener with small caps."""
    path = init_demo(root)
    text = path.read_text().replace('log_level = "WARNING"', 'log_level = "INFO"')
    text = text.replace('public_url = "http://127.0.0.1:8765"', f'public_url = "http://127.0.0.1:{port}"')
    text = text.replace('listen = "127.0.0.1:8765"', f'listen = "127.0.0.1:{port}"')
    extra = (
        f'preview_listen = "127.0.0.1:{preview_port}"\npreview_max_body_bytes = {MAX_BODY}\n'
        f"preview_max_response_bytes = {MAX_RESPONSE}\npreview_timeout_s = 2\n"
        f'preview_requests_per_minute = {PER_MINUTE}\ntrusted_proxies = ["127.0.0.1"]\n'
    )
    path.write_text(text.replace("[http]\n", f"[http]\n{extra}{extra_http}", 1))
    write_hash(root / "state" / "admin-password.argon2", PASSWORD)
    return path


class Preview:
    """The live server, an MCP token for its tools, the administrator's session, and the preview origin."""

    def __init__(self, server: LiveServer, preview_port: int) -> None:
        self.server = server
        self.origin = f"http://127.0.0.1:{preview_port}"
        issued = subprocess.run(
            [
                str(BASTION),
                "admin",
                "token",
                "--client",
                "preview-test",
                "--scope",
                "workbench",
                "--config",
                str(server.config_path),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            stdin=subprocess.DEVNULL,
        )
        self.token = issued.stdout.strip()
        browser = Browser(server)
        browser.login(browser.open("/admin/login"))
        self.session = browser.cookies[SESSION_COOKIE]
        browser.close()

    def tool(self, name: str, **arguments: object) -> dict[str, Any]:
        return call_tool(self.server.mcp_url, self.token, name, arguments)

    def run(self, sandbox_id: str, command: str) -> str:
        result = self.tool("run_command", sandbox_id=sandbox_id, command=command, timeout_s=30)
        assert result["ok"], result
        return str(result["detail"].get("stdout", ""))

    def sandbox_with_servers(self, **create: object) -> str:
        """A sandbox running app.py on 8000 and ws_echo.py on 8001, both listening (and `ws_handshake.py`, which
        the WebSocket apps import, beside them)."""
        created = self.tool("create_sandbox", **create)
        assert created["ok"], created
        sandbox_id = str(created["detail"]["sandbox_id"])
        for name in ("app.py", "ws_echo.py", "ws_handshake.py", "index.html", "hostile.html"):
            written = self.tool("write_file", sandbox_id=sandbox_id, path=name, content=(APPS / name).read_text())
            assert written["ok"], written
        if create.get("template") == "vm":  # what a microVM's command leaves running ends with it: background
            for app in ("python3 app.py 8000", "python3 ws_echo.py 8001"):
                started = self.tool("run_command", sandbox_id=sandbox_id, command=app, background=True)
                assert started["ok"], started
        else:
            self.run(sandbox_id, "python3 app.py 8000 >/dev/null 2>&1 &\npython3 ws_echo.py 8001 >/dev/null 2>&1 &")
        self.run(sandbox_id, WAIT_LISTENING)
        return sandbox_id

    def expose(self, sandbox_id: str, port: int, **extra: object) -> str:
        result = self.tool("expose_port", sandbox_id=sandbox_id, port=port, **extra)
        assert result["ok"], result
        url = str(result["detail"]["url"])
        assert re.fullmatch(re.escape(self.origin) + r"/preview/[A-Za-z0-9_-]{43}/", url), url
        return url

    def get(self, url: str, *, session: bool = True, **kwargs: Any) -> httpx2.Response:
        cookies = f"{SESSION_COOKIE}={self.session}" if session else ""
        headers = {"cookie": cookies, **kwargs.pop("headers", {})} if cookies else kwargs.pop("headers", {})
        with httpx2.Client(timeout=30) as client:
            return client.request(kwargs.pop("method", "GET"), url, headers=headers, **kwargs)


# Waits (bounded) until both servers of the sandbox accept connections.
WAIT_LISTENING = (
    'python3 -c "\nimport socket, time\nfor port in (8000, 8001):\n    for _ in range(400):\n'
    "        try:\n            socket.create_connection(('127.0.0.1', port)).close(); break\n"
    '        except OSError: time.sleep(0.025)\n"'
)


@contextlib.contextmanager
def serving_preview(tmp_path_factory: pytest.TempPathFactory, name: str, extra_http: str = "") -> Iterator[Preview]:
    """A live server with a preview listener (`config_text`, plus `extra_http` in `[http]`), in a fresh folder."""
    root = tmp_path_factory.mktemp(name) / "demo"
    port, preview_port = free_port(), free_port()
    with serve_config(root, config_text(root, port, preview_port, extra_http), port) as server:
        yield Preview(server, preview_port)


@pytest.fixture(scope="module")
def preview(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Preview]:
    with serving_preview(tmp_path_factory, "preview") as served:
        yield served


@pytest.fixture(scope="module")
def sandbox(preview: Preview) -> str:
    return preview.sandbox_with_servers()


def raw_request(origin: str, head: bytes) -> bytes:
    """Send a request head as written (no client normalises it); return the whole answer."""
    host, port = origin.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(head)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


def test_page_loads_with_the_admin_session_and_is_refused_without(preview: Preview, sandbox: str) -> None:
    url = preview.expose(sandbox, 8000)
    page = preview.get(url + "index.html")
    assert page.status_code == 200
    assert "served from inside the sandbox" in page.text
    refused = preview.get(url + "index.html", session=False)
    assert refused.status_code == 403
    assert "log in" in refused.text
    forged = preview.get(url + "index.html", session=False, headers={"cookie": f"{SESSION_COOKIE}=forged"})
    assert forged.status_code == 403


def page_and_echo(
    chromium: Any, preview: Preview, page_url: str, ws_url: str, *, timeout_ms: int, load_timeout_ms: int | None = None
) -> Any:
    """Chromium, logged in, loads the sandbox's page, which echoes a message through its WebSocket
    (`load_timeout_ms`: the page's load, Playwright's default when None)."""
    context = chromium.new_context()
    context.add_cookies([_session_cookie(preview)])
    page = context.new_page()
    page.goto(f"{page_url}index.html?ws={ws_url}", timeout=load_timeout_ms)
    assert page.text_content("#hello") == "served from inside the sandbox"
    page.wait_for_function("window.results.echo !== undefined", timeout=timeout_ms)
    assert page.evaluate("window.results.echo") == "ping from the page"
    return page


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_chromium_loads_a_page_and_a_websocket_echo_then_404_after_close(preview: Preview) -> None:
    sandbox_id = preview.sandbox_with_servers()
    page_url = preview.expose(sandbox_id, 8000)
    ws_url = preview.expose(sandbox_id, 8001).replace("http://", "ws://")
    with launch() as chromium:
        page = page_and_echo(chromium, preview, page_url, ws_url, timeout_ms=10_000)
        # Without the session the same URL is refused in the browser too.
        anonymous = chromium.new_page()
        response = anonymous.goto(f"{page_url}index.html")
        assert response is not None
        assert response.status == 403
        assert preview.tool("close_sandbox", sandbox_id=sandbox_id)["ok"]
        after = page.goto(f"{page_url}index.html")
        assert after is not None
        assert after.status == 404


@pytest.mark.microvm
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_a_microvm_sandbox_serves_a_page_and_a_websocket_echo_through_its_preview_url(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The same page and echo from a microVM sandbox: each connection the preview listener makes is a
    stream the host opens over the guest's serial port to its own loopback; a closed port is a 502."""
    settings = microvm_settings(tmp_path_factory)
    root = tmp_path_factory.mktemp("vm-preview") / "demo"
    port, preview_port = free_port(), free_port()
    config = with_vm_template(config_text(root, port, preview_port), settings.image_dir, emulation=True)
    config.write_text(config.read_text().replace("preview_timeout_s = 2\n", "preview_timeout_s = 30\n"))
    with serve_config(root, config, port) as server:
        preview = Preview(server, preview_port)
        sandbox_id = preview.sandbox_with_servers(template="vm")
        page_url = preview.expose(sandbox_id, 8000)
        ws_url = preview.expose(sandbox_id, 8001).replace("http://", "ws://")
        with launch() as chromium:
            page_and_echo(chromium, preview, page_url, ws_url, timeout_ms=60_000, load_timeout_ms=60_000)
        assert preview.get(preview.expose(sandbox_id, 8009) + "index.html").status_code == 502
        assert preview.tool("close_sandbox", sandbox_id=sandbox_id)["ok"]


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_hostile_page_cannot_read_admin_pages_or_the_login_cookie(preview: Preview, sandbox: str) -> None:
    """Invariant: a page a sandbox serves runs on the preview origin: /admin of bastion's origin is
    cross-origin to it (no CORS: unreadable), /admin on its own origin is nothing of bastion's, and the
    login cookie is HttpOnly. Proved in Chromium with the administrator logged in."""
    url = preview.expose(sandbox, 8000)
    with launch() as chromium:
        context = chromium.new_context()
        context.add_cookies([_session_cookie(preview)])
        page = context.new_page()
        admin = f"{preview.server.base}/admin"
        assert "login" not in _admin_page(context, admin).lower()  # the session is live on the admin origin
        page.goto(f"{url}hostile.html?admin={admin}")
        page.wait_for_function(
            "window.results.admin !== undefined && window.results.same_origin_admin !== undefined", timeout=10_000
        )
        results = page.evaluate("window.results")
    assert results["admin"].startswith("ERROR TypeError"), results
    assert results["same_origin_admin"].strip() == "Not Found", results
    assert "bastion" not in results["cookie"].lower(), results
    # Same-site, so Chromium sent the session cookie with that fetch: the dashboard refused it unread.
    assert re.search(r"GET /admin 403 ", preview.server.log()), "the preview page's fetch of /admin was served"


COOKIE_BOMB = """<!doctype html><html><body><script>
const big = "x".repeat(3900);  // 40 cookies for every path and port of the host, set by script, for a year
for (let i = 0; i < 40; i++) document.cookie = `bomb${i}=${big}; Path=/; Max-Age=31536000`;
window.done = document.cookie.length;
</script></body></html>
"""


def test_a_preview_page_bombing_the_hosts_cookies_locks_the_administrator_out_for_one_page(
    preview: Preview, sandbox: str
) -> None:
    """Attack: a preview page's script sets 40 cookies of 3.9 KB with Path=/ (the host's cookies are shared by
    every port): every request of the administrator's browser to bastion was then over the 16 KiB head cap,
    and /admin, the login and /healthz failed for a year. The first refused request gets a 431 that clears the
    host's cookies (Clear-Site-Data); the next page is the login page. Proved in Chromium."""
    written = preview.tool("write_file", sandbox_id=sandbox, path="bomb.html", content=COOKIE_BOMB)
    assert written["ok"], written
    url = preview.expose(sandbox, 8000)
    with launch() as chromium:
        context = chromium.new_context()
        context.add_cookies([_session_cookie(preview)])
        page = context.new_page()
        page.goto(f"{url}bomb.html")
        page.wait_for_function("window.done !== undefined", timeout=10_000)
        assert page.evaluate("window.done") > 150_000
        admin = f"{preview.server.base}/admin"
        first = page.goto(admin)
        # The 431 itself, or (Chromium sees the server close a connection it was still writing its head to,
        # and sends the request again once the cookies are cleared) the login page straight away.
        assert first is not None
        assert first.status in (431, 200), first.status
        again = page.goto(admin)
        assert again is not None
        assert again.status == 200
        assert "password" in page.content().lower()  # the login page: the session went with the bomb
        assert not [c for c in context.cookies() if c["name"].startswith("bomb")]


@pytest.mark.parametrize("listener", ["main", "preview"])
def test_a_head_over_the_cap_is_a_431_that_clears_cookies_however_it_arrives(preview: Preview, listener: str) -> None:
    """Attack: the same 156 KB Cookie header as the bomb, written at once. h11 enforces its head cap only on a
    head that arrives in pieces: one read in whole went through (to pages that then misbehaved), one read in
    pieces was a bare 400. Both listeners now answer 431 with Clear-Site-Data, whatever the reads."""
    origin = preview.server.base if listener == "main" else preview.origin
    host = origin.removeprefix("http://")
    cookies = "; ".join(f"bomb{i}={'x' * 3900}" for i in range(40))
    answer = raw_request(origin, f"GET /healthz HTTP/1.1\r\nHost: {host}\r\nCookie: {cookies}\r\n\r\n".encode())
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 431 "), answer[:200]
    assert b'clear-site-data: "cookies"' in head


def _session_cookie(preview: Preview) -> dict[str, Any]:
    return {
        "name": SESSION_COOKIE,
        "value": preview.session,
        "domain": "127.0.0.1",
        "path": "/",
        "secure": True,
        "httpOnly": True,
        "sameSite": "Strict",
    }


def _admin_page(context: Any, url: str) -> str:
    page = context.new_page()
    page.goto(url)
    text = str(page.content())
    page.close()
    return text


def test_a_closed_sandbox_and_an_unknown_token_get_the_same_bare_404(preview: Preview) -> None:
    sandbox_id = preview.sandbox_with_servers()
    url = preview.expose(sandbox_id, 8000)
    assert preview.get(url).status_code == 200
    assert preview.tool("close_sandbox", sandbox_id=sandbox_id)["ok"]
    closed = preview.get(url)
    never = preview.get(f"{preview.origin}/preview/{'A' * 43}/")
    assert closed.status_code == never.status_code == 404
    assert closed.text == never.text == "Not Found\n"


def test_unexpose_ends_the_url_and_list_shows_the_live_ones(preview: Preview, sandbox: str) -> None:
    url = preview.expose(sandbox, 8000)
    listed = preview.tool("list_exposed_ports", sandbox_id=sandbox)["detail"]["previews"]
    assert [p["url"] for p in listed if p["port"] == 8000] == [url]
    assert preview.tool("unexpose_port", sandbox_id=sandbox, port=8000)["ok"]
    assert preview.get(url).status_code == 404
    again = preview.tool("unexpose_port", sandbox_id=sandbox, port=8000)
    assert again["code"] == "NOT_FOUND"


def test_a_token_for_sandbox_a_reaches_only_its_own_port_of_sandbox_a(preview: Preview, sandbox: str) -> None:
    """Invariant: a token names one port of one sandbox; the path and headers cannot pick another."""
    other = preview.tool("create_sandbox")["detail"]["sandbox_id"]
    preview.run(other, "mkdir -p site && echo sandbox-b > site/which.txt")
    preview.run(other, "cd site && python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &")
    preview.run(sandbox, "echo sandbox-a > which.txt")
    url_a = preview.expose(sandbox, 8000)
    assert preview.get(url_a + "which.txt").text == "sandbox-a\n"
    for trick in ("../" + url_a.rsplit("/", 2)[1] + "/which.txt", "http://127.0.0.1:8001/which.txt"):
        response = preview.get(url_a + trick)
        assert "sandbox-b" not in response.text
    preview.tool("close_sandbox", sandbox_id=other)


@pytest.mark.parametrize(
    "path",
    ["/../../admin", "/%2e%2e/%2e%2e/admin", "/%2E%2E/admin", "/./index.html"],
)
def test_dot_segments_after_the_token_are_404(preview: Preview, sandbox: str, path: str) -> None:
    url = preview.expose(sandbox, 8000)
    token = url.rstrip("/").rsplit("/", 1)[1]
    cookie = f"Cookie: {SESSION_COOKIE}={preview.session}\r\n"
    head = f"GET /preview/{token}{path} HTTP/1.1\r\nHost: {preview.origin[7:]}\r\n{cookie}Connection: close\r\n\r\n"
    answer = raw_request(preview.origin, head.encode())
    assert answer.startswith(b"HTTP/1.1 404"), answer[:200]


def test_double_slash_host_stays_a_path_of_the_app(preview: Preview, sandbox: str) -> None:
    url = preview.expose(sandbox, 8000)
    response = preview.get(url + "/127.0.0.1:9/")
    assert response.status_code in (200, 404)  # the app's own answer for that path
    assert "Bad Gateway" not in response.text


def test_foreign_host_and_absolute_request_line_are_refused(preview: Preview, sandbox: str) -> None:
    url = preview.expose(sandbox, 8000)
    path = url[len(preview.origin) :]
    cookie = f"Cookie: {SESSION_COOKIE}={preview.session}\r\n"
    foreign = raw_request(
        preview.origin, f"GET {path} HTTP/1.1\r\nHost: evil.example\r\n{cookie}Connection: close\r\n\r\n".encode()
    )
    assert foreign.startswith(b"HTTP/1.1 421")
    absolute = (
        f"GET http://evil.example{path} HTTP/1.1\r\nHost: {preview.origin[7:]}\r\n{cookie}Connection: close\r\n\r\n"
    )
    answer = raw_request(preview.origin, absolute.encode())
    assert answer.startswith((b"HTTP/1.1 404", b"HTTP/1.1 400")), answer[:200]
    main_app = preview.get(f"{preview.origin}/admin")
    assert main_app.status_code == 404  # the preview listener serves nothing of bastion's


def test_request_smuggling_pairs_and_folds_never_reach_the_app_as_two_requests(preview: Preview, sandbox: str) -> None:
    """Attack: Content-Length with Transfer-Encoding (a second request hidden after a zero chunk), two
    different Content-Lengths, a Transfer-Encoding other than chunked. Invariant: each is refused with
    one 400 (no 502 blaming the app, no second answer), and a folded header stays one header."""
    url = preview.expose(sandbox, 8000)
    path = url[len(preview.origin) :]
    start = f"Host: {preview.origin[7:]}\r\nCookie: {SESSION_COOKIE}={preview.session}\r\nConnection: close\r\n"
    hidden = f"0\r\n\r\nGET {path}headers HTTP/1.1\r\nHost: x\r\n\r\n"
    post = f"POST {path}echo HTTP/1.1\r\n{start}"
    heads = [
        f"{post}Transfer-Encoding: chunked\r\nContent-Length: {len(hidden)}\r\n\r\n{hidden}",
        f"{post}Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        f"{post}Content-Length: 4\r\nContent-Length: 5\r\n\r\nhello",
        f"{post}Transfer-Encoding: identity\r\n\r\n",
    ]
    for head in heads:
        answer = raw_request(preview.origin, head.encode())
        assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
        assert answer.count(b"HTTP/1.1 ") == 1, answer
    folded = f"GET {path}headers HTTP/1.1\r\n{start}X-A: 1\r\n X-B: 2\r\n\r\n"
    seen = raw_request(preview.origin, folded.encode()).lower()
    assert b"x-a: 1 x-b: 2\n" in seen
    assert b"\nx-b:" not in seen


@pytest.mark.parametrize("port", [0, 65536, -1, 70000])
def test_expose_refuses_a_port_outside_1_to_65535(preview: Preview, sandbox: str, port: int) -> None:
    result = preview.tool("expose_port", sandbox_id=sandbox, port=port)
    assert not result["ok"]
    assert result["code"] == "INVALID_REQUEST"


def test_public_is_refused_unless_the_config_allows_it(preview: Preview, sandbox: str) -> None:
    result = preview.tool("expose_port", sandbox_id=sandbox, port=8000, public=True)
    assert result["code"] == "FORBIDDEN"
    assert "preview_public_allowed" in result["reason"]


def test_a_closed_port_is_502_with_a_plain_message(preview: Preview, sandbox: str) -> None:
    response = preview.get(preview.expose(sandbox, 8009))
    assert response.status_code == 502
    assert response.text == "Bad Gateway: nothing accepts connections on port 8009 in the sandbox\n"


def test_a_slow_app_is_504_and_a_huge_response_is_cut_at_the_cap(preview: Preview, sandbox: str) -> None:
    url = preview.expose(sandbox, 8000)
    slow = preview.get(url + "slow")
    assert slow.status_code == 504
    with (
        httpx2.Client(timeout=30) as client,
        client.stream(
            "GET", url + f"big?n={4 * MAX_RESPONSE}", headers={"cookie": f"{SESSION_COOKIE}={preview.session}"}
        ) as big,
    ):
        received = 0
        with contextlib.suppress(httpx2.RemoteProtocolError):  # the body ends short of its Content-Length
            for chunk in big.iter_raw():
                received += len(chunk)
    assert received == MAX_RESPONSE


def test_a_request_body_over_the_cap_is_413(preview: Preview, sandbox: str) -> None:
    url = preview.expose(sandbox, 8000)
    small = preview.get(url + "echo", method="POST", content=b"y" * 100)
    assert small.status_code == 200
    assert small.content == b"y" * 100
    declared = preview.get(url + "echo", method="POST", content=b"z" * (MAX_BODY + 1))
    assert declared.status_code == 413

    def chunks() -> Iterator[bytes]:
        for _ in range(MAX_BODY // 4096 + 2):
            yield b"c" * 4096

    streamed = preview.get(url + "echo", method="POST", content=chunks())  # chunked: no Content-Length
    assert streamed.status_code == 413


def test_a_body_over_the_cap_is_413_even_when_the_app_resets_before_reading_it(preview: Preview, sandbox: str) -> None:
    """The app drops the connection unread, so the proxy's write fails before the cap is reached: the proxy
    reads on (bounded) and still answers 413, not 502, to a body over the cap; under it, 502."""
    url = preview.expose(sandbox, 8000)

    def after_the_reset(count: int) -> Iterator[bytes]:
        """One chunk, then the rest only once the app has reset the connection (it writes reset-done)."""
        yield b"c" * 4096
        deadline = time.monotonic() + 30
        while not preview.tool("read_file", sandbox_id=sandbox, path="reset-done")["ok"]:
            assert time.monotonic() < deadline, "the app never reset the connection"
        preview.run(sandbox, "rm reset-done")
        for _ in range(count - 1):
            yield b"c" * 4096

    over = preview.get(url + "reset", method="POST", content=after_the_reset(MAX_BODY // 4096 + 2))
    assert over.status_code == 413
    under = preview.get(url + "reset", method="POST", content=after_the_reset(2))
    assert under.status_code == 502


def test_a_burst_of_requests_gets_429_counted_not_recorded_one_by_one(preview: Preview, sandbox: str) -> None:
    """Attack: flood a preview past its rate. Invariant: 429s; the refusals are counted in a few
    `preview_throttled` records (one per preview a second), not one record each, which let a flood fill
    the audit log's disk; every request allowed is still recorded."""
    url = preview.expose(sandbox, 8000)
    token = url.rstrip("/").rsplit("/", 1)[1]
    over = 60
    statuses = []
    with httpx2.Client(timeout=30) as client:
        for _ in range(PER_MINUTE + over):
            headers = {"cookie": f"{SESSION_COOKIE}={preview.session}", "x-forwarded-for": "198.51.100.9"}
            statuses.append(client.get(url + "index.html", headers=headers).status_code)
    assert statuses[:PER_MINUTE] == [200] * PER_MINUTE
    assert set(statuses[PER_MINUTE:]) == {429}
    deadline = time.monotonic() + 10
    while True:
        _, mine = _preview_records(preview, token, count=PER_MINUTE)
        throttled = [r for r in mine if r["event"] == "preview_throttled"]
        if sum(r["refused"] for r in throttled) >= over or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [r["status"] for r in mine if r["event"] == "preview"] == [200] * PER_MINUTE
    assert sum(r["refused"] for r in throttled) == over
    assert 1 <= len(throttled) <= 10
    assert all(r["workspace"] == sandbox and r["port"] == 8000 and r["status"] == 429 for r in throttled)


def test_bastion_cookies_and_authorization_never_reach_the_app(preview: Preview, sandbox: str) -> None:
    """Invariant: of the browser's cookies the app gets only those its own responses set (prefixed names, the
    prefix removed): never bastion's, nor a cookie of the host it did not set (`theirs=kept`: another port's
    app's or another preview's), nor Authorization."""
    url = preview.expose(sandbox, 8000)
    mine = cookie_prefix(url.rstrip("/").rsplit("/", 1)[1])
    headers = {
        "cookie": f"{SESSION_COOKIE}={preview.session}; __Host-bastion-browser=b; theirs=kept; {mine}app=ok",
        "authorization": "Bearer secret-of-bastion",
    }
    response = preview.get(url + "headers", session=False, headers=headers)
    assert response.status_code == 200
    seen = response.text.lower()
    assert preview.session.lower() not in seen
    assert "bastion" not in seen
    assert "authorization" not in seen
    assert "theirs" not in seen
    assert "cookie: app=ok\n" in seen
    assert "host: 127.0.0.1:8000" in seen


def test_the_app_cannot_set_cookies_beyond_its_preview_nor_clear_site_data(preview: Preview, sandbox: str) -> None:
    url = preview.expose(sandbox, 8000)
    response = preview.get(url + "headers")
    cookies = response.headers.get_list("set-cookie")
    prefix = url[len(preview.origin) :]
    mine = cookie_prefix(url.rstrip("/").rsplit("/", 1)[1])
    assert cookies == [f"{mine}app=ok; HttpOnly; Path={prefix}; Priority=Low"], cookies
    assert "clear-site-data" not in response.headers
    redirect = preview.get(url + "redirect", follow_redirects=False)
    assert redirect.headers["location"] == f"{prefix}landing"


def test_every_request_is_audited_without_the_token(preview: Preview, sandbox: str) -> None:
    url = preview.expose(sandbox, 8000)
    token = url.rstrip("/").rsplit("/", 1)[1]
    preview.get(url + "index.html?secret=1")
    preview.get(url + "index.html", session=False)
    text, mine = _preview_records(preview, token, count=2)
    assert token not in text
    assert {r["path"] for r in mine} == {"/preview/<token>/index.html"}
    assert {r["status"] for r in mine} == {200, 403}
    assert all(r["workspace"] == sandbox and r["port"] == 8000 and r["client"] for r in mine)
    assert any(r["bytes"] > 0 for r in mine)
    assert not re.search(r"secret=1", text)
    assert token not in preview.server.log(), "the server log names no token (uvicorn's WebSocket lines included)"


def _preview_records(preview: Preview, token: str, count: int) -> tuple[str, list[dict[str, Any]]]:
    """The audit log's text once it holds `count` records of this token's requests (each is written as
    its response ends, so just after the client has it), and those records; 10 s at most."""
    deadline = time.monotonic() + 10
    while True:
        text = (preview.server.root / "state" / "audit.jsonl").read_text()
        records = [json.loads(line) for line in text.splitlines() if '"preview_request"' in line]
        mine = [r for r in records if r["preview"] == token_id(token)]
        if len(mine) >= count or time.monotonic() > deadline:
            return text, mine
        time.sleep(0.01)


def ws_handshake(preview: Preview, url: str, extra: list[tuple[str, str]]) -> tuple[bool, str]:
    """A WebSocket handshake to `url` by wsproto over a plain socket: (accepted, the echo of one message)."""
    host, port, path = re.fullmatch(r"http://([^:]+):(\d+)(/.*)", url).groups()  # type: ignore[union-attr]
    ws = WSConnection(ConnectionType.CLIENT)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            ws.send(
                WsRequest(
                    host=f"{host}:{port}", target=path, extra_headers=[(k.encode(), v.encode()) for k, v in extra]
                )
            )
        )
        while True:
            data = sock.recv(65536)
            ws.receive_data(data or None)
            for event in ws.events():
                if isinstance(event, AcceptConnection):
                    sock.sendall(ws.send(TextMessage(data="hello")))
                    while True:
                        ws.receive_data(sock.recv(65536))
                        for reply in ws.events():
                            if isinstance(reply, TextMessage):
                                return True, reply.data
                if isinstance(event, RejectConnection | CloseConnection):
                    return False, ""
            if not data:
                return False, ""


def test_websocket_needs_the_session_and_the_preview_origin(preview: Preview, sandbox: str) -> None:
    """Invariant: a WebSocket to a non-public preview opens only with the administrator's session and
    from the preview origin (no cross-site WebSocket hijacking)."""
    url = preview.expose(sandbox, 8001)
    cookie = ("Cookie", f"{SESSION_COOKIE}={preview.session}")
    assert ws_handshake(preview, url, [cookie, ("Origin", preview.origin)]) == (True, "hello")
    assert ws_handshake(preview, url, [("Origin", preview.origin)]) == (False, "")
    assert ws_handshake(preview, url, [cookie, ("Origin", "http://evil.example")]) == (False, "")
    assert ws_handshake(preview, url.replace(url.rsplit("/", 2)[1], "B" * 43), [cookie]) == (False, "")


def test_public_urls_need_no_session_when_the_config_allows_them(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    port, preview_port = free_port(), free_port()
    config = config_text(root, port, preview_port, "preview_public_allowed = true\n")
    with serve_config(root, config, port) as server:
        live = Preview(server, preview_port)
        sandbox_id = live.sandbox_with_servers()
        public = live.expose(sandbox_id, 8000, public=True)
        assert live.get(public + "index.html", session=False).status_code == 200
        private = live.expose(sandbox_id, 8001)
        assert live.get(private, session=False).status_code == 403
        listed = live.tool("list_exposed_ports", sandbox_id=sandbox_id)["detail"]["previews"]
        assert {p["port"]: p["public"] for p in listed} == {8000: True, 8001: False}


def test_huge_response_headers_are_502_and_service_workers_are_refused(preview: Preview, sandbox: str) -> None:
    """Invariant: an app's header block is bounded (httpcore's h11 limit) and no service worker, which
    would outlive its token and could claim other previews' paths, is ever served."""
    url = preview.expose(sandbox, 8000)
    huge = preview.get(url + "hugeheaders")
    assert huge.status_code == 502
    worker = preview.get(url + "index.html", headers={"service-worker": "script"})
    assert worker.status_code == 403


@pytest.mark.parametrize(
    ("preview_url", "message"),
    [
        ("http://127.0.0.1:{port}", "must be another origin than public_url"),
        ("http://localhost:{preview_port}", "must be public_url's host on another port"),
    ],
)
def test_a_preview_origin_that_is_the_admins_or_another_hosts_is_refused_at_start(
    tmp_path: Path, preview_url: str, message: str
) -> None:
    """Invariant: previews never share the admin pages' origin, and (with auth) stay on the host whose
    login cookie the browser sends them; the server refuses to start otherwise (exit 78, one line)."""
    root = tmp_path / "demo"
    port, preview_port = free_port(), free_port()
    url = preview_url.format(port=port, preview_port=preview_port)
    config = config_text(root, port, preview_port, f'preview_url = "{url}"\n')
    started = subprocess.run(
        [str(BASTION), "serve", "--config", str(config), "--http"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert started.returncode == 78, started.stderr
    assert message in started.stderr
    assert "Traceback" not in started.stderr

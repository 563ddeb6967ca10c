"""Which cookies reach a preview's app, in headless Chromium against a live `bastion serve --http` with real
sandboxes (found by attacking previews, 2026-12-06).

What this proves: browsers send every cookie of a host to every port and path of it, so the login cookie of
another web app of the administrator's on the same host (HttpOnly, SameSite=Strict) and a `Path=/` cookie a
script of another preview sets both reached a sandbox's app. Now only the cookies the app's own responses set
reach it (renamed with a prefix from its token, the prefix removed on the way in): a login-style app still
logs in, stays logged in and logs out; the other cookies stay in the browser, unchanged.
What it does not prove: other browsers; an app's WebSocket, which is sent no cookies at all.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from bastion.transports.http.preview import cookie_prefix

from .chromium import CHROMIUM, admin_login, launch
from .test_preview import Preview, _session_cookie, serving_preview

pytestmark = [pytest.mark.bwrap, pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")]

LOGIN_PORT = 8002
HOST_SECRET = "HOST-APP-SECRET-123"
SCRIPT_SECRET = "SANDBOX-B-SECRET"
# A login-style app (stdlib only, runs INSIDE a sandbox): a form, a session cookie, a page that needs it.
LOGIN_APP = """
import html, http.server, secrets, sys
from urllib.parse import parse_qs

SESSIONS = {}


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def answer(self, status, body, *headers):
        data = body.encode()
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def user(self):
        for pair in self.headers.get("Cookie", "").split(";"):
            name, _, value = pair.strip().partition("=")
            if name == "sid" and value in SESSIONS:
                return SESSIONS[value]
        return None

    def do_GET(self):
        if self.path == "/":
            self.answer(200, '<form method="post" action="login"><input name="user"><button>Log in</button></form>')
        elif self.path == "/me":
            user = self.user()
            said = f"logged in as {user}" if user else "not logged in"
            cookie = html.escape(self.headers.get("Cookie", ""))
            self.answer(200, f'<pre id="me">{said}</pre><pre id="cookie">{cookie}</pre>')
        elif self.path == "/logout":
            self.answer(303, "", ("Set-Cookie", "sid=; Path=/; Max-Age=0"), ("Location", "/me"))
        else:
            self.answer(404, "not found")

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0"))).decode()
        sid = secrets.token_hex(16)
        SESSIONS[sid] = parse_qs(body)["user"][0]
        cookie = f"sid={sid}; Path=/; HttpOnly; SameSite=Lax"
        self.answer(303, "", ("Set-Cookie", cookie), ("Location", "/me"))


http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""
WAIT_LOGIN = (
    'python3 -c "\nimport socket, time\nfor _ in range(400):\n'
    f"    try:\n        socket.create_connection(('127.0.0.1', {LOGIN_PORT})).close(); break\n"
    '    except OSError: time.sleep(0.025)\n"'
)


class OtherApp(http.server.BaseHTTPRequestHandler):
    """Another web app of the administrator's on the same host, another port (Jupyter, code-server...)."""

    seen: ClassVar[list[str]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.seen.append(self.headers.get("Cookie", ""))
        self.send_response(200)
        self.send_header("Set-Cookie", f"jupyter_session={HOST_SECRET}; Path=/; HttpOnly; SameSite=Strict")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")


@pytest.fixture
def other_app() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), OtherApp)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def preview(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Preview]:
    with serving_preview(tmp_path_factory, "preview-cookies") as served:
        yield served


def _login_sandbox(preview: Preview) -> str:
    created = preview.tool("create_sandbox")
    assert created["ok"], created
    sandbox_id = str(created["detail"]["sandbox_id"])
    written = preview.tool("write_file", sandbox_id=sandbox_id, path="login_app.py", content=LOGIN_APP)
    assert written["ok"], written
    preview.run(sandbox_id, f"python3 login_app.py {LOGIN_PORT} >/dev/null 2>&1 &")
    preview.run(sandbox_id, WAIT_LOGIN)
    return sandbox_id


def _seen(page: Any, url: str, selector: str = "body") -> str:
    page.goto(url)
    return str(page.inner_text(selector))


def test_other_ports_and_other_previews_cookies_never_reach_a_preview_app(
    preview: Preview, other_app: http.server.HTTPServer
) -> None:
    """Attack: the administrator uses another web app on this host (its HttpOnly, SameSite=Strict login
    cookie), and another preview's page sets `auth_token=...; path=/` by script; then sandbox A's app reads
    its Cookie header. Invariant: A's app gets only its own session cookie, under the name it gave it, and a
    login-style app logs in, stays logged in and logs out; the other cookies are still in the browser, and
    the other app still gets its own. Does not prove: anything about cookies A's own scripts set (not sent)."""
    login_box, other_box = _login_sandbox(preview), preview.sandbox_with_servers()
    url_a, url_b = preview.expose(login_box, LOGIN_PORT), preview.expose(other_box, 8000)
    other_url = f"http://127.0.0.1:{other_app.server_port}/"
    try:
        with launch() as chromium:
            context = chromium.new_context()
            context.add_cookies([_session_cookie(preview)])
            page = context.new_page()
            page.goto(other_url)
            page.goto(url_b + "index.html")
            page.evaluate(f"document.cookie = 'auth_token={SCRIPT_SECRET}; path=/'")
            page.goto(url_b + "headers")  # B's app sets its own cookie (app=ok), on B's path
            assert "cookie: app=ok\n" in _seen(page, url_b + "headers").lower()  # and gets nothing else

            page.goto(url_a)
            page.fill("input[name=user]", "alice")
            page.click("button")
            page.wait_for_url("**/me")
            assert page.inner_text("#me") == "logged in as alice"
            sent = page.inner_text("#cookie")
            assert sent.startswith("sid=")
            assert ";" not in sent, sent  # nothing but its own session: no host, script or bastion cookie
            assert _seen(page, url_a + "me", "#cookie") == sent  # the session round-trips
            page.goto(url_a + "logout")
            assert page.inner_text("#me") == "not logged in"
            assert page.inner_text("#cookie") == ""

            kept = {c["name"]: c["value"] for c in context.cookies()}
            page.goto(other_url)
    finally:
        for box in (login_box, other_box):
            preview.tool("close_sandbox", sandbox_id=box)
    assert kept["jupyter_session"] == HOST_SECRET
    assert kept["auth_token"] == SCRIPT_SECRET
    assert kept[f"{cookie_prefix(url_b.rstrip('/').rsplit('/', 1)[1])}app"] == "ok"
    assert f"jupyter_session={HOST_SECRET}" in OtherApp.seen[-1]
    assert HOST_SECRET not in preview.server.log()


FLOOD_APP = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        n = int(self.path.rsplit("/", 1)[1]) if self.path.startswith("/flood/") else 0
        self.send_response(200)
        for i in range(n * 60, n * 60 + 60):
            self.send_header("Set-Cookie", f"c{i}=v; Max-Age=86400; Secure")
        body = b"<p id=ok>flooded</p>"
        self.send_header("Content-Type", "text/html"); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_preview_app_setting_hundreds_of_cookies_cannot_log_the_administrator_out(preview: Preview) -> None:
    """Attack (test_evict_secure.py, a review of the cookie prefix): the host's cookie jar is one, shared by
    every port (Chromium keeps about 180 cookies a host). An app set 240 `Secure` cookies and Chromium evicted
    the oldest: bastion's session, device and browser cookies, so the administrator was logged out. Invariant:
    an app's cookies are of low priority, which Chromium evicts first: after the flood bastion's three cookies
    are still there and the dashboard still opens. What it does not prove: a flood by the page's own script
    (document.cookie), which bastion cannot see (SECURITY.md)."""
    created = preview.tool("create_sandbox")
    assert created["ok"], created
    box = str(created["detail"]["sandbox_id"])
    try:
        assert preview.tool("write_file", sandbox_id=box, path="flood.py", content=FLOOD_APP)["ok"]
        preview.run(box, "python3 flood.py 8005 >/dev/null 2>&1 &")
        preview.run(box, WAIT_LOGIN.replace(str(LOGIN_PORT), "8005"))
        url = preview.expose(box, 8005)
        base = preview.server.base
        with launch() as chromium:
            context = chromium.new_context()
            page = context.new_page()
            admin_login(page, base)
            ours = sorted(c["name"] for c in context.cookies() if c["name"].startswith("__Host-bastion"))
            assert len(ours) == 3, ours
            for n in range(4):
                page.goto(f"{url}flood/{n}")
            names = [c["name"] for c in context.cookies()]
            assert len([name for name in names if name.startswith(cookie_prefix(url.split("/")[-2]))]) > 100
            assert sorted(name for name in names if name.startswith("__Host-bastion")) == ours
            page.goto(f"{base}/admin")
            assert page.url == f"{base}/admin", page.url  # not sent back to the login page
            context.close()
    finally:
        preview.tool("close_sandbox", sandbox_id=box)

"""A preview's WebSocket or streaming response once the administrator's login that opened it ends, against a live
`bastion serve --http` with a real sandbox serving the apps, real WebSocket and HTTP clients, and the
administrator's browser session (found by reading the relay, 2026-12).

A preview that is not public checked the login cookie only when a request or a WebSocket opened; after that the
relay asked only whether the preview was still exposed. A logout, the dashboard's "revoke all",
`bastion admin set-password` or the session's expiry left an open WebSocket and a streaming response running
until the preview was unexposed, expired or its sandbox closed. Now each is ended (close 1008, or the response
cut) within about a second (`STANDING_CHECK_S`).

What this proves: the end comes within `END_BOUND_S` for each way a login ends; other sessions' connections,
public previews and the sandbox's apps are untouched; the old cookie is refused afterwards, and a new login
opens the same URL again.
What it does not prove: the refusal when the login ends while the app's answer has not begun (its response's
head, its WebSocket's handshake: test_preview_standing.py, over the real relays), nor the cost figure (one query
a second per connection, by reading; test_preview_standing.py counts it for a body).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import pytest
from wsproto.events import AcceptConnection, CloseConnection, RejectConnection

from bastion.transports.http.preview_ws import STANDING_CHECK_S
from bastion.transports.http.store import digest
from bastion.workbench.previews import token_id

from .live import PASSWORD, Browser, LiveServer, forms
from .test_preview import APPS, SESSION_COOKIE, Preview, serving_preview
from .ws_relay import BrowserWebSocket

pytestmark = pytest.mark.bwrap

WS_PORTS = (8001, 8002, 8003)
"""ws_echo.py on each: the login's own preview, another session's, a public one."""
STREAM_PORTS = (8010, 8011)
"""raw_app.py on each: the login's own preview (another session streams from it too), a public one."""
END_BOUND_S = STANDING_CHECK_S + 2.0
"""How soon after the login ends its connections must have ended: one check's period, with room for a busy
machine. Before the fix they never ended."""
WAIT_S = 10.0
"""The bound on any one wait for the server (a failure, never a pace)."""
NEW_PASSWORD = "a brand new password"
WAIT_LISTENING = (
    'python3 -c "\nimport socket, time\nfor port in PORTS:\n    for _ in range(400):\n'
    "        try:\n            socket.create_connection(('127.0.0.1', port)).close(); break\n"
    '        except OSError: time.sleep(0.025)\n"'
).replace("PORTS", repr(WS_PORTS + STREAM_PORTS))


@pytest.fixture
def websockets() -> Iterator[Callable[[str, str, str | None], BrowserWebSocket]]:
    """Open WebSockets, each accepted, closed at the end of the test."""
    opened: list[BrowserWebSocket] = []

    def open_ws(origin: str, url: str, session: str | None) -> BrowserWebSocket:
        ws = BrowserWebSocket(origin, url, session)
        opened.append(ws)
        accepted = ws.next()
        assert isinstance(accepted, AcceptConnection), accepted
        return ws

    yield open_ws
    for ws in opened:
        ws.close()


def refused_status(origin: str, url: str, session: str | None) -> int:
    """The HTTP status of a WebSocket the server refuses (asserts it is refused)."""
    ws = BrowserWebSocket(origin, url, session)
    try:
        answer = ws.next()
    finally:
        ws.close()
    assert isinstance(answer, RejectConnection), answer
    return int(answer.status_code)


@contextlib.contextmanager
def stream(url: str, session: str | None) -> Iterator[Iterator[bytes]]:
    """The body of a GET of `url` as it comes (asserts a 200)."""
    headers = {"cookie": f"{SESSION_COOKIE}={session}"} if session is not None else {}
    with httpx2.Client(timeout=WAIT_S) as client, client.stream("GET", url, headers=headers) as response:
        assert response.status_code == 200, response.status_code
        yield response.iter_raw()


def ends_after(chunks: Iterator[bytes]) -> float:
    """Seconds until a trickling body ends (it never does of itself), having asserted it ended incomplete."""
    start = time.monotonic()
    try:
        for _ in chunks:
            assert time.monotonic() - start < WAIT_S, f"the response was still coming after {WAIT_S} s"
    except httpx2.RemoteProtocolError:
        return time.monotonic() - start
    pytest.fail("the trickling response ended complete: it never does unless cut")


def closes_after(ws: BrowserWebSocket) -> tuple[CloseConnection, float]:
    """The server's close of an idle WebSocket and how long it took (asserts it came, and nothing else)."""
    start = time.monotonic()
    try:
        closed = ws.next()
    except TimeoutError:
        pytest.fail(f"the WebSocket was still open {WAIT_S} s after the login ended")
    assert isinstance(closed, CloseConnection), closed
    return closed, time.monotonic() - start


def log_in(server: LiveServer, password: str = PASSWORD) -> Browser:
    browser = Browser(server)
    browser.login(browser.open("/admin/login"), password)
    assert SESSION_COOKIE in browser.cookies
    return browser


def post_as_admin(browser: Browser, path: str, **fields: str) -> None:
    home = browser.open("/admin")
    csrf = next(f for f in forms(home.text) if "csrf" in f["fields"])["fields"]["csrf"]
    assert browser.client.post(path, data={"csrf": csrf, **fields}).status_code == 303


def expire_session(server: LiveServer, session: str) -> None:
    with contextlib.closing(server.db()) as db:
        db.execute("UPDATE admin_sessions SET expires_at = ? WHERE digest = ?", (time.time() - 1, digest(session)))


def end_login(how: str, browser: Browser) -> None:
    """End the login of `browser` as the administrator would: a logout, revoke all, a new password, or expiry."""
    session = browser.cookies[SESSION_COOKIE]
    if how == "logout":
        post_as_admin(browser, "/admin/logout")
    elif how == "revoke_all":
        post_as_admin(browser, "/admin/revoke", grant="*")
    elif how == "password_change":
        browser.server.admin("set-password", stdin=NEW_PASSWORD + "\n")
    else:
        expire_session(browser.server, session)


def start_apps(preview: Preview) -> str:
    """A sandbox running ws_echo.py on each of `WS_PORTS` and raw_app.py on each of `STREAM_PORTS`, listening."""
    created = preview.tool("create_sandbox")
    assert created["ok"], created
    sandbox_id = str(created["detail"]["sandbox_id"])
    for name in ("ws_echo.py", "ws_handshake.py", "raw_app.py"):
        written = preview.tool("write_file", sandbox_id=sandbox_id, path=name, content=(APPS / name).read_text())
        assert written["ok"], written
    commands = [f"python3 ws_echo.py {port} >/dev/null 2>&1 &" for port in WS_PORTS]
    commands += [f"python3 raw_app.py {port} >/dev/null 2>&1 &" for port in STREAM_PORTS]
    preview.run(sandbox_id, "\n".join(commands))
    preview.run(sandbox_id, WAIT_LISTENING)
    return sandbox_id


def audited(preview: Preview, url: str, status: int) -> list[dict[str, Any]]:
    """The audit records of `url`'s preview with `status`, once there is one (10 s at most, then none)."""
    key = token_id(url.rstrip("/").rsplit("/", 1)[1])
    deadline = time.monotonic() + WAIT_S
    while True:
        text = (preview.server.root / "state" / "audit.jsonl").read_text()
        mine = [
            r
            for r in map(json.loads, text.splitlines())
            if r.get("event") == "preview" and r["preview"] == key and r["status"] == status
        ]
        if mine or time.monotonic() > deadline:
            return mine
        time.sleep(0.01)


PUBLIC = "preview_public_allowed = true\n"


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Preview, str]]:
    """A live server allowing public previews, and a sandbox running the apps (`start_apps`)."""
    with serving_preview(tmp_path_factory, "preview-logout", PUBLIC) as served:
        yield served, start_apps(served)


@pytest.fixture
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Preview, str]]:
    """As `shared`, for a test that ends every login (and every grant) of its server."""
    with serving_preview(tmp_path_factory, "preview-logout-all", PUBLIC) as served:
        yield served, start_apps(served)


def check_websockets_end(
    preview: Preview, sandbox_id: str, how: str, open_ws: Callable[[str, str, str | None], BrowserWebSocket]
) -> None:
    """The attack on WebSockets, for one way the login ends; the other session's preview is checked only when
    `how` leaves other sessions alone."""
    others_survive = how in ("logout", "session_expiry")
    own, other = preview.expose(sandbox_id, WS_PORTS[0]), preview.expose(sandbox_id, WS_PORTS[1])
    public = preview.expose(sandbox_id, WS_PORTS[2], public=True)
    browser = log_in(preview.server)
    session = browser.cookies[SESSION_COOKIE]
    victim = open_ws(preview.origin, own, session)
    assert victim.echo("before") == "before"
    bystander = open_ws(preview.origin, other, preview.session) if others_survive else None
    opened_publicly = open_ws(preview.origin, public, session)  # the same cookie: not needed there
    try:
        end_login(how, browser)
    finally:
        browser.close()
    closed, after = closes_after(victim)
    assert closed.code == 1008
    assert after < END_BOUND_S, f"closed {after:.1f} s after the login ended"
    assert opened_publicly.echo("public, still open") == "public, still open"
    if bystander is not None:
        assert bystander.echo("another session, still open") == "another session, still open"
    assert refused_status(preview.origin, own, session) == 403
    assert audited(preview, own, 101), "the ended WebSocket was not audited"
    password = NEW_PASSWORD if how == "password_change" else PASSWORD
    again = log_in(preview.server, password)
    try:
        reopened = open_ws(preview.origin, own, again.cookies[SESSION_COOKIE])
        assert reopened.echo("logged in again") == "logged in again"  # the same URL, the same app
    finally:
        again.close()


def check_stream_cut(preview: Preview, sandbox_id: str, how: str) -> None:
    """The attack on a streaming response, for one way the login ends (see `check_websockets_end`)."""
    others_survive = how in ("logout", "session_expiry")
    own = preview.expose(sandbox_id, STREAM_PORTS[0])
    public = preview.expose(sandbox_id, STREAM_PORTS[1], public=True)
    browser = log_in(preview.server)
    session = browser.cookies[SESSION_COOKIE]
    with contextlib.ExitStack() as streams:
        victim = streams.enter_context(stream(own + "trickle", session))
        assert next(victim)
        bystander = streams.enter_context(stream(own + "trickle", preview.session)) if others_survive else None
        opened_publicly = streams.enter_context(stream(public + "trickle", session))
        try:
            end_login(how, browser)
        finally:
            browser.close()
        after = ends_after(victim)
        assert after < END_BOUND_S, f"cut {after:.1f} s after the login ended"
        assert next(opened_publicly)
        if bystander is not None:
            assert next(bystander)
    refused = httpx2.get(own + "trickle", headers={"cookie": f"{SESSION_COOKIE}={session}"}, timeout=WAIT_S)
    assert refused.status_code == 403
    cut = audited(preview, own, 200)
    assert cut, "the cut response was not audited"
    assert cut[0]["bytes"] > 0
    password = NEW_PASSWORD if how == "password_change" else PASSWORD
    again = log_in(preview.server, password)
    try:
        with stream(own + "trickle", again.cookies[SESSION_COOKIE]) as reopened:
            assert next(reopened)  # the same URL, the same app
    finally:
        again.close()


@pytest.mark.parametrize("how", ["logout", "session_expiry"])
def test_logout_leaves_a_preview_websocket_open(
    shared: tuple[Preview, str], how: str, websockets: Callable[[str, str, str | None], BrowserWebSocket]
) -> None:
    """Attack: the administrator logs out (or the session expires) while a WebSocket of a preview that is not
    public, opened with that login, stays open: the app's messages kept flowing for as long as the browser and
    the app kept it. Invariant: it gets close 1008 within `END_BOUND_S`; another session's and a public
    preview's WebSockets carry on, the old cookie is refused, and a new login opens the same URL again."""
    check_websockets_end(*shared, how, websockets)


@pytest.mark.parametrize("how", ["logout", "session_expiry"])
def test_logout_leaves_a_preview_stream_running(shared: tuple[Preview, str], how: str) -> None:
    """Attack: as `test_logout_leaves_a_preview_websocket_open`, with a response the app trickles for ever.
    Invariant: it is cut (incomplete, audited with what it sent) within `END_BOUND_S`; the same preview's
    stream for another session and a public preview's stream carry on; a new login streams again."""
    check_stream_cut(*shared, how)


def test_revoke_all_leaves_a_preview_websocket_open(
    fresh: tuple[Preview, str], websockets: Callable[[str, str, str | None], BrowserWebSocket]
) -> None:
    """Attack: the dashboard's "revoke all" (every grant and every admin session) left a preview's WebSocket
    open. Invariant: it closes with 1008 within `END_BOUND_S`; a public preview's carries on; a new login
    opens the same URL again."""
    check_websockets_end(*fresh, "revoke_all", websockets)


def test_password_change_leaves_a_preview_stream_running(fresh: tuple[Preview, str]) -> None:
    """Attack: `bastion admin set-password` (another process: it deletes every admin session) left a preview's
    streaming response running. Invariant: it is cut within `END_BOUND_S`; a public preview's carries on; a
    login with the new password streams from the same URL again."""
    check_stream_cut(*fresh, "password_change")


def test_password_change_leaves_a_preview_websocket_open(
    fresh: tuple[Preview, str], websockets: Callable[[str, str, str | None], BrowserWebSocket]
) -> None:
    """Attack: as `test_password_change_leaves_a_preview_stream_running`, with a WebSocket: it gets close 1008."""
    check_websockets_end(*fresh, "password_change", websockets)


UPLOAD_LINE_S = 0.05
UPLOAD_LINES = 140
"""An upload of one line every `UPLOAD_LINE_S` for 7 s: it goes on well past `END_BOUND_S` after the logout."""
LINES_BEFORE_LOGOUT = 10


def slow_upload(url: str, session: str, started: threading.Event) -> dict[str, object]:
    """POST `url` a body of `UPLOAD_LINES` lines, each the client's clock as it is sent, one every `UPLOAD_LINE_S`,
    as a slow browser's upload; `started` is set after `LINES_BEFORE_LOGOUT` of them. The answer's status, or the
    transport error that ended it (the server may close before taking the whole body)."""
    width = 16

    def lines() -> Iterator[bytes]:
        for n in range(UPLOAD_LINES):
            if n == LINES_BEFORE_LOGOUT:
                started.set()
            yield f"{time.monotonic():{width - 1}.3f}\n".encode()
            time.sleep(UPLOAD_LINE_S)

    headers = {"cookie": f"{SESSION_COOKIE}={session}", "content-length": str(width * UPLOAD_LINES)}
    try:
        with httpx2.Client(timeout=WAIT_S) as client:
            return {"status": client.post(url, content=lines(), headers=headers).status_code}
    except httpx2.TransportError as exc:
        return {"error": type(exc).__name__}


def test_logout_leaves_a_preview_upload_reaching_the_app(shared: tuple[Preview, str]) -> None:
    """Attack: a slow request body (an upload) to a preview that is not public, opened with a login that then
    ends: its body went on reaching the sandbox's app to the end; only the app's answer was refused (403). So a
    logged-out browser (or a page in it) could still push data into the app. Invariant: the body stops reaching
    the app within `END_BOUND_S` of the logout (the app's own record of what it received), and the browser is
    refused (403, or its connection cut mid-upload); the request is audited as 403.
    What it does not prove: the bound to the millisecond (a poll, once per `STANDING_CHECK_S`)."""
    preview, sandbox_id = shared
    own = preview.expose(sandbox_id, STREAM_PORTS[0])
    browser = log_in(preview.server)
    session = browser.cookies[SESSION_COOKIE]
    started, logged_out = threading.Event(), list[float]()
    with concurrent.futures.ThreadPoolExecutor(1) as worker:
        upload = worker.submit(slow_upload, own + "upload?name=slow-upload.log", session, started)
        try:
            assert started.wait(WAIT_S), "the upload did not start"
            end_login("logout", browser)
            logged_out.append(time.monotonic())
        finally:
            browser.close()
        answer = upload.result(timeout=UPLOAD_LINES * UPLOAD_LINE_S + WAIT_S)
    assert answer in ({"status": 403}, {"error": "WriteError"}, {"error": "RemoteProtocolError"}), answer
    received = [float(line) for line in preview.run(sandbox_id, "cat slow-upload.log").split()]
    assert len(received) >= LINES_BEFORE_LOGOUT, "the upload never reached the app"
    late = received[-1] - logged_out[0]
    assert late < END_BOUND_S, f"the app still received the upload {late:.1f} s after the logout"
    assert audited(preview, own, 403), "the refused upload was not audited"

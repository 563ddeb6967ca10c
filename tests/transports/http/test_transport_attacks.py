"""Attacks on the HTTP transport of a live `bastion serve --http` (issue #20, findings 3 and 5).

What this proves, each against the real server over loopback TCP: 1,100 idle sockets do not stop it
accepting (at a 512-file limit) and the administrator still logs in and a client calls a tool; slow
request heads, slow bodies and silent sockets are disconnected after the configured timeouts; an
attacker-chosen value with a newline cannot forge a log line, and every log line carries a time and a
level; nested or broken JSON at /mcp is a 400 JSON-RPC parse error, never a 500; one grant cannot hold
more than `max_sessions_per_grant` MCP sessions (the oldest idle one is closed; all busy: 429) while
other grants are untouched; a loopback server is the same server as 127.0.0.1, localhost and [::1], and
the SDK's own OAuth client connects through either name. What it does not prove: behaviour under a
distributed flood, or over TLS (asyncio, not bastion, times TLS handshakes).
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from http.client import HTTPConnection
from typing import Any

import anyio
import anyio.streams.buffered
import httpx2
import pytest
from mcp import Client
from mcp.client.auth import OAuthClientProvider
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import AuthorizationCodeResult, OAuthClientMetadata

from tests.helpers import INITIALIZE_REQUEST, MCP_HEADERS, call

from .live import BASTION, Browser, LiveServer, callback_params, get_tokens, pkce
from .sdk_client import MemoryStorage

LINE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
CLAUDE_AI_CALLBACK = "https://claude.ai/api/mcp/auth_callback"


def bearer(token: str) -> dict[str, str]:
    return {**MCP_HEADERS, "Authorization": f"Bearer {token}"}


async def _call_tool(url: str, token: str, mode: str) -> dict[str, object]:
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=30) as http,
        Client(streamable_http_client(url, http_client=http), mode=mode) as client,
    ):
        return await call(client, "list_directory")


def still_works(server: LiveServer) -> None:
    """The administrator logs in and approves a Claude Code-shaped client (public, loopback callback),
    which calls a tool on both protocol eras; a claude.ai-shaped client can still register."""
    client = server.register(client_name="Claude Code (bastion)", grant_types=["authorization_code", "refresh_token"])
    tokens = get_tokens(server, client["client_id"])
    for mode in ("legacy", "2026-07-28"):
        assert anyio.run(_call_tool, server.mcp_url, tokens["access_token"], mode)["ok"]
    claude_ai = server.register(client_name="claude.ai", redirect_uris=[CLAUDE_AI_CALLBACK])
    assert claude_ai["client_id"]


def assert_log_clean(server: LiveServer, *, max_bytes: int = 256 * 1024) -> str:
    log = server.log()
    assert len(log.encode()) < max_bytes, f"log grew to {len(log)} bytes"
    assert "Traceback" not in log
    assert "Exception in ASGI application" not in log
    return log


# -- connections ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def idle_sockets(port: int, count: int, burst: int = 16) -> Iterator[list[socket.socket]]:
    """`count` connections that never send a byte, in order (fewer if the server's queue refuses some).
    Paced `burst` at a time (the least backlog the server sets): each burst waits until the server has
    accepted the one before. Unpaced, every connect that met a full queue waited for the kernel's SYN
    retry, a second each: 18 s for 1,100."""
    opened: list[socket.socket] = []
    try:
        for n in range(count):
            if n % burst == 0:
                accepted_all(port)
            with contextlib.suppress(OSError):
                opened.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        yield opened
    finally:
        for sock in opened:
            sock.close()


def accepted_all(port: int, within_s: float = 5) -> None:
    """Wait until the listener on 127.0.0.1:`port` has no connection waiting for accept() (its accept
    queue is the rx_queue of its LISTEN line in /proc/net/tcp), or `within_s` passes."""
    local = f"0100007F:{port:04X}"
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with open("/proc/net/tcp") as table:
            queued = [line.split()[4] for line in table if f" {local} " in line and line.split()[3] == "0A"]
        if not queued or queued[0].endswith(":00000000"):
            return
        time.sleep(0.001)


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes `sock` within `within_s` (polls recv with a deadline)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, min(0.2, deadline - time.monotonic())))
        try:
            if sock.recv(4096) == b"":
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


def test_idle_socket_flood_then_admin_still_connects(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """1,100 idle sockets against a server whose file limit is 512 (the issue: 1,100 at 1,024 stopped it
    accepting, with a traceback per failed accept). The cap (128 here) closes the sockets waiting
    longest, so new connections keep being served; the log gets summary lines, no traceback."""
    with start_server(nofile=512) as server, idle_sockets(server.port, 1100) as held:
        assert len(held) > 600, "the flood did not get through"
        still_works(server)
        closed = sum(closed_by_server(sock, 0.05) for sock in held[:200])
        assert closed > 150, f"only {closed} of the first 200 idle sockets were closed"
        log = assert_log_clean(server)
        assert "connections open: closed the one waiting longest for its request" in log
        assert "out of file descriptors" not in log
        assert len([line for line in log.splitlines() if "connections open" in line]) <= 5


def test_slowloris_head_body_and_silent_sockets_are_cut_off(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """A head sent a byte at a time, a body trickled, and a socket that says nothing are all closed after
    the timeouts (1 s each here) however steadily they trickle; a whole request on a new connection is
    answered, and the administrator and clients still get in."""
    extra = "request_head_timeout_s = 1\nrequest_body_timeout_s = 1"
    with start_server(http_extra=extra) as server:
        host = f"Host: 127.0.0.1:{server.port}\r\n".encode()
        head = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        body = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        silent = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        with head, body, silent:
            head.sendall(b"GET /.well-known/oauth-protected-resource HTTP/1.1\r\n" + host)
            body.sendall(b"POST /register HTTP/1.1\r\n" + host + b"Content-Type: application/json\r\n")
            body.sendall(b"Content-Length: 1000\r\n\r\n{")
            started = time.monotonic()
            open_head = open_body = True
            sent = 0
            while (open_head or open_body) and time.monotonic() - started < 10:
                sent += 1
                if open_head:
                    head.sendall(b"X")  # a header name that never ends
                    open_head = not closed_by_server(head, 0.1)
                if open_body:
                    with contextlib.suppress(OSError):
                        body.sendall(b" ")
                    open_body = not closed_by_server(body, 0.1)
            elapsed = time.monotonic() - started
            assert not open_head, "a head sent a byte at a time was never cut off"
            assert not open_body, "a trickled body was never cut off"
            assert elapsed < 6, elapsed
            assert sent < 40
            assert closed_by_server(silent, 3), "a silent socket was kept"
        with server.http() as client:
            assert client.get("/.well-known/oauth-protected-resource").status_code == 200
        still_works(server)
        log = assert_log_clean(server)
        assert "closed connections that sent no complete request in time" in log


def test_a_form_declaring_a_huge_body_is_not_a_slowloris_pass(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """Attack: POST the login form declaring a body of 10**19 bytes, then trickle a byte now and then. The
    body deadline grew with the declared length (about 3 * 10**14 s) and the form reader waited for the
    body, so the connection was held for ever. Invariant: refused at once, or cut off within the body
    timeout; the administrator still gets in."""
    extra = "request_head_timeout_s = 1\nrequest_body_timeout_s = 1"
    with start_server(http_extra=extra) as server:
        host = f"Host: 127.0.0.1:{server.port}\r\n".encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(
                b"POST /admin/login HTTP/1.1\r\n" + host + b"Content-Type: application/x-www-form-urlencoded\r\n"
            )
            sock.sendall(b"Content-Length: 9999999999999999999\r\n\r\npassword=")
            started = time.monotonic()
            closed = False
            while not closed and time.monotonic() - started < 10:
                with contextlib.suppress(OSError):
                    sock.sendall(b"x")
                closed = closed_by_server(sock, 0.2)
            assert closed, "a form declaring a huge body was held open"
            assert time.monotonic() - started < 6
        still_works(server)
        assert_log_clean(server)


def test_a_connection_idle_for_a_clients_whole_pool_expiry_is_still_served(server: LiveServer) -> None:
    """The SDK's HTTP client (httpx) reuses a pooled connection for up to 5 s of idle time. With the
    server's keep-alive also 5 s, a request sent as the server closed the connection failed with a read
    error (seen in the load test). Invariant: a connection idle for the client's whole expiry is still open
    and answers the next request on it."""
    expiry = httpx2.Limits().keepalive_expiry
    assert expiry is not None
    connection = HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        for request in range(2):
            connection.request("GET", "/.well-known/oauth-protected-resource")
            answer = connection.getresponse()
            answer.read()
            assert answer.status == 200, request
            assert connection.sock is not None
            if request == 0:
                idle = connection.sock
                assert not closed_by_server(idle, expiry + 0.5), "the server closed a connection a client would reuse"
    finally:
        connection.close()


# -- logs ----------------------------------------------------------------------------------------------


def test_log_injection_newline_in_client_values_cannot_forge_a_line(server: LiveServer) -> None:
    """A client name, a path and a client_id with newlines (and an ANSI escape) end up escaped inside
    the line that quotes them; every log line starts with a time and a level."""
    forged = "2026-01-01T00:00:00+0000 CRITICAL bastion.transports.http.auth: admin password changed"
    server.register(client_name=f"evil\n{forged}\x1b[2J")
    with server.http() as client:
        client.get(f"/x%0a{forged.replace(' ', '%20')}")
        client.get("/authorize", params={"client_id": f"https://127.0.0.1/c\n{forged}", "response_type": "code"})
    log = assert_log_clean(server)
    logged = [line for line in log.splitlines() if not line.startswith(("bastion:", "  "))]
    assert logged
    for line in logged:
        assert LINE.match(line), f"a log line without time and level: {line!r}"
        assert not line.startswith(forged)
    assert "\x1b" not in log
    assert f"\\n{forged}" in log, "the attacker's text is kept, escaped, in the line that quotes it"


# -- /mcp ----------------------------------------------------------------------------------------------

PARSE_FAILURES: dict[str, str | bytes] = {
    "nested arrays in a tools/call": '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":'
    + "[" * 5000
    + "]" * 5000
    + "}",
    "a deep array": "[" * 100_000,
    "deep objects": '{"a":' * 3000 + "1" + "}" * 3000,
    "truncated tools/call": '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"run_command"',
    "not JSON": "{bad",
    "invalid UTF-8 in a tools/call": b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"\xff\xfe"}}',
}


@pytest.mark.parametrize("era", ["2025-11-25", "2026-07-28"])
def test_nested_json_at_mcp_is_a_parse_error_not_a_500(server: LiveServer, era: str) -> None:
    """Every body that does not parse is 400 with JSON-RPC code -32700 (the edge scope check used to
    raise RecursionError: 500 and a traceback); the token still works afterwards."""
    client = server.register()
    token = get_tokens(server, client["client_id"])["access_token"]
    headers = {**bearer(token), "mcp-protocol-version": era}
    with server.http() as http:
        for name, body in PARSE_FAILURES.items():
            response = http.post("/mcp", content=body, headers=headers)
            assert response.status_code == 400, (name, response.status_code, response.text[:200])
            assert response.json()["error"]["code"] == -32700, name
    mode = "legacy" if era == "2025-11-25" else era
    assert anyio.run(_call_tool, server.mcp_url, token, mode)["ok"]
    log = assert_log_clean(server)
    assert not re.search(r"POST /mcp 500 ", log)


def test_subscriptions_listen_is_not_served_so_one_token_cannot_hold_every_connection(server: LiveServer) -> None:
    """Attack: in the 2026-07-28 era a `subscriptions/listen` POST stays open as an event stream with no
    session, so no per-grant cap applied: one token (any scope) held all 1,024 connection slots with them,
    everyone else (the administrator's browser included) was refused, and revoking the token ended none.
    bastion sends no events: listen is not served, and a burst of them holds nothing."""
    token = get_tokens(server, server.register()["client_id"])["access_token"]
    body = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "subscriptions/listen",
        "params": {
            "notifications": {"toolsListChanged": True},
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": {},
            },
        },
    }
    headers = {**bearer(token), "mcp-protocol-version": "2026-07-28", "mcp-method": "subscriptions/listen"}
    with server.http() as http:
        for _ in range(20):
            answer = http.post("/mcp", json=body, headers=headers)
            assert answer.status_code != 200 or "text/event-stream" not in answer.headers.get("content-type", "")
            assert "error" in answer.json(), answer.text[:200]
        assert http.get("/admin/login").status_code == 200
    assert anyio.run(_call_tool, server.mcp_url, token, "2026-07-28")["ok"]


def _open_session(http: httpx2.Client, token: str) -> httpx2.Response:
    return http.post("/mcp", json=INITIALIZE_REQUEST, headers=bearer(token))


def _initialized(http: httpx2.Client, token: str) -> dict[str, str]:
    """A new 2025-11-25 session of `token`, initialized: the headers of its requests."""
    session = _open_session(http, token).headers["mcp-session-id"]
    headers = {**bearer(token), "mcp-session-id": session, "mcp-protocol-version": "2025-11-25"}
    http.post("/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=headers)
    return headers


def _session_alive(http: httpx2.Client, token: str, session_id: str) -> bool:
    headers = {**bearer(token), "mcp-session-id": session_id, "mcp-protocol-version": "2025-11-25"}
    response = http.post("/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=headers)
    return response.status_code != 404


def _wait_closed(http: httpx2.Client, token: str, session_id: str, within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _session_alive(http, token, session_id):
            return True
    return False


def test_session_flood_per_grant_is_capped(start_server: Callable[..., AbstractContextManager[LiveServer]]) -> None:
    """One grant opens more sessions than `max_sessions_per_grant` (4 here): each new one closes that
    grant's session idle the longest; when all four hold a GET stream (busy), a fifth gets 429 with
    Retry-After; another grant opens sessions all along, and the 2026-07-28 era (stateless) is unaffected."""
    with start_server(http_extra="max_sessions_per_grant = 4") as server:
        attacker = get_tokens(server, server.register()["client_id"])["access_token"]
        other = get_tokens(server, server.register()["client_id"])["access_token"]
        with server.http() as http:
            sessions = []
            for _ in range(7):
                opened = _open_session(http, attacker)
                assert opened.status_code == 200, opened.text
                sessions.append(opened.headers["mcp-session-id"])
            for closed in sessions[:3]:
                assert _wait_closed(http, attacker, closed), "the oldest idle session was not closed"
            live = sessions[3:]
            assert all(_session_alive(http, attacker, s) for s in live)
            assert _open_session(http, other).status_code == 200, "another grant is not limited by this one"
        anyio.run(_all_busy_then_refused, server, attacker, live)
        assert anyio.run(_call_tool, server.mcp_url, attacker, "2026-07-28")["ok"]
        log = assert_log_clean(server)
        assert "MCP sessions open, none idle: refused a new one" in log


def test_session_flood_with_auth_off_is_capped(start_server: Callable[..., AbstractContextManager[LiveServer]]) -> None:
    """Attack (found by attack): with auth off (loopback only) nothing capped MCP sessions: one client opened
    2,000 in 4.6 s (+75 MiB), each kept for the SDK's 30-minute idle timeout. Every client is now one grant
    to the cap (4 here): a new session closes the one idle longest, and the server still answers calls."""
    with start_server(http_extra="max_sessions_per_grant = 4", auth=False) as server, server.http() as http:
        sessions = []
        for _ in range(7):
            opened = http.post("/mcp", json=INITIALIZE_REQUEST, headers=MCP_HEADERS)
            assert opened.status_code == 200, opened.text
            sessions.append(opened.headers["mcp-session-id"])

        def alive(session_id: str) -> bool:
            headers = {**MCP_HEADERS, "mcp-session-id": session_id, "mcp-protocol-version": "2025-11-25"}
            initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
            return http.post("/mcp", json=initialized, headers=headers).status_code != 404

        deadline = time.monotonic() + 10
        while any(alive(s) for s in sessions[:3]):
            assert time.monotonic() < deadline, "the oldest idle sessions were not closed"
        assert all(alive(s) for s in sessions[3:])
        assert anyio.run(_call_tool, server.mcp_url, "unused: auth is off", "2026-07-28")["ok"]
        assert "reached 4 MCP sessions: closed the one idle longest" in assert_log_clean(server)


async def _all_busy_then_refused(server: LiveServer, token: str, live: list[str]) -> None:
    """Hold a GET stream on each live session: no session is idle, so a new one is refused (429)."""
    async with httpx2.AsyncClient(base_url=server.base, timeout=30) as http, contextlib.AsyncExitStack() as streams:
        for session_id in live:
            headers = {**bearer(token), "mcp-session-id": session_id, "mcp-protocol-version": "2025-11-25"}
            headers["Accept"] = "text/event-stream"
            response = await streams.enter_async_context(http.stream("GET", "/mcp", headers=headers))
            assert response.status_code == 200
        refused = await http.post("/mcp", json=INITIALIZE_REQUEST, headers=bearer(token))
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"]
        assert "sessions open and busy" in refused.json()["error"]["message"]


# -- loopback aliases ----------------------------------------------------------------------------------


async def _sdk_connects(mcp_url: str, browser: Browser, mode: str) -> tuple[dict[str, Any], MemoryStorage]:
    """The SDK's OAuth client, given only `mcp_url`: discovery, registration, browser, token, a call."""
    storage = MemoryStorage()
    location: dict[str, str] = {}

    async def redirect_handler(url: str) -> None:
        location["value"] = await anyio.to_thread.run_sync(lambda: browser.approve(url))

    async def callback_handler() -> AuthorizationCodeResult:
        params = callback_params(location["value"])
        return AuthorizationCodeResult(code=params["code"][0], state=params["state"][0], iss=params["iss"][0])

    metadata = OAuthClientMetadata.model_validate(
        {
            "client_name": "alias test",
            "redirect_uris": ["http://127.0.0.1/callback"],
            "token_endpoint_auth_method": "none",
        }
    )
    provider = OAuthClientProvider(mcp_url, metadata, storage, redirect_handler, callback_handler)
    async with (
        httpx2.AsyncClient(auth=provider, timeout=30) as http,
        Client(streamable_http_client(mcp_url, http_client=http), mode=mode) as client,
    ):
        return await call(client, "list_directory"), storage


@pytest.mark.parametrize(
    ("name", "mode"), [("localhost", "legacy"), ("localhost", "2026-07-28"), ("127.0.0.1", "legacy")]
)
def test_loopback_alias_sdk_client_connects_on_the_first_try(
    server: LiveServer, browsers: Callable[[LiveServer], Browser], name: str, mode: str
) -> None:
    """`claude mcp add ... http://localhost:PORT/mcp` against a server whose public_url says 127.0.0.1
    used to get 421 "unknown Host". The SDK's client (which checks that the protected-resource metadata
    names the URL it was given) now connects through either name; its token is bound to the canonical
    resource, so it works under the other name too."""
    url = f"http://{name}:{server.port}/mcp"
    listing, storage = anyio.run(_sdk_connects, url, browsers(server), mode)
    assert listing["ok"]
    assert storage.tokens is not None
    assert anyio.run(_call_tool, server.mcp_url, storage.tokens.access_token, "2026-07-28")["ok"]


def test_loopback_aliases_are_one_server_and_other_hosts_are_not(server: LiveServer) -> None:
    """127.0.0.1, localhost and [::1] on the server's port: the metadata and the 401 challenge name the
    URL asked for, the issuer stays one; another port, another name or a foreign Origin are refused."""
    port = server.port
    with server.http() as http:
        issuers = set()
        for host in ("127.0.0.1", "localhost", "[::1]", "LOCALHOST"):
            origin = f"http://{host.lower()}:{port}"
            metadata = http.get("/.well-known/oauth-protected-resource/mcp", headers={"Host": f"{host}:{port}"})
            assert metadata.status_code == 200, host
            assert metadata.json()["resource"] == f"{origin}/mcp"
            issuers.update(metadata.json()["authorization_servers"])
            challenge = http.post("/mcp", json={}, headers={**MCP_HEADERS, "Host": f"{host}:{port}"})
            assert challenge.status_code == 401
            assert (
                f'resource_metadata="{origin}/.well-known/oauth-protected-resource/mcp"'
                in (challenge.headers["www-authenticate"])
            )
        assert issuers == {server.base}
        for host in (f"localhost:{port + 1}", f"evil.example:{port}", f"127.0.0.2:{port}", "localhost"):
            refused = http.get("/.well-known/oauth-protected-resource", headers={"Host": host})
            assert refused.status_code == 421, host
        client = server.register()
        token = get_tokens(server, client["client_id"])["access_token"]
        foreign = http.post(
            "/mcp",
            json=INITIALIZE_REQUEST,
            headers={**bearer(token), "Host": f"localhost:{port}", "Origin": "http://evil.example"},
        )
        assert foreign.status_code == 403
        allowed = http.post(
            "/mcp",
            json=INITIALIZE_REQUEST,
            headers={**bearer(token), "Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"},
        )
        assert allowed.status_code == 200, allowed.text
        wrong = http.post(
            "/token",
            data={
                "grant_type": "refresh_token",
                "refresh_token": "x" * 43,
                "client_id": client["client_id"],
                "resource": f"http://localhost:{port + 1}/mcp",
            },
        )
        assert wrong.status_code == 400
        assert json.loads(wrong.text)["error"] == "invalid_target"


# -- the consent page's address warning ----------------------------------------------------------------


def _consent_page(browser: Browser, client_id: str, redirect_uri: str) -> httpx2.Response:
    _, challenge = pkce()
    login_page = browser.open(browser.authorize_url(client_id, challenge, redirect_uri=redirect_uri))
    assert login_page.status_code == 200, login_page.text
    if "password" not in login_page.text:
        return login_page
    after_login = browser.login(login_page)
    assert after_login.status_code == 303, after_login.text
    return browser.open(after_login.headers["location"])


def test_claude_ai_callback_warning_appears_once(server: LiveServer, browsers: Callable[[LiveServer], Browser]) -> None:
    """claude.ai registers a new client at each connection, always with its own callback: the consent
    page's "check this address" box was shown every time. It is shown until the administrator has
    approved that callback once; an address never approved is still flagged."""
    browser = browsers(server)
    warning = "Check this address."
    first = server.register(client_name="claude.ai", redirect_uris=[CLAUDE_AI_CALLBACK])
    page = _consent_page(browser, first["client_id"], CLAUDE_AI_CALLBACK)
    assert warning in page.text
    approved = browser.consent(page)
    assert approved.status_code == 303
    assert approved.headers["location"].startswith(CLAUDE_AI_CALLBACK + "?code=")
    second = server.register(client_name="claude.ai", redirect_uris=[CLAUDE_AI_CALLBACK])
    page = _consent_page(browsers(server), second["client_id"], CLAUDE_AI_CALLBACK)
    assert "allow access" in page.text.lower() or "approve" in page.text.lower()
    assert warning not in page.text
    other = server.register(client_name="elsewhere", redirect_uris=["https://elsewhere.example/cb"])
    assert warning in _consent_page(browsers(server), other["client_id"], "https://elsewhere.example/cb").text


# -- the bearer check's cache --------------------------------------------------------------------------


def test_revoked_token_is_refused_at_the_next_request_despite_the_cache(server: LiveServer) -> None:
    """The bearer check remembers tokens until the database changes. A token used a moment ago is
    refused at the very next request once its grant is revoked, by the /revoke endpoint (this process)
    and by `bastion admin revoke` (another process); an expired one is refused though nothing changed."""

    def status(token: str) -> int:
        """401 for a token refused; anything else (here 400: an empty message) got past the bearer check."""
        return http.post("/mcp", json={}, headers=bearer(token)).status_code

    with server.http() as http:
        first = server.register()
        tokens = get_tokens(server, first["client_id"])
        for _ in range(3):
            assert status(tokens["access_token"]) != 401
        revoked = http.post("/revoke", data={"token": tokens["refresh_token"], "client_id": first["client_id"]})
        assert revoked.status_code == 200
        assert status(tokens["access_token"]) == 401

        second = get_tokens(server, server.register()["client_id"])
        for _ in range(3):
            assert status(second["access_token"]) != 401
        with server.db() as db:
            grant_id = db.execute(
                "SELECT grant_id FROM oauth_grants WHERE revoked_at IS NULL ORDER BY created_at DESC LIMIT 1"
            ).fetchone()[0]
        result = subprocess.run(
            [str(BASTION), "admin", "revoke", "--config", str(server.config_path), grant_id],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert status(second["access_token"]) == 401

        third = get_tokens(server, server.register()["client_id"])
        assert status(third["access_token"]) != 401
        with server.db() as db:
            # Another connection's write: the cache is dropped and the new expiry read.
            db.execute("UPDATE oauth_tokens SET expires_at = ? WHERE kind = 'access'", (time.time() - 1,))
        assert status(third["access_token"]) == 401


def test_a_get_stream_asking_to_resume_gets_a_fresh_stream_not_a_500(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """Attack (repro_misc.py part B): GET /mcp with any `Last-Event-ID`. bastion keeps no event store, and the
    SDK then answered nothing at all: uvicorn's 500 and an error line per request, a log flood for any token
    holder. Invariant: the stream opens as a GET without the header does (200, event-stream), the log has no
    error, and the session still answers a call."""
    with start_server() as server:
        token = get_tokens(server, server.register()["client_id"])["access_token"]
        with server.http() as http:
            opened = _open_session(http, token)
            assert opened.status_code == 200, opened.text
            session = opened.headers["mcp-session-id"]
            headers = {**bearer(token), "mcp-session-id": session, "mcp-protocol-version": "2025-11-25"}
            http.post("/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=headers)
            for event_id in ("0", "not-an-event", "x" * 200):
                with http.stream("GET", "/mcp", headers={**headers, "last-event-id": event_id}) as stream:
                    assert stream.status_code == 200, event_id
                    assert stream.headers["content-type"].startswith("text/event-stream")
        assert anyio.run(_call_tool, server.mcp_url, token, "legacy")["ok"]
        log = assert_log_clean(server)
        assert "returned without starting response" not in log
        assert " 500 " not in log


# -- request ids ---------------------------------------------------------------------------------------


def test_a_request_id_reused_in_flight_on_a_session_is_refused_not_held_open_for_ever(server: LiveServer) -> None:
    """Found by attack: the SDK keys a session's answers by `str(id)`, so a ping sent as id 7 while a call with
    id 7 ran replaced the call's answer stream: the call's POST was never answered and stayed open for ever, its
    event stream's pings keeping it alive, through a DELETE of the session and the grant's revocation; 30 of
    them held a cap of 32 connections, which the cap cannot evict (each is being served). Invariant: while id 7
    is in flight on the session, a request with id 7 (or "7", the same key) is refused with 409, and so is the
    SDK's own key of the GET stream; the call is answered; once it is, id 7 is free again."""
    token = get_tokens(server, server.register()["client_id"])["access_token"]
    audit = server.root / "state" / "audit.jsonl"
    with server.http() as http, ThreadPoolExecutor(1) as pool:
        headers = _initialized(http, token)
        session = headers["mcp-session-id"]
        marker = f"sleep 3.{int(session[:8], 16) % 10**6:06d}"  # this test's own call, in the audit log
        params = {"name": "run_command", "arguments": {"command": marker}}
        call_7 = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params}

        def first_call() -> httpx2.Response:
            with server.http() as own:
                return own.post("/mcp", json=call_7, headers=headers, timeout=15)  # held for ever, it ends here

        first = pool.submit(first_call)
        deadline = time.monotonic() + 10
        while marker not in audit.read_text():  # its start record: the call is in flight
            assert not first.done(), first.result().text
            assert time.monotonic() < deadline, "the call never started"
            time.sleep(0.01)
        for clash in (7, "7", "_GET_stream"):
            refused = http.post("/mcp", json={"jsonrpc": "2.0", "id": clash, "method": "ping"}, headers=headers)
            assert refused.status_code == 409, refused.text
            assert "already in flight on this session" in refused.json()["error"]["message"]
        assert not first.done(), "the call ended before the clashes were sent: give it longer"
        answer = first.result(timeout=30)
        assert answer.status_code == 200
        assert '"id":7' in answer.text.replace(" ", "")
        assert '"result"' in answer.text
        # Free again once the call's POST has ended on the server too (its answer may reach the client first).
        deadline = time.monotonic() + 10
        ping_7 = {"jsonrpc": "2.0", "id": 7, "method": "ping"}
        while (free := http.post("/mcp", json=ping_7, headers=headers)).status_code != 200:
            assert free.status_code == 409, free.text
            assert time.monotonic() < deadline, "id 7 stayed in flight after its call was answered"
    assert_log_clean(server, max_bytes=4 << 20)


def test_a_huge_unknown_prompt_name_does_not_flood_the_server_log(server: LiveServer) -> None:
    """Found by attack: `prompts/get` with a name of 1.3 M zero-width spaces (a 3.9 MB body, under the 4 MiB cap)
    on a 2025-11-25 session: the SDK logs the name whole at ERROR ("Unknown prompt: <name>", shown at the default
    level), and escaping it wrote 7.8 MB of log a request (8.8 MB/s from one client) and held the event loop 1 s.
    Invariant: three such requests are answered and grow the log by a few KiB each."""
    token = get_tokens(server, server.register()["client_id"])["access_token"]
    with server.http() as http:
        headers = _initialized(http, token)
        request = {"jsonrpc": "2.0", "id": 2, "method": "prompts/get", "params": {"name": "\u200b" * 1_300_000}}
        body = json.dumps(request, ensure_ascii=False).encode()
        before = server.log_path.stat().st_size
        for _ in range(3):
            answer = http.post("/mcp", content=body, headers=headers)
            assert answer.status_code == 200
            assert "Unknown prompt" in answer.text
    grown = server.log_path.stat().st_size - before
    assert grown < 3 * 64 * 1024, f"the log grew {grown} bytes for 3 requests"


def test_an_unknown_tools_huge_name_is_cut_in_the_http_answer_and_its_record(server: LiveServer) -> None:
    """Found by attack (twenty-seventh session): `tools/call` with a name of 1.3 M zero-width spaces (a 3.9 MB
    body, under the 4 MiB cap) on a 2025-11-25 session. The HTTP scope check refuses an unknown tool before the
    server's own check (which cut the name), and quoted it whole (`{name!r}`: six characters each, then
    JSON-escaped) and as the answer's action: a 28.6 MB answer, the event loop held ~0.45 s a request, another
    grant's ping up to 624 ms with two such clients. Invariant: the answer is small, names the tool cut, and
    its one audit record's tool is at most MCP's bound on a name; the server logs no traceback."""
    token = get_tokens(server, server.register()["client_id"])["access_token"]
    name = "\u200b" * 1_300_000
    with server.http() as http:
        headers = _initialized(http, token)
        request = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": name, "arguments": {}}}
        body = json.dumps(request, ensure_ascii=False).encode()
        answer = http.post("/mcp", content=body, headers=headers, timeout=60)
    assert answer.status_code == 200
    assert "unknown tool" in answer.text
    assert len(answer.content) < 16 * 1024, f"a {len(body)} B request got a {len(answer.content)} B answer"
    audit = (server.root / "state" / "audit.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in audit]
    refused = [r for r in records if str(r.get("tool", "")).startswith("\u200b")]
    assert len(refused) == 1, len(refused)
    assert refused[0]["tool"] == name[:128]
    assert "Traceback" not in server.log()


@contextlib.contextmanager
def _get_streams(server: LiveServer, headers: dict[str, str], count: int) -> Iterator[list[socket.socket]]:
    """`count` GETs of a session's event stream, sent at once on as many connections; yields those answered 200."""
    lines = ["GET /mcp HTTP/1.1", f"Host: 127.0.0.1:{server.port}", "Accept: text/event-stream"]
    lines += [f"{k}: {v}" for k, v in headers.items() if k.lower() not in ("accept", "content-type")]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode()
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(count)]
    try:
        for sock in socks:
            sock.sendall(request)
        answered = []
        for sock in socks:
            sock.settimeout(10)
            head = b""
            while b"\r\n\r\n" not in head and (chunk := sock.recv(4096)):
                head += chunk
            if head.startswith(b"HTTP/1.1 200"):
                answered.append(sock)
        yield answered
    finally:
        for sock in socks:
            sock.close()


def test_a_client_reopening_its_event_stream_at_once_gets_it_and_the_old_one_ends(server: LiveServer) -> None:
    """Found by CI: a client that closed its GET stream and opened another at once got 409 when the old one's end
    had not reached the server yet, and so would a client whose old connection died unseen (a laptop asleep).
    Invariant: the session's newest GET is served, the stream it replaces ends, and another grant knowing the
    session id cannot end it."""
    token = get_tokens(server, server.register()["client_id"])["access_token"]
    other = get_tokens(server, server.register()["client_id"])["access_token"]
    with server.http() as http:
        headers = _initialized(http, token)
        with _get_streams(server, headers, 1) as first:
            assert len(first) == 1
            with _get_streams(server, {**headers, **bearer(other)}, 1) as stranger:
                assert not stranger, "another grant was served this session's event stream"
            assert not _stream_ended(first[0], 0.5), "another grant ended this session's event stream"
            with _get_streams(server, headers, 1) as second:  # the first still open on the client's side
                assert len(second) == 1, "the session's newest GET stream was refused"
                assert _stream_ended(first[0], 5), "the replaced GET stream was not ended"
                assert not _stream_ended(second[0], 0.5)
        assert anyio.run(_call_tool, server.mcp_url, token, "legacy")["ok"]
    assert_log_clean(server)


def test_a_sessions_get_re_sent_on_many_connections_does_not_hold_every_connection_slot(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """Found by review: once a session's new GET waited for the stream it replaces to end (up to 2 s, inside the
    application, where the connection cap cannot evict it), one grant re-sending its session's GET on 70
    connections held a 64-connection cap: another grant's client was refused 87 to 98% of the time. Invariant:
    one GET a session waits, the newest (the one it replaces answers 409 at once), so the other grant connects."""
    with start_server(http_extra="max_connections = 64\nmax_sessions_per_grant = 8\n") as server:
        token = get_tokens(server, server.register()["client_id"])["access_token"]
        other = get_tokens(server, server.register()["client_id"])["access_token"]
        with server.http() as http:
            headers = _initialized(http, token)
        stop = time.monotonic() + 6
        with ThreadPoolExecutor(1) as pool:
            flood = pool.submit(anyio.run, _re_send_gets, server.port, headers, 70, stop)
            time.sleep(1)  # the flood under way: what follows measures it, nothing waits on its order
            served = refused = 0
            while time.monotonic() < stop - 1 and served + refused < 40:
                try:
                    with httpx2.Client(base_url=server.base, timeout=5) as client:
                        served += _open_session(client, other).status_code == 200
                except httpx2.HTTPError:
                    refused += 1
            answers = flood.result()
        assert answers["200"] > 0, answers
        assert refused <= served // 4, f"another grant was refused {refused} times of {served + refused}"
        assert_log_clean(server, max_bytes=16 << 20)


async def _re_send_gets(port: int, headers: dict[str, str], connections: int, stop: float) -> dict[str, int]:
    """`connections` connections, each re-sending a session's GET as soon as its answer ends, until `stop`; the
    answers' status codes counted."""
    lines = ["GET /mcp HTTP/1.1", f"Host: 127.0.0.1:{port}", "Accept: text/event-stream"]
    lines += [f"{k}: {v}" for k, v in headers.items() if k.lower() not in ("accept", "content-type")]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode()
    answers: dict[str, int] = {"200": 0}

    async def one() -> None:
        while time.monotonic() < stop:
            with contextlib.suppress(
                OSError, anyio.BrokenResourceError, anyio.EndOfStream, anyio.IncompleteRead, TimeoutError
            ):
                async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                    buffered = anyio.streams.buffered.BufferedByteReceiveStream(stream)
                    while time.monotonic() < stop:
                        await stream.send(request)
                        with anyio.fail_after(max(0.1, stop - time.monotonic())):
                            head = await buffered.receive_until(b"\r\n\r\n", 65536)
                            status = head.split(b" ", 2)[1].decode()
                            answers[status] = answers.get(status, 0) + 1
                            length = re.search(rb"(?im)^content-length: *(\d+)", head)
                            if length is not None:
                                await buffered.receive_exactly(int(length[1]))
                            else:  # an event stream, chunked: to its last chunk
                                await buffered.receive_until(b"0\r\n\r\n", 1 << 20)
            await anyio.sleep(0.05)

    async with anyio.create_task_group() as group:
        for _ in range(connections):
            group.start_soon(one)
    return answers


def _stream_ended(sock: socket.socket, within_s: float) -> bool:
    """Whether the event stream on `sock` ends (its last chunk, or the connection closed) within `within_s`."""
    deadline = time.monotonic() + within_s
    seen = b""
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, min(0.2, deadline - time.monotonic())))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            return True
        seen += chunk
        if not chunk or seen.endswith(b"0\r\n\r\n"):
            return True
    return False


def test_get_streams_sent_together_on_a_session_are_one_stream_that_ends_with_it(server: LiveServer) -> None:
    """Found by review: the SDK looks for a session's GET stream before its response's task registers it, so 8 GETs
    sent together were all served; each replaced the last in the SDK's map, and the 7 replaced ones, in no map,
    outlived the session's DELETE and the grant's revocation, pinging for ever (one grant held 1,023 streams of a
    1,024-connection cap, and every other client was refused). Invariant: one GET stream per session is served
    at a time (each new one ends the last, or gets 409), and the one left ends with the session's DELETE, then
    with the grant's revocation."""
    client_id = server.register()["client_id"]
    token = get_tokens(server, client_id)["access_token"]
    with server.http() as http:
        for ending in ("delete", "revoke"):
            headers = _initialized(http, token)
            with _get_streams(server, headers, 8) as answered:
                live = [sock for sock in answered if not _stream_ended(sock, 1)]
                assert len(live) == 1, f"{len(live)} of {len(answered)} GET streams served on one session still live"
                if ending == "delete":
                    assert http.delete("/mcp", headers=headers).status_code == 200
                else:
                    with contextlib.closing(server.db()) as db:
                        grant = db.execute("SELECT grant_id FROM oauth_grants WHERE client_id = ?", (client_id,))
                        server.admin("revoke", str(grant.fetchone()[0]))
                assert _stream_ended(live[0], 10), f"the GET stream outlived the session's {ending}"
    assert_log_clean(server, max_bytes=4 << 20)

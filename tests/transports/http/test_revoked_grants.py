"""What a revoked grant holds open, against a live `bastion serve --http` (the 2025-11-25 handshake era).

The attack: a client whose grant the administrator revokes (`bastion admin revoke`, the dashboard's
revoke, a refresh token's reuse, the client's own /revoke, a new admin password) or whose grant expires
keeps what it already opened: up to `max_sessions_per_grant` MCP sessions, each with its server task and
GET event stream, until the SDK's 30-minute idle timeout; a held GET stream never idles. Only its next
request was refused (401).
What this proves, with the SDK's own streamable HTTP client: after the revocation the grant's GET streams
are ended by the server within `BOUND_S`, each of its sessions is terminated (the server's log names
each), a call in flight is cancelled with its end record in the audit log and its command killed, another
grant's session and stream are untouched, and the administrator still logs in and connects.
The 2026-07-28 era holds no session, but its calls in flight ran to their own end after the revocation:
now they are cancelled the same way, the client told why.
What it does not prove: how soon, to the millisecond (the server looks every 0.5 s).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from starlette.types import Message, Receive, Scope, Send

from bastion.safety.audit import verify
from bastion.tools._call import CANCELLED_REASON
from bastion.transports.http.sessions import REVOKED_MESSAGE, GrantCalls
from tests.helpers import call

from .conftest import SHARED_HTTP
from .live import PASSWORD, Browser, LiveServer, forms, get_tokens, live_server, pkce, redeem_code

BOUND_S = 10.0
"""How long the server may take to end what a revoked grant holds (it looks every 0.5 s)."""
SESSIONS = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The shared server, where a rotated refresh token presented again revokes its grant at once."""
    extra = f"{SHARED_HTTP}\nrefresh_reuse_grace_s = 0"
    with live_server(tmp_path_factory.mktemp("http") / "demo", http_extra=extra) as live:
        yield live


class _Body(httpx2.AsyncByteStream):
    """A GET stream's body that notes when the server ends it (not when the client closes it)."""

    def __init__(self, inner: httpx2.AsyncByteStream, ended: list[str], session: str) -> None:
        self.inner = inner
        self.ended = ended
        self.session = session

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.inner:
            yield chunk
        self.ended.append(self.session)

    async def aclose(self) -> None:
        await self.inner.aclose()


class WatchedGets(httpx2.AsyncBaseTransport):
    """The SDK client's HTTP transport, noting which sessions' GET event streams opened and which the
    server ended, and the status of every GET it refused."""

    def __init__(self) -> None:
        self.inner = httpx2.AsyncHTTPTransport()
        self.opened: list[str] = []
        self.ended: list[str] = []
        self.refused: list[int] = []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        if request.method != "GET":
            return response
        if response.status_code != 200:
            self.refused.append(response.status_code)
            return response
        session = request.headers["mcp-session-id"]
        self.opened.append(session)
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        return httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=_Body(response.stream, self.ended, session),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


async def until(done: Callable[[], bool], what: str, within_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, f"not within {within_s:g} s: {what}"
        await anyio.sleep(0.02)


@contextlib.asynccontextmanager
async def holding(server: LiveServer, token: str, sessions: int) -> AsyncIterator[tuple[list[Client], WatchedGets]]:
    """`sessions` SDK clients on one token, each with the GET stream the SDK opens after initializing."""
    watch = WatchedGets()
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60, transport=watch) as http,
        contextlib.AsyncExitStack() as stack,
    ):
        clients = []
        for _ in range(sessions):
            transport = streamable_http_client(server.mcp_url, http_client=http)
            clients.append(await stack.enter_async_context(Client(transport, mode="legacy")))
        await until(lambda: len(set(watch.opened)) == sessions, "the SDK clients' GET streams opened")
        yield clients, watch


def grant_of(server: LiveServer, client_id: str) -> str:
    with contextlib.closing(server.db()) as db:
        row = db.execute("SELECT grant_id FROM oauth_grants WHERE client_id = ?", (client_id,)).fetchone()
    return str(row[0])


def revoke_on_dashboard(server: LiveServer, grant: str) -> None:
    browser = Browser(server)
    try:
        home = browser.open(browser.login(browser.open("/admin/login")).headers["location"])
        csrf = next(f for f in forms(home.text) if "csrf" in f["fields"])["fields"]["csrf"]
        assert browser.client.post("/admin/revoke", data={"csrf": csrf, "grant": grant}).status_code == 303
    finally:
        browser.close()


def reuse_refresh_token(server: LiveServer, client_id: str, tokens: dict[str, Any]) -> None:
    form = {"grant_type": "refresh_token", "refresh_token": tokens["refresh_token"], "client_id": client_id}
    with server.http() as http:
        assert http.post("/token", data=form).status_code == 200
        assert http.post("/token", data=form).json()["error"] == "invalid_grant"  # the reuse revokes the grant


def revoke_by_the_client(server: LiveServer, client_id: str, tokens: dict[str, Any]) -> None:
    with server.http() as http:
        assert http.post("/revoke", data={"token": tokens["access_token"], "client_id": client_id}).status_code == 200


def expire(server: LiveServer, grant: str) -> None:
    with contextlib.closing(server.db()) as db:
        db.execute("UPDATE oauth_grants SET expires_at = ? WHERE grant_id = ?", (time.time() - 1, grant))


def end_grant(server: LiveServer, how: str, client_id: str, tokens: dict[str, Any]) -> None:
    grant = grant_of(server, client_id)
    if how == "cli":
        server.admin("revoke", grant)
    elif how == "dashboard":
        revoke_on_dashboard(server, grant)
    elif how == "refresh-reuse":
        reuse_refresh_token(server, client_id, tokens)
    elif how == "client-revoke":
        revoke_by_the_client(server, client_id, tokens)
    else:
        expire(server, grant)


def terminated(server: LiveServer) -> set[str]:
    """Session ids the server's log says it terminated (the SDK's own line)."""
    marker = "Terminating session: "
    return {line.split(marker, 1)[1].strip() for line in server.log().splitlines() if marker in line}


def admin_connects(server: LiveServer, password: str = PASSWORD) -> None:
    """The administrator logs in, approves a new client, which calls a tool."""
    client_id = server.register()["client_id"]
    verifier, challenge = pkce()
    browser = Browser(server)
    try:
        location = browser.approve(browser.authorize_url(client_id, challenge), password=password)
    finally:
        browser.close()
    token = redeem_code(server, location, verifier, client_id, "http://127.0.0.1/callback")["access_token"]
    assert anyio.run(_lists, server, token)["ok"]


async def _lists(server: LiveServer, token: str) -> dict[str, Any]:
    async with holding(server, token, 1) as (clients, _):
        return await call(clients[0], "list_directory")


def assert_log_clean(server: LiveServer) -> None:
    log = server.log()
    assert "Traceback" not in log
    assert "Exception in ASGI application" not in log


@pytest.mark.parametrize("how", ["cli", "dashboard", "refresh-reuse", "client-revoke", "expiry"])
def test_revoked_grant_keeps_its_sessions_and_get_streams_open(server: LiveServer, how: str) -> None:
    """A grant holding three sessions, each with a GET stream, is revoked (or expires) while another grant
    holds one. Invariant: within `BOUND_S` the server ends the three streams and terminates the three
    sessions; the other grant's stream stays open and its session answers a call; the administrator still
    logs in and connects; the log has no traceback."""
    attacker_id = server.register()["client_id"]
    attacker = get_tokens(server, attacker_id)
    other = get_tokens(server, server.register()["client_id"])["access_token"]

    async def scenario() -> None:
        async with (
            holding(server, attacker["access_token"], SESSIONS) as (_, held),
            holding(server, other, 1) as (others, untouched),
        ):
            assert (await call(others[0], "list_directory"))["ok"]
            await anyio.to_thread.run_sync(end_grant, server, how, attacker_id, attacker)
            await until(lambda: set(held.opened) <= set(held.ended), "the revoked grant's GET streams ended")
            await until(lambda: set(held.opened) <= terminated(server), "the revoked grant's sessions terminated")
            assert set(held.refused) <= {401}, "a GET stream's reconnect got past the bearer check"
            assert untouched.ended == [], "another grant's GET stream was ended"
            assert not set(untouched.opened) & terminated(server), "another grant's session was terminated"
            assert (await call(others[0], "list_directory"))["ok"]

    anyio.run(scenario)
    admin_connects(server)
    assert "is revoked or has expired: ended its 3 MCP session(s)" in server.log()
    assert_log_clean(server)


def test_revoked_grant_keeps_every_session_open_after_a_password_reset(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """`bastion admin set-password` revokes everything: every grant's sessions and streams end within
    `BOUND_S`, and the administrator logs in with the new password and connects."""
    with start_server() as server:
        first = get_tokens(server, server.register()["client_id"])["access_token"]
        second = get_tokens(server, server.register()["client_id"])["access_token"]

        async def scenario() -> None:
            async with holding(server, first, 2) as (_, one), holding(server, second, 1) as (_, two):
                await anyio.to_thread.run_sync(lambda: server.admin("set-password", stdin="a brand new password\n"))
                everything = [*one.opened, *two.opened]
                await until(lambda: set(everything) <= {*one.ended, *two.ended}, "every GET stream ended")
                await until(lambda: set(everything) <= terminated(server), "every session terminated")

        anyio.run(scenario)
        admin_connects(server, "a brand new password")
        assert_log_clean(server)


def _audit_records(path: Path, command: str) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("tool") == "run_command" and r.get("args", {}).get("command") == command]


def _running(argv: list[str]) -> bool:
    wanted = "\0".join(argv).encode()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if cmdline.read_bytes().rstrip(b"\0") == wanted:
                return True
    return False


@pytest.mark.bwrap
def _assert_killed_and_recorded(server: LiveServer, command: str, seconds: str) -> None:
    """The cancelled call's `sleep <seconds>` was killed, and its start and end records (cancelled) written."""
    anyio.run(until, lambda: not _running(["sleep", seconds]), "the command was killed")
    audit = server.root / "state" / "audit.jsonl"
    anyio.run(until, lambda: len(_audit_records(audit, command)) == 2, "the call's end record was written")
    start, end = _audit_records(audit, command)
    assert (start["event"], end["event"]) == ("start", "end")
    assert (end["code"], end["reason"]) == ("UNAVAILABLE", CANCELLED_REASON)
    assert verify(audit).ok


def test_revoked_grant_keeps_its_long_call_running(server: LiveServer) -> None:
    """A call in flight when its grant is revoked (`run_command` of a 28 s sleep) is cancelled with its
    session: the client's call ends within `BOUND_S` without an answer, the command is killed, and the
    audit log has the call's start and its end record (UNAVAILABLE, cancelled) and still verifies."""
    command = "sleep 28.25"  # unique: it is found in /proc by its arguments
    client_id = server.register()["client_id"]
    tokens = get_tokens(server, client_id)
    outcome: dict[str, object] = {}

    async def scenario() -> None:
        async with holding(server, tokens["access_token"], 1) as (clients, held):

            async def long_call() -> None:
                try:
                    outcome["answer"] = await clients[0].call_tool("run_command", {"command": command})
                except Exception as exc:
                    outcome["error"] = exc

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(long_call)
                await until(lambda: _running(["sleep", "28.25"]), "the command started")
                await anyio.to_thread.run_sync(server.admin, "revoke", grant_of(server, client_id))
                await until(lambda: bool(outcome), "the call ended")
            await until(lambda: set(held.opened) <= set(held.ended), "the GET stream ended")

    anyio.run(scenario)
    assert "answer" not in outcome, outcome
    _assert_killed_and_recorded(server, command, "28.25")
    assert_log_clean(server)


@contextlib.asynccontextmanager
async def modern_client(server: LiveServer, token: str) -> AsyncIterator[Client]:
    """An SDK client on the stateless 2026-07-28 protocol: no session, one POST per request."""
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http,
        Client(streamable_http_client(server.mcp_url, http_client=http), mode="2026-07-28") as client,
    ):
        yield client


@pytest.mark.bwrap
@pytest.mark.parametrize(
    ("how", "seconds"),
    [
        ("cli", "27.31"),
        ("dashboard", "27.32"),
        ("refresh-reuse", "27.33"),
        ("client-revoke", "27.34"),
        ("expiry", "27.35"),
    ],
)
def test_revoked_grant_keeps_its_modern_era_call_running(server: LiveServer, how: str, seconds: str) -> None:
    """A 2026-07-28 call in flight (no MCP session holds it) when its grant is revoked or expires: the
    server cancels it as it ends a handshake-era session. Invariant: within `BOUND_S` the client gets a
    refusal naming the revocation (a JSON-RPC error, no result), the command is killed, the audit log has
    the call's start and its end record (UNAVAILABLE, cancelled) and verifies; another grant's call in
    flight at the same time answers; the log has no traceback.
    What it does not prove: the refusal of a call whose answer had already started as an event stream
    (a call past 15 s or one sending progress; the unit test below covers that shape)."""
    command = f"sleep {seconds}"
    client_id = server.register()["client_id"]
    tokens = get_tokens(server, client_id)
    other = get_tokens(server, server.register()["client_id"])["access_token"]
    outcome: dict[str, object] = {}

    async def scenario() -> None:
        async with modern_client(server, tokens["access_token"]) as client, modern_client(server, other) as bystander:

            async def long_call() -> None:
                try:
                    outcome["answer"] = await client.call_tool("run_command", {"command": command})
                except Exception as exc:
                    outcome["error"] = exc

            async def other_call() -> None:
                outcome["other"] = await call(bystander, "run_command", command="sleep 1.5")

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(long_call)
                tasks.start_soon(other_call)
                await until(lambda: _running(["sleep", seconds]), "the command started")
                await anyio.to_thread.run_sync(end_grant, server, how, client_id, tokens)
                await until(lambda: "answer" in outcome or "error" in outcome, "the call ended")

    anyio.run(scenario)
    assert "answer" not in outcome, outcome
    assert "revoked or has expired" in str(outcome["error"]), outcome
    other_payload = outcome["other"]
    assert isinstance(other_payload, dict)
    assert other_payload["ok"], other_payload
    _assert_killed_and_recorded(server, command, seconds)
    assert "is revoked or has expired: cancelled its 1 call(s) in flight" in server.log()
    assert_log_clean(server)


def _one_modern_call() -> tuple[Scope, Receive]:
    """The scope and the request body of one 2026-07-28 tools/call (id 7) of grant-1's token."""
    token = AccessToken(token="t" * 43, client_id="c", scopes=["read"], subject="grant-1")
    scope: Scope = {
        "type": "http",
        "method": "POST",
        "path": "/mcp",
        "headers": [(b"mcp-protocol-version", b"2026-07-28")],
        "user": AuthenticatedUser(token),
    }
    request = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "run_command"}}
    pending: list[Message] = [{"type": "http.request", "body": json.dumps(request).encode(), "more_body": False}]

    async def receive() -> Message:
        if pending:
            return pending.pop()
        await anyio.sleep_forever()
        raise AssertionError  # unreachable

    return scope, receive


def test_revoked_grant_keeps_its_modern_era_event_stream_open() -> None:
    """A 2026-07-28 answer already committed to an event stream (a progress event sent, or 15 s passed)
    when its grant dies: `GrantCalls.end` cancels the app, whose stream then ends with one last event, the
    JSON-RPC error for the request's id naming the revocation. Another grant's `end` touches nothing.
    The app here is a stand-in for the SDK's stream (an event, then a wait); the live test above runs the
    SDK's own, on the answer that had not started."""
    cancelled = anyio.Event()

    async def long_stream(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"event: message\r\ndata: {}\r\n\r\n", "more_body": True})
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()

    calls = GrantCalls(long_stream)
    scope, receive = _one_modern_call()
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def scenario() -> None:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(calls, scope, receive, send)
                await until(lambda: len(sent) == 2, "the event stream started")
                assert calls.grants() == {"grant-1"}
                assert calls.end("grant-2") == 0
                assert calls.end("grant-1") == 1

    anyio.run(scenario)
    assert cancelled.is_set()
    assert calls.grants() == set()
    last = sent[-1]
    assert len(sent) == 3
    assert not last.get("more_body", False)
    event = last["body"].decode()
    assert event.startswith("event: message\r\ndata: ")
    assert event.endswith("\r\n\r\n")
    answer = json.loads(event.split("data: ", 1)[1])
    assert answer == {"jsonrpc": "2.0", "id": 7, "error": {"code": -32000, "message": REVOKED_MESSAGE}}


@pytest.mark.parametrize("held", ["head", "body"])
def test_revoked_grant_whose_answer_waits_for_a_slow_reader_is_answered_broken(held: str) -> None:
    """Found by review: GrantCalls counted an answer's head (or last body) as sent before uvicorn had written it,
    and uvicorn waits for a slow reader's socket to drain before it writes. A call cancelled while its head
    waited got the refusal's body first: a 500 and uvicorn's "Expected ASGI message 'http.response.start'" error
    line. The send here waits, as uvicorn's does, until the test lets it go. Invariant: a head that never went out
    is replaced by the 403 naming the revocation; a JSON answer whose head went out is ended without another
    message (uvicorn then closes the connection: its body's length cannot be met)."""
    sent: list[Message] = []
    drained = anyio.Event()
    app_cancelled = anyio.Event()

    async def send(message: Message) -> None:
        if not drained.is_set() and (message["type"] == "http.response.start") == (held == "head"):
            await drained.wait()  # the slow reader: this message waits for the socket to drain
        sent.append(message)

    async def json_answer(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"20")]
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b'{"jsonrpc":"2.0"...}'})
        finally:
            app_cancelled.set()

    calls = GrantCalls(json_answer)
    scope, receive = _one_modern_call()

    async def scenario() -> None:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(calls, scope, receive, send)
                await until(lambda: calls.grants() == {"grant-1"} and len(sent) == (held == "body"), "the send waits")
                assert calls.end("grant-1") == 1
                await app_cancelled.wait()
                drained.set()

    anyio.run(scenario)
    if held == "head":
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
        assert sent[0]["status"] == 403
        answer = json.loads(sent[1]["body"])
        assert answer == {"jsonrpc": "2.0", "id": 7, "error": {"code": -32000, "message": REVOKED_MESSAGE}}
    else:
        assert [m["type"] for m in sent] == ["http.response.start"]  # ended there: no body of another length
    assert calls.grants() == set()


def test_revoked_grant_whose_call_still_writes_its_end_record_is_cancelled_once() -> None:
    """Found by review: a cancelled call stays in flight while it writes its end record, shielded (the audit log on a
    slow disk), and the next poll, half a second later, cancelled and counted it again: the server log said once more
    that it was cancelled. Invariant: `end` counts a call once, and a second `end` finds nothing more to cancel, the
    call still running; it is answered with the refusal once it finishes."""
    record_written = anyio.Event()
    sent: list[Message] = []

    async def writing_its_end_record(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await record_written.wait()  # the shielded end record, on a slow disk

    async def send(message: Message) -> None:
        sent.append(message)

    calls = GrantCalls(writing_its_end_record)
    scope, receive = _one_modern_call()

    async def scenario() -> None:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(calls, scope, receive, send)
                try:
                    await until(lambda: calls.grants() == {"grant-1"}, "the call is in flight")
                    assert calls.end("grant-1") == 1
                    await anyio.sleep(0)
                    assert calls.grants() == {"grant-1"}  # still writing its record
                    assert calls.end("grant-1") == 0
                finally:
                    record_written.set()

    anyio.run(scenario)
    assert calls.grants() == set()
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 403

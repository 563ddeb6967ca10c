"""A cap on the MCP sessions one grant holds open (the 2025-11-25 handshake era; 2026-07-28 is stateless).

Each session is a server task with its own streams until the client ends it or it has been idle for the
SDK's idle timeout (30 minutes): one approved client opened 300 in 12 s. Past `per_grant` sessions, a
new one closes the grant's session idle the longest (as its idle timeout would; a client that lost track
of its sessions still connects); when every one is busy (a request or a GET stream in flight), the new
session is refused with 429. Sessions of other grants are never touched.

A grant revoked (or expired) ends what it holds: `end_revoked_forever` looks its sessions' grants up every
`REVOKED_CHECK_S` and terminates the sessions of those no longer live, as a DELETE would: their GET
streams end and their calls in flight are cancelled (each still gets its audit end record). Without it a
revoked grant kept up to `per_grant` sessions and their streams for the idle timeout, a held GET stream
for ever; the bearer check refuses only its next request. A revocation by the CLI is another process's
write, so this polls the database rather than waiting to be told.

The 2026-07-28 era holds no session, but its requests in flight (a long `tools/call`, a
`subscriptions/listen` stream) ran to their own end after the revocation. `GrantCalls` keeps them by
grant, and the same look-up cancels those of a dead grant: the call still gets its audit end record, the
client a JSON-RPC error saying why (an event, if its answer had started as an event stream).

The SDK keeps sessions in its session manager with the principal that opened them (`_session_owners`,
whose `subject` is bastion's grant id: see `BastionAuthProvider.load_access_token`); it has no public
accessor, so this reads that private mapping of the pinned SDK version (uv.lock).
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Final, cast

import anyio
import pydantic_core
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.streamable_http import GET_STREAM_KEY, StreamableHTTPServerTransport
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bastion.transports.http.connections import cut_on_purpose

logger = logging.getLogger("bastion.http.sessions")
RETRY_AFTER_S: Final = 5
REVOKED_CHECK_S: Final = 0.5
"""How often the grants holding sessions are looked up: one query while any session is open (30 us for
ten grants, 0.5 ms for 200)."""
ANONYMOUS: Final = ""
"""The key of every session when auth is off (a grant id is never empty)."""
STREAM_HANDOVER_S: Final = 2.0
"""How long a session's new GET stream waits for the one it replaces to end before it is refused (409)."""
_HANDOVER_STEP_S: Final = 0.1


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None


def grant_of(scope: Scope) -> str:
    """The grant behind a request (its token's subject), or `ANONYMOUS` with auth off."""
    user = scope.get("user")
    return (user.access_token.subject if isinstance(user, AuthenticatedUser) else None) or ANONYMOUS


def _modern(scope: Scope) -> bool:
    """A request the SDK serves on the 2026-07-28 era (its routing: a version header naming no handshake)."""
    version = _header(scope, b"mcp-protocol-version")
    return version is not None and version.decode("latin-1") not in HANDSHAKE_PROTOCOL_VERSIONS


def _opens_session(scope: Scope) -> bool:
    """A POST with no session id on the handshake era: the SDK makes a session for it if it initializes."""
    if scope.get("method") != "POST" or _header(scope, b"mcp-session-id") is not None:
        return False
    version = _header(scope, b"mcp-protocol-version")
    return version is None or version.decode("latin-1") in HANDSHAKE_PROTOCOL_VERSIONS


class SessionCap:
    """ASGI wrapper for /mcp, inside the bearer check (the grant is known), and the body read (replayed).

    Also drops a GET stream's `Last-Event-ID`: bastion keeps no event store, so there is nothing to replay,
    and the SDK answered such a GET with nothing at all (a 500 and an error line in the log, each time).
    The stream starts afresh, as a GET without it does.

    And refuses (409) a request on a session whose id is that of one still in flight there: the SDK keys a
    session's answers by ``str(id)``, so the second request's stream replaced the first's, whose POST was never
    answered and stayed open for ever, through a DELETE of the session and the grant's revocation, kept alive
    by its event stream's pings (found by attack: 30 such POSTs held a cap of 32 connections, unevictable).
    """

    def __init__(self, app: ASGIApp, manager: StreamableHTTPSessionManager, per_grant: int) -> None:
        self.app = app
        self.manager = manager
        self.per_grant = per_grant
        self.opening: Counter[str] = Counter()
        self.in_flight: dict[bytes, set[str]] = {}
        """Session id -> the ``str(id)`` of each of its requests in flight (the SDK's keys)."""
        self.streaming: set[bytes] = set()
        """Sessions with a GET stream being served."""
        self.waiting: dict[bytes, _Waiter] = {}
        """Sessions with a GET waiting for the stream being served to end -> that GET (one a session, the newest)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # With auth off (loopback only) every client is one grant: 2,000 sessions opened in 4.6 s held 75 MiB.
        if scope.get("method") == "GET" and _header(scope, b"last-event-id") is not None:
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"last-event-id"]}
        grant = grant_of(scope)
        if not _opens_session(scope):
            method = scope.get("method")
            session = _header(scope, b"mcp-session-id") if method in ("POST", "GET") else None
            if session is None or _modern(scope):
                await self.app(scope, receive, send)
            elif method == "GET":
                await self._one_stream(session, scope, receive, send)
            else:
                await self._one_id_at_a_time(session, scope, receive, send)
            return
        if not self._make_room(grant):
            await _too_many(send, self.per_grant)
            return
        # Counted as opening until its response starts: by then the SDK has registered the session.
        self.opening[grant] += 1
        pending = True

        async def watch(message: Message) -> None:
            nonlocal pending
            if pending and message["type"] == "http.response.start":
                pending = False
                self._opened(grant)
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if pending:
                self._opened(grant)

    async def _one_stream(self, session: bytes, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve a GET stream of `session`, once the one being served (if any) has ended: the newest wins.

        Found by review: the SDK checks for a session's stream before its response's task registers it, so GETs
        sent together all passed; each replaced the last, and the replaced streams, in no map, outlived the
        session's DELETE and the grant's revocation, pinging for ever (one grant held 1,023 of a 1,024-connection
        cap). Refusing every GET while one was served then refused a client reconnecting at once: its old
        stream's end (or a dead peer's, found only when a write fails) had not reached the server yet. So a new
        GET of the session's own grant ends the old stream and waits up to `STREAM_HANDOVER_S` for it (a step at
        a time: the old one may not have registered its stream with the SDK yet). One GET a session waits, the
        newest: the one it replaces answers 409 at once (found by review: with every GET waiting, one grant
        re-sending its session's GET on 70 connections held every connection slot, each one being served).
        A GET of a session that is not the grant's own, or gone, goes to the SDK, which answers 404.
        """
        grant = grant_of(scope)
        if self._own_session(session, grant) is None:
            await self.app(scope, receive, send)  # the SDK answers 404 and serves no stream
            return
        if (session in self.streaming or session in self.waiting) and not await self._handed_over(session, grant):
            if self._own_session(session, grant) is None:  # ended meanwhile (a DELETE): 404, as it now is
                await self.app(scope, receive, send)
            else:
                await send_rpc_error(
                    send, 409, -32600, "this session's event stream is open already: one GET stream each"
                )
            return
        self.streaming.add(session)
        try:
            await self.app(scope, receive, send)
        finally:
            self.streaming.discard(session)
            waiter = self.waiting.get(session)
            if waiter is not None:
                waiter.wake.set()

    async def _handed_over(self, session: bytes, grant: str) -> bool:
        """End `session`'s stream and wait for it to end; False if a newer GET came meanwhile, or time ran out."""
        previous = self.waiting.get(session)
        if previous is not None:
            previous.superseded = True
            previous.wake.set()
        me = self.waiting[session] = _Waiter()
        deadline = anyio.current_time() + STREAM_HANDOVER_S
        try:
            while session in self.streaming:
                transport = self._own_session(session, grant)
                left = deadline - anyio.current_time()
                if transport is None or left <= 0:
                    return False
                transport.close_standalone_sse_stream()
                with anyio.move_on_after(min(_HANDOVER_STEP_S, left)):
                    await me.wake.wait()
                if me.superseded:
                    return False
                me.wake = anyio.Event()
            return True
        finally:
            if self.waiting.get(session) is me:
                del self.waiting[session]

    def _own_session(self, session: bytes, grant: str) -> StreamableHTTPServerTransport | None:
        """The transport of `session` if `grant` opened it (only its own client may end its stream)."""
        session_id = session.decode("latin-1")
        transport = self.manager._server_instances.get(session_id)  # private: see the module docstring
        return transport if transport is not None and _subject(self.manager, session_id) == grant else None

    async def _one_id_at_a_time(self, session: bytes, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass a POST on `session` on, unless it is a request whose id the session has in flight (409)."""
        first = await receive()
        body = first.get("body", b"") if first["type"] == "http.request" else b""
        key = _request_key(scope, body)
        held = self.in_flight.setdefault(session, set())
        if key is not None and (key in held or key == GET_STREAM_KEY):
            await _id_in_flight(send, key)
            if not held:
                del self.in_flight[session]
            return
        if key is not None:
            held.add(key)
        given = False

        async def again() -> Message:  # the message read here, then the connection's next ones
            nonlocal given
            if given:
                return await receive()
            given = True
            return first

        try:
            await self.app(scope, again, send)
        finally:
            held.discard(key or "")
            if not held and self.in_flight.get(session) is held:
                del self.in_flight[session]

    def _opened(self, grant: str) -> None:
        self.opening[grant] -= 1
        if not self.opening[grant]:
            del self.opening[grant]

    def _sessions_of(self, grant: str) -> list[StreamableHTTPServerTransport]:
        return [transport for subject, transport in open_sessions(self.manager) if subject == grant]

    def _make_room(self, grant: str) -> bool:
        """True if the grant may open one more session, after closing its longest-idle one if need be."""
        sessions = self._sessions_of(grant)
        if len(sessions) + self.opening[grant] < self.per_grant:
            return True
        # An idle session's scope has a finite deadline (in-flight requests set it to infinity).
        idle = [s for s in sessions if s.idle_scope is not None and s.idle_scope.deadline != math.inf]
        if not idle or len(sessions) - 1 + self.opening[grant] >= self.per_grant:
            logger.warning(
                "grant %s has %d MCP sessions open, none idle: refused a new one", _named(grant), len(sessions)
            )
            return False
        oldest = min(idle, key=lambda s: s.idle_scope.deadline if s.idle_scope is not None else math.inf)
        assert oldest.idle_scope is not None
        oldest.idle_scope.cancel()
        logger.info("grant %s reached %d MCP sessions: closed the one idle longest", _named(grant), self.per_grant)
        return True


@dataclass(eq=False)
class _Waiter:
    """A GET waiting for its session's stream to end: woken by that end, or by a newer GET (superseded)."""

    wake: anyio.Event = field(default_factory=anyio.Event)
    superseded: bool = False


@dataclass(frozen=True, slots=True)
class BodyFacts:
    """What bastion's checks need of a POST body to /mcp: parsed as the SDK parses it, then dropped."""

    parsed: bool
    """False: not JSON, or nested past the parser's limit (the SDK refuses it too)."""
    request_key: str | None
    """The SDK's key of the JSON-RPC request (``str`` of its id); None for a notification or a response."""
    tools: tuple[str, ...]
    """The tools the message (or batch) calls; "" for a name that is not a string."""


_FACTS_KEY: Final = "bastion.body_facts"


def body_facts(scope: Scope, body: bytes) -> BodyFacts:
    """`body`'s facts, parsed once per request (`pydantic_core.from_json`, as the SDK) and kept in the scope, without
    the parsed value. Found by review: the session's id check parsed each POST with `json.loads`, 125 ms of the
    event loop for a 4 MiB array of zeros (52 ms this way), beside the scope check's own parse and the SDK's."""
    kept = scope.get(_FACTS_KEY)
    if kept is not None and kept[0] is body:
        return cast(BodyFacts, kept[1])
    try:
        message = pydantic_core.from_json(body)
    except ValueError:  # not JSON, or nested past the parser's recursion limit
        facts = BodyFacts(False, None, ())
    else:
        facts = BodyFacts(True, _key_of(message), _tools_of(message))
    scope[_FACTS_KEY] = (body, facts)
    return facts


def _key_of(message: object) -> str | None:
    if not isinstance(message, dict) or "method" not in message:
        return None
    found = message.get("id")
    return str(found) if isinstance(found, str | int) and not isinstance(found, bool) else None


def _tools_of(message: object) -> tuple[str, ...]:
    names = []
    for item in message if isinstance(message, list) else [message]:
        if isinstance(item, dict) and item.get("method") == "tools/call":
            params = item.get("params")
            name = params.get("name") if isinstance(params, dict) else None
            names.append(name if isinstance(name, str) else "")
    return tuple(names)


def _request_key(scope: Scope, body: bytes) -> str | None:
    """The SDK's key of the JSON-RPC request in `body`, or None if it is none (a notification, a response, a body
    the SDK refuses)."""
    if b'"id"' not in body and b"\\" not in body:  # no id, unless spelled with an escape
        return None
    return body_facts(scope, body).request_key


async def _id_in_flight(send: Send, key: str) -> None:
    message = f"a request with id {key[:64]!r} is already in flight on this session: give each request an id of its own"
    await send_rpc_error(send, 409, -32600, message)


async def send_rpc_error(send: Send, status: int, code: int, message: str, request_id: str | int | None = None) -> None:
    """An answer of HTTP `status` holding one JSON-RPC error (with `nosniff`, as every JSON answer)."""
    error = {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}
    data = json.dumps(error).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        (b"x-content-type-options", b"nosniff"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def open_sessions(manager: StreamableHTTPSessionManager) -> Iterator[tuple[str, StreamableHTTPServerTransport]]:
    """(grant, transport) of each session neither ending nor ended."""
    for session_id, transport in list(manager._server_instances.items()):  # private: see the module docstring
        closing = transport.idle_scope is not None and transport.idle_scope.cancel_called
        if not closing and not transport.is_terminated:
            yield _subject(manager, session_id), transport


def _subject(manager: StreamableHTTPSessionManager, session_id: str) -> str:
    """The grant that opened `session_id`."""
    owner = manager._session_owners.get(session_id)  # none with auth off: the SDK records no principal
    return (owner.get("subject") if owner is not None else None) or ANONYMOUS


@dataclass(eq=False)
class _Call:
    """One 2026-07-28 request in flight: its cancel scope and what of its answer went out."""

    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    body: list[bytes] = field(default_factory=list)
    started: bool = False
    event_stream: bool = False
    finished: bool = False


class GrantCalls:
    """ASGI wrapper for /mcp, inside the bearer check: the 2026-07-28 era's POSTs in flight, by grant.

    `end` cancels a grant's calls (the poller of `end_revoked_forever` calls it); each is then answered
    with `REVOKED_MESSAGE`: a 403 with a JSON-RPC error for the request's id if nothing was sent yet, that
    error as the last event of a started event stream. Not a 401: an OAuth client answers 401 by
    authorizing again and resending the request, and this call had already started running.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.running: dict[str, set[_Call]] = {}

    def grants(self) -> set[str]:
        return set(self.running)

    def end(self, grant: str) -> int:
        """Cancel the calls of `grant` in flight not cancelled yet; returns how many."""
        # Not again: a cancelled call still writing its shielded end record (a slow disk) stays here past the next
        # poll, and was counted, and logged, once more.
        calls = [call for call in self.running.get(grant, ()) if not call.scope.cancel_called]
        for call in calls:
            call.scope.cancel()
        return len(calls)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        grant = grant_of(scope)
        if grant == ANONYMOUS or scope.get("method") != "POST" or not _modern(scope):
            await self.app(scope, receive, send)
            return
        call = _Call()

        async def kept() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                call.body.append(message.get("body", b""))
            return message

        async def watched(message: Message) -> None:
            # Marked once sent: uvicorn waits for the socket to drain before it writes a message. Found by review:
            # marked before, a head still waiting for a slow reader counted as sent, and the refusal's body then
            # came first (a 500, and uvicorn's error line).
            await send(message)
            if message["type"] == "http.response.start":
                call.started = True
                call.event_stream = (b"content-type", b"text/event-stream") in message.get("headers", ())
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                call.finished = True

        self.running.setdefault(grant, set()).add(call)
        try:
            with call.scope:
                await self.app(scope, kept, watched)
        finally:
            self._done(grant, call)
        if call.scope.cancelled_caught and not call.finished:
            await _refuse_revoked(call, send)

    def _done(self, grant: str, call: _Call) -> None:
        calls = self.running.get(grant)
        if calls is not None:
            calls.discard(call)
            if not calls:
                del self.running[grant]


REVOKED_MESSAGE: Final = (
    "the grant of this token was revoked or has expired: the call was ended, and may have run in part or whole (the "
    "audit log says how far); authorize again"
)


def _request_id(body: bytes) -> str | int | None:
    """The id of the JSON-RPC request in `body` (the SDK has parsed it already: this is a call in flight)."""
    try:
        message = json.loads(body)
    except (ValueError, RecursionError):
        return None
    found = message.get("id") if isinstance(message, dict) else None
    return found if isinstance(found, str | int) and not isinstance(found, bool) else None


async def _refuse_revoked(call: _Call, send: Send) -> None:
    request_id = _request_id(b"".join(call.body))
    if not call.started:
        await send_rpc_error(send, 403, -32000, REVOKED_MESSAGE, request_id)
    elif call.event_stream:
        error = {"code": -32000, "message": REVOKED_MESSAGE}
        data = json.dumps({"jsonrpc": "2.0", "id": request_id, "error": error}).encode()
        await send({"type": "http.response.body", "body": b"event: message\r\ndata: " + data + b"\r\n\r\n"})
    else:
        # A JSON answer cut between its head and its body (its Content-Length cannot be met): returned without
        # its last chunk, so uvicorn closes the connection and the client sees the answer broken.
        cut_on_purpose()


async def end_dead_grants(
    manager: StreamableHTTPSessionManager, calls: GrantCalls, live: Callable[[Collection[str]], set[str]]
) -> None:
    """End what every grant `live` does not return (revoked or expired) holds: sessions and calls in flight.

    Args:
        manager: the SDK's session manager.
        calls: the 2026-07-28 era's calls in flight.
        live: which of the given grant ids are still live (`AuthStore.live_grants`).
    """
    held: dict[str, list[StreamableHTTPServerTransport]] = {}
    for grant, transport in open_sessions(manager):
        if grant != ANONYMOUS:
            held.setdefault(grant, []).append(transport)
    busy = calls.grants()
    if not held and not busy:
        return
    alive = live(held.keys() | busy)
    for grant, transports in held.items():
        if grant in alive:
            continue
        for transport in transports:
            # As a DELETE: the streams close, the session's loop ends and cancels its calls in flight.
            await transport.terminate()
        logger.warning("grant %s is revoked or has expired: ended its %d MCP session(s)", grant, len(transports))
    for grant in busy - alive:
        cancelled = calls.end(grant)
        if cancelled:
            logger.warning("grant %s is revoked or has expired: cancelled its %d call(s) in flight", grant, cancelled)


async def end_revoked_forever(
    manager: StreamableHTTPSessionManager, calls: GrantCalls, live: Callable[[Collection[str]], set[str]]
) -> None:
    """Run `end_dead_grants` every `REVOKED_CHECK_S` until cancelled (the server stopping)."""
    while True:
        await anyio.sleep(REVOKED_CHECK_S)
        try:
            await end_dead_grants(manager, calls, live)
        except sqlite3.Error as exc:  # a locked or failing database: the next round tries again
            logger.warning("could not look up the grants holding MCP sessions and calls: %s", exc)


def _named(grant: str) -> str:
    return grant or "(every client: auth is off)"


async def _too_many(send: Send, per_grant: int) -> None:
    message = f"this grant already has {per_grant} MCP sessions open and busy: end one (HTTP DELETE) or retry later"
    data = ('{"jsonrpc":"2.0","id":null,"error":{"code":-32000,"message":"' + message + '"}}').encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
    ]
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": data})

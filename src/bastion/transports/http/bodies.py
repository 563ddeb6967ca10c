"""Request bodies at /mcp: how many bytes of them the server holds at once, across clients.

Found by attack: one client (any approved one, or anyone on loopback with auth off) opened 150 connections,
each sending a 4 MiB tools/call body but its last byte; the server held every body read so far, 615 MiB
(1,024 connections: over 4 GiB, in the cgroup the sandboxes share). Now a body over `SMALL_BODY_BYTES`
takes its declared length (or, with none, the largest a body may be) from `BodyBudget` before it is read,
and gives it back when its request has been answered: the parsed arguments live as long as the call. A
request that finds no room waits, in turn, up to `wait_s`, then gets 503 with Retry-After. One grant holds
at most half of the budget, so another client's large request still finds room. Small bodies (nearly every
call) never wait: the connection cap and the head cap bound them.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Final

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bastion.transports.http.connections import declared_length
from bastion.transports.http.sessions import grant_of

__all__ = [
    "MAX_MCP_BODY_BYTES",
    "SMALL_BODY_BYTES",
    "BodyBudget",
    "Budgeted",
    "Refused",
    "body_or_refusal",
    "read_leased",
    "replay",
    "send_json",
]

MAX_MCP_BODY_BYTES: Final = 4 * 1024 * 1024
SMALL_BODY_BYTES: Final = 64 * 1024
RETRY_AFTER_S: Final = 1


@dataclass(eq=False)
class _Waiter:
    grant: str
    size: int
    woken: anyio.Event
    granted: bool = False


class BodyBudget:
    """Bytes of large request bodies held at once: `limit` in all, half of it per grant; waiters in turn.

    A waiter that only its own grant's half holds back does not hold back the others; one the whole
    budget holds back does, so a large body is never passed over by smaller ones until it times out.
    """

    def __init__(self, limit: int, wait_s: float) -> None:
        self.limit = limit
        self.wait_s = wait_s
        self.used = 0
        self.by_grant: Counter[str] = Counter()
        self._queue: list[_Waiter] = []

    def _grant_fits(self, grant: str, size: int) -> bool:
        return self.by_grant[grant] + size <= self.limit // 2

    async def take(self, grant: str, size: int) -> bool:
        """Take `size` bytes for `grant`, waiting in turn up to `wait_s` for room; False if none came."""
        # A waiter its own grant's half does not hold back waits for the whole budget: it goes first.
        if not any(self._grant_fits(w.grant, w.size) for w in self._queue) and self._fits(grant, size):
            self._add(grant, size)
            return True
        waiter = _Waiter(grant, size, anyio.Event())
        self._queue.append(waiter)
        try:
            with anyio.move_on_after(self.wait_s):
                await waiter.woken.wait()
        except BaseException:
            if waiter.granted:  # given room, then cancelled before it could use it
                self.give(grant, size)
            raise
        finally:
            if not waiter.granted:
                self._queue.remove(waiter)
                self._wake()  # it may have held back the ones behind it
        return waiter.granted

    def give(self, grant: str, size: int) -> None:
        self.used -= size
        self.by_grant[grant] -= size
        if not self.by_grant[grant]:
            del self.by_grant[grant]
        self._wake()

    def _fits(self, grant: str, size: int) -> bool:
        return self.used + size <= self.limit and self._grant_fits(grant, size)

    def _add(self, grant: str, size: int) -> None:
        self.used += size
        self.by_grant[grant] += size

    def _wake(self) -> None:
        for waiter in list(self._queue):
            if not self._grant_fits(waiter.grant, waiter.size):
                continue  # its own grant holds it back: the next may go
            if self.used + waiter.size > self.limit:
                return  # the first that waits for the whole budget keeps its turn
            self._add(waiter.grant, waiter.size)
            waiter.granted = True
            self._queue.remove(waiter)
            waiter.woken.set()

    @asynccontextmanager
    async def held(self, grant: str, size: int) -> AsyncIterator[bool]:
        """`size` bytes held for the block (True), or no room came in time (False, nothing held)."""
        if size <= SMALL_BODY_BYTES:
            yield True
            return
        if not await self.take(grant, size):
            yield False
            return
        try:
            yield True
        finally:
            self.give(grant, size)


@dataclass(frozen=True)
class Refused:
    status: int
    body: dict[str, str]
    headers: tuple[tuple[bytes, bytes], ...] = ()


TOO_LARGE: Final = Refused(413, {"error": "request_too_large", "error_description": "a request body is 4 MiB at most"})
BUSY: Final = Refused(
    503,
    {"error": "server_busy", "error_description": "too many large requests are being read: retry in a moment"},
    ((b"retry-after", str(RETRY_AFTER_S).encode()),),
)


@asynccontextmanager
async def read_leased(budget: BodyBudget, scope: Scope, receive: Receive) -> AsyncIterator[bytes | Refused | None]:
    """The request's body, read whole under its share of `budget` (held until the block ends), why not, or
    None if the client went away before it was whole (nothing to run, no one to answer). A body with no
    declared length (chunked) counts as the largest one may be."""
    headers = scope.get("headers", ())
    declared = declared_length(headers)
    if declared > MAX_MCP_BODY_BYTES:
        yield TOO_LARGE
        return
    counted = declared if any(name == b"content-length" for name, _ in headers) else MAX_MCP_BODY_BYTES
    async with budget.held(grant_of(scope), counted) as room:
        if not room:
            yield BUSY
            return
        yield await _read(receive)


@asynccontextmanager
async def body_or_refusal(
    budget: BodyBudget, scope: Scope, receive: Receive, send: Send
) -> AsyncIterator[bytes | None]:
    """`read_leased`, with its refusal sent (then None; None too when the client went away)."""
    async with read_leased(budget, scope, receive) as body:
        if isinstance(body, Refused):
            await send_json(send, body.status, body.body, list(body.headers))
            yield None
        else:
            yield body


async def _read(receive: Receive) -> bytes | Refused | None:
    """The whole body, `TOO_LARGE` past `MAX_MCP_BODY_BYTES`, or None if the client went away first.
    Found by review: a body cut by a disconnect was run as the whole one (a write_file of half its content)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_MCP_BODY_BYTES:
            return TOO_LARGE
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Callable[[], Awaitable[Message]]:
    """A `receive` that gives the app `body` (already read), then what the connection sends next."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def send_json(send: Send, status: int, body: dict[str, str], headers: list[tuple[bytes, bytes]]) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                (b"x-content-type-options", b"nosniff"),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class Budgeted:
    """ASGI wrapper for /mcp with auth off: POST bodies read under the budget (with auth on, `RequireToken`
    reads them so, after the bearer check: a request without a token never takes any of it)."""

    def __init__(self, app: ASGIApp, budget: BodyBudget) -> None:
        self.app = app
        self.budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        async with body_or_refusal(self.budget, scope, receive, send) as body:
            if body is not None:
                await self.app(scope, replay(body, receive), send)

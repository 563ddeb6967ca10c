"""What re-checking a preview's login costs a streaming response: the relay (`_Body`) between a real HTTP/1.1
connection to an app on a socket (httpcore, as the preview listener makes it) and an ASGI browser side.

A response of a preview that is not public ends once the login that opened it does (test_preview_logout.py,
against a live server). The login is a database query: made for each piece of a body, an app sending small
pieces as fast as it can would make the server query its database thousands of times a second per request.

What this proves: the login is looked up at most once per `STANDING_CHECK_S` however many pieces pass, and the
response ends, without its last chunk, within a period of the login ending while the app still sends.
What it does not prove: the end against a real session store (test_preview_logout.py does).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import httpcore2
import pytest
from starlette.types import Message

from bastion.transports.http.preview import CappedBody, SocketStream, _Body, _Progress, _Standing
from bastion.transports.http.preview_ws import STANDING_CHECK_S

PIECE_INTERVAL_S = 0.002
PIECES_BEFORE_LOGOUT = 600
"""Pieces passed on before the login ends: over a second of them, so the check has run at least once."""
WAIT_S = 10.0
"""The bound on the whole exchange (a failure, never a pace)."""


async def _trickling_app(sock: socket.socket) -> None:
    """An app that answers any request with a chunked body of one-byte pieces, one every `PIECE_INTERVAL_S`,
    for ever."""
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(PIECE_INTERVAL_S)
    except OSError:
        pass
    finally:
        writer.close()


class _Browser:
    """The ASGI browser side: it stays, and counts what it is sent."""

    def __init__(self) -> None:
        self.received = 0
        self.messages: list[Message] = []
        self.enough = asyncio.Event()
        self.stays = asyncio.Event()
        self.asked = False

    async def receive(self) -> Message:
        if not self.asked:
            self.asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.stays.wait()  # never set: the browser does not leave
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.messages.append(message)
        self.received += len(message.get("body", b""))
        if self.received >= PIECES_BEFORE_LOGOUT:
            self.enough.set()


class _Login:
    """The session check, counted: valid until `end`."""

    def __init__(self) -> None:
        self.lookups = 0
        self.valid = True

    def __call__(self) -> bool:
        self.lookups += 1
        return self.valid


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    proxy_side, app_side = socket.socketpair()
    for sock in (proxy_side, app_side):
        sock.setblocking(False)
    yield proxy_side, app_side
    proxy_side.close()
    app_side.close()


async def _relay(proxy_side: socket.socket, browser: _Browser, login: _Login) -> None:
    reader, writer = await asyncio.open_connection(sock=proxy_side)
    connection = httpcore2.AsyncHTTP11Connection(
        httpcore2.Origin(b"http", b"127.0.0.1", 8080), SocketStream(reader, writer)
    )
    try:
        request = httpcore2.Request(
            "GET", httpcore2.URL("http://127.0.0.1:8080/trickle"), headers=[(b"host", b"127.0.0.1:8080")]
        )
        response = await connection.handle_async_request(request)
        body = CappedBody(browser.receive, 1 << 20)
        await _Body(response, browser.send, body, 1 << 20, _Progress()).relay(_Standing(lambda: True, login))
    finally:
        await connection.aclose()


def test_a_flood_of_pieces_makes_no_login_lookup_per_piece(pair: tuple[socket.socket, socket.socket]) -> None:
    """Attack: an app streams one-byte pieces to a logged-in browser as fast as the relay passes them; each
    piece costing a session query would load the server's database. Invariant: one lookup per
    `STANDING_CHECK_S` at most, and the response is cut within about one period once the login ends."""
    proxy_side, app_side = pair
    browser, login = _Browser(), _Login()

    async def main() -> tuple[float, float]:
        app = asyncio.ensure_future(_trickling_app(app_side))
        started = time.monotonic()
        try:
            async with asyncio.timeout(WAIT_S):
                relay = asyncio.ensure_future(_relay(proxy_side, browser, login))
                await browser.enough.wait()
                login.valid = False
                ended = time.monotonic()
                await relay
            return ended - started, time.monotonic() - ended
        finally:
            app.cancel()
            await asyncio.gather(app, return_exceptions=True)

    streamed_s, cut_after_s = asyncio.run(main())
    assert browser.received >= PIECES_BEFORE_LOGOUT
    assert login.lookups <= 2 + (streamed_s + cut_after_s) / STANDING_CHECK_S, (login.lookups, streamed_s)
    assert cut_after_s < STANDING_CHECK_S + 1.0
    assert all(message.get("more_body", True) for message in browser.messages), "the cut body was ended whole"

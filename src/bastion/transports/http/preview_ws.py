"""A preview's WebSocket: the browser's (uvicorn's, ASGI) joined to the app's, spoken with wsproto over
the socket the sandbox's agent connected. Messages are capped (`MAX_WS_MESSAGE_BYTES`, in at most
`MAX_PIECES` pieces); the app's handshake must end within `HANDSHAKE_TIMEOUT_S`. Everything from
the app is hostile: a malformed frame ends the connection (wsproto raises), never the server.

Backpressure: nothing more is read from the app until the browser's connection has taken what it was sent
(`_Browser.taken`), so a WebSocket holds one message at most in the server, and the app's own sends wait in
its sandbox. A browser that takes nothing for `send_stall_timeout_s` meanwhile is reset. Found by attack:
200 public-preview WebSockets that never read, to an app pushing 1 MiB messages, held 3.4 MB of the server's
memory and ~6 MB of kernel socket memory each, counted by no limit (`max_unsent_mib` ends at the upgrade)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Final

from starlette.types import Message as AsgiMessage
from starlette.types import Receive, Scope, Send
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Message,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from bastion.safety.rates import ByteRate
from bastion.transports.http.connections import (
    WEBSOCKET_CONNECTION,
    SummaryLog,
    WebSocketConnection,
    close_or_reset,
)

logger = logging.getLogger("bastion.http.preview")
MAX_WS_MESSAGE_BYTES: Final = 1 << 20
MAX_PIECES: Final = 4096
"""Pieces of an app's message (a frame, or the part of one a read brought) at most. Empty continuation frames,
2 bytes each on the wire, otherwise grew a message for ever (2 M of them: 19 MiB and 14 s of CPU). Counted
apart from the bytes: charged 256 bytes each against the byte cap instead, a message of exactly the cap was
refused (1009) whenever a read ended a few bytes into it. The browser's side needs none: uvicorn appends its
pieces to one buffer, capped by bytes."""
PIECE_COST_BYTES: Final = 32 * 1024
"""What a piece spends of its sandbox's preview rate at least (`preview.PREVIEW_BYTES_PER_S`): an event from the app's
WebSocket (a frame or the part of one a read brought, control frames too), a read of a response's head, a piece of
its body. At the default rate, at most 2,048 a second a sandbox."""
HANDSHAKE_TIMEOUT_S: Final = 10.0
STANDING_CHECK_S: Final = 1.0
"""How often a live WebSocket checks that it may go on: its preview still exposed and, unless the preview is
public, the administrator's login that opened it still valid (a poll: the registry has no events, an expiry is
a time, and a logout, a revoke all or `admin set-password` is a database write, maybe by another process)."""
READ_BYTES: Final = 65_536
"""What one read from the app takes; the app's stream buffers at most twice this before it stops reading."""
APP_RECEIVE_BUFFER: Final = 65_536
"""The kernel's receive buffer for the app's socket (Linux doubles it; its default grows to tcp_rmem's 32 MiB):
what the relay does not read stays in the app's own send queue, in its sandbox."""
DRAIN_POLL_S: Final = 0.005
MAX_DRAIN_POLL_S: Final = 1.0
"""How often a browser's connection that is not drained is measured again: `DRAIN_POLL_S`, doubling up to this
while the browser takes nothing (a stalled one costs a wake-up a second, a reading one waits little)."""
_stalled = SummaryLog("reset preview WebSockets whose browsers took nothing of a message in time", logging.INFO)


@dataclass
class Standing:
    """Whether an open request or WebSocket of a preview may go on: its preview still exposed (`exposed`, a dict
    lookup) and, unless the preview is public, the login session that opened it still valid (`logged_in`, a
    database query: made at most once every `STANDING_CHECK_S` per connection, not per message). `checked`: when
    the whole check was last made (the admission's, by default: the standing is made right after it)."""

    exposed: Callable[[], bool]
    logged_in: Callable[[], bool]
    label: str = "preview"
    checked: float = field(default_factory=time.monotonic)

    def __call__(self) -> bool:
        """The whole check, now."""
        self.checked = time.monotonic()
        return self._safely(lambda: self.exposed() and self.logged_in())

    def due_in(self) -> float:
        """Seconds until the whole check is due again (0: it is)."""
        return max(0.0, self.checked + STANDING_CHECK_S - time.monotonic())

    def if_due(self) -> bool:
        """The whole check if it is due, else only the exposure: for the moment an answer starts. An app may take
        `preview_timeout_s` to answer, a WebSocket's handshake `HANDSHAKE_TIMEOUT_S`, and the login can end
        meanwhile; a quick answer costs no query."""
        return self() if self.due_in() == 0 else self._safely(self.exposed)

    def _safely(self, check: Callable[[], bool]) -> bool:
        """`check`, failing closed: a check that raises (whatever it is) ends the connection, in one log line.
        Found by review: a check raising anything but sqlite3.Error ended the relay's watch, the body went on."""
        try:
            return check()
        except Exception as exc:
            reason = f"{type(exc).__name__}: {str(exc)[:200]}"
            logger.warning("%s: could not check that it may go on, ended: %s", self.label, reason)
            return False


class BrowserStalled(OSError):
    """The browser took nothing it was sent for its connection's stall time."""


class _Browser:
    """The browser's side: ASGI `send`, and the connection (offered by the server: `WebSocketConnection`) whose
    buffer the relay waits on. Without one (a server that does not offer it), nothing is waited for."""

    def __init__(self, scope: Scope, send: Send) -> None:
        offered = scope.get("extensions", {}).get(WEBSOCKET_CONNECTION)
        self.send = send
        self.connection = offered if isinstance(offered, WebSocketConnection) else None

    async def taken(self) -> None:
        """Return once the server holds no more for the browser than its connection's low-water mark (the
        kernel took the rest; uvicorn's send, which waits on that mark too, then does not wait).

        Raises BrowserStalled, having reset the connection, when the browser took nothing for the stall time:
        uvicorn's close would wait for the buffer to drain, for as long as the browser reads nothing."""
        if self.connection is None:
            return
        transport, loop = self.connection.transport, asyncio.get_running_loop()
        drained, _ = transport.get_write_buffer_limits()
        held, since, pause = transport.get_write_buffer_size(), loop.time(), DRAIN_POLL_S
        while held > drained:
            await asyncio.sleep(pause)
            now = transport.get_write_buffer_size()
            if now < held:
                since, pause = loop.time(), DRAIN_POLL_S
            elif loop.time() - since >= self.connection.stall_s:
                close_or_reset(transport)
                _stalled.add(loop)
                raise BrowserStalled(f"the browser took nothing for {self.connection.stall_s:g} s")
            else:
                pause = min(pause * 2, MAX_DRAIN_POLL_S)
            held = now


class _Link:
    """The app's side: a wsproto client over the socket."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout_s: float) -> None:
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.reader = reader
        self.writer = writer
        self.timeout_s = timeout_s
        self.early: Iterator[Event] | None = None  # what came in the same read as the app's accept, unparsed

    async def send(self, event: Event) -> None:
        """Raises TimeoutError (an OSError) when the app takes nothing for `timeout_s`: found by attack, a
        relay to an app that never read waited for ever, past the browser's leaving."""
        self.writer.write(self.ws.send(event))
        async with asyncio.timeout(self.timeout_s):
            await self.writer.drain()

    async def events(self) -> Iterator[Event]:
        """The events of the app's next read, parsed as they are taken (a read may hold 32,768 empty frames)."""
        if self.early is not None:
            early, self.early = self.early, None
            return early
        data = await self.reader.read(READ_BYTES)
        if not data:
            raise OSError("the app closed the connection")
        self.ws.receive_data(data)
        return self.ws.events()


async def _handshake(link: _Link, port: int, target: bytes, subprotocols: list[str]) -> AcceptConnection | None:
    await link.send(Request(host=f"127.0.0.1:{port}", target=target.decode("latin-1"), subprotocols=subprotocols))
    async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
        while True:
            events = await link.events()
            for event in events:
                if isinstance(event, AcceptConnection):
                    link.early = events  # the rest, parsed as it is taken
                    return event
                if isinstance(event, RejectConnection | RejectData):
                    return None


async def proxy_websocket(
    scope: Scope,
    receive: Receive,
    send: Send,
    sock: socket.socket,
    port: int,
    target: bytes,
    standing: Standing,
    rate: ByteRate,
    app_timeout_s: float = 30.0,
) -> tuple[int, int]:
    """Run one proxied WebSocket to its end; (the status to audit, bytes sent to the browser).

    `standing` says whether it may go on: checked after the app's handshake (if due: `Standing.if_due`), then
    every `STANDING_CHECK_S`, so a WebSocket ends (close 1008 both ways) soon after unexpose_port, the URL's
    expiry, its sandbox's close or the end of the login that opened it, even an idle one.
    The status: 101 once both sides were joined, 502 when the app refused or failed its handshake, 403 when
    the WebSocket could no longer go on once the app's handshake ended (the browser is refused, nothing of the
    app passed on), 499 (as nginx names it) when the browser left during the app's handshake.
    `rate`: the sandbox's, spent by each event from the app (`PIECE_COST_BYTES` at least), which waits while it is
    in debt. `app_timeout_s`: how long the app may take nothing the browser sends before the WebSocket ends."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, APP_RECEIVE_BUFFER)
    reader, writer = await asyncio.open_connection(sock=sock, limit=READ_BYTES)
    link = _Link(reader, writer, app_timeout_s)
    try:
        try:
            accepted = await _handshake(link, port, target, list(scope.get("subprotocols", [])))
        except (TimeoutError, OSError, LocalProtocolError, RemoteProtocolError):
            accepted = None
        if accepted is None:
            await close_browser(send, 1011)
            return 502, 0
        if not standing.if_due():  # found by review: a login ended during a slow handshake was still accepted
            _close_app(link, 1008)
            await close_browser(send, 1008)  # before the accept: uvicorn answers the upgrade with 403
            return 403, 0
        try:
            await send({"type": "websocket.accept", "subprotocol": accepted.subprotocol})
        except OSError:  # the browser left during the app's handshake
            return 499, 0
        sent = [0]
        to_app = asyncio.ensure_future(_browser_to_app(receive, link))
        to_browser = asyncio.ensure_future(_app_to_browser(_Browser(scope, send), link, sent, rate))
        revoked = asyncio.ensure_future(_until_revoked(standing))
        done, pending = await asyncio.wait({to_app, to_browser, revoked}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if revoked in done:  # closed once the relays have stopped: nothing of the app follows the close
            _close_app(link, 1008)
            await close_browser(send, 1008)
        for task in done:
            if not task.cancelled() and task.exception() is not None:  # read, or asyncio logs it at collection
                logger.warning("preview WebSocket to port %d ended: %r", port, task.exception())
        return 101, sent[0]
    finally:
        close_or_reset(writer.transport)  # what the app did not take is dropped, not kept for it


async def _until_revoked(standing: Standing) -> None:
    """Return once the WebSocket may no longer go on (the URL or the login is revoked: the caller closes both sides
    with 1008). Polled (see `STANDING_CHECK_S`), the first time when the check after the admission is due."""
    while True:
        await asyncio.sleep(standing.due_in())
        if not standing():
            return


async def _browser_to_app(receive: Receive, link: _Link) -> None:
    with contextlib.suppress(OSError, LocalProtocolError):
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                await link.send(CloseConnection(code=int(message.get("code", 1000))))
                return
            if message.get("text") is not None:
                await link.send(TextMessage(data=message["text"]))
            elif message.get("bytes") is not None:
                await link.send(BytesMessage(data=message["bytes"]))


async def _app_to_browser(browser: _Browser, link: _Link, sent: list[int], rate: ByteRate) -> None:
    """Whole messages from the app to the browser, each read once the browser took the one before and the sandbox's
    rate allows; a close, a broken app, an oversized message or a browser that stalls ends it."""
    send = browser.send
    parts: list[str | bytes] = []
    size = pieces = 0
    try:
        while True:
            await browser.taken()
            for event in await link.events():
                # Every event spends, control frames and fragments too (found by review: endless Pongs, or messages
                # of 4,000 one-byte fragments, cost 0.9 cores and other callers' p90 6 s, charged nothing or once).
                wait = rate.owed_s(max(len(event.data) if isinstance(event, Message) else 0, PIECE_COST_BYTES))
                if wait > 0:
                    await asyncio.sleep(wait)
                if isinstance(event, Ping):
                    await link.send(event.response())
                elif isinstance(event, CloseConnection):
                    await close_browser(send, event.code)
                    return
                elif isinstance(event, Message):
                    parts.append(event.data)
                    length = len(event.data.encode()) if isinstance(event.data, str) else len(event.data)
                    size += length
                    pieces += 1
                    if size > MAX_WS_MESSAGE_BYTES or pieces > MAX_PIECES:
                        _close_app(link, 1009)
                        await close_browser(send, 1009)
                        return
                    if event.message_finished:
                        await _forward(send, parts)
                        sent[0] += size
                        parts, size, pieces = [], 0, 0
    except BrowserStalled:
        _close_app(link, 1001)
    except (OSError, LocalProtocolError, RemoteProtocolError):
        await close_browser(send, 1011)


def _close_app(link: _Link, code: int) -> None:
    """Tell the app why (its socket closes next); not awaited, as an app that stops reading must not hold us."""
    with contextlib.suppress(LocalProtocolError):
        link.writer.write(link.ws.send(CloseConnection(code=code)))


async def close_browser(send: Send, code: int) -> None:
    """Close the browser's side; a browser already gone (uvicorn's ClientDisconnected, an OSError) is not an
    error: the connection is over either way, and its audit record must still be written."""
    with contextlib.suppress(OSError):
        await send({"type": "websocket.close", "code": code})


async def _forward(send: Send, parts: list[str | bytes]) -> None:
    """Send the message made of `parts`, emptied first: the message is then held once, not twice."""
    message: AsgiMessage
    if isinstance(parts[0], str):
        message = {"type": "websocket.send", "text": "".join(str(p) for p in parts)}
    else:
        message = {"type": "websocket.send", "bytes": b"".join(p for p in parts if isinstance(p, bytes))}
    parts.clear()
    await send(message)

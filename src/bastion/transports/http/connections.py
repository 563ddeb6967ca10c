"""Connection limits for `bastion serve --http`: deadlines for request heads and bodies, and a connection cap.

uvicorn (0.54, h11) closes a keep-alive connection only after a response (`timeout_keep_alive`); a
connection that never finishes its request head, or trickles its body, is kept for ever, and it
applies `limit_concurrency` by answering 503 to every new request once that many sockets are open,
so idle sockets lock out everyone. Held sockets also use file descriptors: at the process's limit,
`accept()` fails (EMFILE) and nobody can connect. This module is the small protocol glue for that:

- a request head must arrive within `[http] request_head_timeout_s` of the connection opening (or of
  the previous response); a body within `request_body_timeout_s`, plus time for its declared length
  (at most the largest body the listener accepts) at `MIN_BODY_RATE`; otherwise the connection is
  closed (slowloris);
- at most `max_connections` are open. A new connection over the cap closes the connection that has
  waited longest for a request head or body (one the application is not serving yet); when every
  connection is being served, the new one is closed. The administrator's browser or a client thus
  always gets in while the sockets held open are idle ones.
- the cap, and the accept burst, stay below the file-descriptor limit, so accept() does not fail for
  want of one (see `fd_limits` for the sockets a flood keeps in flight beyond the cap);
- refusals are logged as one summary line per `LOG_EVERY_S`, never a line (or traceback) per socket;
- answers a client does not read are bounded (`UnsentWatch`): what all connections hold unsent (uvicorn's
  buffers and the kernel's send queues) stays under `[http] max_unsent_mib`, the connections that have
  held theirs longest reset first, and a connection whose client takes none of its answer for
  `send_stall_timeout_s` is reset. Found by attack: 400 connections of one client, each asking for a
  1 MiB file and never reading, held 3.4 MB apiece in the kernel and ~1 MiB in the server (1,024 of them:
  about 4.5 GiB, charged to the cgroup the sandboxes share); a connection closed with its answer unread
  also kept its slot for ever;
- a WebSocket upgrade ends the head deadline: uvicorn hands the socket to its WebSocket protocol, which
  takes this one's place in the count and is served (never evicted) until it closes. Its keepalive pings
  (uvicorn's 20 s interval and timeout) close a peer that is gone or stops reading; one that answers
  stays, as an idle WebSocket (a dev server's reload socket) is meant to, within the cap. Its unsent bytes
  leave `UnsentWatch` there: the application gets the connection (`WebSocketConnection`, a scope extension)
  to bound them itself (the preview relay waits for the browser to take each message, and resets a stalled one).

- over TLS, a connection the server closes ends once all it wrote (the answer and its close_notify) is in
  the kernel's queue (`tls_flushed`), as a plain connection does, instead of asyncio's wait of up to 30 s for
  the client's close_notify: a client that never sends one held the connection's slot that long.

What this does not do: limit a client that completes its requests (rate limits are per endpoint), or
time TLS handshakes (asyncio allows 60 s).
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import contextlib
import contextvars
import fcntl
import logging
import os
import resource
import socket
import struct
import termios
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("bastion.http.connections")

MIN_BODY_RATE: Final = 32 * 1024
"""Bytes a second a declared body may take beyond the body timeout (4 MiB: 128 s more)."""
KEEP_ALIVE_S: Final = 15
"""uvicorn's idle time for a kept-alive connection. Longer than the pool expiry of the MCP SDKs' HTTP
clients (httpx 5 s, undici 4 s): the client drops an idle connection before the server does. With
both at 5 s, a request sent on a connection the server was just closing failed with a read error.
`request_head_timeout_s` (10 s by default) closes an idle connection first."""
MAX_HEAD_BYTES: Final = 16 * 1024
MAX_BACKLOG: Final = 128
"""listen() backlog at most, and what one accept burst may take before any connection is counted."""
IN_FLIGHT_BURSTS: Final = 4
"""Accept bursts a flood can hold beyond the cap (see `fd_limits`)."""
LOG_EVERY_S: Final = 10.0
TLS_CLOSE_POLL_S: Final = 0.1
"""How often a TLS connection the server is closing is checked for all it wrote having reached the kernel."""

Phase = Literal["head", "body", "served"]


@dataclass(frozen=True)
class FdLimits:
    """What each listener may hold: `backlog` (listen() and asyncio's accept burst) and `cap` connections."""

    backlog: int
    cap: int


def fd_limits(max_connections: int, listeners: int = 1, soft: int | None = None) -> FdLimits:
    """Per-listener limits that keep a flood of connections inside the open-file limit.

    Beyond the cap, a flood holds sockets asyncio has accepted but not handed over yet: one loop turn
    accepts a burst (up to the backlog), the next makes their transports, the next calls
    `connection_made` (which evicts), the next closes the evicted sockets; meanwhile each turn accepts
    another burst. `IN_FLIGHT_BURSTS` bursts per listener are thus reserved; a third of the rest goes to
    connections, and the other two thirds stay for the store, the audit log and the sandboxes' pipes and
    sockets. The burst shrinks with a small limit (512 files: bursts of 32, a cap of 128). `soft`: the
    open-file limit, the process's own when None.
    """
    if soft is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return FdLimits(MAX_BACKLOG, max_connections)
    backlog = max(16, min(MAX_BACKLOG, soft // 16))
    spare = soft - listeners * IN_FLIGHT_BURSTS * backlog
    return FdLimits(backlog, max(16, min(max_connections, spare // 3 // listeners)))


def raise_fd_limit() -> int:
    """Raise the soft open-file limit to the hard one (systemd's LimitNOFILE sets both); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def declared_length(headers: Iterable[tuple[bytes, bytes]]) -> int:
    """A request's Content-Length as a number (0 if absent; h11 has refused a malformed one)."""
    for name, value in headers:
        if name == b"content-length" and value.isdigit():
            return int(value)
    return 0


class SummaryLog:
    """Count an event; log one line about it at most every `LOG_EVERY_S` (the count since the last line)."""

    def __init__(self, text: str, level: int = logging.WARNING) -> None:
        self.text = text
        self.level = level
        self.count = 0
        self.last = -LOG_EVERY_S
        self.pending: asyncio.TimerHandle | None = None

    def add(self, loop: asyncio.AbstractEventLoop) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= LOG_EVERY_S:
            self.flush()
        elif self.pending is None:
            self.pending = loop.call_later(LOG_EVERY_S - (now - self.last), self.flush)

    def flush(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None
        if self.count:
            logger.log(self.level, "%s (%d in the last %.0f s)", self.text, self.count, LOG_EVERY_S)
            self.count = 0
            self.last = time.monotonic()


LINGER_S: Final = 2.0
"""How long a connection refused for its head's size reads and drops the rest before it closes."""
HEAD_TOO_LARGE_BODY: Final = (
    b"Request Header Fields Too Large: this browser sent over 16 KiB of headers, most likely cookies a page "
    b"on this host set (a sandbox's preview). They are cleared now: reload, and log in again.\n"
)
HEAD_TOO_LARGE_HEADERS: Final = (
    (b"content-type", b"text/plain; charset=utf-8"),
    (b"content-length", str(len(HEAD_TOO_LARGE_BODY)).encode()),
    (b"clear-site-data", b'"cookies"'),
)


class HeadCap:
    """The head cap for a head h11 read whole: it enforces `MAX_HEAD_BYTES` only on one that arrives in pieces,
    so a 156 KB Cookie header sent in one write passed or not by the timing of reads. Refused the same way
    (`GuardedH11Protocol.send_400_response`); a WebSocket handshake is refused before it is accepted."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and _head_bytes(scope) > MAX_HEAD_BYTES:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1009})
                return
            await send({"type": "http.response.start", "status": 431, "headers": list(HEAD_TOO_LARGE_HEADERS)})
            await send({"type": "http.response.body", "body": HEAD_TOO_LARGE_BODY})
            return
        await self.app(scope, receive, send)


def _head_bytes(scope: dict[str, Any]) -> int:
    """About what the request's head took on the wire: its target and its header lines."""
    target = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
    return target + sum(len(key) + len(value) + 4 for key, value in scope.get("headers", ()))


WATCH_MIN_BYTES: Final = 64 * 1024
"""Unsent bytes below this are not watched: a small answer in a socket's queue costs what its slot does."""
_INT = struct.Struct("i")
_LINGER_NONE: Final = struct.pack("ii", 1, 0)
_TCP_INFO_BYTES: Final = 136
_BYTES_ACKED = struct.Struct("Q")
_BYTES_ACKED_AT: Final = 120
"""`tcpi_bytes_acked` in Linux's `struct tcp_info` (4.1 and later; the struct only grows at its end)."""


MAX_KEPT_CLOSED: Final = 256
"""Closed connections kept open in the kernel's name at most (`UnsentWatch.closing`): a file each."""
POLL_S: Final = 1.0
"""How often a held answer is measured again: a drained one is let go within this."""


def kept_limit(soft: int | None = None) -> int:
    """Closed connections `UnsentWatch` may keep, at the open-file limit `soft` (the process's if None): a
    sixteenth of it, within 16 and `MAX_KEPT_CLOSED`, out of what `fd_limits` leaves beyond the connections."""
    if soft is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_KEPT_CLOSED
    return max(16, min(MAX_KEPT_CLOSED, soft // 16))


def queued_bytes(sock: socket.socket) -> int:
    """What `sock`'s peer has not acknowledged of what was sent on it (its send queue, SIOCOUTQ)."""
    try:
        queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(_INT.size))
    except (OSError, ValueError):  # ValueError: closed already (its fileno is -1)
        return 0
    return int(_INT.unpack(queued)[0])


def close_or_reset(transport: asyncio.WriteTransport) -> None:
    """Close `transport`, or reset it when its peer has not taken all that was written to it: a close would
    keep that, in the server's buffer or the kernel's queue, for as long as the peer reads nothing."""
    sock = transport.get_extra_info("socket")
    if not transport.get_write_buffer_size() and (sock is None or not queued_bytes(sock)):
        transport.close()
        return
    if sock is not None:
        _reset_at_close(sock)
    transport.abort()


def _reset_at_close(sock: socket.socket) -> None:
    """A reset, not a close, when `sock` is closed: a closed socket keeps its unsent queue in the kernel."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_NONE)


def acked_bytes(sock: socket.socket) -> int | None:
    """How many bytes `sock`'s peer has acknowledged so far (TCP only; None when unknown)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except OSError:
        return None
    if len(info) < _BYTES_ACKED_AT + _BYTES_ACKED.size:
        return None
    return int(_BYTES_ACKED.unpack_from(info, _BYTES_ACKED_AT)[0])


@dataclass
class _Held:
    """An answer its client has not taken: on a live connection (`transport`), or on one the server has
    closed (`transport` None: `sock` is a duplicate of its socket, kept so its queue is still counted)."""

    sock: socket.socket
    transport: asyncio.Transport | None
    size: int
    acked: int | None
    since: float = 0.0
    """When the client last took some of it (monotonic)."""
    timer: asyncio.TimerHandle | None = None

    def unsent(self) -> int:
        held = self.transport.get_write_buffer_size() if self.transport is not None else 0
        return held + queued_bytes(self.sock)


class UnsentWatch:
    """Answers written to connections whose clients have not taken them: bounded in bytes and in time.

    Measured when an answer is complete, when a connection's buffer passes its high-water mark (the only
    moments what a connection holds grows) and when the server closes a connection; between them it only
    shrinks, so the sum kept here is never below the truth, and only when it passes the limit is every
    held answer measured again. Then the ones held longest are reset (their answers dropped, in the
    server and in the kernel) until the rest fit. One whose client acknowledges nothing for `stall_s` is
    reset too. Resetting loses only answers: the calls ran, and the audit log has them.

    A connection the server closes (after its head timeout, on ``Connection: close``) with an answer still
    in the kernel's queue would leave that queue to the kernel, uncounted, for as long as the client keeps
    its end open (found by attack: 120 such sockets held 267 MiB past the limit). Its socket is kept open
    (`closing`) and counted until it drains, stalls or is shed; the kernel's own timer (`TCP_USER_TIMEOUT`,
    set by the protocol) ends it too.
    """

    def __init__(self, limit_bytes: int, stall_s: float, max_kept: int = MAX_KEPT_CLOSED) -> None:
        self.limit = limit_bytes
        self.stall_s = stall_s
        self.max_kept = max_kept
        """Closed connections kept at most (`closing`): a file each."""
        self.poll_s = min(POLL_S, stall_s)
        self.held: dict[object, _Held] = {}
        """By transport (a live connection) or by the kept socket (a closed one), oldest first."""
        self.closed = 0
        self.total = 0
        self.reset = SummaryLog(
            f"reset connections whose clients did not read their answers (over {limit_bytes >> 20} MiB "
            f"unsent in all, or nothing read for {stall_s:g} s)"
        )

    def measure(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        """Count what `transport` holds unsent now (after an answer, or part of one, was written to it)."""
        held = self.held.get(transport)
        if held is not None:
            self._update(transport, held, held.unsent())
        else:
            sock = transport.get_extra_info("socket")
            if sock is None:
                return
            size = transport.get_write_buffer_size() + queued_bytes(sock)
            if size >= WATCH_MIN_BYTES:
                self._hold(transport, _Held(sock, transport, size, acked_bytes(sock)), loop)
        if self.total > self.limit:
            self._shed(loop)

    def closing(
        self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, own: socket.socket | None = None
    ) -> None:
        """`transport`'s connection is being closed: keep its socket while it holds an answer. `own`: a duplicate
        of the socket made at the start (over TLS asyncio closes its socket before this runs), used or closed
        here; without one, the transport's socket, still open."""
        self.forget(transport)
        sock = own if own is not None else transport.get_extra_info("socket")
        if sock is None:
            return
        size = 0 if _resetting(sock) else queued_bytes(sock)
        if size < WATCH_MIN_BYTES:
            if own is not None:
                own.close()
            return
        try:
            kept = own if own is not None else socket.socket(fileno=os.dup(sock.fileno()))
        except OSError:  # no file left for it: the kernel's own timer ends the socket (TCP_USER_TIMEOUT)
            return
        # The FIN after the answer, as the close being made would send it: the client sees the end at once.
        with contextlib.suppress(OSError):
            kept.shutdown(socket.SHUT_WR)
        self.closed += 1
        self._hold(kept, _Held(kept, None, size, acked_bytes(kept)), loop)
        if self.closed > self.max_kept:
            oldest = next(key for key, held in self.held.items() if held.transport is None)
            self._reset(oldest, loop)
        if self.total > self.limit:
            self._shed(loop)

    def forget(self, key: object) -> None:
        held = self.held.pop(key, None)
        if held is None:
            return
        if held.timer is not None:
            held.timer.cancel()
        self.total -= held.size
        if held.transport is None:
            self.closed -= 1
            held.sock.close()  # nothing left in its queue, or reset just before

    def _hold(self, key: object, held: _Held, loop: asyncio.AbstractEventLoop) -> None:
        held.since = loop.time()
        held.timer = loop.call_later(self.poll_s, self._check, key, loop)
        self.held[key] = held
        self.total += held.size

    def _update(self, key: object, held: _Held, size: int) -> None:
        self.total += size - held.size
        held.size = size
        if size < WATCH_MIN_BYTES:
            self.forget(key)

    def _shed(self, loop: asyncio.AbstractEventLoop) -> None:
        for key, held in list(self.held.items()):
            self._update(key, held, held.unsent())
        for key in list(self.held):  # oldest first: a dict keeps its insertion order
            if self.total <= self.limit:
                break
            self._reset(key, loop)

    def _check(self, key: object, loop: asyncio.AbstractEventLoop) -> None:
        """Measure a held answer again: let it go once drained, reset it once its client took nothing for
        `stall_s`."""
        held = self.held.get(key)
        if held is None:
            return
        size, acked = held.unsent(), acked_bytes(held.sock)
        progressed = _progressed(held, size, acked)
        self._update(key, held, size)
        if key not in self.held:
            return
        if progressed:
            held.acked, held.since = acked, loop.time()
        elif loop.time() - held.since >= self.stall_s:
            self._reset(key, loop)
            return
        held.timer = loop.call_later(self.poll_s, self._check, key, loop)

    def _reset(self, key: object, loop: asyncio.AbstractEventLoop) -> None:
        held = self.held[key]
        _reset_at_close(held.sock)
        self.forget(key)
        if held.transport is not None:
            held.transport.abort()
        self.reset.add(loop)


WEBSOCKET_CONNECTION: Final = "bastion.connection"
"""The scope extension that gives a WebSocket's application its `WebSocketConnection`."""


@dataclass(frozen=True)
class WebSocketConnection:
    """A WebSocket's connection, for its application (the preview relay): unsent bytes are not counted by
    `UnsentWatch` once the connection is upgraded, so the relay bounds them itself. It waits for `transport`'s
    buffer to drain before reading more, and resets a connection whose client took nothing for `stall_s`
    (`send_stall_timeout_s`, as for HTTP answers)."""

    transport: asyncio.Transport
    stall_s: float


def _offer_connection(transport: asyncio.Transport, stall_s: float) -> None:
    """Put the connection in the scope of the WebSocket application uvicorn just made (its task has not run)."""
    scope = getattr(transport.get_protocol(), "scope", None)
    if isinstance(scope, dict):  # None when the handshake was refused: no application runs
        scope.setdefault("extensions", {})[WEBSOCKET_CONNECTION] = WebSocketConnection(transport, stall_s)


def tls_flushed(transport: asyncio.BaseTransport) -> bool:
    """Whether the TLS `transport`, being closed by the server, has handed all it wrote to the kernel: the
    answer and its close_notify, so that only the client's close_notify is awaited (asyncio waits up to 30 s).

    asyncio says this nowhere in public: read from its SSL protocol (Python 3.11's `asyncio.sslproto`).
    Where those names are missing (another Python), this answers False and asyncio's own wait applies.
    """
    protocol = getattr(transport, "_ssl_protocol", None)
    inner = getattr(protocol, "_transport", None)
    outgoing = getattr(protocol, "_outgoing", None)
    if inner is None or outgoing is None:
        return False
    shutting = getattr(protocol, "_state", None) is asyncio.sslproto.SSLProtocolState.SHUTDOWN
    return shutting and not outgoing.pending and not inner.get_write_buffer_size()


def _resetting(sock: socket.socket) -> bool:
    """Whether `sock` is set to reset when closed (`UnsentWatch._reset` did): its queue goes with it."""
    try:
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _INT.size * 2) == _LINGER_NONE
    except OSError:
        return True


def _progressed(held: _Held, size: int, acked: int | None) -> bool:
    """Whether the client took some of its answer since `held` was measured: TCP's count of acknowledged
    bytes grew (or, without it, what is held shrank)."""
    if acked is not None and held.acked is not None:
        return acked > held.acked
    return size < held.size


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with head and body deadlines and the connection cap (see the module doc)."""

    max_connections: ClassVar[int]
    head_timeout_s: ClassVar[float]
    body_timeout_s: ClassVar[float]
    max_body_bytes: ClassVar[int]
    evicted: ClassVar[SummaryLog]
    refused: ClassVar[SummaryLog]
    timed_out: ClassVar[SummaryLog]
    unsent: ClassVar[UnsentWatch]

    phase: Phase | None = None
    phase_since = 0.0
    own: socket.socket | None = None
    """Over TLS, a duplicate of the connection's socket for `UnsentWatch.closing` (asyncio closes its own first)."""
    deadline: asyncio.TimerHandle | None = None
    upgraded = False
    lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # The kernel ends a connection (closed or not) whose peer acknowledges nothing sent for this long.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(self.unsent.stall_s * 1000))
            if transport.get_extra_info("ssl_object") is not None:
                # Found by review: over TLS, connection_lost runs after asyncio closed the socket, so an answer
                # left in its queue was counted nowhere. A file more per TLS connection, while it is open.
                with contextlib.suppress(OSError):
                    self.own = socket.socket(fileno=os.dup(sock.fileno()))
        self._follow()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        own, self.own = self.own, None
        try:
            self.unsent.closing(self.transport, self.loop, own)  # without TLS, asyncio closes the socket after this
        finally:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the rest of a refused head: read and dropped (`_linger`)
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.unsent.measure(self.transport, self.loop)
        self._follow()
        self._closing()

    def timeout_keep_alive_handler(self) -> None:
        # Found by review: uvicorn's own close of an idle kept-alive connection (past `KEEP_ALIVE_S`, which
        # comes first when `request_head_timeout_s` is longer) waited for the TLS client's close_notify too.
        super().timeout_keep_alive_handler()
        self._closing()

    def _close(self) -> None:
        self.transport.close()
        self._closing()

    def _closing(self) -> None:
        """After a close by the server (its own, or uvicorn's): over TLS, end the connection once `tls_flushed`
        (see the module doc). Found by attack: 16 TLS clients asking `Connection: close` and never sending
        close_notify held every slot of a 16-connection cap for 30 s, and the server refused everyone else.
        The socket's queue stays with the kernel, counted by `UnsentWatch.closing` (which sends the FIN after it)."""
        if self.own is None or not self.transport.is_closing():
            return  # not TLS, not closing, or connection_lost ran
        if tls_flushed(self.transport):
            self.transport.abort()
        else:
            self.loop.call_later(TLS_CLOSE_POLL_S, self._closing)

    def pause_writing(self) -> None:
        super().pause_writing()
        self.unsent.measure(self.transport, self.loop)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's 400 for a request h11 refused; a head over `MAX_HEAD_BYTES` gets a 431 that also asks the
        browser to clear this host's cookies (RFC 9110 §15.5.20 is silent on how to recover; Clear-Site-Data is).

        Why: a page of a preview shares the host's cookies with bastion's pages (other ports, one host), and a
        script there can set cookies for every path (`document.cookie`): 40 of 3.9 KB made each request of the
        administrator's browser too large, locking them out of /admin and the login for a year. The first refused
        page now clears them (the login cookie too: they log in again).
        """
        if len(self.conn.trailing_data[0]) <= MAX_HEAD_BYTES:
            super().send_400_response(msg)
            self._closing()
            return
        headers = [*HEAD_TOO_LARGE_HEADERS, (b"connection", b"close")]
        for event in (
            h11.Response(status_code=431, headers=headers),
            h11.Data(data=HEAD_TOO_LARGE_BODY),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event) or b"")
        self._linger()

    def _linger(self) -> None:
        """Close after the answer without losing it: closed with the head's rest unread, the socket sends a
        reset, which can destroy the answer in the client's buffer before it is read (a browser then sends the
        request again, never seeing the 431). The rest is read and dropped until the client closes, or for
        `LINGER_S` at most (as web servers' lingering close)."""
        self.lingering = True
        self._disarm()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.deadline = self.loop.call_later(LINGER_S, self._close)

    def eof_received(self) -> None:
        if self.lingering:
            self._close()
        super().eof_received()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        # The transport moves to the WebSocket protocol: this one's connection_lost never runs, so a deadline
        # left armed would close a live WebSocket. uvicorn moves the count in `connections` to the new protocol.
        self.upgraded = True
        self._disarm()
        self.unsent.forget(self.transport)
        if self.own is not None:  # the WebSocket protocol takes the connection: not watched there
            self.own.close()
            self.own = None
        super().handle_websocket_upgrade(event)
        _offer_connection(self.transport, self.unsent.stall_s)

    def _current(self) -> Phase:
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return "head"
        return "body" if cycle.more_body else "served"

    def _follow(self) -> None:
        """Start the deadline of the phase the connection just entered (trickled bytes never extend it)."""
        phase = self._current()
        if phase == self.phase or self.upgraded or self.lingering or self.transport.is_closing():
            return
        self.phase, self.phase_since = phase, time.monotonic()
        self._disarm()
        if phase == "head":
            self.deadline = self.loop.call_later(self.head_timeout_s, self._expire)
        elif phase == "body":
            # The declared length is the client's word: past what this listener accepts it buys no more time.
            declared = min(declared_length(self.headers or ()), self.max_body_bytes)
            allowed = self.body_timeout_s + declared / MIN_BODY_RATE
            self.deadline = self.loop.call_later(allowed, self._expire)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expire(self) -> None:
        self.deadline = None
        if not self.transport.is_closing():
            self.timed_out.add(self.loop)
            self._close()

    def _make_room(self) -> None:
        waiting = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and c.phase != "served"]
        waiting = [c for c in waiting if c is not self and not c.transport.is_closing()]
        if waiting:
            min(waiting, key=lambda c: c.phase_since)._close()
            self.evicted.add(self.loop)
        else:
            self.refused.add(self.loop)
            self._close()


def guarded_protocol(
    max_connections: int, head_timeout_s: float, body_timeout_s: float, max_body_bytes: int, unsent: UnsentWatch
) -> type[GuardedH11Protocol]:
    """A protocol class for `uvicorn.Config(http=...)` with its own limits and log counters.
    `max_body_bytes`: the largest body the listener's endpoints accept (its body deadline's bound);
    `unsent`: the bound on unread answers, shared by the server's listeners."""
    cap = max_connections
    attributes: dict[str, Any] = {
        "max_connections": cap,
        "head_timeout_s": head_timeout_s,
        "body_timeout_s": body_timeout_s,
        "max_body_bytes": max_body_bytes,
        "evicted": SummaryLog(f"{cap} connections open: closed the one waiting longest for its request"),
        "refused": SummaryLog(f"{cap} connections open, all being served: refused new connections"),
        "timed_out": SummaryLog("closed connections that sent no complete request in time", logging.INFO),
        "unsent": unsent,
    }
    return type("CappedH11Protocol", (GuardedH11Protocol,), attributes)


CANCELLED_AT_SHUTDOWN: Final = "a request still running when the graceful shutdown ended was cancelled"


LIFESPAN_CUT_SHORT: Final = "a forced stop (a second Ctrl-C) cut the application's shutdown short"


_CUT: contextvars.ContextVar[bool] = contextvars.ContextVar("bastion_cut", default=False)
"""Set in the request's context when its response is cut on purpose (`QuietCuts`)."""


def cut_on_purpose() -> None:
    """Say that this request's response ends without its last chunk on purpose (`QuietCuts`)."""
    _CUT.set(True)


class QuietCuts(logging.Filter):
    """A response cut on purpose (a preview's app broke it or went past the cap; a call of a revoked grant
    cancelled after its head went out) is ended by returning without its last chunk, so uvicorn closes the
    connection and the client sees it incomplete, never a whole (cacheable) answer. uvicorn logs that as an
    error: whoever cut it already logged why, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_CUT.get() and record.msg == "ASGI callable returned without completing response.")


class ShutdownCancels(logging.Filter):
    """uvicorn logs each request its graceful shutdown cancels as "Exception in ASGI application" at
    ERROR, with the CancelledError: an expected end (the call's audit end record says it was
    cancelled), told as one INFO line instead of an error an operator would chase."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        message = record.getMessage().strip()
        if isinstance(exc, asyncio.CancelledError) and message == "Exception in ASGI application":
            self._told(record, CANCELLED_AT_SHUTDOWN)
        elif message.startswith("Traceback") and message.endswith("CancelledError"):
            # Found by review: a second Ctrl-C forces uvicorn's exit, and starlette sends the cancelled
            # lifespan's traceback as its shutdown failure, which uvicorn logs at ERROR as the message.
            self._told(record, LIFESPAN_CUT_SHORT)
        return True

    @staticmethod
    def _told(record: logging.LogRecord, line: str) -> None:
        record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        record.msg, record.args, record.exc_info, record.exc_text = line, (), None, None


def quiet_loop_errors() -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """An event-loop exception handler: accept() out of file descriptors is one summary line per
    `LOG_EVERY_S` (asyncio logs a traceback each time, and retries every second); anything else is one
    line naming the exception, with no traceback."""
    out_of_files = SummaryLog("accept() failed: out of file descriptors or memory; new connections wait", logging.ERROR)

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", "event loop error"))
        exc = context.get("exception")
        if message.startswith("socket.accept() out of system resource"):
            out_of_files.add(loop)
            return
        detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        logger.error("%s%s", message, detail)

    return handle

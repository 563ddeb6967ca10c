"""The preview listener: /preview/<token>/<path> reverse-proxied to 127.0.0.1:<port> inside a sandbox.

SECURITY BOUNDARY. What a sandbox serves is hostile: its pages run scripts in the administrator's browser.
So previews have an origin of their own (`[http] preview_listen`, another port): a page there cannot read
/admin or /oauth (cross-origin: no CORS), and the login cookie is HttpOnly. A Content-Security-Policy
sandbox (an opaque origin) was weighed and rejected: Chromium then sends no SameSite cookie with the
page's own subresource requests and refuses its fetches to its own server (CORS from "null"), so no
real app would work and the login check could not be made. Requests reach the app with no
Authorization header and only the cookies its own responses set: browsers send every cookie of the host
(other ports' apps' login cookies, other previews' `Path=/` script cookies) to every preview, so an app's
cookies are renamed with a prefix derived from its token (`cookie_prefix`) and every other cookie is
dropped. Its responses cannot set cookies for other paths or domains, nor `__Host-`/`__Secure-`/bastion
names, nor clear site data (the origin shares the host's cookies with the admin pages). The bytes cross
the sandbox boundary only over a socket the sandbox's agent connects to 127.0.0.1:<port> in the sandbox's
own network namespace (`WarmSandbox.connect`): no host, no other sandbox, no other port is reachable from
here. Previews of different sandboxes share this one origin (its storage too): a page could read another
preview only by knowing its token.

A preview that is not public needs the administrator's login session: checked when a request or a WebSocket
opens, again when the app's answer (its response's head, its WebSocket's accept) comes over `STANDING_CHECK_S`
later (the browser then gets 403 and nothing of the app), and every `STANDING_CHECK_S` while its request body is
sent to the app, or its WebSocket or response goes on, so a logout, a revoke all, `admin set-password` or the
session's expiry ends them (the body stopped and 403, close 1008, or the response cut) within about a second.

A request for an unknown, expired or closed token gets 404 with no detail. Requests are rate limited
per token and per client address (an IPv6 /64), bodies capped both ways, and each one is audited (token
digest, method, path without its query, status, bytes, address, sandbox, port), except those refused for
the rate: counted, one `preview_throttled` record per preview a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import socket
import sqlite3
import time
from collections.abc import AsyncIterator, Coroutine, Iterable
from dataclasses import dataclass
from typing import Final
from urllib.parse import unquote

import httpcore2
from starlette.types import Message, Receive, Scope, Send

from bastion.config import HttpConfig
from bastion.safety.audit import AuditLog
from bastion.safety.errors import BastionError
from bastion.safety.rates import ByteRate
from bastion.transports.http.admin_pages import SESSION_COOKIE
from bastion.transports.http.connections import close_or_reset, cut_on_purpose
from bastion.transports.http.preview_ws import PIECE_COST_BYTES, Standing, close_browser, proxy_websocket
from bastion.transports.http.ratelimit import WindowLimiter, address_key
from bastion.transports.http.store import AuthStore
from bastion.workbench.previews import Preview, PreviewRegistry, token_id

logger = logging.getLogger("bastion.http.preview")

MAX_AUDIT_PATH_CHARS: Final = 200
THROTTLE_REPORT_S: Final = 1.0
"""At most one `preview_throttled` record per preview this often: each 429 is counted, not recorded."""
# RFC 9110 §7.6.1 and the proxy headers no app should see or send back.
HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",  # re-framed: the request's is checked and passed on, the response's is the server's
    }
)
# Headers an app must not send to the administrator's browser: they act on the whole host (every port) or
# the whole preview origin (a service worker for "/" would see every other sandbox's preview), or would
# show the browser's own password prompt on bastion's host (a phishing page for the admin password).
RESPONSE_DROPPED: Final = frozenset(
    {"strict-transport-security", "clear-site-data", "alt-svc", "server", "service-worker-allowed", "www-authenticate"}
)
_BASTION_COOKIE = re.compile(r"(?i)^(__host-|__secure-|bastion)")
COOKIE_PREFIX_HEX: Final = 12
"""Hex digits of a preview's cookie prefix (48 bits): a page can set only about 180 cookies on a host, so
another preview's or port's page cannot guess its way to a name this preview's app receives."""
CHUNK_CHARGE_BYTES: Final = 1024
"""What each piece of an app's response body is allowed on average: a response may have at most
`preview_max_response_bytes` / 1 KiB pieces. A piece costs the server about 10 us whatever its size (parsed,
then passed on): an app sending 1-byte chunks made one request cost 20 s of CPU per MiB. Bytes are counted
apart and exactly: a body of ordinary pieces is cut at the cap to the byte."""
PREVIEW_BYTES_PER_S: Final = 64 * 1024 * 1024
"""What a sandbox's apps send its previews' browsers, response heads and bodies and WebSocket frames together, on
average; a piece (a read of a head, a piece of a body, a WebSocket event) counts at least `PIECE_COST_BYTES`. The
relay is the server's CPU, not the sandbox's: found by attack, an app sending endless 1-byte WebSocket messages to
an open tab cost the server half a core for as long as the tab stayed open (and a page's own script can keep its
tab fetching)."""
PREVIEW_BURST_BYTES: Final = 16 * 1024 * 1024
MAX_INTERIM_RESPONSES: Final = 16
"""Interim (1xx) responses an app may send before its final one (RFC 9110 allows several: 100, 103...)."""
MAX_HEAD_BYTES: Final = 128 * 1024
"""One response head at most (httpcore's own parser stops at 100 KiB)."""
PIECES_PER_TURN: Final = 64
"""Pieces of an app's body read before the relay gives the event loop a turn (about a millisecond's parsing)."""
PENDING_BYTES: Final = 256 * 1024
"""Of an app's body read and not yet sent to the browser: past it, the app is not read until the browser takes it."""
MAX_STATUS: Final = 599
"""The highest status passed on: h11 reads up to 999 from the app, uvicorn has no phrase past 599."""


class HideTokens(logging.Filter):
    """uvicorn logs each WebSocket's path (`"WebSocket /preview/<token>/" [accepted]`): never the token."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any("/preview/" in str(a) for a in record.args):
            record.args = tuple(_PREVIEW_TOKEN.sub("/preview/<token>", str(a)) for a in record.args)
        return True


_PREVIEW_TOKEN = re.compile(r"/preview/[A-Za-z0-9_-]+")


class SandboxRates:
    """One `ByteRate` per sandbox for what its apps send through previews. A bucket unused for longer than it takes
    to refill is the same as a new one, so such buckets are dropped once there are many."""

    def __init__(self, rate_per_s: float = PREVIEW_BYTES_PER_S, burst: int = PREVIEW_BURST_BYTES) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._rates: dict[str, tuple[ByteRate, float]] = {}

    def of(self, sandbox_id: str) -> ByteRate:
        now = time.monotonic()
        if len(self._rates) > 64:
            full = self.burst / self.rate_per_s
            self._rates = {key: kept for key, kept in self._rates.items() if now - kept[1] < full}
        rate = self._rates.get(sandbox_id, (ByteRate(self.rate_per_s, self.burst), now))[0]
        self._rates[sandbox_id] = (rate, now)
        return rate


@dataclass
class RelayProgress:
    """How far a request got: what its audit record says, even for one cancelled midway (server stopping)."""

    status: int = 0
    sent: int = 0


@dataclass
class _Throttled:
    """429s given for one preview since its last `preview_throttled` record, and the timer that writes the next."""

    count: int = 0
    report: asyncio.TimerHandle | None = None


def split_target(path: str) -> tuple[str, str] | None:
    """(token, the path for the app) of a raw /preview/<token>/<path>; None if not of that shape or if a
    segment is `.` or `..` once decoded (the app behind sees the path as sent; no trick is needed there)."""
    match = re.fullmatch(r"/preview/([A-Za-z0-9_-]{20,100})(/[^?#]*)?", path)
    if match is None:
        return None
    rest = match.group(2) or ""
    if any(unquote(segment) in (".", "..") for segment in rest.split("/")):
        return None
    return match.group(1), rest


def cookie_prefix(token: str) -> str:
    """The name prefix of a preview's cookies: from its secret token (not `token_id`, which the audit log
    shows), so no other page of the host can name a cookie this preview's app receives."""
    digest = hashlib.sha256(b"bastion-preview-cookie:" + token.encode()).hexdigest()
    return f"pv{digest[:COOKIE_PREFIX_HEX]}_"


def request_headers(
    headers: Iterable[tuple[bytes, bytes]], port: int, length: int | None, token: str
) -> list[tuple[bytes, bytes]]:
    """The browser's headers for the app: hop-by-hop and Authorization removed, only this preview's own
    cookies kept (`own_cookies`), Host rewritten, the body framed by `length` (checked against the cap) or
    else chunked."""
    named_by_connection = set()
    framing = (b"content-length", str(length).encode()) if length is not None else (b"transfer-encoding", b"chunked")
    kept: list[tuple[bytes, bytes]] = [(b"host", f"127.0.0.1:{port}".encode()), framing]
    for key, value in headers:
        if key == b"connection":
            named_by_connection |= {v.strip().lower() for v in value.split(b",")}
    for key, value in headers:
        name = key.lower()
        if name.decode("latin-1") in HOP_BY_HOP or name in named_by_connection or name == b"authorization":
            continue
        if name.startswith(b"sec-websocket"):
            continue
        if name == b"cookie":
            value = own_cookies(value, token)
            if not value:
                continue
        kept.append((name, value))
    return kept


def own_cookies(header: bytes, token: str) -> bytes:
    """The cookies of a Cookie header that this preview's responses set, under the names the app gave them.
    Every other one is dropped: bastion's, other ports' apps' (browsers send a host's cookies to all its
    ports, HttpOnly and SameSite=Strict ones too) and other previews' (they share this origin)."""
    prefix = cookie_prefix(token).encode()
    kept = []
    for pair in header.split(b";"):
        name, equals, value = pair.strip().partition(b"=")
        if equals and name.startswith(prefix) and len(name) > len(prefix):
            kept.append(name[len(prefix) :] + b"=" + value)
    return b"; ".join(kept)


def response_headers(headers: Iterable[tuple[bytes, bytes]], token: str) -> list[tuple[bytes, bytes]]:
    """The app's headers for the browser: hop-by-hop and host-wide ones removed, cookies confined."""
    prefix = f"/preview/{token}"
    kept: list[tuple[bytes, bytes]] = []
    for key, value in headers:
        name = key.lower()
        text = name.decode("latin-1")
        if text in HOP_BY_HOP or text in RESPONSE_DROPPED:
            continue
        if name == b"set-cookie":
            confined = confine_cookie(value.decode("latin-1"), token)
            if confined is not None:
                kept.append((name, confined.encode("latin-1")))
            continue
        if name == b"location" and value.startswith(b"/") and not value.startswith(b"//"):
            value = prefix.encode() + value
        kept.append((name, value))
    return kept


def confine_cookie(header: str, token: str) -> str | None:
    """A Set-Cookie limited to the preview's own path, renamed with its `cookie_prefix` and of low priority,
    or None: a Domain attribute, a `__Host-`, `__Secure-` or bastion name would reach beyond it (the admin
    pages share the host's cookies), and a cookie without a name could not carry the prefix.

    Low priority: the host's cookie jar is shared (Chromium keeps about 180 cookies a host), and an app
    that set 240 `Secure` cookies evicted bastion's own (the administrator was logged out) and other previews'.
    Chromium evicts low-priority cookies first and keeps the newest 30 of them, so an app's flood now evicts
    its own and other previews' cookies, never bastion's (the page's own scripts still can: SECURITY.md)."""
    name_value, *attributes = header.split(";")
    name, equals, value = name_value.partition("=")
    name = name.strip()
    if not equals or not name or _BASTION_COOKIE.match(name):
        return None
    kept = []
    for attribute in attributes:
        key = attribute.split("=", 1)[0].strip().lower()
        if key == "domain":
            return None
        if key not in ("path", "priority"):
            kept.append(attribute.strip())
    shown = f"{cookie_prefix(token)}{name}={value.strip()}"
    return "; ".join([shown, *kept, f"Path=/preview/{token}/", "Priority=Low"])


_HEAD_END: Final = re.compile(rb"\n\r?\n")
"""Where h11 (httpcore's parser) ends a head: a blank line, CRLF or a bare LF (found by review: counting only
CRLFCRLF, 5,000 heads ending in LFLF passed as one, and a final head ending so had its body taken for a head)."""


class ResponseHeads:
    """Follows the heads an app sends before its final response, from the bytes as read: found by attack, an app
    answering with endless `100 Continue` had httpcore parse them for as long as it sent them (it skips interim
    responses, and each read reset the read timeout): a core of the server, every caller's calls 1.4 s, and the
    server deaf to SIGTERM. Past `MAX_INTERIM_RESPONSES`, or a head past `MAX_HEAD_BYTES`, the exchange fails."""

    def __init__(self) -> None:
        self.interim = 0
        self.done = False
        self._head = b""

    def feed(self, data: bytes) -> None:
        """Raises httpcore2.RemoteProtocolError (a 502) past the caps."""
        while data and not self.done:
            joined = self._head + data
            end = _HEAD_END.search(joined, max(0, len(self._head) - 2))
            if end is None:
                if len(joined) > MAX_HEAD_BYTES:
                    raise httpcore2.RemoteProtocolError(f"the app's response head is over {MAX_HEAD_BYTES} bytes")
                self._head = joined
                return
            head, data = joined[: end.end()], joined[end.end() :]
            self._head = b""
            if head[9:10] != b"1":  # "HTTP/1.1 1xx": an interim response; any other status ends the heads
                self.done = True
            else:
                self.interim += 1
                if self.interim > MAX_INTERIM_RESPONSES:
                    raise httpcore2.RemoteProtocolError(f"the app sent over {MAX_INTERIM_RESPONSES} interim responses")


class SocketStream(httpcore2.AsyncNetworkStream):
    """httpcore's view of the socket the sandbox's agent connected (asyncio streams over it). Until the app's final
    response head has come (`ResponseHeads`), each read spends `PIECE_COST_BYTES` at least of the sandbox's
    preview rate, if given (the body's pieces spend it in `ResponseRelay`)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rate: ByteRate | None = None):
        self.reader = reader
        self.writer = writer
        self.rate = rate
        self.heads = ResponseHeads()

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109 - httpcore's interface
        try:
            async with asyncio.timeout(timeout):
                data = await self.reader.read(max_bytes)
        except TimeoutError:
            raise httpcore2.ReadTimeout("the sandbox's app sent nothing in time") from None
        except OSError as exc:
            raise httpcore2.ReadError(str(exc)) from None
        if not self.heads.done:
            self.heads.feed(data)
            wait = self.rate.owed_s(max(len(data), PIECE_COST_BYTES)) if self.rate is not None else 0.0
            if wait > 0:
                await asyncio.sleep(wait)
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109 - httpcore's interface
        try:
            async with asyncio.timeout(timeout):
                self.writer.write(buffer)
                await self.writer.drain()
        except TimeoutError:
            raise httpcore2.WriteTimeout("the sandbox's app read nothing in time") from None
        except OSError as exc:
            raise httpcore2.WriteError(str(exc)) from None

    async def aclose(self) -> None:
        # Found by attack: after a 504 for a body the app never read, a close waited for the app to take it,
        # for ever: 20 such sockets held 74 MiB, until the sandbox closed.
        close_or_reset(self.writer.transport)

    def get_extra_info(self, info: str) -> object:
        return None


Refusal = tuple[int, str, list[tuple[bytes, bytes]]]  # status, text, extra headers


class BodyTooLarge(Exception):
    pass


async def _plain(send: Send, status: int, text: str, extra: list[tuple[bytes, bytes]] | None = None) -> int:
    body = (text + "\n").encode()
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})
    return len(body)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None


def _cookie(scope: Scope, name: str) -> str | None:
    for pair in (_header(scope, b"cookie") or b"").decode("latin-1").split(";"):
        key, _, value = pair.strip().partition("=")
        if key == name:
            return value
    return None


class PreviewApp:
    """The ASGI app of the preview listener (behind the Host check); nothing but /preview/."""

    def __init__(
        self, registry: PreviewRegistry, config: HttpConfig, audit: AuditLog, store: AuthStore | None, origin: str
    ) -> None:
        self.registry = registry
        self.config = config
        self.audit = audit
        self.store = store
        self.origin = origin
        # Capped tables (10,000 keys, oldest forgotten first), per IPv6 /64 as the other limits.
        self.per_token = WindowLimiter(config.preview_requests_per_minute, 60.0)
        self.per_address = WindowLimiter(config.preview_requests_per_minute, 60.0)
        self._throttled: dict[str, _Throttled] = {}
        self._reports: set[asyncio.Task[None]] = set()
        self.rates = SandboxRates()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        started = time.perf_counter()
        path = scope.get("raw_path", b"").decode("latin-1").split("?", 1)[0]
        preview, progress = None, RelayProgress()
        started_response = False

        async def tracked(message: Message) -> None:
            nonlocal started_response
            started_response = started_response or message["type"] == "http.response.start"
            await respond(message)

        respond, send = send, tracked
        try:
            preview, refusal = self._admit(scope, path)
            if refusal is not None and refusal[0] == 429:
                assert preview is not None
                self._count_throttled(preview)
                preview = None  # counted, not recorded one by one: a flood would fill the disk
                await _plain(send, *refusal)
                return
            if refusal is not None:
                progress.status = refusal[0]
                progress.sent = await _plain(send, *refusal)
                return
            assert preview is not None
            progress.status, progress.sent = await self._proxy(scope, receive, send, preview, progress)
        except Exception as exc:  # whatever a hostile app provokes: one line, no traceback
            logger.warning("preview request failed: %s: %s", type(exc).__name__, str(exc)[:200])
            progress.status = progress.status or 502
            if not started_response:
                with contextlib.suppress(OSError, RuntimeError):  # the browser may be gone too
                    progress.sent = await _plain(send, 502, "Bad Gateway: the sandbox's app broke the exchange")
        finally:
            if preview is not None:
                await self._record(scope, path, preview, progress.status, progress.sent, started)

    def _admit(self, scope: Scope, path: str) -> tuple[Preview | None, Refusal | None]:
        """The preview a request may reach, or the refusal to send (status, text, headers)."""
        target = split_target(path)
        if target is None:
            return None, (404, "Not Found", [])
        preview = self.registry.lookup(target[0])
        if preview is None:
            return None, (404, "Not Found", [])
        client = (scope.get("client") or ("-", 0))[0]
        if not self.per_token.allow(token_id(preview.token)) or not self.per_address.allow(address_key(client)):
            return preview, (429, "Too Many Requests: slow down", [(b"retry-after", b"60")])
        if _header(scope, b"service-worker") is not None:
            # A service worker outlives its token and could serve stale or forged pages: none on this origin.
            return preview, (403, "Forbidden: service workers are not allowed on previews", [])
        if not preview.public and not self._logged_in(scope):
            return preview, (403, "Forbidden: log in as the administrator first (this preview is not public)", [])
        if not target[1]:
            location = f"{path}/".encode()
            return preview, (308, "Permanent Redirect", [(b"location", location)])
        return preview, None

    def _logged_in(self, scope: Scope) -> bool:
        return self._session_valid(_cookie(scope, SESSION_COOKIE))

    def _session_valid(self, session: str | None) -> bool:
        if self.store is None:
            return not self.config.auth  # auth = false (loopback only): there is no login to require
        if not session:
            return False
        return self.store.admin_session_csrf(session) is not None

    def _standing(self, scope: Scope, preview: Preview) -> Standing:
        """The check an open request or WebSocket of `preview` makes again while it goes on (`Standing`): made
        right after its admission, whose check it counts as the first."""
        session = _cookie(scope, SESSION_COOKIE)

        def exposed() -> bool:
            return self.registry.lookup(preview.token) is preview

        def still_logged_in() -> bool:
            if preview.public:
                return True
            try:
                return self._session_valid(session)
            except sqlite3.Error as exc:  # the session cannot be confirmed: end, as a failed login check would
                logger.warning("preview %s: could not look its login up: %s", token_id(preview.token), exc)
                return False

        return Standing(exposed, still_logged_in, f"preview {token_id(preview.token)}")

    async def _connect(self, preview: Preview) -> socket.socket | None:
        try:
            return await preview.box.workspace.sandbox.connect(preview.port)
        except BastionError as exc:
            logger.info("preview %s: %s", token_id(preview.token), exc.reason)
            return None

    async def _proxy(
        self, scope: Scope, receive: Receive, send: Send, preview: Preview, progress: RelayProgress
    ) -> tuple[int, int]:
        standing = self._standing(scope, preview)  # no await since the admission: its check counts
        declared = _header(scope, b"content-length")
        if declared is not None and _header(scope, b"transfer-encoding") is not None:
            # The classic smuggling pair (RFC 9112 §6.1): h11 reads the body by its chunks, but its
            # Content-Length would frame it for the app. No browser sends both: refuse, not re-frame.
            text = "Bad Request: a request with both Content-Length and Transfer-Encoding is refused"
            return 400, await _plain(send, 400, text)
        if declared is not None and (not declared.isdigit() or int(declared) > self.config.preview_max_body_bytes):
            return 413, await _plain(send, 413, "Content Too Large: the request body is over the preview's cap")
        sock = await self._connect(preview)
        if sock is None:
            text = f"Bad Gateway: nothing accepts connections on port {preview.port} in the sandbox"
            return 502, await _plain(send, 502, text)
        reader, writer = await asyncio.open_connection(sock=sock)
        stream = SocketStream(reader, writer, self.rates.of(preview.sandbox_id))
        origin = httpcore2.Origin(b"http", b"127.0.0.1", preview.port)
        connection = httpcore2.AsyncHTTP11Connection(origin, stream)
        try:
            return await self._exchange(scope, receive, send, preview, connection, progress, standing)
        finally:
            await connection.aclose()

    async def _exchange(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        preview: Preview,
        connection: httpcore2.AsyncHTTP11Connection,
        progress: RelayProgress,
        standing: Standing,
    ) -> tuple[int, int]:
        target = _split_token(scope, preview.token)
        timeout = self.config.preview_timeout_s
        body = CappedBody(receive, self.config.preview_max_body_bytes)
        request = httpcore2.Request(
            scope["method"],
            httpcore2.URL(scheme=b"http", host=b"127.0.0.1", port=preview.port, target=target),
            headers=request_headers(scope.get("headers", ()), preview.port, _declared_length(scope), preview.token),
            content=body,
            extensions={"timeout": {"connect": timeout, "read": timeout, "write": timeout, "pool": timeout}},
        )
        too_large = "Content Too Large: the request body is over the preview's cap"
        try:
            if _declared_length(scope) == 0:
                response = await connection.handle_async_request(request)
            else:
                found = await _while_standing(connection.handle_async_request(request), standing)
                if found is None:
                    logger.info("preview request body stopped: %s no longer stands", standing.label)
                    return 403, await _plain(send, 403, "Forbidden: the login or the preview has ended")
                response = found
        except BodyTooLarge:
            return 413, await _plain(send, 413, too_large)
        except httpcore2.TimeoutException:
            if await body.over_cap():
                return 413, await _plain(send, 413, too_large)
            return 504, await _plain(send, 504, "Gateway Timeout: the sandbox's app did not answer in time")
        except (httpcore2.NetworkError, httpcore2.ProtocolError):
            if await body.over_cap():
                return 413, await _plain(send, 413, too_large)
            return 502, await _plain(send, 502, "Bad Gateway: the sandbox's app did not answer with HTTP")
        network = response.extensions.get("network_stream")
        if isinstance(network, SocketStream):
            network.heads.done = True  # the answer's head is parsed: what follows is its body
        if response.status > MAX_STATUS:
            await response.aclose()
            return 502, await _plain(send, 502, "Bad Gateway: the sandbox's app answered with an invalid status")
        headers = response_headers(response.headers, preview.token)
        rate = self.rates.of(preview.sandbox_id)
        relay = ResponseRelay(response, send, body, self.config.preview_max_response_bytes, progress, rate)
        return await relay.answer(headers, standing), progress.sent

    def _count_throttled(self, preview: Preview) -> None:
        """A 429: counted, and reported in one record per preview a second (as the egress proxy does)."""
        key = token_id(preview.token)
        entry = self._throttled.setdefault(key, _Throttled())
        entry.count += 1
        if entry.report is None:
            loop = asyncio.get_running_loop()
            entry.report = loop.call_later(THROTTLE_REPORT_S, self._start_report, key, preview)

    def _start_report(self, key: str, preview: Preview) -> None:
        task = asyncio.get_running_loop().create_task(self._report_throttled(key, preview))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _report_throttled(self, key: str, preview: Preview) -> None:
        entry = self._throttled.pop(key)
        record = {
            "event": "preview_throttled",
            "tool": "preview_request",
            "preview": key,
            "workspace": preview.sandbox_id,
            "port": preview.port,
            "status": 429,
            "refused": entry.count,
            "per_minute": self.per_token.limit,
        }
        try:
            await self.audit.append_async(record)
        except BastionError as exc:
            logger.error("%d throttled preview requests not audited: %s", entry.count, exc.reason)

    async def _record(self, scope: Scope, path: str, preview: Preview, status: int, sent: int, started: float) -> None:
        record = {
            "event": "preview",
            "tool": "preview_request",
            "preview": token_id(preview.token),
            "workspace": preview.sandbox_id,
            "port": preview.port,
            "method": str(scope.get("method", "WEBSOCKET")),
            "path": _without_token(path, preview.token)[:MAX_AUDIT_PATH_CHARS],
            "status": status,
            "bytes": sent,
            "client": (scope.get("client") or ("-", 0))[0],
            "duration_ms": round((time.perf_counter() - started) * 1000, 3),
        }
        try:
            await self.audit.append_async(record)
        except BastionError as exc:
            logger.error("preview request not audited: %s", exc.reason)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        if (await receive())["type"] != "websocket.connect":
            return
        path = scope.get("raw_path", b"").decode("latin-1").split("?", 1)[0]
        preview, refusal = self._admit(scope, path)
        origin = _header(scope, b"origin")
        if refusal is None and origin is not None and origin.decode("latin-1") != self.origin:
            refusal = (403, "Forbidden: WebSocket from another origin", [])
        if preview is None or refusal is not None:
            await close_browser(send, 1008)
            if preview is not None and refusal is not None and refusal[0] == 429:
                self._count_throttled(preview)
            elif preview is not None:
                await self._record(scope, path, preview, refusal[0] if refusal else 403, 0, started)
            return
        standing = self._standing(scope, preview)  # no await since the admission: its check counts
        sock = await self._connect(preview)
        if sock is None:
            await close_browser(send, 1011)
            await self._record(scope, path, preview, 502, 0, started)
            return
        target = _split_token(scope, preview.token)
        status, sent = await proxy_websocket(
            scope,
            receive,
            send,
            sock,
            preview.port,
            target,
            standing,
            self.rates.of(preview.sandbox_id),
            self.config.preview_timeout_s,
        )
        await self._record(scope, path, preview, status, sent, started)


async def _while_standing(
    request: Coroutine[None, None, httpcore2.Response], standing: Standing
) -> httpcore2.Response | None:
    """`request` (its body sent to the app, its answer's head awaited), or None once the request may no longer go
    on: `standing` checked when due, every `STANDING_CHECK_S` as the response's relay does. Found by review: a slow
    upload to a preview that is not public went on reaching the app after a logout; only its answer was refused."""
    sending = asyncio.ensure_future(request)
    try:
        while True:
            done, _ = await asyncio.wait({sending}, timeout=standing.due_in())
            if done:
                return sending.result()
            if not standing():
                return None
    finally:
        if not sending.done():
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)


def _declared_length(scope: Scope) -> int | None:
    """The request's Content-Length (digits only: `_proxy` refused anything else), or None when it has none."""
    declared = _header(scope, b"content-length")
    if declared is not None:
        return int(declared)
    if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE") and _header(scope, b"transfer-encoding") is None:
        return 0
    return None


def _split_token(scope: Scope, token: str) -> bytes:
    """The request target for the app: the raw path after /preview/<token>, with the query string."""
    raw = bytes(scope.get("raw_path", b"")).split(b"?", 1)[0]
    target = raw[len(f"/preview/{token}") :] or b"/"
    query = scope.get("query_string", b"")
    return target + (b"?" + query if query else b"")


def _without_token(path: str, token: str) -> str:
    return path.replace(token, "<token>")


class CappedBody:
    """The client's request body for the app, cut at the cap (`BodyTooLarge`).

    When the app breaks the exchange before the body is all sent (it answered early, closed, or stopped
    reading), `over_cap` reads the rest, still bounded by the cap and by the connection's body deadline,
    so a body over the cap is a 413 whatever the app did first.
    """

    def __init__(self, receive: Receive, cap: int) -> None:
        self.receive = receive
        self.cap = cap
        self.received = 0
        self.done = False
        self.gone = False
        """The browser disconnected."""

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        while not self.done:
            chunk = await self._next()
            if chunk:
                yield chunk

    async def _next(self) -> bytes:
        message: Message = await self.receive()
        if message["type"] == "http.disconnect":
            self.done = self.gone = True
            return b""
        chunk = bytes(message.get("body", b""))
        self.received += len(chunk)
        if self.received > self.cap:
            self.done = True
            raise BodyTooLarge
        if not message.get("more_body", False):
            self.done = True
        return chunk

    async def over_cap(self) -> bool:
        try:
            while not self.done:
                await self._next()
        except BodyTooLarge:
            return True
        return False

    async def until_gone(self) -> None:
        """Return once the browser has gone (what is left of its body, still capped, is read and dropped)."""
        with contextlib.suppress(BodyTooLarge):
            while not self.done:
                await self._next()
        if not self.gone:
            while (await self.receive())["type"] != "http.disconnect":
                pass


class ResponseRelay:
    """An app's response body passed on to the browser, while the browser stays and the request may go on
    (`Standing`: its preview's exposure checked at each piece, the whole check every `STANDING_CHECK_S`, so a
    body the app sends nothing of ends too); cut at the response cap, or at its number of pieces
    (`CHUNK_CHARGE_BYTES`). What arrives while a send is under way goes out in the next send: a flood of small
    pieces costs one send per read from the app, not one per piece.

    A body the app broke (a stall past `preview_timeout_s`, a short body, a protocol error), one cut at the
    cap or one whose preview or login went away is ended without its last chunk: uvicorn then closes the
    connection, and the browser sees it incomplete rather than caching a truncated page as whole.
    """

    def __init__(
        self,
        response: httpcore2.Response,
        send: Send,
        body: CappedBody,
        cap: int,
        progress: RelayProgress,
        rate: ByteRate,
    ):
        self.response = response
        self.rate = rate
        self.send = send
        self.body = body
        self.cap = cap
        self.progress = progress
        self.pending = bytearray()
        self.wake = asyncio.Event()
        self.drained = asyncio.Event()
        self.ended: str | None = None
        """Why no more will come: "complete", "cut", "broken", "revoked" or "gone"."""
        self.failure: str | None = None
        """What a task of the relay raised, unforeseen (`_failed`)."""

    async def answer(self, headers: list[tuple[bytes, bytes]], standing: Standing) -> int:
        """Start the response with `headers`, then relay its body; the status to audit. If the request may no
        longer go on once the app answered (`Standing.if_due`: found by review, a login ended while the app took
        its time still got the whole answer), the browser gets 403 and nothing of the app."""
        if not standing.if_due():
            await self.response.aclose()
            logger.info("preview response refused as it began: %s no longer stands", standing.label)
            self.progress.sent = await _plain(self.send, 403, "Forbidden: the login or the preview has ended")
            return 403
        await self.send({"type": "http.response.start", "status": self.response.status, "headers": headers})
        self.progress.status = self.response.status
        await self.relay(standing)
        return self.response.status

    async def relay(self, standing: Standing) -> None:
        tasks = [asyncio.create_task(work) for work in (self._pull(), self._watch(), self._recheck(standing))]
        for task in tasks:
            task.add_done_callback(self._failed)
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                if self.ended == "gone":
                    return
                if self.ended == "revoked":
                    break  # what the app sent meanwhile is dropped, not delivered after the revocation
                if self.pending:
                    data = bytes(self.pending)
                    self.pending.clear()
                    self.drained.set()
                    await self.send({"type": "http.response.body", "body": data, "more_body": True})
                    self.progress.sent += len(data)
                if self.ended is None and not standing.exposed():
                    self._end("revoked")
                if self.ended is not None and not self.pending:
                    break
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.response.aclose()
        if self.ended == "complete":
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            why, level = (self.failure, logging.WARNING) if self.failure is not None else (self.ended, logging.INFO)
            logger.log(level, "preview response ended early after %d bytes (%s)", self.progress.sent, why)
            cut_on_purpose()  # no last chunk: uvicorn closes the connection (`QuietCuts`)

    async def _pull(self) -> None:
        read, pieces, max_pieces = 0, 0, max(1, self.cap // CHUNK_CHARGE_BYTES)
        try:
            async for chunk in self.response.aiter_stream():
                pieces += 1
                room = self.cap - read
                if pieces > max_pieces or len(chunk) > room:
                    if pieces <= max_pieces:
                        self.pending += chunk[:room]
                    self._end("cut")
                    return
                read += len(chunk)
                self.pending += chunk
                self.wake.set()
                wait = self.rate.owed_s(max(len(chunk), PIECE_COST_BYTES))
                if wait > 0:
                    await asyncio.sleep(wait)
                elif pieces % PIECES_PER_TURN == 0:
                    # Pieces already buffered are parsed without an await: found by attack, 65,536 one-byte pieces
                    # (the default cap's) held every agent's calls 0.3 to 0.6 s in one block.
                    await asyncio.sleep(0)
                while len(self.pending) >= PENDING_BYTES:
                    # A browser reading slowly holds the app back, as a send awaited in turn did: not the cap's
                    # worth (64 MiB) of the app's body in the server's memory per request.
                    self.drained.clear()
                    await self.drained.wait()
            self._end("complete")
        except (httpcore2.TimeoutException, httpcore2.NetworkError, httpcore2.ProtocolError):
            self._end("broken")

    async def _watch(self) -> None:
        await self.body.until_gone()
        self._end("gone")

    async def _recheck(self, standing: Standing) -> None:
        """End the body once the request may no longer go on (its login ended, or its preview went away while
        the app sent nothing): a poll, as the WebSocket's (`STANDING_CHECK_S`), the first time when the check
        after the admission is due (not a whole period after the response began)."""
        while True:
            await asyncio.sleep(standing.due_in())
            if not standing():
                self._end("revoked")
                return

    def _failed(self, task: asyncio.Task[None]) -> None:
        """End the relay when one of its tasks raised: found by review, an error `_pull` did not expect (not
        httpcore's) ended only its task, and the relay waited for the browser to leave or a check to fail, which a
        public preview never has."""
        if task.cancelled() or task.exception() is None or self.ended is not None:
            return
        exc = task.exception()
        self.failure = f"broken: {type(exc).__name__}: {str(exc)[:200]}"
        self._end("broken")

    def _end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why
        self.wake.set()

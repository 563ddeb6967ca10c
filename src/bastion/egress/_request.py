"""The request a sandbox's client sends the egress proxy: read, parsed strictly, answered. PART OF A SECURITY BOUNDARY.

`bastion.egress.proxy` reads one request head per connection with `Reader`, parses it here,
then decides on the destination; a refusal from either is written back by `reply` (one HTTP
status line carrying the reason: pip and curl print it) or `socks_reply`, never a silent
close. The head comes from the sandbox, so it is hostile: what is not plainly valid is refused
(400), never guessed at.

- HTTP (RFC 9112): the head must be ASCII, without a bare CR, LF or NUL; the request line
  ``METHOD target HTTP/1.1`` (or 1.0); header names without whitespace, so no space before
  the colon and no folded line (RFC 9112 §5.1, §5.2). CONNECT takes ``host:port``; any other
  method an absolute ``http://`` URL, without credentials in it.
- SOCKS5 (RFC 1928): CONNECT only, without authentication; port 0 is refused.
- Destinations: an IPv6 literal in brackets, a port from 1 to 65535, a name normalized by
  `bastion.config.normalize_host`, the form the allowlist is matched against.
- A plain HTTP request is rewritten to origin form with the URL's Host, without hop-by-hop
  headers or those its Connection header names, and with ``Connection: close``. One body
  with two framings (two Content-Lengths, or one with Transfer-Encoding; RFC 9112 §6.3) is
  refused: the request smuggling shape.

Bounds: a head of at most `MAX_HEAD_BYTES` (431 past it); its time limit is the caller's
(`EgressSettings.head_timeout_s`, 408). Bytes read past the head are kept in
`Request.forward`, to go only to the server the proxy checks.

What it does not do: decide anything. Whether a destination is allowed is `egress`'s call.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct
from dataclasses import dataclass
from typing import Final

from bastion.config import normalize_host
from bastion.egress._relay import Budget

MAX_HEAD_BYTES: Final = 64 * 1024
MAX_METHOD_CHARS: Final = 32  # the longest registered HTTP method is 17 letters (UPDATEREDIRECTREF)
_HOP_BY_HOP: Final = frozenset(
    {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "proxy-authenticate", "te", "upgrade"}
)
_PHRASES: Final = {
    400: "Bad Request",
    403: "Forbidden",
    408: "Request Timeout",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
# RFC 1928 §6 reply codes for the same outcomes.
SOCKS_REPLY: Final = {400: 0x01, 403: 0x02, 408: 0x01, 431: 0x01, 502: 0x04, 503: 0x01, 504: 0x06}


class Refused(Exception):
    """An attempt that ends before a connection: the status the client gets and one line why."""

    def __init__(self, status: int, reason: str, *, decision: str = "deny") -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.decision = decision


def refused_error(status: int, reason: str) -> Refused:
    return Refused(status, reason, decision="error")


@dataclass(frozen=True, slots=True)
class Request:
    protocol: str  # "connect", "http" or "socks5"
    method: str
    host: str
    port: int
    forward: bytes  # what goes upstream first: the rewritten head, or bytes already read past it
    url: str | None = None


class Reader:
    """Buffered reads from the client socket, for the request head only. Each read spends the sandbox's `budget`
    (its bytes, and one of its head reads) and waits while it is in debt (within the head timeout): found by review,
    heads fed a byte at a time on 32 connections, reopened before the head cap or timeout, cost the proxy's thread
    a core, and the relay's budget never saw them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, budget: Budget) -> None:
        self.loop = loop
        self.sock = sock
        self.buf = bytearray()
        self.budget = budget

    async def fill(self) -> None:
        data = await self.loop.sock_recv(self.sock, 65536)
        if not data:
            raise refused_error(400, "the client closed the connection before its request was complete")
        self.buf += data
        wait = self.budget.owed_s(len(data))
        if wait > 0:
            await asyncio.sleep(wait)

    async def exact(self, count: int) -> bytes:
        while len(self.buf) < count:
            await self.fill()
        out = bytes(self.buf[:count])
        del self.buf[:count]
        return out

    async def head(self) -> bytes:
        start = 0
        while True:
            end = self.buf.find(b"\r\n\r\n", max(0, start - 3))
            if end != -1 and end <= MAX_HEAD_BYTES:
                out = bytes(self.buf[:end])
                del self.buf[: end + 4]
                return out
            if len(self.buf) > MAX_HEAD_BYTES:
                raise refused_error(431, f"the request head is larger than {MAX_HEAD_BYTES} bytes")
            start = len(self.buf)
            await self.fill()


def _split_authority(authority: str, default_port: int | None) -> tuple[str, int]:
    """``host[:port]`` or ``[v6][:port]`` -> (normalized host, port). Raises Refused(400)."""
    if authority.startswith("["):
        end = authority.find("]")
        host, rest = (authority[: end + 1], authority[end + 1 :]) if end != -1 else (authority, "")
    elif authority.count(":") > 1:
        raise refused_error(400, f"{authority!r}: put an IPv6 address in brackets")
    else:
        host, colon, port_text = authority.partition(":")
        rest = colon + port_text
    if rest and not rest.startswith(":"):
        raise refused_error(400, f"{authority!r} is not host:port")
    port_text = rest[1:]
    if not port_text:
        if default_port is None:
            raise refused_error(400, f"{authority!r} has no port: CONNECT needs host:port")
        port = default_port
    elif port_text.isascii() and port_text.isdigit() and len(port_text) <= 5 and 0 < int(port_text) < 65536:
        port = int(port_text)
    else:
        raise refused_error(400, f"{authority!r}: the port must be 1 to 65535")
    try:
        return normalize_host(host), port
    except ValueError as exc:
        raise refused_error(400, str(exc)) from None


def parse_http(head: bytes, rest: bytes) -> Request:
    """The request line and headers of an HTTP proxy request (RFC 9112 §3, §9.3.6 of RFC 9110)."""
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise refused_error(400, "the request head is not ASCII") from None
    lines = text.split("\r\n")
    if any("\r" in line or "\n" in line or "\0" in line for line in lines):
        raise refused_error(400, "the request head has a bare CR, LF or NUL")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[0].isupper() or parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
        raise refused_error(400, "the request line is not 'METHOD target HTTP/1.1'")
    method, target, version = parts
    # Each attempt's two records hold the method and the target: 4 KiB of each, the target in control
    # characters (6 bytes of JSON each), made one sandbox's refused attempts grow the log by 50 GB a day.
    if len(method) > MAX_METHOD_CHARS:
        raise refused_error(400, f"the method is longer than {MAX_METHOD_CHARS} letters")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in target):
        raise refused_error(400, "the request target has control characters (RFC 9112: visible ASCII only)")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        # A space before the colon or a folded line is a smuggling vector (RFC 9112 §5.1, §5.2).
        if not colon or not name or name != name.strip() or " " in name or "\t" in name:
            raise refused_error(400, "a request header is malformed")
        headers.append((name, value.strip()))
    if method == "CONNECT":
        host, port = _split_authority(target, None)
        return Request("connect", method, host, port, rest)
    if not target[:7].lower() == "http://":
        raise refused_error(400, "the target must be an absolute http:// URL (use CONNECT for https)")
    remainder = target[7:]
    cut = min((i for i in (remainder.find(c) for c in "/?#") if i != -1), default=len(remainder))
    authority, path = remainder[:cut], remainder[cut:]
    if "@" in authority:
        raise refused_error(400, "credentials in the URL are not forwarded: send an Authorization header")
    host, port = _split_authority(authority, 80)
    path = path.partition("#")[0]
    if not path.startswith("/"):
        path = "/" + path
    return Request("http", method, host, port, _rewrite(method, path, version, headers, authority) + rest, target)


def _rewrite(method: str, path: str, version: str, headers: list[tuple[str, str]], authority: str) -> bytes:
    """Origin-form request to the server, with the URL's Host and without hop-by-hop headers."""
    lengths = {value for name, value in headers if name.lower() == "content-length"}
    chunked = any(name.lower() == "transfer-encoding" for name, _ in headers)
    if len(lengths) > 1 or (lengths and chunked):
        # Two framings for one body (RFC 9112 §6.3): the classic request smuggling shape.
        raise refused_error(400, "the request has conflicting Content-Length or Transfer-Encoding headers")
    listed = {
        token.strip().lower() for name, value in headers if name.lower() == "connection" for token in value.split(",")
    }
    drop = _HOP_BY_HOP | listed | {"host"}
    out = [f"{method} {path} {version}", f"Host: {authority}"]
    out += [f"{name}: {value}" for name, value in headers if name.lower() not in drop]
    out.append("Connection: close")
    return ("\r\n".join(out) + "\r\n\r\n").encode("ascii")


async def read_socks(reader: Reader) -> Request:
    """A SOCKS5 CONNECT request (RFC 1928), without authentication."""
    _, count = await reader.exact(2)
    methods = await reader.exact(count)
    if 0 not in methods:
        await reader.loop.sock_sendall(reader.sock, b"\x05\xff")
        raise refused_error(400, "SOCKS5 without the no-authentication method")
    await reader.loop.sock_sendall(reader.sock, b"\x05\x00")
    version, command, _, kind = await reader.exact(4)
    if kind == 1:
        host = str(ipaddress.IPv4Address(await reader.exact(4)))
    elif kind == 4:
        host = str(ipaddress.IPv6Address(await reader.exact(16)))
    elif kind == 3:
        (length,) = await reader.exact(1)
        raw = await reader.exact(length)
        try:
            host = normalize_host(raw.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise refused_error(400, "the SOCKS5 host name is not a valid name") from None
    else:
        raise refused_error(400, "SOCKS5 address type unknown")
    (port,) = struct.unpack("!H", await reader.exact(2))
    if version != 5 or command != 1:
        raise refused_error(400, "only SOCKS5 CONNECT is supported")
    if port == 0:
        raise refused_error(400, "port 0 is not a destination")
    return Request("socks5", "CONNECT", host, port, bytes(reader.buf))


def reply(status: int, reason: str) -> bytes:
    # The reason goes in the status line too: pip and curl print the status line, not the body.
    line = "".join(c if c.isprintable() and c.isascii() else "?" for c in reason)[:200]
    body = f"bastion egress: {line}\n".encode()
    return (
        f"HTTP/1.1 {status} {_PHRASES.get(status, 'Error')}: {line}\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def socks_reply(code: int) -> bytes:
    return bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])

"""The egress proxy: the one way out of a sandbox, decided on the host.

A sandbox's network namespace has only loopback. A program inside that honours
``HTTP_PROXY``/``HTTPS_PROXY`` (or ``ALL_PROXY=socks5h://...``) reaches the proxy so:

    program -> 127.0.0.1:PORT (sandbox/_forwarder.py, inside, decides nothing)
            -> the unix socket file bound into the sandbox
            -> this proxy, on the host: parse the request, check the sandbox's allowlist,
               resolve the name here, check every address against the blocked ranges,
               connect to an address it checked
            -> the destination

A program that ignores the proxy variables has no route at all: nothing leaks. The socket
is made mode 0600 and put in place by rename; keep its folder private to the server, and
bind the folder (read-only is enough to connect) rather than the file, so a restarted
proxy's new socket is seen inside.

What it enforces (a security boundary):
    * Only destinations on the sandbox's allowlist (`bastion.config.AllowRule`: exact names,
      ``*.suffix``, IP literals, each with its ports). An IP literal is refused unless a rule
      names that literal: a name rule never admits an address. A name not on the allowlist
      is never resolved, so the proxy is no channel for DNS lookups either.
    * Never an address in the blocked ranges (`bastion.config.DEFAULT_BLOCKED_RANGES`:
      loopback, private, link-local, CGNAT, multicast, cloud metadata...), whatever name
      resolved to it (DNS rebinding): a name with any address in a blocked range is refused
      whole. The proxy resolves names itself (or through the configured ``hosts``) and
      connects to the very address it checked; IPv4-mapped IPv6 addresses are checked and
      dialled as the IPv4 address they carry.
    * Plain HTTP carries one request per connection: the proxy asks the server to close
      after its response and then closes the client's connection, so every request, a
      followed redirect included, comes on a new connection and is checked on its own.
      Bytes a client sends after its request still go only to the server it checked.
    * Bounds: request head size, head timeout, connect timeout, idle timeout, and a cap on
      open connections per sandbox.
    * Every attempt, allowed or refused, is one audit record (``event: "egress"``) with the
      sandbox, domain, port, resolved address, decision, reason, bytes each way and
      duration, written when it ends (the only time its byte counts are known). An allowed
      connection is also recorded before it is made (``event: "egress_open"``, with the
      checked addresses): if that record cannot be written, the connection is refused (503)
      and never made, so a crash or a broken log can never hide a connection.

What it does not do:
    * Look inside CONNECT tunnels: TLS is end to end, so the SNI and Host inside a tunnel are
      not checked. The tunnel's bytes still reach only the address that was checked.
    * Limit the bandwidth or the number of attempts over time; only concurrency is capped.

Usage from sync code (one event loop, in a daemon thread, serves every sandbox)::

    service = EgressService.from_config(audit, config.sandboxes.network)
    service.start("sb-0123456789ab", rules, "/state/sandboxes/sb-0123456789ab/egress.sock")
    service.set_rules("sb-0123456789ab", more_rules)   # e.g. the registry, during an install
    service.stop("sb-0123456789ab")                    # ends its connections, removes the socket
    service.close()                                    # stops everything and the thread

From a coroutine on another loop (the server's), `start_async`, `set_rules_async` and
`stop_async` do the same without blocking that loop.

Refusals answer the client with an HTTP status and a one-line reason (SOCKS5: a reply
code), never a silent close: 400 malformed request, 403 refused by policy, 408 request head
too slow, 431 head too large, 502 name or connection failure, 503 too many connections or
audit unavailable, 504 connect timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import fcntl
import ipaddress
import logging
import os
import socket
import stat
import struct
import threading
import time
import uuid
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from bastion.config import DEFAULT_BLOCKED_RANGES, AllowRule, normalize_host
from bastion.safety.errors import AuditUnavailable, Conflict, InvalidRequest, OperationFailed, SandboxNotFound

if TYPE_CHECKING:
    from bastion.config import NetworkConfig
    from bastion.safety.audit import AuditLog

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_HEAD_BYTES: Final = 64 * 1024
HEAD_TIMEOUT_S: Final = 30.0
CHUNK_BYTES: Final = 1024 * 1024
# A direction's pipe starts at the kernel's default (64 KiB) and grows to PIPE_BYTES once it has
# carried GROW_AFTER_BYTES: a bulk transfer then moves up to 1 MiB per splice (a 50 MiB download:
# ~190 splices instead of ~430 with 256 KiB, and a third less proxy CPU), while short and idle
# directions do not spend the user's pipe budget (fs.pipe-user-pages-soft).
PIPE_BYTES: Final = 1024 * 1024
GROW_AFTER_BYTES: Final = 1024 * 1024
SOCKET_BUFFER_BYTES: Final = 4 * 1024 * 1024
USE_SPLICE = hasattr(os, "splice")  # Linux, Python >= 3.10; tests turn it off to cover the fallback
MAX_ADDRESSES_TRIED: Final = 4
STOP_TIMEOUT_S: Final = 10.0
LINGER_S: Final = 2.0
LINGER_BYTES: Final = 1024 * 1024
_UNIX_PATH_MAX: Final = 107  # sun_path is 108 bytes, NUL included
_HOP_BY_HOP: Final = frozenset(
    {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "proxy-authenticate", "te", "upgrade"}
)
_PHRASES: Final = {
    400: "Bad Request",
    403: "Forbidden",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
# RFC 1928 §6 reply codes for the same outcomes.
_SOCKS_REPLY: Final = {400: 0x01, 403: 0x02, 408: 0x01, 431: 0x01, 502: 0x04, 503: 0x01, 504: 0x06}

_log = logging.getLogger("bastion.egress")


class Refused(Exception):
    """An attempt that ends before a connection: the status the client gets and one line why."""

    def __init__(self, status: int, reason: str, *, decision: str = "deny") -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.decision = decision


def _error(status: int, reason: str) -> Refused:
    return Refused(status, reason, decision="error")


@dataclass(frozen=True, slots=True)
class EgressSettings:
    """What every sandbox's proxy shares: blocked ranges, name overrides, timeouts, caps."""

    blocked_ranges: tuple[IPNetwork, ...]
    hosts: Mapping[str, tuple[IPAddress, ...]]
    connect_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0
    max_connections: int = 64
    head_timeout_s: float = HEAD_TIMEOUT_S


def parse_ranges(texts: Iterable[str]) -> tuple[IPNetwork, ...]:
    """Networks from their text form (``10.0.0.0/8``); raises ValueError on a malformed one."""
    return tuple(ipaddress.ip_network(text) for text in texts)


def blocked_by(address: IPAddress, ranges: Sequence[IPNetwork]) -> IPNetwork | None:
    """The blocked range holding `address`, or None. An IPv4-mapped address counts as its IPv4 one."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    for network in ranges:
        if network.version == address.version and address in network:
            return network
    return None


@dataclass(slots=True)
class _Attempt:
    """One audit record in the making."""

    sandbox: str
    protocol: str = "http"
    method: str | None = None
    domain: str | None = None
    port: int | None = None
    address: str | None = None
    url: str | None = None
    decision: str = "error"
    reason: str = ""
    bytes_up: int = 0
    bytes_down: int = 0
    started: float = field(default_factory=time.monotonic)

    def record(self) -> dict[str, object]:
        return {
            "event": "egress",
            "sandbox": self.sandbox,
            "protocol": self.protocol,
            "method": self.method,
            "domain": self.domain,
            "port": self.port,
            "address": self.address,
            "url": self.url,
            "decision": self.decision,
            "reason": self.reason,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "duration_ms": round((time.monotonic() - self.started) * 1000, 3),
        }


@dataclass(frozen=True, slots=True)
class _Request:
    protocol: str  # "connect", "http" or "socks5"
    method: str
    host: str
    port: int
    forward: bytes  # what goes upstream first: the rewritten head, or bytes already read past it
    url: str | None = None


class _Reader:
    """Buffered reads from the client socket, for the request head only."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        self.loop = loop
        self.sock = sock
        self.buf = bytearray()

    async def fill(self) -> None:
        data = await self.loop.sock_recv(self.sock, 65536)
        if not data:
            raise _error(400, "the client closed the connection before its request was complete")
        self.buf += data

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
                raise _error(431, f"the request head is larger than {MAX_HEAD_BYTES} bytes")
            start = len(self.buf)
            await self.fill()


def _split_authority(authority: str, default_port: int | None) -> tuple[str, int]:
    """``host[:port]`` or ``[v6][:port]`` -> (normalized host, port). Raises Refused(400)."""
    if authority.startswith("["):
        end = authority.find("]")
        host, rest = (authority[: end + 1], authority[end + 1 :]) if end != -1 else (authority, "")
    elif authority.count(":") > 1:
        raise _error(400, f"{authority!r}: put an IPv6 address in brackets")
    else:
        host, colon, port_text = authority.partition(":")
        rest = colon + port_text
    if rest and not rest.startswith(":"):
        raise _error(400, f"{authority!r} is not host:port")
    port_text = rest[1:]
    if not port_text:
        if default_port is None:
            raise _error(400, f"{authority!r} has no port: CONNECT needs host:port")
        port = default_port
    elif port_text.isascii() and port_text.isdigit() and len(port_text) <= 5 and 0 < int(port_text) < 65536:
        port = int(port_text)
    else:
        raise _error(400, f"{authority!r}: the port must be 1 to 65535")
    try:
        return normalize_host(host), port
    except ValueError as exc:
        raise _error(400, str(exc)) from None


def _parse_http(head: bytes, rest: bytes) -> _Request:
    """The request line and headers of an HTTP proxy request (RFC 9112 §3, §9.3.6 of RFC 9110)."""
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise _error(400, "the request head is not ASCII") from None
    lines = text.split("\r\n")
    if any("\r" in line or "\n" in line or "\0" in line for line in lines):
        raise _error(400, "the request head has a bare CR, LF or NUL")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[0].isupper() or parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
        raise _error(400, "the request line is not 'METHOD target HTTP/1.1'")
    method, target, version = parts
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        # A space before the colon or a folded line is a smuggling vector (RFC 9112 §5.1, §5.2).
        if not colon or not name or name != name.strip() or " " in name or "\t" in name:
            raise _error(400, "a request header is malformed")
        headers.append((name, value.strip()))
    if method == "CONNECT":
        host, port = _split_authority(target, None)
        return _Request("connect", method, host, port, rest)
    if not target[:7].lower() == "http://":
        raise _error(400, "the target must be an absolute http:// URL (use CONNECT for https)")
    remainder = target[7:]
    cut = min((i for i in (remainder.find(c) for c in "/?#") if i != -1), default=len(remainder))
    authority, path = remainder[:cut], remainder[cut:]
    if "@" in authority:
        raise _error(400, "credentials in the URL are not forwarded: send an Authorization header")
    host, port = _split_authority(authority, 80)
    path = path.partition("#")[0]
    if not path.startswith("/"):
        path = "/" + path
    return _Request("http", method, host, port, _rewrite(method, path, version, headers, authority) + rest, target)


def _rewrite(method: str, path: str, version: str, headers: list[tuple[str, str]], authority: str) -> bytes:
    """Origin-form request to the server, with the URL's Host and without hop-by-hop headers."""
    lengths = {value for name, value in headers if name.lower() == "content-length"}
    chunked = any(name.lower() == "transfer-encoding" for name, _ in headers)
    if len(lengths) > 1 or (lengths and chunked):
        # Two framings for one body (RFC 9112 §6.3): the classic request smuggling shape.
        raise _error(400, "the request has conflicting Content-Length or Transfer-Encoding headers")
    listed = {
        token.strip().lower() for name, value in headers if name.lower() == "connection" for token in value.split(",")
    }
    drop = _HOP_BY_HOP | listed | {"host"}
    out = [f"{method} {path} {version}", f"Host: {authority}"]
    out += [f"{name}: {value}" for name, value in headers if name.lower() not in drop]
    out.append("Connection: close")
    return ("\r\n".join(out) + "\r\n\r\n").encode("ascii")


async def _read_socks(reader: _Reader) -> _Request:
    """A SOCKS5 CONNECT request (RFC 1928), without authentication."""
    _, count = await reader.exact(2)
    methods = await reader.exact(count)
    if 0 not in methods:
        await reader.loop.sock_sendall(reader.sock, b"\x05\xff")
        raise _error(400, "SOCKS5 without the no-authentication method")
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
            raise _error(400, "the SOCKS5 host name is not a valid name") from None
    else:
        raise _error(400, "SOCKS5 address type unknown")
    (port,) = struct.unpack("!H", await reader.exact(2))
    if version != 5 or command != 1:
        raise _error(400, "only SOCKS5 CONNECT is supported")
    if port == 0:
        raise _error(400, "port 0 is not a destination")
    return _Request("socks5", "CONNECT", host, port, bytes(reader.buf))


def _reply(status: int, reason: str) -> bytes:
    # The reason goes in the status line too: pip and curl print the status line, not the body.
    line = "".join(c if c.isprintable() and c.isascii() else "?" for c in reason)[:200]
    body = f"bastion egress: {line}\n".encode()
    return (
        f"HTTP/1.1 {status} {_PHRASES.get(status, 'Error')}: {line}\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def _socks_reply(code: int) -> bytes:
    return bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])


@dataclass(eq=False)
class _SandboxProxy:
    sandbox_id: str
    rules: tuple[AllowRule, ...]
    listener: socket.socket
    path: Path
    inode: tuple[int, int]
    accept_task: asyncio.Task[None] | None = None
    connections: set[asyncio.Task[None]] = field(default_factory=set)


class EgressProxy:
    """The asyncio side: every sandbox's listener and connections, on one event loop.

    Use `EgressService` from sync code; this class is for code already on the loop.
    """

    def __init__(self, audit: AuditLog, settings: EgressSettings) -> None:
        self._audit = audit
        self._settings = settings
        self._proxies: dict[str, _SandboxProxy] = {}
        # AuditLog.append_async serves one event loop (the server's): this loop writes
        # with the thread-safe `append`, off the loop, on its own small pool.
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="egress-audit")

    async def start(self, sandbox_id: str, rules: Sequence[AllowRule], socket_path: str | os.PathLike[str]) -> None:
        """Listen on `socket_path` (mode 0600) for `sandbox_id`.

        Raises:
            Conflict: the sandbox already has a proxy, or the path exists and is not a socket.
            InvalidRequest: the path is too long for a unix socket.
            OperationFailed: the socket cannot be made.
        """
        if sandbox_id in self._proxies:
            raise Conflict(f"sandbox {sandbox_id} already has an egress proxy: stop it first")
        path = Path(socket_path)
        listener, inode = _listen(path)
        proxy = _SandboxProxy(sandbox_id, tuple(rules), listener, path, inode)
        self._proxies[sandbox_id] = proxy
        proxy.accept_task = asyncio.get_running_loop().create_task(self._accept(proxy))

    def set_rules(self, sandbox_id: str, rules: Sequence[AllowRule]) -> None:
        """Replace a sandbox's allowlist; open connections keep the decision they were given.

        Raises:
            SandboxNotFound: the sandbox has no proxy.
        """
        proxy = self._proxies.get(sandbox_id)
        if proxy is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} has no egress proxy: start one first")
        proxy.rules = tuple(rules)

    async def stop(self, sandbox_id: str) -> None:
        """Stop listening, end the sandbox's connections (their records are written), remove the socket."""
        proxy = self._proxies.pop(sandbox_id, None)
        if proxy is None:
            return
        with contextlib.suppress(OSError):
            st = os.lstat(proxy.path)
            if (st.st_dev, st.st_ino) == proxy.inode:
                os.unlink(proxy.path)
        tasks = [t for t in (proxy.accept_task, *proxy.connections) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
        _close(proxy.listener)

    async def close(self) -> None:
        for sandbox_id in list(self._proxies):
            await self.stop(sandbox_id)
        self._writer.shutdown(wait=True)

    def sandboxes(self) -> list[str]:
        return sorted(self._proxies)

    # -- one connection ------------------------------------------------------------

    async def _accept(self, proxy: _SandboxProxy) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                client, _ = await loop.sock_accept(proxy.listener)
            except OSError as exc:
                _log.warning("egress proxy of %s cannot accept: %s", proxy.sandbox_id, exc)
                await asyncio.sleep(0.1)
                continue
            client.setblocking(False)
            _grow_buffers(client)
            task = loop.create_task(self._serve(proxy, client))
            proxy.connections.add(task)
            task.add_done_callback(proxy.connections.discard)

    async def _serve(self, proxy: _SandboxProxy, client: socket.socket) -> None:
        attempt = _Attempt(proxy.sandbox_id)
        upstream: socket.socket | None = None
        socks = False
        try:
            if len(proxy.connections) > self._settings.max_connections:
                raise Refused(503, f"more than {self._settings.max_connections} open connections: close some first")
            request = await self._read_request(client, attempt)
            socks = request.protocol == "socks5"
            upstream = await self._open(proxy, request, attempt)
            await self._relay(client, upstream, request, attempt)
        except Refused as exc:
            attempt.decision, attempt.reason = exc.decision, exc.reason
            message = _socks_reply(_SOCKS_REPLY.get(exc.status, 1)) if socks else _reply(exc.status, exc.reason)
            await _answer_and_linger(client, message)
        except OSError as exc:
            # The client went away during the handshake; the decision already made stands.
            attempt.reason = f"{attempt.reason or 'failed'}; ended: {exc.strerror or exc}"
        except asyncio.CancelledError:
            attempt.reason = f"{attempt.reason or 'no decision'}; ended: the sandbox's proxy stopped"
            raise
        except Exception as exc:
            _log.exception("egress proxy error for %s", proxy.sandbox_id)
            attempt.decision, attempt.reason = "error", f"internal error: {type(exc).__name__}"
        finally:
            _close(client)
            if upstream is not None:
                _close(upstream)
            await self._append(attempt.record())

    async def _read_request(self, client: socket.socket, attempt: _Attempt) -> _Request:
        reader = _Reader(asyncio.get_running_loop(), client)
        try:
            async with asyncio.timeout(self._settings.head_timeout_s):
                await reader.fill()
                if reader.buf[0] == 5:
                    attempt.protocol = "socks5"
                    return await _read_socks(reader)
                head = await reader.head()
        except TimeoutError:
            raise _error(408, f"the request head did not arrive within {self._settings.head_timeout_s:g} s") from None
        except OSError as exc:
            raise _error(400, f"the client connection failed: {exc.strerror or exc}") from None
        request = _parse_http(head, bytes(reader.buf))
        attempt.protocol, attempt.method, attempt.url = request.protocol, request.method, request.url
        return request

    async def _open(self, proxy: _SandboxProxy, request: _Request, attempt: _Attempt) -> socket.socket:
        """Check, resolve, check again and connect; the socket returned is to an address that was checked."""
        attempt.method, attempt.domain, attempt.port = request.method, request.host, request.port
        if not any(rule.matches(request.host, request.port) for rule in proxy.rules):
            what = "IP address" if _literal(request.host) else "destination"
            raise Refused(403, f"{what} {_show(request.host, request.port)} is not on this sandbox's allowlist")
        addresses = await self._resolve(request.host, request.port)
        allowed: list[IPAddress] = []
        for address in addresses:
            network = blocked_by(address, self._settings.blocked_ranges)
            if network is not None:
                attempt.address = str(address)
                raise Refused(403, f"{request.host} resolves to {address}, in the blocked range {network}")
            allowed.append(address.ipv4_mapped or address if isinstance(address, ipaddress.IPv6Address) else address)
        await self._record_open(attempt, allowed[:MAX_ADDRESSES_TRIED])
        sock, address = await self._connect(allowed[:MAX_ADDRESSES_TRIED], request.port)
        attempt.address = str(address)
        return sock

    async def _record_open(self, attempt: _Attempt, addresses: list[IPAddress]) -> None:
        """Record an allowed connection before it is made; refuse it (503) if that fails."""
        record: dict[str, object] = {
            "event": "egress_open",
            "sandbox": attempt.sandbox,
            "protocol": attempt.protocol,
            "method": attempt.method,
            "domain": attempt.domain,
            "port": attempt.port,
            "url": attempt.url,
            "addresses": [str(address) for address in addresses],
        }
        if not await self._append(record):
            raise Refused(503, "the audit log is unavailable: no connection is made unrecorded")

    async def _resolve(self, host: str, port: int) -> list[IPAddress]:
        literal = _literal(host)
        if literal is not None:
            return [literal]
        mapped = self._settings.hosts.get(host)
        if mapped is not None:
            return list(mapped)
        loop = asyncio.get_running_loop()
        # The host's resolver (glibc: /etc/hosts, then DNS). No trailing dot is added against
        # search-list expansion: /etc/hosts names would no longer match. A name the search list
        # expands into an internal one still meets the blocked ranges.
        try:
            async with asyncio.timeout(self._settings.connect_timeout_s):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        except TimeoutError:
            raise _error(504, f"resolving {host} took longer than {self._settings.connect_timeout_s:g} s") from None
        except OSError as exc:
            raise _error(502, f"{host} cannot be resolved: {exc.strerror or exc}") from None
        found: list[IPAddress] = []
        for family, _, _, _, sockaddr in infos:
            if family in (socket.AF_INET, socket.AF_INET6):
                # A scope id ("fe80::1%eth0") is dropped: such addresses are link-local, hence blocked.
                address = ipaddress.ip_address(str(sockaddr[0]).partition("%")[0])
                if address not in found:
                    found.append(address)
        if not found:
            raise _error(502, f"{host} has no IPv4 or IPv6 address")
        return found

    async def _connect(self, addresses: list[IPAddress], port: int) -> tuple[socket.socket, IPAddress]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.connect_timeout_s
        failure = _error(502, "no address to connect to")
        for address in addresses:
            family = socket.AF_INET if address.version == 4 else socket.AF_INET6
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                async with asyncio.timeout_at(deadline):
                    await loop.sock_connect(sock, (str(address), port))
            except TimeoutError:
                _close(sock)
                raise _error(504, f"connecting to {_show(str(address), port)} timed out") from None
            except OSError as exc:
                _close(sock)
                failure = _error(502, f"connecting to {_show(str(address), port)} failed: {exc.strerror or exc}")
                continue
            except BaseException:
                _close(sock)
                raise
            return sock, address
        raise failure

    async def _relay(
        self, client: socket.socket, upstream: socket.socket, request: _Request, attempt: _Attempt
    ) -> None:
        loop = asyncio.get_running_loop()
        attempt.decision, attempt.reason = "allow", "allowed"
        if request.protocol == "connect":
            await loop.sock_sendall(client, b"HTTP/1.1 200 Connection established\r\n\r\n")
        elif request.protocol == "socks5":
            await loop.sock_sendall(client, _socks_reply(0))
        last = [loop.time()]
        try:
            if request.forward:
                await loop.sock_sendall(upstream, request.forward)
                attempt.bytes_up += len(request.forward)
            up = loop.create_task(_copy(loop, client, upstream, attempt, "bytes_up", last))
            down = loop.create_task(_copy(loop, upstream, client, attempt, "bytes_down", last))
        except OSError as exc:
            attempt.reason = f"ended: {exc.strerror or exc}"
            return
        pending = {up, down}
        try:
            while pending:
                wait = last[0] + self._settings.idle_timeout_s - loop.time()
                done, pending = await asyncio.wait(pending, timeout=max(wait, 0), return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    failure = task.exception()
                    if failure is not None:
                        attempt.reason = f"ended: {getattr(failure, 'strerror', None) or failure}"
                        return
                # Plain HTTP: the response is complete when the server closes; the client's
                # next request must come on a new connection, to be checked.
                if request.protocol == "http" and down in done:
                    return
                if not done and loop.time() - last[0] >= self._settings.idle_timeout_s:
                    attempt.reason = f"ended: idle for {self._settings.idle_timeout_s:g} s"
                    return
        finally:
            for task in (up, down):
                task.cancel()
            await asyncio.wait([up, down])

    async def _append(self, record: dict[str, object]) -> bool:
        """Write one record off the loop; whether it is on disk (a failure is logged)."""
        loop = asyncio.get_running_loop()
        try:
            await asyncio.shield(loop.run_in_executor(self._writer, self._audit.append, record))
        except AuditUnavailable as exc:
            _log.error("egress attempt not recorded (%s): %s", exc.reason, record)
        except Exception:
            _log.exception("egress attempt not recorded: %s", record)
        else:
            return True
        return False


async def _copy(
    loop: asyncio.AbstractEventLoop,
    src: socket.socket,
    dst: socket.socket,
    attempt: _Attempt,
    counter: str,
    last: list[float],
) -> None:
    """Copy until EOF, then pass the EOF on (half-close).

    splice(2) through a pipe when the kernel allows it: the bytes never enter this
    process, which halves the proxy's CPU per byte; otherwise large reads and writes.
    """
    if not (USE_SPLICE and await _splice(loop, src, dst, attempt, counter, last)):
        await _read_write(loop, src, dst, attempt, counter, last)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


async def _read_write(
    loop: asyncio.AbstractEventLoop,
    src: socket.socket,
    dst: socket.socket,
    attempt: _Attempt,
    counter: str,
    last: list[float],
) -> None:
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    while True:
        count = await loop.sock_recv_into(src, buf)
        if not count:
            return
        await loop.sock_sendall(dst, view[:count])
        setattr(attempt, counter, getattr(attempt, counter) + count)
        last[0] = loop.time()


async def _splice(
    loop: asyncio.AbstractEventLoop,
    src: socket.socket,
    dst: socket.socket,
    attempt: _Attempt,
    counter: str,
    last: list[float],
) -> bool:
    """Copy with splice(2); False if the kernel refuses it before any byte moved."""
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
    moved = 0
    try:
        while True:
            try:
                count = os.splice(src.fileno(), write_end, CHUNK_BYTES, flags=flags)
            except BlockingIOError:
                await _ready(loop, src, write=False)
                continue
            except OSError as exc:
                if not moved and exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    return False
                raise
            if not count:
                return True
            if moved < GROW_AFTER_BYTES <= moved + count:
                with contextlib.suppress(OSError):  # refused past the user's pipe budget: the pipe stays small
                    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            moved += count
            left = count
            while left:
                try:
                    left -= os.splice(read_end, dst.fileno(), left, flags=flags)
                except BlockingIOError:
                    await _ready(loop, dst, write=True)
            setattr(attempt, counter, getattr(attempt, counter) + count)
            last[0] = loop.time()
    finally:
        os.close(read_end)
        os.close(write_end)


async def _ready(loop: asyncio.AbstractEventLoop, sock: socket.socket, *, write: bool) -> None:
    """Wait until `sock` is readable (or writable)."""
    waiter: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    if write:
        loop.add_writer(sock, wake)
    else:
        loop.add_reader(sock, wake)
    try:
        await waiter
    finally:
        if sock.fileno() != -1:
            (loop.remove_writer if write else loop.remove_reader)(sock)


async def _answer_and_linger(client: socket.socket, message: bytes) -> None:
    """Send a refusal, then read and drop what the client still sends, for a moment.

    Closing with unread data makes the kernel reset the connection, which can destroy
    the refusal before the client reads it (RFC 9112 §9.6, "tear-down").
    """
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(LINGER_S):
            await loop.sock_sendall(client, message)
            client.shutdown(socket.SHUT_WR)
            dropped = 0
            while dropped < LINGER_BYTES:
                count = len(await loop.sock_recv(client, 65536))
                if not count:
                    break
                dropped += count


def _grow_buffers(sock: socket.socket) -> None:
    # Fewer, larger copies: the kernel caps the request at net.core.[rw]mem_max.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def _close(sock: socket.socket) -> None:
    """Close a socket an `await loop.sock_*` may still be registered for.

    Removing the reader and writer first cancels their handles, so the cancelled
    operation's late clean-up cannot unregister another socket that reuses the number.
    """
    if sock.fileno() != -1:
        loop = asyncio.get_running_loop()
        loop.remove_reader(sock)
        loop.remove_writer(sock)
    sock.close()


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _show(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _listen(path: Path) -> tuple[socket.socket, tuple[int, int]]:
    """A listening unix socket at `path`, mode 0600, put in place by rename (never half-made)."""
    if len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise InvalidRequest(
            f"egress socket path {path} is longer than {_UNIX_PATH_MAX} bytes: use a shorter state_dir"
        )
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise Conflict(f"{path} exists and is not a socket: remove it")
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    if len(os.fsencode(temp)) > _UNIX_PATH_MAX:
        temp = path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(temp))
        os.chmod(temp, 0o600)
        if temp != path:
            os.rename(temp, path)
        listener.listen(128)
        listener.setblocking(False)
        st = os.lstat(path)
    except OSError as exc:
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise OperationFailed(f"egress socket {path} cannot be made: {exc.strerror or exc}") from None
    return listener, (st.st_dev, st.st_ino)


class EgressService:
    """Sync front of `EgressProxy`: one event loop in a daemon thread serves every sandbox.

    Args:
        audit: the server's audit log (its thread-safe `append` is used, off the loop).
        blocked_ranges: networks never connected to; default `DEFAULT_BLOCKED_RANGES`.
        hosts: names resolved to these addresses instead of through DNS.
        connect_timeout_s, idle_timeout_s, max_connections: per connection / per sandbox bounds.
    """

    def __init__(
        self,
        audit: AuditLog,
        *,
        blocked_ranges: Iterable[str] = DEFAULT_BLOCKED_RANGES,
        hosts: Mapping[str, Sequence[str]] | None = None,
        connect_timeout_s: float = 10.0,
        idle_timeout_s: float = 300.0,
        max_connections: int = 64,
        head_timeout_s: float = HEAD_TIMEOUT_S,
    ) -> None:
        settings = EgressSettings(
            blocked_ranges=parse_ranges(blocked_ranges),
            hosts={
                normalize_host(name): tuple(ipaddress.ip_address(a) for a in addresses)
                for name, addresses in (hosts or {}).items()
            },
            connect_timeout_s=connect_timeout_s,
            idle_timeout_s=idle_timeout_s,
            max_connections=max_connections,
            head_timeout_s=head_timeout_s,
        )
        self._loop = asyncio.new_event_loop()
        self._proxy = EgressProxy(audit, settings)
        self._thread = threading.Thread(target=self._run, name="bastion-egress", daemon=True)
        self._closed = False
        self._thread.start()

    @classmethod
    def from_config(cls, audit: AuditLog, network: NetworkConfig) -> EgressService:
        return cls(
            audit,
            blocked_ranges=network.blocked_ranges,
            hosts=network.hosts,
            connect_timeout_s=network.connect_timeout_s,
            idle_timeout_s=network.idle_timeout_s,
            max_connections=network.max_connections,
        )

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call(self, coro: Coroutine[Any, Any, None], timeout: float) -> None:
        if threading.current_thread() is self._thread or self._closed:
            coro.close()
            if self._closed:
                raise OperationFailed("the egress service is closed")
            raise RuntimeError("EgressService is sync: call it from outside its own event loop")
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self, sandbox_id: str, rules: Sequence[AllowRule], socket_path: str | os.PathLike[str]) -> None:
        """Serve `sandbox_id` on a unix socket at `socket_path`; see `EgressProxy.start` for errors."""
        self._call(self._proxy.start(sandbox_id, rules, socket_path), STOP_TIMEOUT_S)

    def set_rules(self, sandbox_id: str, rules: Sequence[AllowRule]) -> None:
        """Replace a running sandbox's allowlist (SandboxNotFound if it has none)."""

        async def update() -> None:
            self._proxy.set_rules(sandbox_id, rules)

        self._call(update(), STOP_TIMEOUT_S)

    def stop(self, sandbox_id: str) -> None:
        """End a sandbox's proxy and connections; a no-op for a sandbox without one."""
        self._call(self._proxy.stop(sandbox_id), STOP_TIMEOUT_S * 2)

    # The same, for code on another event loop (the server's), without blocking it.

    async def start_async(
        self, sandbox_id: str, rules: Sequence[AllowRule], socket_path: str | os.PathLike[str]
    ) -> None:
        await self._call_async(self._proxy.start(sandbox_id, rules, socket_path))

    async def set_rules_async(self, sandbox_id: str, rules: Sequence[AllowRule]) -> None:
        async def update() -> None:
            self._proxy.set_rules(sandbox_id, rules)

        await self._call_async(update())

    async def stop_async(self, sandbox_id: str) -> None:
        await self._call_async(self._proxy.stop(sandbox_id))

    async def _call_async(self, coro: Coroutine[Any, Any, None]) -> None:
        if self._closed:
            coro.close()
            raise OperationFailed("the egress service is closed")
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def sandboxes(self) -> list[str]:
        return self._proxy.sandboxes()

    def close(self) -> None:
        """Stop every proxy, then the loop and its thread. Idempotent."""
        if self._closed:
            return
        try:
            self._call(self._proxy.close(), STOP_TIMEOUT_S * 3)
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(STOP_TIMEOUT_S)
            if not self._thread.is_alive():
                self._loop.close()

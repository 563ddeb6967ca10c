"""The egress proxy: the one way out of a sandbox, decided on the host.

A sandbox's network namespace has only loopback. A program inside that honours
``HTTP_PROXY``/``HTTPS_PROXY`` (or ``ALL_PROXY=socks5h://...``) reaches the proxy so:

    program -> 127.0.0.1:PORT (sandbox/inside/forwarder.py, decides nothing)
            -> the unix socket file bound into the sandbox
            -> this proxy, on the host: parse the request, check the sandbox's allowlist,
               resolve the name here, check every address against the blocked ranges,
               connect to an address it checked
            -> the destination

A program that ignores the proxy variables has no route at all: nothing leaks. The socket
is made mode 0600 and put in place by rename; keep its folder private to the server, and
bind the folder (read-only is enough to connect) rather than the file, so a restarted
proxy's new socket is seen inside.

This module holds the policy, the audit records and the service. The request head is read
and parsed by `bastion.egress._request`, and an allowed connection's bytes are carried
by `bastion.egress._relay`; their docstrings say what each refuses and what it guarantees.

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
    * Bounds: head timeout, connect timeout and a cap on open connections per sandbox, here;
      the request head size in `_request`, the idle timeout in `_relay`.
    * Name lookups per sandbox (`_throttle.NameLookups`): on the sandbox's own threads, 8 at once
      by default, each holding its slot until the resolver returns (not until the proxy stops
      waiting). Past the cap a sandbox's lookups wait for one of its own slots, until the connect
      timeout (then 503): a sandbox whose DNS never answers delays its own attempts, never another's.
    * A rate of attempts per sandbox (`_throttle`: a token bucket, 20 a second and bursts of
      200 by default). Past it an attempt is refused with 429 before its request is read,
      and counted instead of recorded: one ``event: "egress_throttled"`` record a second
      carries the count, so a sandbox cannot fill the audit log's disk (which would stop
      the server) by opening connections in a loop.
    * A rate of bytes per sandbox (`bastion.safety.rates.ByteRate`: 64 MiB a second, both ways and every
      connection together, bursts of 16 MiB by default). The relay is the server's CPU, not
      the sandbox's: found by attack, one sandbox's download from a fast destination took
      half a core of it and slowed every other sandbox's connections.
    * Every attempt within the rate, allowed or refused, is one audit record
      (``event: "egress"``) with the sandbox, domain, port, resolved address, decision,
      reason, bytes each way and
      duration, written when it ends (the only time its byte counts are known). An allowed
      connection is also recorded before it is made (``event: "egress_open"``, with the
      checked addresses): if that record cannot be written, the connection is refused (503)
      and never made, so a crash or a broken log can never hide a connection.

What it does not do:
    * Look inside CONNECT tunnels: TLS is end to end, so the SNI and Host inside a tunnel are
      not checked. The tunnel's bytes still reach only the address that was checked.
    * Share the bandwidth fairly among one sandbox's connections: the byte budget is the sandbox's.
    * Answer SOCKS5 in its own terms when throttling: a throttled SOCKS client gets the HTTP 429.

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
too slow, 429 too many attempts, 431 head too large, 502 name or connection failure, 503 too many connections,
too many name lookups in progress or audit unavailable, 504 lookup or connect timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import os
import socket
import stat
import threading
import time
import uuid
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from bastion.config import DEFAULT_BLOCKED_RANGES, DEFAULT_BYTE_BURST, DEFAULT_BYTES_PER_S, AllowRule, normalize_host
from bastion.egress._relay import (
    PASS_BURST,
    PASSES_PER_S,
    Budget,
    answer_and_linger,
    carry,
    close_socket,
    grow_buffers,
    ready,
)
from bastion.egress._request import (
    SOCKS_REPLY,
    Reader,
    Request,
    parse_http,
    read_socks,
    refused_error,
    reply,
    socks_reply,
)

# Re-exported: `Refused` is raised by the request parsing too, so it is defined there.
from bastion.egress._request import Refused as Refused
from bastion.egress._throttle import MAX_IN_RESOLVER, AttemptThrottle, LookupsBusy, NameLookups, ResolverFull
from bastion.executors import started_pool
from bastion.metrics import EgressVerdict, Metrics
from bastion.safety.errors import (
    AuditUnavailable,
    ConfigError,
    Conflict,
    InvalidRequest,
    OperationFailed,
    SandboxNotFound,
)
from bastion.safety.rates import ByteRate

if TYPE_CHECKING:
    from bastion.config import NetworkConfig
    from bastion.safety.audit import AuditLog

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

HEAD_TIMEOUT_S: Final = 30.0
MAX_ADDRESSES_TRIED: Final = 4
STOP_TIMEOUT_S: Final = 10.0
RECORD_WRITERS: Final = 4  # threads writing connection records (`EgressService._writer`)
_ACCEPTS_PER_PASS: Final = 32  # then the loop serves others before the listener again
HEAD_READS_PER_S: Final = 256
HEAD_READ_BURST: Final = 64
"""Reads of request heads a second a sandbox, and at once (a head comes in one read or two; attempts are 20 a
second). Fewer than a relay's passes: the kernel's work for a read grows with the writes it gathers (each a buffer
of its own), and a client feeding heads a byte at a time on 32 connections cost the proxy's thread 0.98 cores
(found by review)."""
HELD_PER_CAP: Final = 2
"""A sandbox's proxy holds at most this many times `max_connections` (open ones, and refused ones lingering
for their answer to be read); the rest wait unaccepted in the listener's backlog."""
THROTTLE_REPORT_S: Final = 1.0  # at most one egress_throttled record per sandbox this often
UNIX_PATH_MAX: Final = 107  # sun_path is 108 bytes, NUL included

_log = logging.getLogger("bastion.egress")


@dataclass(frozen=True, slots=True)
class EgressSettings:
    """What every sandbox's proxy shares: blocked ranges, name overrides, timeouts, caps."""

    blocked_ranges: tuple[IPNetwork, ...]
    hosts: Mapping[str, tuple[IPAddress, ...]]
    connect_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0
    max_connections: int = 64
    head_timeout_s: float = HEAD_TIMEOUT_S
    attempts_per_s: float = 20.0
    attempt_burst: int = 200
    max_lookups: int = 8
    bytes_per_s: int = DEFAULT_BYTES_PER_S
    byte_burst: int = DEFAULT_BYTE_BURST


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


MAX_RECORDED_URL_CHARS: Final = 512


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


@dataclass(eq=False)
class _SandboxProxy:
    sandbox_id: str
    rules: tuple[AllowRule, ...]
    listener: socket.socket
    path: Path
    inode: tuple[int, int]
    throttle: AttemptThrottle
    lookups: NameLookups
    budget: Budget  # its bytes, and the relay's passes
    heads: Budget  # the same bytes, and its reads of request heads
    accept_task: asyncio.Task[None] | None = None
    connections: set[asyncio.Task[None]] = field(default_factory=set)
    report: asyncio.TimerHandle | None = None  # the pending egress_throttled record
    reports: set[asyncio.Task[None]] = field(default_factory=set)  # egress_throttled records being written
    room: asyncio.Event = field(default_factory=asyncio.Event)  # set as a connection ends (`_accept` waits)
    destinations: dict[asyncio.Task[None], tuple[str, int]] = field(default_factory=dict)  # open, allowed ones
    narrowed: set[asyncio.Task[None]] = field(default_factory=set)  # ended by `set_rules`


def _recorded(url: str | None) -> str | None:
    """A URL as its records keep it: its first `MAX_RECORDED_URL_CHARS` (a target may fill a 64 KiB head,
    written twice an attempt, 20 attempts a second)."""
    if url is None or len(url) <= MAX_RECORDED_URL_CHARS:
        return url
    return f"{url[:MAX_RECORDED_URL_CHARS]}…[{len(url) - MAX_RECORDED_URL_CHARS} more characters]"


def _allows(rules: Sequence[AllowRule], host: str, port: int) -> bool:
    return any(rule.matches(host, port) for rule in rules)


def _to_this_host(sock: socket.socket) -> bool:
    """Whether a connected socket's peer is this host: the kernel then uses the peer's own address as
    ours. The blocked ranges hold loopback and private ranges, not the host's public addresses, which an
    allowed name's DNS can name (a service of the host bound to 0.0.0.0 or ::, reached from a sandbox).
    Loopback stays the blocked ranges' to decide (blocked by default; a test's server is let through)."""
    try:
        return bool(sock.getsockname()[0] == sock.getpeername()[0])
    except OSError:
        return False


def _close_client(client: socket.socket, _: asyncio.Task[None]) -> None:
    close_socket(client)


class EgressProxy:
    """The asyncio side: every sandbox's listener and connections, on one event loop.

    Use `EgressService` from sync code; this class is for code already on the loop.
    """

    def __init__(self, audit: AuditLog, settings: EgressSettings, metrics: Metrics | None = None) -> None:
        self._audit = audit
        self._settings = settings
        self._metrics = metrics
        self._proxies: dict[str, _SandboxProxy] = {}
        # AuditLog.append_async serves one event loop (the server's): this loop writes
        # with the thread-safe `append`, off the loop, on its own small pool.
        # Started up front (`started_pool`): a record queued in a pool that could not start a thread was written
        # later, after the attempt had been counted unrecorded (found by review, a host out of threads).
        try:
            self._writer = started_pool(RECORD_WRITERS, "egress-audit")
        except RuntimeError as exc:
            raise ConfigError(f"egress: the threads that record connections cannot start ({exc})") from None

    async def start(
        self,
        sandbox_id: str,
        rules: Sequence[AllowRule],
        socket_path: str | os.PathLike[str],
        owner: tuple[int, int] | None = None,
    ) -> None:
        """Listen on `socket_path` (mode 0600, owned by `owner` if given: the sandbox's host identity) for `sandbox_id`.

        Raises:
            Conflict: the sandbox already has a proxy, or the path exists and is not a socket.
            InvalidRequest: the path is too long for a unix socket.
            OperationFailed: the socket cannot be made.
        """
        if sandbox_id in self._proxies:
            raise Conflict(f"sandbox {sandbox_id} already has an egress proxy: stop it first")
        path = Path(socket_path)
        listener, inode = _listen(path, owner)
        throttle = AttemptThrottle(self._settings.attempts_per_s, self._settings.attempt_burst)
        lookups = NameLookups(self._settings.max_lookups, f"egress-lookup-{sandbox_id}")
        sent = ByteRate(self._settings.bytes_per_s, self._settings.byte_burst)
        budget = Budget(sent, ByteRate(PASSES_PER_S, PASS_BURST))
        heads = Budget(sent, ByteRate(HEAD_READS_PER_S, HEAD_READ_BURST))
        proxy = _SandboxProxy(sandbox_id, tuple(rules), listener, path, inode, throttle, lookups, budget, heads)
        self._proxies[sandbox_id] = proxy
        proxy.accept_task = asyncio.get_running_loop().create_task(self._accept(proxy))

    def set_rules(self, sandbox_id: str, rules: Sequence[AllowRule]) -> None:
        """Replace a sandbox's allowlist, and end its open connections the new one does not allow.

        A tunnel opened while an install widened the allowlist kept its route to the registry for as long
        as a byte crossed it every `idle_timeout_s`: a way out for ever after the install. Each connection
        so ended gets its record (`ended: the allowlist no longer allows it`).

        Raises:
            SandboxNotFound: the sandbox has no proxy.
        """
        proxy = self._proxies.get(sandbox_id)
        if proxy is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} has no egress proxy: start one first")
        proxy.rules = tuple(rules)
        for task, (host, port) in list(proxy.destinations.items()):
            if not _allows(proxy.rules, host, port):
                proxy.narrowed.add(task)
                task.cancel()

    async def stop(self, sandbox_id: str) -> None:
        """Stop listening, end the sandbox's connections (their records are written), remove the socket."""
        proxy = self._proxies.pop(sandbox_id, None)
        if proxy is None:
            return
        with contextlib.suppress(OSError):
            st = os.lstat(proxy.path)
            if (st.st_dev, st.st_ino) == proxy.inode:
                os.unlink(proxy.path)
        tasks = [t for t in (proxy.accept_task, *proxy.connections, *proxy.reports) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
        close_socket(proxy.listener)
        proxy.lookups.close()
        if proxy.report is not None:
            proxy.report.cancel()
        await self._report_throttled(proxy)

    async def close(self) -> None:
        for sandbox_id in list(self._proxies):
            await self.stop(sandbox_id)
        self._writer.shutdown(wait=True)

    def sandboxes(self) -> list[str]:
        return sorted(self._proxies)

    # -- one connection ------------------------------------------------------------

    async def _accept(self, proxy: _SandboxProxy) -> None:
        # Not `loop.sock_accept`: it accepts in one pass and resumes this task in the next, so a
        # `stop` landing between the two dropped the accepted socket unclosed. Waiting for the
        # listener, then accepting with no await in between, leaves nothing in flight to drop.
        loop = asyncio.get_running_loop()
        held = self._settings.max_connections * HELD_PER_CAP
        while True:
            while len(proxy.connections) >= held:
                # Connections past the cap are refused (503, or 429 past the rate) and linger for the answer to
                # be read: a flood of them held an fd and a task each, 11,000 fds and a core of the server's CPU.
                # Past this many, attempts wait in the listener's backlog (the sandbox's connect waits).
                proxy.room.clear()
                await proxy.room.wait()
            await ready(loop, proxy.listener, write=False)
            for _ in range(min(_ACCEPTS_PER_PASS, held - len(proxy.connections))):
                try:
                    client, _ = proxy.listener.accept()
                except BlockingIOError:
                    break
                except OSError as exc:
                    _log.warning("egress proxy of %s cannot accept: %s", proxy.sandbox_id, exc)
                    await asyncio.sleep(0.1)
                    break
                self._adopt(proxy, client)

    def _adopt(self, proxy: _SandboxProxy, client: socket.socket) -> None:
        client.setblocking(False)
        grow_buffers(client)
        task = asyncio.get_running_loop().create_task(self._serve(proxy, client))
        proxy.connections.add(task)
        task.add_done_callback(proxy.connections.discard)
        task.add_done_callback(lambda _: proxy.room.set())
        # A task cancelled before its first step (the proxy stopping at once) never runs _serve's
        # `finally`: the client would be left for the garbage collector. Closing twice is harmless.
        task.add_done_callback(functools.partial(_close_client, client))

    async def _serve(self, proxy: _SandboxProxy, client: socket.socket) -> None:
        if not proxy.throttle.take():
            await self._refuse_throttled(proxy, client)
            return
        attempt = _Attempt(proxy.sandbox_id)
        upstream: socket.socket | None = None
        socks = False
        try:
            if len(proxy.connections) > self._settings.max_connections:
                raise Refused(503, f"more than {self._settings.max_connections} open connections: close some first")
            request = await self._read_request(client, attempt, proxy.heads)
            socks = request.protocol == "socks5"
            upstream = await self._open(proxy, request, attempt)
            if not _allows(proxy.rules, request.host, request.port):  # narrowed while it connected
                raise Refused(403, f"{_show(request.host, request.port)} is no longer on this sandbox's allowlist")
            task = asyncio.current_task()
            if task is not None:
                proxy.destinations[task] = (request.host, request.port)
            await self._relay(client, upstream, request, attempt, proxy.budget)
        except Refused as exc:
            attempt.decision, attempt.reason = exc.decision, exc.reason
            message = socks_reply(SOCKS_REPLY.get(exc.status, 1)) if socks else reply(exc.status, exc.reason)
            await answer_and_linger(client, message)
        except OSError as exc:
            # The client went away during the handshake; the decision already made stands.
            attempt.reason = f"{attempt.reason or 'failed'}; ended: {exc.strerror or exc}"
        except asyncio.CancelledError:
            narrowed = asyncio.current_task() in proxy.narrowed
            ended = "the allowlist no longer allows it" if narrowed else "the sandbox's proxy stopped"
            attempt.reason = f"{attempt.reason or 'no decision'}; ended: {ended}"
            raise
        except Exception as exc:
            _log.exception("egress proxy error for %s", proxy.sandbox_id)
            attempt.decision, attempt.reason = "error", f"internal error: {type(exc).__name__}"
        finally:
            task = asyncio.current_task()
            if task is not None:
                proxy.destinations.pop(task, None)
                proxy.narrowed.discard(task)
            close_socket(client)
            if upstream is not None:
                close_socket(upstream)
            if self._metrics is not None:
                verdict: EgressVerdict = "allowed" if attempt.decision == "allow" else "refused"
                self._metrics.egress_attempt(verdict, attempt.bytes_up, attempt.bytes_down)
            await self._append(attempt.record())

    async def _read_request(self, client: socket.socket, attempt: _Attempt, budget: Budget) -> Request:
        reader = Reader(asyncio.get_running_loop(), client, budget)
        try:
            async with asyncio.timeout(self._settings.head_timeout_s):
                await reader.fill()
                if reader.buf[0] == 5:
                    attempt.protocol = "socks5"
                    return await read_socks(reader)
                head = await reader.head()
        except TimeoutError:
            raise refused_error(
                408, f"the request head did not arrive within {self._settings.head_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise refused_error(400, f"the client connection failed: {exc.strerror or exc}") from None
        request = parse_http(head, bytes(reader.buf))
        attempt.protocol, attempt.method, attempt.url = request.protocol, request.method, _recorded(request.url)
        return request

    async def _open(self, proxy: _SandboxProxy, request: Request, attempt: _Attempt) -> socket.socket:
        """Check, resolve, check again and connect; the socket returned is to an address that was checked."""
        attempt.method, attempt.domain, attempt.port = request.method, request.host, request.port
        if not _allows(proxy.rules, request.host, request.port):
            what = "IP address" if _literal(request.host) else "destination"
            raise Refused(403, f"{what} {_show(request.host, request.port)} is not on this sandbox's allowlist")
        addresses = await self._resolve(proxy.lookups, request.host, request.port)
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

    async def _resolve(self, lookups: NameLookups, host: str, port: int) -> list[IPAddress]:
        literal = _literal(host)
        if literal is not None:
            return [literal]
        mapped = self._settings.hosts.get(host)
        if mapped is not None:
            return list(mapped)
        # The host's resolver (glibc: /etc/hosts, then DNS). No trailing dot is added against
        # search-list expansion: /etc/hosts names would no longer match. A name the search list
        # expands into an internal one still meets the blocked ranges.
        timeout_s = self._settings.connect_timeout_s
        try:
            infos = await lookups.getaddrinfo(host, port, asyncio.get_running_loop().time() + timeout_s)
        except LookupsBusy:
            raise refused_error(
                503,
                f"resolving {host} waited {timeout_s:g} s for one of this sandbox's {lookups.limit} name lookups"
                " in progress to end: its DNS answers slowly, try again later",
            ) from None
        except ResolverFull:
            raise refused_error(
                503,
                f"resolving {host}: {MAX_IN_RESOLVER} name lookups of all sandboxes are still waiting for the "
                "host's resolver (DNS answers slowly): try again later",
            ) from None
        except TimeoutError:
            raise refused_error(504, f"resolving {host} took longer than {timeout_s:g} s") from None
        except OSError as exc:
            raise refused_error(502, f"{host} cannot be resolved: {exc.strerror or exc}") from None
        found: list[IPAddress] = []
        for family, text in infos:
            if family in (socket.AF_INET, socket.AF_INET6):
                # A scope id ("fe80::1%eth0") is dropped: such addresses are link-local, hence blocked.
                address = ipaddress.ip_address(text.partition("%")[0])
                if address not in found:
                    found.append(address)
        if not found:
            raise refused_error(502, f"{host} has no IPv4 or IPv6 address")
        return found

    async def _connect(self, addresses: list[IPAddress], port: int) -> tuple[socket.socket, IPAddress]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.connect_timeout_s
        failure = refused_error(502, "no address to connect to")
        for address in addresses:
            family = socket.AF_INET if address.version == 4 else socket.AF_INET6
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                async with asyncio.timeout_at(deadline):
                    await loop.sock_connect(sock, (str(address), port))
            except TimeoutError:
                close_socket(sock)
                raise refused_error(504, f"connecting to {_show(str(address), port)} timed out") from None
            except OSError as exc:
                close_socket(sock)
                failure = refused_error(502, f"connecting to {_show(str(address), port)} failed: {exc.strerror or exc}")
                continue
            except BaseException:
                close_socket(sock)
                raise
            if not address.is_loopback and _to_this_host(sock):  # loopback: the blocked ranges decide
                close_socket(sock)
                raise Refused(403, f"{address} is an address of this host: bastion's host is not a destination")
            return sock, address
        raise failure

    async def _relay(
        self, client: socket.socket, upstream: socket.socket, request: Request, attempt: _Attempt, budget: Budget
    ) -> None:
        loop = asyncio.get_running_loop()
        attempt.decision, attempt.reason = "allow", "allowed"
        if request.protocol == "connect":
            await loop.sock_sendall(client, b"HTTP/1.1 200 Connection established\r\n\r\n")
        elif request.protocol == "socks5":
            await loop.sock_sendall(client, socks_reply(0))
        await carry(
            client,
            upstream,
            request.forward,
            attempt,
            budget=budget,
            idle_timeout_s=self._settings.idle_timeout_s,
            one_response=request.protocol == "http",
        )

    async def _refuse_throttled(self, proxy: _SandboxProxy, client: socket.socket) -> None:
        """429 without reading the request; counted, and reported in one record a second."""
        if self._metrics is not None:
            self._metrics.egress_attempt("refused")
        if proxy.report is None:
            loop = asyncio.get_running_loop()
            proxy.report = loop.call_later(THROTTLE_REPORT_S, self._start_report, proxy)
        rate = proxy.throttle.rate_per_s
        try:
            await answer_and_linger(client, reply(429, f"more than {rate:g} connection attempts a second: slow down"))
        finally:
            close_socket(client)

    def _start_report(self, proxy: _SandboxProxy) -> None:
        # Not among the connections: a finished report left there counted toward the cap for ever, and after
        # about 64 busy seconds every attempt of the sandbox was 503.
        task = asyncio.get_running_loop().create_task(self._report_throttled(proxy))
        proxy.reports.add(task)
        task.add_done_callback(proxy.reports.discard)

    async def _report_throttled(self, proxy: _SandboxProxy) -> None:
        proxy.report = None
        refused = proxy.throttle.drain()
        if refused:
            record: dict[str, object] = {
                "event": "egress_throttled",
                "sandbox": proxy.sandbox_id,
                "refused": refused,
                "attempts_per_s": proxy.throttle.rate_per_s,
                "burst": proxy.throttle.burst,
            }
            await self._append(record)

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


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _show(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _listen(path: Path, owner: tuple[int, int] | None = None) -> tuple[socket.socket, tuple[int, int]]:
    """A listening unix socket at `path`, mode 0600, put in place by rename (never half-made).

    `owner`: who may connect (the sandbox's host identity); its folder is the server's, so
    nothing but the server can swap the socket between the bind and the chown.
    """
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise InvalidRequest(f"egress socket path {path} is longer than {UNIX_PATH_MAX} bytes: use a shorter state_dir")
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise Conflict(f"{path} exists and is not a socket: remove it")
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    if len(os.fsencode(temp)) > UNIX_PATH_MAX:
        temp = path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(temp))
        os.chmod(temp, 0o600)
        if owner is not None:
            os.chown(temp, *owner, follow_symlinks=False)
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
        attempts_per_s, attempt_burst: the rate of connection attempts per sandbox.
        max_lookups: name lookups of one sandbox in progress at once (each holds a thread until glibc returns).
        bytes_per_s, byte_burst: the bytes per second of a sandbox's connections, both ways together.
        metrics: where attempts and bytes are counted.
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
        attempts_per_s: float = 20.0,
        attempt_burst: int = 200,
        max_lookups: int = 8,
        bytes_per_s: int = DEFAULT_BYTES_PER_S,
        byte_burst: int = DEFAULT_BYTE_BURST,
        metrics: Metrics | None = None,
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
            attempts_per_s=attempts_per_s,
            attempt_burst=attempt_burst,
            max_lookups=max_lookups,
            bytes_per_s=bytes_per_s,
            byte_burst=byte_burst,
        )
        self._loop = asyncio.new_event_loop()
        self._proxy = EgressProxy(audit, settings, metrics)
        self._thread = threading.Thread(target=self._run, name="bastion-egress", daemon=True)
        self._closed = False
        self._thread.start()

    @classmethod
    def from_config(cls, audit: AuditLog, network: NetworkConfig, metrics: Metrics | None = None) -> EgressService:
        return cls(
            audit,
            metrics=metrics,
            blocked_ranges=network.blocked_ranges,
            hosts=network.hosts,
            connect_timeout_s=network.connect_timeout_s,
            idle_timeout_s=network.idle_timeout_s,
            max_connections=network.max_connections,
            attempts_per_s=network.attempts_per_s,
            attempt_burst=network.attempt_burst,
            bytes_per_s=network.bytes_per_s,
            byte_burst=network.byte_burst,
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
        self,
        sandbox_id: str,
        rules: Sequence[AllowRule],
        socket_path: str | os.PathLike[str],
        owner: tuple[int, int] | None = None,
    ) -> None:
        await self._call_async(self._proxy.start(sandbox_id, rules, socket_path, owner))

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

    @property
    def closed(self) -> bool:
        """The service has stopped (every proxy with it)."""
        return self._closed

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

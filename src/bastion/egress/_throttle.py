"""Per-sandbox bounds on the egress proxy's work: attempts a second and name lookups at once (and bytes a second).

Attempts (`AttemptThrottle`). Every egress attempt is a fsync'd audit record, and code in a
sandbox can open connections to its proxy as fast as the loopback allows. Unbounded, one sandbox
could fill the audit log's disk, and a full audit log stops the whole server (fail-closed). Past
the rate, attempts are refused (429) and only counted; the proxy writes one record per second
with the count (``event: "egress_throttled"``), so the log grows by a bounded amount however
hard a sandbox tries.

Bytes (`bastion.safety.rates.ByteRate`, one per sandbox's proxy). The relay runs on one thread of the
server, in the server's cgroup, not the sandbox's: found by attack, code in one sandbox pulling an allowed
fast destination's endless body over 8 connections had the relay move 1.3 GB/s, half a core of the server's
CPU outside the sandbox's `cpu_cores`, and another sandbox's fetches through its own proxy went from a p90
of 4 to 8 ms to 35 to 48 ms. Each sandbox's connections, both ways together, now share a byte budget: a
direction that moved more than the budget holds waits before it reads again, so the sandbox's TCP windows
fill and its peers slow.

Name lookups (`NameLookups`). glibc's getaddrinfo cannot be interrupted: a lookup the proxy gives
up on still holds its thread until the resolver returns (its timeouts and retries, tens of seconds
against a DNS server that never answers). On the event loop's default executor (cpus + 4 threads,
shared by every sandbox), one sandbox asking for its own allowed names whose DNS never answers held
every thread, and other sandboxes' lookups queued behind them until they timed out (504). Each
sandbox now has threads of its own (one per lookup, `limit` at most), and a lookup holds one of its
sandbox's `limit` slots until its thread returns; past `limit` at once, a sandbox's lookups wait for one
of its own slots. So a lookup never waits for a thread held by another sandbox, nor for a stuck one of
its own sandbox: a sandbox's slow DNS delays only that sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import threading
import time
from collections.abc import Callable

from bastion.safety.rates import TokenBucket

Resolved = list[tuple[int, str]]
"""What a lookup found: (address family, address text) per getaddrinfo entry."""


class AttemptThrottle(TokenBucket):
    """Allow `burst` attempts at once, refilled at `rate_per_s`; count what is refused."""

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(rate_per_s, burst, clock, "attempt")
        self.refused = 0

    def take(self) -> bool:
        """Spend one attempt; False (and one more refused) if the bucket is empty."""
        self._refill()
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self.refused += 1
        return False

    def drain(self) -> int:
        """The attempts refused since the last drain; the count starts again at zero."""
        count, self.refused = self.refused, 0
        return count


class LookupsBusy(Exception):
    """No lookup slot of the sandbox came free before the deadline."""


class ResolverFull(Exception):
    """`MAX_IN_RESOLVER` lookups of all sandboxes, stopped ones' included, are still in the resolver."""


MAX_IN_RESOLVER = 256
"""Lookups in glibc's resolver at once in this process, each on a thread of its own. A sandbox's lookups
outlive its proxy (nothing interrupts glibc), so closing and making sandboxes could otherwise add 8 stuck
threads each time, against the server's task limit, until their resolver gave up."""

_in_resolver = 0
_in_resolver_lock = threading.Lock()


def _enter_resolver() -> bool:
    global _in_resolver
    with _in_resolver_lock:
        if _in_resolver >= MAX_IN_RESOLVER:
            return False
        _in_resolver += 1
        return True


def _leave_resolver() -> None:
    global _in_resolver
    with _in_resolver_lock:
        _in_resolver -= 1


class NameLookups:
    """One sandbox's name lookups, each on a thread of its own, at most `limit` at once.

    A thread per lookup rather than a pool: its bookkeeping (the sandbox's slot, the server's count of
    lookups in the resolver) is then exact on every path. A pool queued the work before it started a
    thread, so a thread that could not start, or a pool shut down with work queued, left a count taken
    and never given back (or given back twice). Daemon threads: a server stopping does not wait for a
    resolver that never answers. Use from the event loop that made it (the egress proxy's); `running`
    counts its lookups still in the resolver.
    """

    def __init__(self, limit: int, thread_name: str) -> None:
        if limit < 1:
            raise ValueError("a sandbox needs at least one name lookup at a time")
        self.limit = limit
        self.running = 0
        self._slots = asyncio.Semaphore(limit)
        self._thread_name = thread_name
        self._made = 0

    async def getaddrinfo(self, host: str, port: int, deadline: float) -> Resolved:
        """Resolve `host` with the host's resolver (glibc: /etc/hosts, then DNS) by `deadline` (loop time).

        Raises:
            LookupsBusy: every slot was still held at the deadline.
            ResolverFull: `MAX_IN_RESOLVER` lookups of all sandboxes are still in the resolver.
            TimeoutError: the lookup itself did not end by the deadline (its thread and slot go on until it does).
            OSError: the resolver's failure (`socket.gaierror`), or no thread could be started.
        """
        try:
            async with asyncio.timeout_at(deadline):
                await self._slots.acquire()
        except TimeoutError:
            raise LookupsBusy from None
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Resolved] = loop.create_future()
        if not _enter_resolver():
            self._slots.release()
            raise ResolverFull
        self._made += 1
        name = f"{self._thread_name}_{self._made}"
        thread = threading.Thread(target=self._lookup, args=(loop, answer, host, port), name=name, daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # "can't start new thread": it never runs, so the counts are given back here
            _leave_resolver()
            self._slots.release()
            raise OSError(errno.EAGAIN, f"no thread for the lookup ({exc})") from None
        self.running += 1
        async with asyncio.timeout_at(deadline):
            return await answer

    def close(self) -> None:
        """Nothing to stop: a lookup still in the resolver ends, and gives its counts back, when it returns."""

    def _lookup(self, loop: asyncio.AbstractEventLoop, answer: asyncio.Future[Resolved], host: str, port: int) -> None:
        outcome: Resolved | Exception
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
            outcome = [(family, str(sockaddr[0])) for family, _, _, _, sockaddr in infos]
        except Exception as exc:  # gaierror, or UnicodeError for a name IDNA refuses: the caller's to judge
            outcome = exc
        finally:
            _leave_resolver()  # here, not on the loop: a stopped proxy's loop may never run again
        with contextlib.suppress(RuntimeError):  # the loop is closed (the service stopped): nobody waits
            loop.call_soon_threadsafe(self._finished, answer, outcome)

    def _finished(self, answer: asyncio.Future[Resolved], outcome: Resolved | Exception) -> None:
        self.running -= 1
        self._slots.release()
        if answer.done():  # the caller stopped waiting: its timeout, or its sandbox's proxy stopping
            return
        if isinstance(outcome, Exception):
            answer.set_exception(outcome)
        else:
            answer.set_result(outcome)

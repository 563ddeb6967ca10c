"""Rate limits for the login forms, /authorize and client registration (in memory, per server process).

Login (RFC 6749 §10.10, OAuth 2.1 §7.5 credentials guessing; issue 20):
- An attempt is reserved (counted) before its password is checked, and one address (an IPv6 address by
  its /64) has at most one check in flight: a burst from one address is refused, not verified in parallel.
- At most `max_checks` argon2 checks run at once in the whole server (each holds 64 MiB); the argon2 work
  is never queued, so memory stays bounded whatever the burst.
- Addresses without a device cookie share one check slot. One that finds it busy waits for its turn
  (at most `MAX_WAITING` wait, each at most `TURN_WAIT_S`). Turns go by rank: the fewest failed or refused
  attempts on record from the address's network (an IPv4 /24, an IPv6 /48: `network_key`), then from the
  address, then the longest waiting. First-come let a flood that retried every few milliseconds take every
  free turn; an address's own count alone ranked a flood of fresh addresses (any number of /64s in one
  IPv6 /48) with the administrator. A full line drops its worst-ranked waiter (503) for a newcomer ranked
  strictly better; a newcomer ranked no better gets 503 at once. So the administrator's fresh browser, from
  a network the flood does not use, takes a flood waiter's place and gets the next turn (after any earlier
  waiter from a network as clean). The line and the per-network counts are bounded (`_MAX_TRACKED`).
  Best-effort, not a boundary: an attacker with addresses in many networks (a botnet, many /24s, an IPv6
  /32's /48s), each used for a handful of attempts, ranks as well as the administrator. Such a flood keeps
  the line full of equals and a fresh browser gets 503 until the flood pauses; so does a fresh browser
  that shares its network with the flood (one NAT, one /24). A browser with a device cookie is not in the
  line at all: that, not the line, is what keeps a returning administrator's login open.
- After `free` failures from one address, each further failure doubles that address's waiting time, up
  to `max_s`. A success clears the address's count.
- When more than `global_per_minute` attempts arrive in a minute from all addresses together, addresses
  that have failed wait until the minute has passed; an address with no failure on record may still try,
  so a flood from elsewhere never locks the administrator out of a login from their own address.
- All of loopback (127.0.0.0/8, ::1, and their IPv4-mapped and -compatible forms) is one address: any
  local user can bind any of 127.0.0.0/8, so each was a fresh address with its own allowance.
- A browser that has logged in before (a valid device cookie, `devices.py`) is counted by that cookie,
  not its address, and one of the `max_checks` slots is kept for such browsers: an attacker on the same
  host (the same address) or with many addresses can neither back it off nor keep it waiting.
These are best-effort limits on guessing, not a boundary: the password's strength is the boundary.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Final

import anyio

from bastion.metrics import Metrics
from bastion.safety.errors import ResourceLimit

logger = logging.getLogger("bastion.http.ratelimit")

_WINDOW_S: Final = 60.0
_MAX_TRACKED: Final = 10_000  # addresses remembered at most; oldest forgotten first
_MAX_DOUBLINGS: Final = 62  # a back-off of 2**62 s is past any max_s; beyond, 2.0 ** n overflows at 1024
MAX_CONCURRENT_CHECKS: Final = 2  # argon2id checks at once, server-wide (64 MiB each)
_BUSY_RETRY_S: Final = 1.0
_IPV6_PREFIX: Final = 64  # one subscriber's allocation (RFC 6177): one address for the limits
DEVICE_PREFIX: Final = "device:"  # never the start of an address key
LOOPBACK_KEY: Final = "loopback"  # all of loopback: any local user can bind any 127.0.0.0/8 address
MAX_WAITING: Final = 16  # addresses waiting for the shared check slot (about 0.3 s of argon2 each)
TURN_WAIT_S: Final = 10.0  # how long one waits for its turn before 503
_IPV4_NETWORK_PREFIX: Final = 24  # the smallest block routed between providers: one site's addresses
_IPV6_NETWORK_PREFIX: Final = 48  # one site's allocation (RFC 6177), holding 65,536 /64s


def address_key(ip: str) -> str:
    """The unit the limits count: an IPv4 address, or an IPv6 address's /64 (IPv4-mapped and -compatible
    as IPv4); all of loopback is one key (`LOOPBACK_KEY`)."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            address = embedded
        elif address.is_loopback:
            return LOOPBACK_KEY
        else:
            return str(ipaddress.IPv6Network((address, _IPV6_PREFIX), strict=False))
    return LOOPBACK_KEY if address.is_loopback else str(address)


def network_key(key: str) -> str:
    """The network of an address key (`address_key`) whose failures rank its waiters: an IPv4 /24, an
    IPv6 /48; loopback and keys that are not addresses are their own network."""
    try:
        network = ipaddress.ip_network(key, strict=False)
    except ValueError:
        return key
    prefix = _IPV4_NETWORK_PREFIX if network.version == 4 else _IPV6_NETWORK_PREFIX
    return str(network.supernet(new_prefix=prefix))


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address of an IPv4-mapped (::ffff:a.b.c.d) or -compatible (::a.b.c.d, RFC 4291 §2.5.5.1)
    address; None for others, and for :: and ::1, which are not IPv4-compatible."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    value = int(address)
    return ipaddress.IPv4Address(value) if 1 < value < 1 << 32 else None


def device_key(device: str) -> str:
    """The unit the limits count for a browser with a valid device cookie (`devices.py`)."""
    return f"{DEVICE_PREFIX}{device}"


def is_device_key(key: str) -> bool:
    return key.startswith(DEVICE_PREFIX)


class LoginRefused(ResourceLimit):
    """A login attempt refused before its password is checked; `status` is the HTTP answer (429 or 503)."""

    def __init__(self, reason: str, *, retry_after_s: float, status: int = 429) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s
        self.status = status


@dataclass(frozen=True)
class LoginAttempt:
    """Proof that a password check may run now; hand it back to `LoginLimiter.finish`."""

    key: str
    device: bool = False


@dataclass
class _Failures:
    count: int = 0
    locked_until: float = 0.0
    in_flight: bool = False
    """A check is running or waiting for its turn: another from this key is refused."""


@dataclass(eq=False)
class _Turn:
    """An address waiting for the shared check slot; `attempt` is set when the slot is handed to it."""

    key: str
    network: str
    order: int
    given: anyio.Event = field(default_factory=anyio.Event)
    attempt: LoginAttempt | None = None


def _busy() -> LoginRefused:
    return LoginRefused(
        "The server is busy checking other logins: try again in a second.", retry_after_s=_BUSY_RETRY_S, status=503
    )


@dataclass
class LoginLimiter:
    free: int
    max_s: float
    global_per_minute: int
    max_checks: int = MAX_CONCURRENT_CHECKS
    metrics: Metrics | None = None
    """Where failed and refused logins are counted."""
    _by_key: dict[str, _Failures] = field(default_factory=dict)
    _by_network: dict[str, int] = field(default_factory=dict)
    """Failed or refused attempts per network (`network_key`), most recently counted last."""
    _recent: deque[float] = field(default_factory=deque)
    _running: int = 0
    _running_untrusted: int = 0
    _line: list[_Turn] = field(default_factory=list)
    _order: itertools.count[int] = field(default_factory=itertools.count)

    def begin(self, ip: str, *, device: str | None = None) -> LoginAttempt:
        """Reserve a password check for `ip` now, counted as a failure until `finish` says otherwise.

        `device`: the id of a valid device cookie (`devices.TrustedDevices`): the attempt is then counted
        against that browser, not its address, and may use the check slot kept for such browsers.

        Raises:
            LoginRefused: this address has a check in flight or must wait (429), or the server is busy (503).
        """
        key = device_key(device) if device else address_key(ip)
        try:
            self._refuse_if_held(key, global_limit=device is None)
            if not self._slot_free(trusted=device is not None):
                raise _busy()
            return self._start(key, trusted=device is not None)
        except LoginRefused:
            self._count_refusal(key)
            raise

    async def acquire(self, ip: str, *, device: str | None = None) -> LoginAttempt:
        """As `begin`, but an address without a device cookie that finds the shared slot busy waits for its
        turn (by `_rank`) instead of being refused at once.

        Raises:
            LoginRefused: as `begin`; 503 if `MAX_WAITING` already wait, none ranked worse, or the turn does
                not come in time, or if a better-ranked newcomer takes this one's place in the line.
        """
        if device is not None or self._slot_free(trusted=False):
            return self.begin(ip, device=device)
        key = address_key(ip)
        try:
            self._refuse_if_held(key, global_limit=True)
            turn = self._join(key)
        except LoginRefused:
            self._count_refusal(key)
            raise
        return await self._wait_turn(turn)

    def _join(self, key: str) -> _Turn:
        """Into the line; a full line drops its worst-ranked waiter for a newcomer ranked strictly better
        (ties keep the one waiting, so a flood of equals does not churn the line)."""
        turn = _Turn(key, network_key(key), next(self._order))
        if len(self._line) >= MAX_WAITING:
            worst = max(self._line, key=self._rank)
            if self._rank(turn) > self._rank(worst):  # the newcomer's order is the last: ties rank it worse
                raise _busy()
            self._drop(worst)
        entry = self._by_key.pop(key, None) or _Failures()
        entry.in_flight = True
        self._by_key[key] = entry
        self._line.append(turn)
        return turn

    def _rank(self, turn: _Turn) -> tuple[int, int, int]:
        """Lower goes first: failed or refused attempts from the network, from the address, then arrival."""
        entry = self._by_key.get(turn.key)
        return self._by_network.get(turn.network, 0), entry.count if entry else 0, turn.order

    def _drop(self, turn: _Turn) -> None:
        """Out of the line without a turn: its `_wait_turn` answers 503."""
        self._line.remove(turn)
        entry = self._by_key.get(turn.key)
        if entry is not None:
            entry.in_flight = False
        turn.given.set()

    async def _wait_turn(self, turn: _Turn) -> LoginAttempt:
        try:
            with anyio.move_on_after(TURN_WAIT_S):
                await turn.given.wait()
        except BaseException:
            self._leave(turn)
            raise
        if turn.attempt is None:
            self._leave(turn)
            self._count_refusal(turn.key)
            raise _busy()
        return turn.attempt

    def _leave(self, turn: _Turn) -> None:
        """A waiter gave up (timed out or went away): out of the line, or its slot given back unused."""
        if turn.attempt is not None:
            self._release(turn.attempt)
            entry = self._by_key.get(turn.key)
            if entry is not None:
                entry.count = max(0, entry.count - 1)
            self._count_network(turn.key, -1)
            return
        if turn not in self._line:
            return  # dropped for a better-ranked newcomer: its address is already free
        self._line.remove(turn)
        entry = self._by_key.get(turn.key)
        if entry is not None:
            entry.in_flight = False

    def _refuse_if_held(self, key: str, *, global_limit: bool) -> None:
        """429 if `key` has a check in flight or must wait; `global_limit=False` for a device cookie: only a
        login makes one, so a guessing flood is not its."""
        entry = self._by_key.get(key)
        if entry is not None and entry.in_flight:
            raise LoginRefused(
                "A login from this address is already being checked: wait for its answer.",
                retry_after_s=_BUSY_RETRY_S,
            )
        wait = self._wait(entry, time.monotonic(), global_limit=global_limit)
        if wait > 0:
            raise LoginRefused(f"Too many failed attempts. Try again in {_seconds(wait)} s.", retry_after_s=wait)

    def _slot_free(self, *, trusted: bool) -> bool:
        """One slot stays free for browsers that logged in before: a flood never takes the last one; and
        an address without a device cookie never passes those waiting in line."""
        if trusted:
            return self._running < self.max_checks
        return not self._line and self._untrusted_free()

    def _untrusted_free(self) -> bool:
        return self._running < self.max_checks and self._running_untrusted < max(1, self.max_checks - 1)

    def _start(self, key: str, *, trusted: bool) -> LoginAttempt:
        now = time.monotonic()
        self._running += 1
        if not trusted:
            self._running_untrusted += 1
        self._recent.append(now)
        entry = self._by_key.pop(key, None) or _Failures()
        entry.count += 1
        entry.in_flight = True
        self._by_key[key] = entry  # most recent last, for eviction
        self._forget_oldest()
        self._count_network(key, 1)
        if len(self._recent) == self.global_per_minute:
            logger.warning("admin login: %d attempts in a minute from all addresses; limiting", len(self._recent))
        return LoginAttempt(key, device=trusted)

    def _count_refusal(self, key: str) -> None:
        """A refused attempt counts against its network's rank: a flood that retries each 503 at once
        ranks its network behind one that does not."""
        self._count_network(key, 1)
        if self.metrics is not None:
            self.metrics.login_failure("refused")

    def _count_network(self, key: str, change: int) -> None:
        """Add `change` to the count of `key`'s network (not for a device cookie: it has none); bounded,
        the network counted the longest ago forgotten first."""
        if is_device_key(key):
            return
        network = network_key(key)
        count = self._by_network.pop(network, 0) + change
        if count > 0:
            self._by_network[network] = count
        while len(self._by_network) > _MAX_TRACKED:
            del self._by_network[next(iter(self._by_network))]

    def finish(self, attempt: LoginAttempt, ok: bool) -> None:
        """The check is over: a success clears the address, a failure may start its back-off."""
        entry = self._by_key.get(attempt.key)
        if ok:
            self._by_key.pop(attempt.key, None)
            self._by_network.pop(network_key(attempt.key), None)  # a right password: its network ranks first again
        elif self.metrics is not None:
            self.metrics.login_failure("wrong_password")
        if not ok and entry is not None and entry.count >= self.free:
            # The exponent capped: 2.0 ** 1024 raises OverflowError, which left the address unlocked for good.
            doubling = min(entry.count - self.free, _MAX_DOUBLINGS)
            entry.locked_until = time.monotonic() + min(self.max_s, 2.0**doubling)
            logger.warning("admin login: %d failed attempts from %s; backing off", entry.count, attempt.key)
        self._release(attempt)

    def _release(self, attempt: LoginAttempt) -> None:
        """Give the slot back and hand it to the next in line, so that no newcomer takes it first."""
        self._running -= 1
        if not attempt.device:
            self._running_untrusted -= 1
        entry = self._by_key.get(attempt.key)
        if entry is not None:
            entry.in_flight = False
        while self._line and self._untrusted_free():
            turn = min(self._line, key=self._rank)
            self._line.remove(turn)
            turn.attempt = self._start(turn.key, trusted=False)
            turn.given.set()

    def retry_after(self, ip: str) -> float:
        """Seconds this address must wait before it may try a password; 0 if it may try now."""
        return max(0.0, self._wait(self._by_key.get(address_key(ip)), time.monotonic()))

    def _wait(self, entry: _Failures | None, now: float, *, global_limit: bool = True) -> float:
        while self._recent and self._recent[0] < now - _WINDOW_S:
            self._recent.popleft()
        if entry is None:
            return 0.0
        waits = [entry.locked_until - now]
        if global_limit and entry.count > 0 and len(self._recent) >= self.global_per_minute:
            waits.append(self._recent[0] + _WINDOW_S - now)
        return max(waits)

    def _forget_oldest(self) -> None:
        """Bound memory; an address with a check in flight or waiting is kept (a few dozen at most)."""
        while len(self._by_key) > _MAX_TRACKED:
            oldest = next(k for k, v in self._by_key.items() if not v.in_flight)
            del self._by_key[oldest]


def _seconds(wait: float) -> int:
    return max(1, int(wait + 0.999))


@dataclass
class WindowLimiter:
    """At most `limit` events per key in a sliding `window_s`."""

    limit: int
    window_s: float
    _events: dict[str, deque[float]] = field(default_factory=dict)

    def allow(self, key: str) -> bool:
        now = time.monotonic()
        events = self._events.setdefault(key, deque())
        while events and events[0] < now - self.window_s:
            events.popleft()
        if len(events) >= self.limit:
            return False
        events.append(now)
        if len(self._events) > _MAX_TRACKED:
            self._events.pop(next(iter(self._events)))
        return True

    def retry_after(self, key: str) -> float:
        """Seconds until `key` may have another event (0 if it may now)."""
        events = self._events.get(key)
        if not events or len(events) < self.limit:
            return 0.0
        return max(0.0, events[0] + self.window_s - time.monotonic())

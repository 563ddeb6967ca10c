"""Rate limits for the login form and for client registration (in memory, per server process).

Login (RFC 6749 §10.10, OAuth 2.1 §7.5 credentials guessing): after `free` failures from one address,
each further failure doubles that address's waiting time, up to `max_s`; and when more than
`global_per_minute` failures arrive in a minute from all addresses together, every address waits until
the minute has passed. A success clears the address's count. The administrator can always log in again
once the waiting time is over.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Final

logger = logging.getLogger("bastion.http.ratelimit")

_WINDOW_S: Final = 60.0
_MAX_TRACKED: Final = 10_000  # addresses remembered at most; oldest forgotten first


@dataclass
class _Failures:
    count: int = 0
    locked_until: float = 0.0


@dataclass
class LoginLimiter:
    free: int
    max_s: float
    global_per_minute: int
    _by_ip: dict[str, _Failures] = field(default_factory=dict)
    _recent: deque[float] = field(default_factory=deque)

    def retry_after(self, ip: str) -> float:
        """Seconds this address must wait before it may try a password; 0 if it may try now."""
        now = time.monotonic()
        while self._recent and self._recent[0] < now - _WINDOW_S:
            self._recent.popleft()
        waits = [0.0]
        entry = self._by_ip.get(ip)
        if entry is not None:
            waits.append(entry.locked_until - now)
        if len(self._recent) >= self.global_per_minute:
            waits.append(self._recent[0] + _WINDOW_S - now)
        return max(waits)

    def failure(self, ip: str) -> None:
        now = time.monotonic()
        self._recent.append(now)
        entry = self._by_ip.pop(ip, None) or _Failures()
        entry.count += 1
        if entry.count >= self.free:
            entry.locked_until = now + min(self.max_s, 2.0 ** (entry.count - self.free))
            logger.warning("admin login: %d failed attempts from %s; backing off", entry.count, ip)
        self._by_ip[ip] = entry
        if len(self._by_ip) > _MAX_TRACKED:
            self._by_ip.pop(next(iter(self._by_ip)))
        if len(self._recent) == self.global_per_minute:
            logger.warning(
                "admin login: %d failed attempts in a minute from all addresses; pausing logins", len(self._recent)
            )

    def success(self, ip: str) -> None:
        self._by_ip.pop(ip, None)


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

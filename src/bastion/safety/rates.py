"""Token buckets: how fast something a sandbox drives may go, on the server's CPU.

`TokenBucket` holds `burst` tokens, refilled at `rate_per_s`. `ByteRate` never refuses: a spender takes the
bytes it already moved (or reads: the egress relay counts its passes in one of its own), and waits out the debt it
is told (`owed_s`). Used where a sandbox's traffic costs the server's CPU rather than its own cgroup's: the egress
relay and its request heads (`bastion.egress`), a command's pipes (`bastion.sandbox.processes`), what its apps send
through previews (`bastion.transports.http.preview`); and what a caller's tool calls write to the audit log
(`bastion.tools._call`).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """A token bucket: `burst` tokens at once, refilled at `rate_per_s`; `what` names it in errors."""

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float], what: str) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError(f"the {what} rate must be positive and the burst at least 1")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._refilled = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._refilled) * self.rate_per_s)
        self._refilled = now

    def full(self) -> bool:
        """Whether it holds its whole burst again: it is then what a new one would be."""
        self._refill()
        return self._tokens >= self.burst

    def hold(self, count: int) -> float:
        """Take `count` tokens if the bucket holds them and return 0; else take nothing and return the seconds
        until it would hold them."""
        self._refill()
        if self._tokens >= count:
            self._tokens -= count
            return 0.0
        return (count - self._tokens) / self.rate_per_s

    def give_back(self, count: int) -> None:
        """Return `count` tokens held (`hold`) and not used, never past the burst."""
        self._refill()
        self._tokens = min(float(self.burst), self._tokens + count)


class ByteRate(TokenBucket):
    """`burst` bytes at once, refilled at `rate_per_s`, shared by what one sandbox drives (all its connections,
    both ways; all its commands' pipes).

    A spend never refuses: it takes the bytes already moved and, if the bucket is in debt, waits until the
    debt is repaid. Spenders sharing it each wait out the debt they found, so their whole traffic keeps to
    the rate however many share it.
    """

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(rate_per_s, burst, clock, "byte")

    def owed_s(self, count: int) -> float:
        """Spend `count` bytes; the seconds to wait before moving more (0 if the bucket holds them)."""
        self._refill()
        self._tokens -= count
        return -self._tokens / self.rate_per_s if self._tokens < 0 else 0.0

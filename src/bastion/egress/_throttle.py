"""A token bucket per sandbox for egress attempts, and a count of the attempts it refused.

Why: every egress attempt is a fsync'd audit record, and code in a sandbox can open
connections to its proxy as fast as the loopback allows. Unbounded, one sandbox could fill
the audit log's disk, and a full audit log stops the whole server (fail-closed). Past the
rate, attempts are refused (429) and only counted; the proxy writes one record per second
with the count (``event: "egress_throttled"``), so the log grows by a bounded amount however
hard a sandbox tries.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class AttemptThrottle:
    """Allow `burst` attempts at once, refilled at `rate_per_s`; count what is refused."""

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("the attempt rate must be positive and the burst at least 1")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._refilled = clock()
        self.refused = 0

    def take(self) -> bool:
        """Spend one attempt; False (and one more refused) if the bucket is empty."""
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._refilled) * self.rate_per_s)
        self._refilled = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self.refused += 1
        return False

    def drain(self) -> int:
        """The attempts refused since the last drain; the count starts again at zero."""
        count, self.refused = self.refused, 0
        return count

"""The login back-off and the registration window, with a fake clock.

What this proves: an address waits after `free` failures, doubling up to the maximum; a success clears
it; the global limit stops every address and lifts once the minute has passed; the window limiter
counts per key. What it does not prove: the HTTP answers (429 and Retry-After are tested live).
"""

from __future__ import annotations

import pytest

from bastion.http import ratelimit
from bastion.http.ratelimit import LoginLimiter, WindowLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(ratelimit.time, "monotonic", fake)
    return fake


def test_back_off_doubles_then_caps_and_clears(clock: Clock) -> None:
    limiter = LoginLimiter(free=3, max_s=5.0, global_per_minute=1000)
    for _ in range(2):
        limiter.failure("a")
    assert limiter.retry_after("a") == 0
    limiter.failure("a")
    assert limiter.retry_after("a") == pytest.approx(1.0)
    limiter.failure("a")
    assert limiter.retry_after("a") == pytest.approx(2.0)
    for _ in range(5):
        limiter.failure("a")
    assert limiter.retry_after("a") == pytest.approx(5.0)
    assert limiter.retry_after("b") == 0
    clock.now += 5.0
    assert limiter.retry_after("a") == 0  # the administrator can try again after the cool-down
    limiter.success("a")
    limiter.failure("a")
    assert limiter.retry_after("a") == 0


def test_global_limit_stops_everyone_for_the_minute(clock: Clock) -> None:
    limiter = LoginLimiter(free=100, max_s=900.0, global_per_minute=5)
    for n in range(5):
        limiter.failure(f"10.0.0.{n}")
        clock.now += 1
    assert limiter.retry_after("192.0.2.1") == pytest.approx(55.0)  # the first failure leaves the window
    clock.now += 55.0
    assert limiter.retry_after("192.0.2.1") == 0


def test_window_limiter(clock: Clock) -> None:
    window = WindowLimiter(limit=2, window_s=3600.0)
    assert window.allow("a")
    assert window.allow("a")
    assert not window.allow("a")
    assert window.allow("b")
    clock.now += 3601
    assert window.allow("a")

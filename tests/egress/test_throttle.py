"""The egress attempt throttle: a token bucket with a count of what it refused; the byte rate: a bucket that never
refuses, it makes the spender wait (a fake clock)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bastion.egress._throttle import AttemptThrottle, ByteRate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_burst_then_the_rate_and_the_refused_count() -> None:
    clock = Clock()
    throttle = AttemptThrottle(2.0, 3, clock)
    assert [throttle.take() for _ in range(5)] == [True, True, True, False, False]
    clock.now += 0.5  # one token back
    assert [throttle.take() for _ in range(2)] == [True, False]
    assert throttle.drain() == 3
    assert throttle.drain() == 0
    clock.now += 60  # refills up to the burst, no further
    assert [throttle.take() for _ in range(4)] == [True, True, True, False]


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 1), (-1.0, 5), (1.0, 0)])
def test_nonsense_settings_are_refused(rate: float, burst: int) -> None:
    with pytest.raises(ValueError, match="attempt rate"):
        AttemptThrottle(rate, burst)


@given(
    rate=st.floats(min_value=0.01, max_value=1000),
    burst=st.integers(min_value=1, max_value=500),
    gaps=st.lists(st.floats(min_value=0, max_value=5), max_size=200),
)
def test_never_more_than_the_burst_plus_the_rate_allows(rate: float, burst: int, gaps: list[float]) -> None:
    """Invariant: over any run, allowed <= burst + rate * elapsed, and allowed + refused == tries."""
    clock = Clock()
    throttle = AttemptThrottle(rate, burst, clock)
    allowed = 0
    for gap in gaps:
        clock.now += gap
        allowed += throttle.take()
    elapsed = clock.now - 100.0
    assert allowed <= burst + rate * elapsed + 1e-6
    assert allowed + throttle.drain() == len(gaps)


def test_byte_rate_owes_nothing_within_the_burst_then_the_debt_at_the_rate() -> None:
    clock = Clock()
    rate = ByteRate(1000.0, 500, clock)
    assert rate.owed_s(300) == 0.0
    assert rate.owed_s(200) == 0.0
    assert rate.owed_s(100) == pytest.approx(0.1)  # 100 bytes of debt at 1,000 a second
    assert rate.owed_s(400) == pytest.approx(0.5)  # every spender waits out the whole debt it finds
    clock.now += 0.5
    assert rate.owed_s(0) == 0.0  # repaid
    clock.now += 60
    assert rate.owed_s(500) == 0.0  # refilled up to the burst, no further
    assert rate.owed_s(1) == pytest.approx(0.001)


@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.floats(0, 2)), min_size=1, max_size=200))
def test_byte_rate_never_lets_more_than_the_burst_plus_the_rate_through(spends: list[tuple[int, float]]) -> None:
    """Whatever the spenders do, each waiting what it is told: the bytes moved by the time each may move again
    never exceed the burst plus the rate times the time gone."""
    clock = Clock()
    start = clock.now
    rate = ByteRate(4096.0, 65536, clock)
    moved = 0
    for count, pause in spends:
        clock.now += pause
        moved += count
        clock.now += rate.owed_s(count)
        assert moved <= 65536 + 4096.0 * (clock.now - start) + 1e-6 * moved


def test_byte_rate_refuses_a_rate_or_burst_that_is_not_positive() -> None:
    for bad in ((0.0, 1), (-1.0, 1), (1.0, 0)):
        with pytest.raises(ValueError, match="positive"):
            ByteRate(*bad)

"""The egress attempt throttle: a token bucket with a count of what it refused (a fake clock)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bastion.egress._throttle import AttemptThrottle
from tests.helpers import FakeClock


def test_burst_then_the_rate_and_the_refused_count() -> None:
    clock = FakeClock(100.0)
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
    clock = FakeClock(100.0)
    throttle = AttemptThrottle(rate, burst, clock)
    allowed = 0
    for gap in gaps:
        clock.now += gap
        allowed += throttle.take()
    elapsed = clock.now - 100.0
    assert allowed <= burst + rate * elapsed + 1e-6
    assert allowed + throttle.drain() == len(gaps)

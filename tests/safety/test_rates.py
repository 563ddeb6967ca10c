"""The byte rate: a token bucket that never refuses, it tells the spender how long to wait (a fake clock)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bastion.safety.rates import ByteRate
from tests.helpers import FakeClock


def test_byte_rate_owes_nothing_within_the_burst_then_the_debt_at_the_rate() -> None:
    clock = FakeClock(100.0)
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
    clock = FakeClock(100.0)
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


def test_a_bucket_is_full_again_only_once_the_rate_has_refilled_its_whole_burst() -> None:
    """`full` is what lets a keeper forget a bucket (a caller's audit budget): a new one would start full, so
    forgetting one that is not would hand its spender a fresh burst."""
    clock = FakeClock(100.0)
    rate = ByteRate(1000.0, 500, clock)
    assert rate.full()
    rate.owed_s(1)
    assert not rate.full()
    clock.now += 0.0009
    assert not rate.full()
    clock.now += 0.0002
    assert rate.full()


def test_hold_takes_all_or_nothing_and_give_back_never_passes_the_burst() -> None:
    clock = FakeClock(100.0)
    rate = ByteRate(1000.0, 500, clock)
    assert rate.hold(400) == 0.0
    assert rate.hold(200) == pytest.approx(0.1)  # 100 short: nothing taken
    assert rate.hold(100) == 0.0  # what the refused hold did not take is still there
    clock.now += 60  # refilled up to the burst, the holds' 500 counted as spent
    rate.give_back(500)
    assert rate.full()
    assert rate.hold(501) == pytest.approx(0.001)  # never more than the burst


@given(st.lists(st.tuples(st.integers(1, 1 << 17), st.integers(0, 1 << 17), st.floats(0, 2)), max_size=200))
def test_calls_that_hold_their_most_before_spending_never_pass_the_burst_plus_the_rate(
    calls: list[tuple[int, int, float]],
) -> None:
    """A caller's audit budget (`CallRunner`): each call holds `most`, writes `used` (no more than it held), then
    gives the hold back; calls overlap freely. What is written never exceeds the burst plus the rate times the
    time gone, however the calls interleave."""
    clock = FakeClock(100.0)
    start = clock.now
    rate = ByteRate(4096.0, 1 << 18, clock)
    held: list[tuple[int, int]] = []
    written = 0
    for most, used, pause in calls:
        clock.now += pause
        if rate.hold(most) == 0.0:
            held.append((most, min(used, most)))
        if held and pause > 1:  # the oldest call in flight writes its records and ends
            hold, spent = held.pop(0)
            rate.owed_s(spent)
            written += spent
            rate.give_back(hold)
        assert written <= (1 << 18) + 4096.0 * (clock.now - start)

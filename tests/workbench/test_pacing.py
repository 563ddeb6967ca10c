"""The `OUTPUT` timeline's pacing, simulated on loop time: what floods together may take, and who waits for whom."""

from __future__ import annotations

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from bastion.workbench.pacing import PACE_FACTOR, Pacer

SHARE = 1 / (1 + PACE_FACTOR)


def flood(readers: list[tuple[str, float]], seconds: float) -> dict[int, float]:
    """Readers (group, cost of each step) that read again the moment their wait ends, for `seconds` of loop time
    with steps taking no time of their own: the time each spent in steps."""
    pacer = Pacer()
    spent = dict.fromkeys(range(len(readers)), 0.0)
    due = [(0.0, index) for index in range(len(readers))]
    while due and due[0][0] < seconds:
        now, index = heapq.heappop(due)
        group, cost = readers[index]
        spent[index] += cost
        heapq.heappush(due, (pacer.slot(index, group, now, cost), index))
    return spent


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(1e-5, 0.02)), min_size=1, max_size=12))
def test_flooding_readers_together_take_at_most_a_quarter_of_the_loop(readers: list[tuple[str, float]]) -> None:
    """Whatever their sandboxes and costs: a quarter over time, plus what their first steps take before each
    counts the others (about one step each; it does not grow with time)."""
    seconds = 20.0
    spent = flood(readers, seconds)
    worst_step = max(cost for _, cost in readers)
    assert sum(spent.values()) <= SHARE * seconds + 2 * len(readers) * worst_step


def test_a_sandbox_with_many_flooding_readers_takes_no_more_than_one_with_a_single_reader() -> None:
    """Found by review: queued one after another, another sandbox's cheap code steps waited for every one of a
    sandbox's four terminals' 20 ms steps. Each sandbox now takes an equal share, whatever its readers cost, and
    the single cheap reader reads often."""
    readers = [("a", 0.02)] * 4 + [("b", 0.0003)]
    spent = flood(readers, 20.0)
    a, b = sum(spent[i] for i in range(4)), spent[4]
    assert abs(a - b) < 0.1 * SHARE * 20, (a, b)
    steps_b = b / 0.0003
    assert steps_b > 20.0 / (0.0003 * (1 + PACE_FACTOR) * 2 * 1.5), steps_b  # about one every 2.4 ms

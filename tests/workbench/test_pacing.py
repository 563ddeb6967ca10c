"""The `OUTPUT` timeline's pacing, simulated on loop time: what floods together may take, and who waits for whom."""

from __future__ import annotations

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from bastion.workbench.pacing import PACE_FACTOR, Pacer

SHARE = 1 / (1 + PACE_FACTOR)
Reader = tuple[str, float, float]
"""A simulated reader: its sandbox, the cost of each step, and how long after its wait it reads again (0: at once,
a flood; more: it trickles)."""


def run(readers: list[Reader], seconds: float) -> dict[int, float]:
    """`readers` for `seconds` of loop time, their steps taking no time of their own: the time each spent in steps."""
    pacer = Pacer()
    spent = dict.fromkeys(range(len(readers)), 0.0)
    due = [(0.0, index) for index in range(len(readers))]
    while due and due[0][0] < seconds:
        now, index = heapq.heappop(due)
        group, cost, gap = readers[index]
        spent[index] += cost
        heapq.heappush(due, (pacer.slot(index, group, now, cost) + gap, index))
    return spent


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.floats(1e-5, 0.02), st.sampled_from([0.0, 0.0, 0.003, 0.03, 0.2])),
        min_size=1,
        max_size=12,
    )
)
def test_readers_together_take_at_most_a_quarter_of_the_loop(readers: list[Reader]) -> None:
    """Whatever their sandboxes, costs and pace: a quarter over time, plus what their first steps take before each
    counts the others (about one step each; it does not grow with time), plus what tricklers take between their
    waits (each of their steps is followed by its gap, not by a paced wait)."""
    seconds = 20.0
    spent = run(readers, seconds)
    worst_step = max(cost for _, cost, _ in readers)
    trickled = sum(cost * seconds / gap for _, cost, gap in readers if gap > 0)
    assert sum(spent.values()) <= SHARE * seconds + 2 * len(readers) * worst_step + trickled


def test_a_sandbox_with_many_flooding_readers_takes_no_more_than_one_with_a_single_reader() -> None:
    """Found by review: queued one after another, another sandbox's cheap code steps waited for every one of a
    sandbox's four terminals' 20 ms steps. Each sandbox now takes an equal share, whatever its readers cost, and
    the single cheap reader reads often."""
    readers = [("a", 0.02, 0.0)] * 4 + [("b", 0.0003, 0.0)]
    spent = run(readers, 20.0)
    a, b = sum(spent[i] for i in range(4)), spent[4]
    assert abs(a - b) < 0.1 * SHARE * 20, (a, b)
    steps_b = b / 0.0003
    assert steps_b > 20.0 / (0.0003 * (1 + PACE_FACTOR) * 2 * 1.5), steps_b  # about one every 2.4 ms


def test_sandboxes_that_only_trickle_do_not_divide_the_share_of_one_that_floods() -> None:
    """Found by review: 15 sandboxes printing a dot every 30 ms each counted as busy, so another sandbox's output
    got 1/64 of the loop with the loop 90% idle (its terminal 18 times slower). A reader that reads again long
    after its wait is not flooding and divides nobody's share: the one flooding reader keeps its quarter."""
    readers = [(f"t{n}", 1e-5, 0.03) for n in range(15)] + [("b", 0.0003, 0.0)]
    spent = run(readers, 20.0)
    assert spent[15] > 0.9 * SHARE * 20, spent[15]


def test_the_pacer_forgets_readers_a_moment_after_their_last_wait() -> None:
    """Found by review: the pacer held the readers themselves (terminals, with their screens) until some later
    step anywhere, 55 MiB for 16 closed terminals on a quiet server. It holds int keys and group names now, and
    forgets them once their wait is over."""
    pacer = Pacer()
    for reader in range(100):
        pacer.slot(reader, f"sandbox-{reader % 7}", 0.0, 0.001)
    assert pacer.remembered == 100
    pacer.slot(1000, "other", 10.0, 0.001)
    assert pacer.remembered == 1
    assert pacer.flooding == 0  # a first step is not a flood yet

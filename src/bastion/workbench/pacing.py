"""A share of the event loop for work that arrives faster than it should be handled, as one timeline per loop.

Terminals (`bastion.workbench.screen`) and code contexts (`bastion.workbench.code`) read what sandboxes
send on the server's event loop. After each step of such work, its reader waits `PACE_FACTOR` + 1 times the
step's cost, times the number of sandboxes (groups) with readers busy on the timeline, times the number of
its own sandbox's busy readers, before it reads again (busy: waiting out a step, or done with one a moment
ago, `STILL_READING_S`; itself included). Each of G such sandboxes takes at most 1/(4G) of the loop however
many readers it has, all of them together at most a quarter however many flood, and a reader's wait follows
its own cost, not the others'. Paced each on
its own, 16 flooded terminals took the whole loop (a tool call waited 0.2 s), and eight flooding code
contexts made other sandboxes' calls 16 to 35 times slower. Terminals and code contexts share one timeline,
`OUTPUT`: on two, one sandbox flooding a terminal and a code context at once had the server spend 0.42 to
0.69 cores (found by attack). Queued one after another in it (as the steps were until then), a code
context's cheap steps each waited for every flooded terminal's 20 ms ones: another sandbox's 1 MB cell took
1.5 s instead of 0.03 s (found by review). Not a bound on the programs' own CPU time (their cgroup's).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import weakref
from typing import Final

PACE_FACTOR: Final = 3.0
"""After work of t, its reader waits 3t: at most a quarter of the loop for one timeline."""
STILL_READING_S: Final = 0.05
"""A reader counts as one of those sharing the timeline until this long after its last wait ended: a flooding
reader books its next step a moment after its wait, and uncounted in between, the others waited less (the loop's
thread 0.30 to 0.32 of its time with a terminal and a code cell flooding, instead of a quarter)."""
OUTPUT: Final = "output"
"""The timeline of every terminal's and code context's reader: what sandboxes print, rendered or parsed."""


class Pacer:
    """One timeline of readers' waits on one event loop (`of`)."""

    def __init__(self) -> None:
        self._free_at = 0.0  # loop time at which the last wait ends
        self._ends: dict[object, tuple[float, object]] = {}  # busy reader -> (loop time its wait ends, its group)
        self._by_end: list[tuple[float, int, object]] = []  # the same, by end (and stale entries, skipped)
        self._busy: dict[object, int] = {}  # group -> its busy readers
        self._order = itertools.count()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop, timeline: str) -> Pacer:
        """The pacer every reader of `timeline` (`OUTPUT`) on `loop` shares."""
        pacers = _PACERS.setdefault(loop, {})
        pacer = pacers.get(timeline)
        if pacer is None:
            pacer = pacers[timeline] = cls()
        return pacer

    @property
    def free_at(self) -> float:
        """Loop time at which the last wait ends."""
        return self._free_at

    @property
    def busy(self) -> int:
        """Readers waiting out a step or just done with one (as of the last step booked)."""
        return len(self._ends)

    def slot(self, reader: object, group: object, started: float, spent_s: float) -> float:
        """Book `reader`'s step (one of `group`'s: its sandbox) that began at loop time `started` and cost
        `spent_s`; return when it may read again: after its own last wait, `PACE_FACTOR` + 1 times the cost
        for each busy group, for each busy reader of its own group."""
        self._forget_ended(started)
        entry = self._ends.get(reader)
        groups = len(self._busy) + (group not in self._busy)
        readers = self._busy.get(group, 0) + (entry is None)
        end = max(entry[0] if entry else started, started) + spent_s * (1 + PACE_FACTOR) * groups * readers
        if entry is None:
            self._busy[group] = readers
        self._ends[reader] = (end, group)
        heapq.heappush(self._by_end, (end, next(self._order), reader))
        self._free_at = max(self._free_at, end)
        return end

    def _forget_ended(self, now: float) -> None:
        by_end, ends, busy = self._by_end, self._ends, self._busy
        while by_end and by_end[0][0] <= now - STILL_READING_S:
            end, _, reader = heapq.heappop(by_end)
            entry = ends.get(reader)
            if entry is not None and entry[0] == end:
                del ends[reader]
                group = entry[1]
                busy[group] -= 1
                if not busy[group]:
                    del busy[group]


_PACERS: Final[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Pacer]]] = weakref.WeakKeyDictionary()

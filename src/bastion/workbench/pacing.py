"""A share of the event loop for work that arrives faster than it should be handled, as one timeline per loop.

Terminals (`bastion.workbench.screen`) and code contexts (`bastion.workbench.code`) read what sandboxes
send on the server's event loop. After each step of such work, its reader waits `PACE_FACTOR` + 1 times the
step's cost, times the number of sandboxes (groups) with readers flooding the timeline, times the number of
its own sandbox's flooding readers, before it reads again (flooding: it read again within its last wait's
length, or `CONTINUOUS_S`, of that wait's end, and counts until `STILL_READING_S` after its latest; itself
included). Each of G such
sandboxes takes at most 1/(4G) of the loop however many readers it has, all of them together at most a
quarter however many flood, and a reader's wait follows its own cost, not the others'. A reader that only
trickles never counts: counted whenever they had read lately, 15 sandboxes printing a dot every 30 ms made
another sandbox's terminal 18 times slower with the loop 90% idle (found by review). The pacer holds keys
(`new_reader`) and group names, never a reader: holding terminals kept 16 closed ones' screens, 55 MiB,
alive (found by review). Paced each on
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
CONTINUOUS_S: Final = 0.005
"""A reader that reads again within this long of its last wait's end, or within that wait's own length (a busy
loop resumes a paced reader late), is flooding; a trickling one comes back much later than its short waits."""
STILL_READING_S: Final = 0.05
"""A flooding reader counts until this long after its last wait ended (or that wait's length, if longer):
uncounted between its wait and its next step, the others waited less (the loop's thread 0.30 to 0.32 of its
time with a terminal and a code cell flooding, instead of a quarter)."""
OUTPUT: Final = "output"
"""The timeline of every terminal's and code context's reader: what sandboxes print, rendered or parsed."""

_reader_keys = itertools.count()


def new_reader() -> int:
    """A key for one reader's steps in a `Pacer`."""
    return next(_reader_keys)


class Pacer:
    """One timeline of readers' waits on one event loop (`of`)."""

    def __init__(self) -> None:
        self._free_at = 0.0  # loop time at which the last wait ends
        # reader -> (loop time its wait ends, its group, whether it floods, how long that wait is)
        self._ends: dict[int, tuple[float, str, bool, float]] = {}
        self._by_end: list[tuple[float, int, float]] = []  # (when to forget, reader, end): stale entries skipped
        self._flooding: dict[str, int] = {}  # group -> its flooding readers

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
    def flooding(self) -> int:
        """Readers counted as flooding (as of the last step booked)."""
        return sum(self._flooding.values())

    @property
    def remembered(self) -> int:
        """Readers whose last wait is remembered (as of the last step booked)."""
        return len(self._ends)

    def slot(self, reader: int, group: str, started: float, spent_s: float) -> float:
        """Book `reader`'s step (one of `group`'s: its sandbox's id) that began at loop time `started` and cost
        `spent_s`; return when it may read again: after its own last wait, `PACE_FACTOR` + 1 times the cost
        for each flooding group, for each flooding reader of its own group (itself counted)."""
        self._forget_ended(started)
        entry = self._ends.get(reader)
        last_end = entry[0] if entry is not None else started
        flooding = entry is not None and started <= last_end + max(CONTINUOUS_S, entry[3])
        if flooding != (entry is not None and entry[2]):
            self._count(group, 1 if flooding else -1)
        groups = len(self._flooding) + (group not in self._flooding)
        readers = self._flooding.get(group, 0) + (not flooding)
        begins = max(last_end, started)
        end = begins + spent_s * (1 + PACE_FACTOR) * groups * readers
        self._ends[reader] = (end, group, flooding, end - begins)
        heapq.heappush(self._by_end, (end + max(STILL_READING_S, end - begins), reader, end))
        self._free_at = max(self._free_at, end)
        return end

    def _count(self, group: str, change: int) -> None:
        count = self._flooding.get(group, 0) + change
        if count:
            self._flooding[group] = count
        else:
            del self._flooding[group]

    def _forget_ended(self, now: float) -> None:
        by_end, ends = self._by_end, self._ends
        while by_end and by_end[0][0] <= now:
            _, reader, end = heapq.heappop(by_end)
            entry = ends.get(reader)
            if entry is not None and entry[0] == end:
                del ends[reader]
                if entry[2]:
                    self._count(entry[1], -1)


_PACERS: Final[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Pacer]]] = weakref.WeakKeyDictionary()

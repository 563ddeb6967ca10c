"""A share of the event loop for work that arrives faster than it should be handled, as one timeline per loop.

Terminals (`bastion.workbench.screen`) and code contexts (`bastion.workbench.code`) read what sandboxes
send on the server's event loop. Each step of such work, whichever sandbox's, takes a slot of
`PACE_FACTOR` + 1 times its cost after the slots booked before it on its timeline, and its reader reads
again only when the slot ends: together the readers of one timeline take at most a quarter of the loop,
in turn. Paced each on its own, 16 flooded terminals took the whole loop (a tool call waited 0.2 s), and
eight flooding code contexts made other sandboxes' calls 16 to 35 times slower. Terminals and code
contexts share one timeline, `OUTPUT`: on two, one sandbox flooding a terminal and a code context at once
had the server spend 0.42 to 0.69 cores (found by attack). Not a bound on the programs' own CPU time (their
cgroup's).
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Final

PACE_FACTOR: Final = 3.0
"""After work of t, its reader waits 3t: at most a quarter of the loop for one timeline."""
OUTPUT: Final = "output"
"""The timeline of every terminal's and code context's reader: what sandboxes print, rendered or parsed."""


class Pacer:
    """One timeline of slots on one event loop (`of`)."""

    def __init__(self) -> None:
        self._free_at = 0.0  # loop time at which the last slot ends

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
        """Loop time at which the last slot ends."""
        return self._free_at

    def slot(self, started: float, spent_s: float) -> float:
        """Book a step that began at loop time `started` and cost `spent_s`; return when its slot ends."""
        self._free_at = max(self._free_at, started) + spent_s * (1 + PACE_FACTOR)
        return self._free_at


_PACERS: Final[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Pacer]]] = weakref.WeakKeyDictionary()

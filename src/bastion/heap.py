"""The cyclic garbage collector, set for a long-running server.

CPython's defaults suit a short script: a young collection every 700 container allocations, and a
full one, which walks every object the process holds, each time the old generation has grown by a
quarter. A bastion server holds about 110,000 objects once it has imported and built everything
(pydantic schemas, the SDK, the config), and under 32 HTTP clients its requests, alive across many
young collections, were promoted fast enough to start a full collection every 200 calls: over 5,120
calls, 2.5 s went to full collections and 1.5 s to the younger ones, of about 17 s of CPU
(bench_http.py, CHANGELOG).

So, once the server is built and before it serves: freeze what start-up made (it lives as long as the
process: no later collection needs to walk it), and collect the young generation less often. What a
request makes and drops is still collected. No collection runs first: it took 50 ms of every start
and found about 40 objects of garbage, which stay frozen.
"""

from __future__ import annotations

import gc
from typing import Final

YOUNG_THRESHOLD: Final = 10_000
"""Container allocations between two young collections (CPython's default: 700)."""
OLDER_THRESHOLDS: Final = (10, 10)
"""Young collections per middle one, middle ones per full one (CPython's defaults)."""


def settle() -> None:
    """Call once, when the server is built and before it serves (module docstring)."""
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *OLDER_THRESHOLDS)

"""Thread pools whose threads are all started up front.

A `ThreadPoolExecutor` starts a thread at a `submit` that finds none idle, after it has queued the task; when the
start fails (the host, or the server's cgroup, has no thread left) `submit` raises, and the task stays queued and
runs later, once some other submit gets a thread: work its caller was told had failed. Found by attack (the
server's cgroup at its pids limit): a `create_sandbox` answered UNAVAILABLE had its sandbox built a moment later,
mounted, counted by nobody. Started up front, a pool's `submit` never starts a thread (they never retire).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final

START_TIMEOUT_S: Final = 30.0


def started_pool(workers: int, name: str, *, initializer: Callable[[], object] | None = None) -> ThreadPoolExecutor:
    """A pool of `workers` threads named `name`-N, every one started before it is returned.

    Raises:
        RuntimeError: a thread cannot be started ("can't start new thread"); nothing is left running.
    """
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, initializer=initializer)
    # Each task holds its thread at the barrier until all have one: no submit finds an idle thread to reuse.
    gate = threading.Barrier(workers + 1)
    try:
        for _ in range(workers):
            pool.submit(gate.wait, START_TIMEOUT_S)
        gate.wait(START_TIMEOUT_S)
    except BaseException:
        gate.abort()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    return pool

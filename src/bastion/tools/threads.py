"""Worker threads shared fairly among the places and callers whose tools run in them.

Found by attack: anyio's worker threads are one pool of 40 for the whole server. 60 concurrent
`list_directory` calls from one agent held all of them and another agent's `read_file` waited 10 s;
review then found the same through the organizer's tools, and through one agent's many sandboxes
(4 threads each). A call now holds its place's share (a workspace, an inbox: at most
`MAX_THREADS_PER_PLACE`) and its caller's (an OAuth client, or the one local caller: at most
`MAX_THREADS_PER_CALLER`) before it takes a thread, so a burst queues behind its own.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

import anyio
import anyio.to_thread
from mcp.server.auth.middleware.auth_context import get_access_token

from bastion.workbench.workers import InThread

MAX_THREADS_PER_PLACE: Final = 4
MAX_THREADS_PER_CALLER: Final = 8
"""Well under anyio's 40: five callers at their share leave threads for the audit log's and the rest."""
LOCAL_CALLER: Final = ""
"""A call with no OAuth token (stdio, or HTTP with auth off): one caller."""

T = TypeVar("T")


class ThreadShares:
    """The shares of one server's tools (`run`)."""

    def __init__(self) -> None:
        # Weak: a closed sandbox's share goes with its workspace.
        self._places: weakref.WeakKeyDictionary[object, anyio.CapacityLimiter] = weakref.WeakKeyDictionary()
        # Callers are OAuth clients, bounded by the client table (and its eviction).
        self._callers: dict[str, anyio.CapacityLimiter] = {}

    async def run(self, place: object, work: Callable[[], T], *, limiter: anyio.CapacityLimiter | None = None) -> T:
        """`work()` in a worker thread (anyio's) once `limiter` (a tool's own bound, if any), then `place` and
        this call's caller have one to spare. The tool's bound is taken first: found in the twenty-second session,
        searches waiting for their bound of 2 held their workspace's share, and a burst of them left none for
        any other tool there, another agent's reads of a shared host workspace included."""
        async with contextlib.AsyncExitStack() as held:
            if limiter is not None:
                await held.enter_async_context(limiter)
            await held.enter_async_context(self._place(place))
            await held.enter_async_context(self._caller())
            return await anyio.to_thread.run_sync(work)

    def binding(self, place: object, *, limiter: anyio.CapacityLimiter | None = None) -> InThread:
        """`run` for `place` (under `limiter` too, if given), as workbench code takes it (`InThread`)."""

        def in_thread(work: Callable[[], T]) -> Awaitable[T]:
            return self.run(place, work, limiter=limiter)

        return in_thread

    def _place(self, place: object) -> anyio.CapacityLimiter:
        share = self._places.get(place)
        if share is None:
            share = self._places[place] = anyio.CapacityLimiter(MAX_THREADS_PER_PLACE)
        return share

    def _caller(self) -> anyio.CapacityLimiter:
        return _callers_limiter(self._callers, MAX_THREADS_PER_CALLER)


class CallerBound:
    """A tool's own bound, per caller (`mine`): `size` of its calls at once for each caller. Per caller, because a
    call holds it while it waits for its shares (`ThreadShares.run`): found by review, one server-wide bound of 2
    searches, held by one agent's searches waiting for its full caller share, kept every other agent's searches
    waiting too."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._callers: dict[str, anyio.CapacityLimiter] = {}

    def mine(self) -> anyio.CapacityLimiter:
        """This call's caller's bound."""
        return _callers_limiter(self._callers, self._size)


def _callers_limiter(limiters: dict[str, anyio.CapacityLimiter], size: int) -> anyio.CapacityLimiter:
    """The limiter of this call's caller (its OAuth client, or the one local caller) in `limiters`, made at first."""
    token = get_access_token()
    caller = LOCAL_CALLER if token is None else token.client_id
    limiter = limiters.get(caller)
    if limiter is None:
        limiter = limiters[caller] = anyio.CapacityLimiter(size)
    return limiter

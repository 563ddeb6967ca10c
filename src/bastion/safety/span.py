"""A tool call's span: what code deep inside a call needs done when the call ends.

`CallRunner.run` opens one per call; `at_end` registers a callback there (a sandbox counts the call as use
until it ends). Outside a call, nothing is registered. A worker thread the call hands work to shares it: anyio
copies the context, and the list of callbacks is the same object.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

_ENDS: ContextVar[list[Callable[[], None]] | None] = ContextVar("bastion_call_ends", default=None)


@contextlib.contextmanager
def call_span() -> Iterator[None]:
    """The span of one call: the callbacks registered in it run when it ends, however it ends."""
    ends: list[Callable[[], None]] = []
    token = _ENDS.set(ends)
    try:
        yield
    finally:
        _ENDS.reset(token)
        for end in ends:
            end()


def at_end(callback: Callable[[], None]) -> bool:
    """Run `callback` when the current call ends; False (nothing registered) outside a call."""
    ends = _ENDS.get()
    if ends is None:
        return False
    ends.append(callback)
    return True

"""How workbench code hands its blocking work to a worker thread: `InThread`, given by the tool that called it.

The tools hold the thread shares (`bastion.tools.threads.ThreadShares`: a place's and a caller's), so one agent's
burst waits behind its own share; a call from outside the tools gets `any_thread`, anyio's pool.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final, Protocol, TypeVar

import anyio.to_thread

__all__ = ["INLINE_CLEAN_CHARS", "InThread", "any_thread"]

T = TypeVar("T")

INLINE_CLEAN_CHARS: Final = 8 * 1024
"""Text up to this long is cleaned and redacted on the event loop, cheaper than a thread hop. Longer goes to a
worker: redaction costs up to about 1 us a character on adversarial text (lines of `key=`), so a command's
64 KiB of output took 40 to 70 ms of the loop, and a terminal's scrollback 100 ms."""


class InThread(Protocol):
    """Runs `work` in a worker thread under the shares its caller holds (the tools' `ThreadShares`: the
    sandbox's and the OAuth client's), so one agent's many sandboxes work in its own share."""

    def __call__(self, work: Callable[[], T], /) -> Awaitable[T]: ...


async def any_thread(work: Callable[[], T]) -> T:
    """`InThread` with no caller's shares (a call from outside the tools): anyio's pool."""
    return await anyio.to_thread.run_sync(work)

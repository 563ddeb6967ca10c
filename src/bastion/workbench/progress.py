"""Progress of a long operation (an install) as short messages: phases, and the newest line of output.

An installer's output is the sandbox's (a package's build code writes it): each line is cut,
cleaned of terminal escapes and redacted like command output before it becomes a message, and
messages go out at most one per MIN_INTERVAL_S, so a flood of lines costs a few notifications.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final

from bastion.safety.output import clean_output
from bastion.safety.redact import Redactor
from bastion.sandbox.processes import OutputSink

logger = logging.getLogger("bastion.progress")

MIN_INTERVAL_S: Final = 0.25
MAX_LINE_BYTES: Final = 4096  # of one line kept for a message; the rest of a longer line is dropped
MAX_MESSAGE_CHARS: Final = 300

Send = Callable[[float, str], Awaitable[None]]
"""Sends one message with a count that only grows (MCP progress must increase)."""


class LineProgress:
    """Turns phases and raw output into rate-limited progress messages (`send`)."""

    def __init__(self, redactor: Redactor, send: Send) -> None:
        self._redactor = redactor
        self._send = send
        self._partial = [bytearray(), bytearray()]
        self._latest = ""
        self._count = 0
        self._sent = 0
        self._changed = asyncio.Event()

    def phase(self, text: str) -> None:
        """A step bastion takes (its own words: not redacted)."""
        self._post(text)

    def sinks(self) -> tuple[OutputSink, OutputSink]:
        """What the command's stdout and stderr feed."""
        return (lambda chunk: self._feed(0, chunk)), (lambda chunk: self._feed(1, chunk))

    def _feed(self, stream: int, chunk: bytes) -> None:
        partial = self._partial[stream]
        *complete, rest = chunk.split(b"\n")
        if complete:
            line = bytes(partial + complete[-1]) if len(complete) == 1 else complete[-1]
            partial.clear()
            self._line(line)
        room = MAX_LINE_BYTES - len(partial)
        if room > 0:
            partial += rest[:room]

    def _line(self, raw: bytes) -> None:
        # pip draws with carriage returns: what a terminal would show is the part after the last one.
        shown = raw[:MAX_LINE_BYTES].rsplit(b"\r", 1)[-1]
        text = clean_output(self._redactor, shown, cut=False).strip()
        if text:
            self._post(text[:MAX_MESSAGE_CHARS])

    def _post(self, text: str) -> None:
        self._latest = text
        self._count += 1
        self._changed.set()

    async def _pump(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            await self._deliver()
            await asyncio.sleep(MIN_INTERVAL_S)

    async def _deliver(self) -> None:
        """The newest message, if there is one not sent yet (MCP progress counts must increase)."""
        if self._count == self._sent:
            return
        self._sent = self._count
        try:
            await self._send(float(self._sent), self._latest)
        except Exception:  # a client that cannot take progress still gets the answer
            logger.debug("progress notification failed", exc_info=True)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[LineProgress]:
        """Send messages while the block runs; the last one is sent before it ends."""
        task = asyncio.get_running_loop().create_task(self._pump())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # Only after the pump is gone: two sends at once could reach the client out of order.
        await self._deliver()

"""The stdio transport: JSON-RPC lines on non-blocking pipes, read and written on the event loop.

The SDK's `stdio_server` reads and writes through anyio worker threads: three thread
hops per message, which on a two-core machine cost more CPU than a whole tool call.
When stdin and stdout are pipes or sockets (the way every MCP client spawns a server),
bastion reads and writes them on the event loop instead; anything else (a terminal, a
file) goes through the SDK's transport unchanged.

As in the SDK, the wire is served from private duplicates while fd 0 reads the null
device and fd 1 points at stderr, so a child process's stray output never corrupts it.
The pipes are non-blocking while served (a property of the open file, so a parent that
kept a copy of the same pipe sees it too) and made blocking again at exit.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import stat
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from types import TracebackType
from typing import TYPE_CHECKING, Final, Self

import anyio
import mcp_types as types
from mcp.server.stdio import stdio_server
from mcp.shared.message import SessionMessage

if TYPE_CHECKING:
    from mcp.shared._stream_protocols import ReadStream, WriteStream

logger = logging.getLogger("bastion.stdio")

# One JSON-RPC message per line; a line longer than this ends the session (a client that
# sends 64 MiB in one message is broken or hostile, and buffering it whole is the cost).
MAX_LINE_BYTES: Final = 64 * 1024 * 1024


def _is_pipe(fd: int) -> bool:
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


@contextmanager
def _claimed(fd: int) -> Iterator[int]:
    """Serve `fd` from a private duplicate; meanwhile fd reads the null device (0) or goes to stderr (1)."""
    private = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    try:
        diversion = os.open(os.devnull, os.O_RDONLY) if fd == 0 else os.dup(2)
        try:
            os.dup2(diversion, fd)
        finally:
            os.close(diversion)
        try:
            yield private
        finally:
            # The open file description is shared with fd after this: give it back blocking.
            with suppress(OSError):
                os.set_blocking(private, True)
            os.dup2(private, fd)
    finally:
        os.close(private)


class _Stream:
    """An async context manager that closes the stream on exit, as anyio's streams do."""

    async def aclose(self) -> None:
        return None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class _LineReader(_Stream):
    """The server's read stream: one parsed message per line of stdin."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader

    async def receive(self) -> SessionMessage | Exception:
        while True:
            try:
                line = await self._reader.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                line = exc.partial
                if not line:
                    raise anyio.EndOfStream from None
            except asyncio.LimitOverrunError:
                logger.error(
                    "bastion: a message longer than %d bytes arrived on stdin: ending the session", MAX_LINE_BYTES
                )
                raise anyio.EndOfStream from None
            if line.strip():
                break
        try:
            message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
        except Exception as exc:
            return exc
        return SessionMessage(message)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None


class _LineWriter(_Stream):
    """The server's write stream: one message per line of stdout, written whole."""

    def __init__(self, transport: asyncio.WriteTransport, protocol: asyncio.streams.FlowControlMixin) -> None:
        # drain() then waits until the pipe took every byte, as the SDK's write-and-flush does:
        # a reply is on the wire when send returns, and nothing is left behind at exit.
        transport.set_write_buffer_limits(high=0)
        self._writer = asyncio.StreamWriter(transport, protocol, None, asyncio.get_running_loop())

    async def flush(self, timeout_s: float) -> None:
        """Wait (bounded) for bytes a cancelled send left in the buffer."""
        with anyio.move_on_after(timeout_s, shield=True), suppress(ConnectionError):
            await self._writer.drain()

    async def send(self, item: SessionMessage, /) -> None:
        data = item.message.model_dump_json(by_alias=True, exclude_unset=True).encode("utf-8")
        # One write call per message: concurrent senders can never interleave their lines.
        self._writer.write(data + b"\n")
        await self._writer.drain()

    async def aclose(self) -> None:
        if not self._writer.is_closing():
            self._writer.close()


@asynccontextmanager
async def stdio_streams() -> AsyncIterator[tuple[ReadStream[SessionMessage | Exception], WriteStream[SessionMessage]]]:
    """The server's ends of the stdio wire: on the event loop when both are pipes, else the SDK's."""
    if not (_is_pipe(0) and _is_pipe(1)):
        async with stdio_server() as streams:
            yield streams
        return
    loop = asyncio.get_running_loop()
    with _claimed(0) as wire_in, _claimed(1) as wire_out:
        reader = asyncio.StreamReader(limit=MAX_LINE_BYTES)
        in_transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(wire_in, "rb", buffering=0, closefd=False)
        )
        out_transport, out_protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(wire_out, "wb", buffering=0, closefd=False)
        )
        writer = _LineWriter(out_transport, out_protocol)
        try:
            yield _LineReader(reader), writer
        finally:
            in_transport.close()
            await writer.flush(timeout_s=5)
            out_transport.close()

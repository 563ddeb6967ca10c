"""The stdio transport: one JSON-RPC message per line, read and written by bastion itself.

The SDK's `stdio_server` reads and writes through anyio worker threads: three thread
hops per message, which on a two-core machine cost more CPU than a whole tool call, and
at end of input it can exit before the last reply is written (measured: 2 runs in 30
lost it). When stdin and stdout are pipes or sockets (the way every MCP client spawns a
server, or inetd and socat connect one), bastion reads and writes them on the event loop.
A terminal or a file is read in a worker thread and written directly, since making it
non-blocking would change it for the shell that shares it. Either way every reply is
written whole before exit, unless the client is gone: then the answers are dropped and
the end of input waits for none.

As in the SDK, the wire is served from private duplicates while fd 0 reads the null
device and fd 1 points at stderr, so a child process's stray output never corrupts it.
Pipes are non-blocking while served (a property of the open file, so a parent that kept
a copy of the same pipe sees it too) and made blocking again at exit.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import fcntl
import functools
import logging
import os
import select
import socket
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager, suppress
from types import TracebackType
from typing import TYPE_CHECKING, Final, Self

import anyio
import mcp_types as types
from mcp.shared.dispatcher import coerce_request_id
from mcp.shared.message import SessionMessage

if TYPE_CHECKING:
    from mcp.shared._stream_protocols import ReadStream, WriteStream

logger = logging.getLogger("bastion.stdio")

# One JSON-RPC message per line; a line longer than this ends the session (a client that
# sends 64 MiB in one message is broken or hostile, and buffering it whole is the cost).
MAX_LINE_BYTES: Final = 64 * 1024 * 1024
EOF_DRAIN_S: Final = 3600.0  # the longest a call may run (a sandbox command's timeout_s ceiling)
_CLIENT_GONE_ERRNOS: Final = frozenset({errno.ECONNRESET, errno.EPIPE, errno.EIO})
HANG_UP_POLL_S: Final = 0.25  # how often that wait asks whether a socket's client has closed it


def _is_pipe(fd: int) -> bool:
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def _is_fifo(fd: int) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:
        return False


def _stream_socket(fd: int) -> socket.socket | None:
    """A socket of its own on a duplicate of `fd`, if `fd` is a stream socket."""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return None
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    if sock.type != socket.SOCK_STREAM:
        sock.close()
        return None
    return sock


def wire_problem() -> str | None:
    """Why stdin or stdout cannot carry the stdio transport, when one is a socket it cannot use; else None. Found
    by review: a SOCK_SEQPACKET socket lost every answer past its send buffer's size, silently; a datagram one never
    saw its client go, and held the state folder; a listening one ended the server at the first connection."""
    for fd, name in ((0, "stdin"), (1, "stdout")):
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            with socket.socket(fileno=os.dup(fd)) as sock:
                kind, listening = sock.type, sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        except OSError:
            continue
        if kind != socket.SOCK_STREAM:
            return f"{name} is a {kind.name} socket: the stdio transport needs a byte stream (systemd: ListenStream=)"
        if listening:
            return f"{name} is a listening socket: give the server a connection (systemd: Accept=yes; inetd: nowait)"
    return None


def _hung_up(fd: int) -> bool:
    """Whether a socket's peer closed it for good (POLLHUP: a unix socket's peer closed; POLLERR). A TCP peer's
    close cannot be told from its half-close (SHUT_WR, still reading) without writing to it."""
    poller = select.poll()
    poller.register(fd, 0)  # POLLHUP and POLLERR are reported whatever is asked
    return any(events & (select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))


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


class _TooLong(Exception):
    """A line longer than MAX_LINE_BYTES."""


def _pipe_lines(reader: asyncio.StreamReader) -> Callable[[], Awaitable[bytes]]:
    """Lines of a non-blocking pipe, read on the event loop; b"" at the end."""

    async def read_line() -> bytes:
        try:
            return await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            return exc.partial
        except asyncio.LimitOverrunError:
            raise _TooLong from None

    return read_line


def _file_lines(fd: int) -> Callable[[], Awaitable[bytes]]:
    """Lines of a terminal or a file, read in a worker thread; b"" at the end."""
    source = os.fdopen(fd, "rb", closefd=False)

    async def read_line() -> bytes:
        line: bytes = await anyio.to_thread.run_sync(source.readline, MAX_LINE_BYTES + 1, abandon_on_cancel=True)
        if len(line) > MAX_LINE_BYTES:
            raise _TooLong
        return line

    return read_line


class _Unanswered:
    """Requests read and not yet answered: stdin's end waits for them (bounded), so a client that
    writes its calls and closes its end still gets every answer, however long a call takes.

    A request the client cancels (``notifications/cancelled``) gets no answer (the protocol says none is
    sent): it is not waited for. It was, for an hour, holding the state folder's lock, so the client's next
    server could not start. Ids are counted: a client that reuses an id in flight gets both answers. Ids are
    compared as the SDK correlates them (`coerce_request_id`: "5" is 5): a call 5 cancelled as "5" is
    cancelled there, and was waited for here.
    """

    def __init__(self) -> None:
        self._ids: collections.Counter[int | str] = collections.Counter()
        self._none_left = asyncio.Event()
        self._none_left.set()
        self._gone = False
        # Whether the client's end of stdout is closed for good, asked while the end of input waits (a socket's
        # POLLHUP: nothing else tells a socket's writer before a write fails).
        self.hung_up: Callable[[], bool] = lambda: False

    def read(self, message: object) -> None:
        if self._gone:  # found by review: a request read after that was waited for, its answer going nowhere
            return
        if isinstance(message, types.JSONRPCRequest):
            self._ids[coerce_request_id(message.id)] += 1
            self._none_left.clear()
        elif isinstance(message, types.JSONRPCNotification) and message.method == "notifications/cancelled":
            params = message.params if isinstance(message.params, dict) else {}
            request = params.get("requestId")
            if isinstance(request, int | str) and not isinstance(request, bool):
                self._forget(coerce_request_id(request))

    def answered(self, message: object) -> None:
        if isinstance(message, types.JSONRPCResponse | types.JSONRPCError) and message.id is not None:
            self._forget(coerce_request_id(message.id))

    def gone(self) -> None:
        """The client stopped reading: no answer can reach it, so the end of input waits for none."""
        self._gone = True
        self._ids.clear()
        self._none_left.set()

    def _forget(self, request: int | str) -> None:
        if self._ids[request] > 1:
            self._ids[request] -= 1
        else:
            self._ids.pop(request, None)
        if not self._ids:
            self._none_left.set()

    async def drain(self) -> None:
        if self._ids:
            with anyio.move_on_after(EOF_DRAIN_S) as scope:
                while not self._none_left.is_set():
                    with anyio.move_on_after(HANG_UP_POLL_S):
                        await self._none_left.wait()
                    if self.hung_up():
                        self.gone()
            if scope.cancelled_caught:
                logger.error("bastion: stdin closed; %d calls still unanswered after %g s", len(self._ids), EOF_DRAIN_S)


class _LineReader(_Stream):
    """The server's read stream: one parsed message per line of stdin."""

    def __init__(self, read_line: Callable[[], Awaitable[bytes]], unanswered: _Unanswered) -> None:
        self._read_line = read_line
        self._unanswered = unanswered

    async def receive(self) -> SessionMessage | Exception:
        while True:
            try:
                line = await self._read_line()
            except _TooLong:
                logger.error(
                    "bastion: a message longer than %d bytes arrived on stdin: ending the session", MAX_LINE_BYTES
                )
                raise anyio.EndOfStream from None
            except OSError as exc:
                # A socket its peer reset (it quit with an answer unread), a terminal hung up (EIO): found by
                # review, each ended the server with status 1 and a traceback. Nobody is left to answer.
                if exc.errno not in _CLIENT_GONE_ERRNOS:
                    logger.warning("bastion: reading stdin failed (%s): ending the session", exc.strerror or exc)
                self._unanswered.gone()
                line = b""
            if not line:
                await self._unanswered.drain()
                raise anyio.EndOfStream
            if line.strip():
                break
        try:
            message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
        except Exception as exc:
            return exc
        self._unanswered.read(message)
        return SessionMessage(message)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None


def _line(item: SessionMessage) -> bytes:
    return item.message.model_dump_json(by_alias=True, exclude_unset=True).encode("utf-8") + b"\n"


class _LineWriter(_Stream):
    """The server's write stream on a non-blocking pipe: one message per line, written whole."""

    def __init__(
        self, transport: asyncio.WriteTransport, protocol: asyncio.streams.FlowControlMixin, unanswered: _Unanswered
    ) -> None:
        self._unanswered = unanswered
        # asyncio watches the pipe and closes the transport when its reading end closes: from then on no answer
        # can reach the client (found by review: the end of input waited for a 30 s call's answer, holding the
        # state folder, when the client had quit at its start).
        lost = protocol.connection_lost

        def connection_lost(exc: Exception | None) -> None:
            unanswered.gone()
            lost(exc)

        protocol.connection_lost = connection_lost  # type: ignore[method-assign]
        # drain() then waits until the pipe took every byte, as the SDK's write-and-flush does:
        # a reply is on the wire when send returns, and nothing is left behind at exit.
        transport.set_write_buffer_limits(high=0)
        self._writer = asyncio.StreamWriter(transport, protocol, None, asyncio.get_running_loop())

    async def flush(self, timeout_s: float) -> None:
        """Wait (bounded) for bytes a cancelled send left in the buffer."""
        with anyio.move_on_after(timeout_s, shield=True), suppress(ConnectionError):
            await self._writer.drain()

    async def send(self, item: SessionMessage, /) -> None:
        if self._writer.is_closing():  # the pipe's reading end closed (asyncio watches it), or our own close
            raise _client_gone(self._unanswered)
        # One write call per message: concurrent senders can never interleave their lines.
        self._writer.write(_line(item))
        try:
            await self._writer.drain()
        except ConnectionError:
            raise _client_gone(self._unanswered) from None
        self._unanswered.answered(item.message)

    async def aclose(self) -> None:
        if not self._writer.is_closing():
            self._writer.close()


class _FdWriter(_Stream):
    """The server's write stream on a terminal, a file or a socket: each line written whole and in turn.

    A socket is not given to asyncio's pipe transport, which watches it for reading and closes itself when it
    becomes readable: with stdin and stdout one socket (inetd, socat, systemd's Accept=yes), at the client's
    next request (found by review: every answer after the first was dropped). A terminal or a file is written
    blocking, as it is shared with the shell; a socket, non-blocking, waits for room on the loop. A line is
    written by a task of its own, which a cancelled send does not stop: a line cut off would corrupt the next.
    """

    def __init__(self, fd: int, unanswered: _Unanswered) -> None:
        self._fd = fd
        self._unanswered = unanswered
        self._broken = False
        self._turn = asyncio.Lock()
        self._writing: set[asyncio.Task[None]] = set()

    async def send(self, item: SessionMessage, /) -> None:
        if self._broken:
            raise _client_gone(self._unanswered)
        task = asyncio.get_running_loop().create_task(self._write(_line(item)))
        self._writing.add(task)
        task.add_done_callback(self._written)
        try:
            await asyncio.shield(task)
        except OSError:  # a terminal hung up, a file's disk full, a socket's peer gone
            self._broken = True
            raise _client_gone(self._unanswered) from None
        self._unanswered.answered(item.message)

    async def _write(self, line: bytes) -> None:
        async with self._turn:
            view = memoryview(line)
            while view:
                try:
                    view = view[os.write(self._fd, view) :]
                except BlockingIOError:
                    await _writable(self._fd)

    def _written(self, task: asyncio.Task[None]) -> None:
        self._writing.discard(task)
        if not task.cancelled() and task.exception() is not None:  # also a line whose send was cancelled
            self._broken = True
            self._unanswered.gone()

    async def flush(self, timeout_s: float) -> None:
        """Wait (bounded) for the lines whose sends were cancelled."""
        if self._writing:
            with anyio.move_on_after(timeout_s, shield=True):
                await asyncio.wait(set(self._writing))


async def _writable(fd: int) -> None:
    """Until `fd` (non-blocking) can take bytes again."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def room() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(fd, room)
    try:
        await ready
    finally:
        loop.remove_writer(fd)


def _client_gone(unanswered: _Unanswered) -> anyio.BrokenResourceError:
    """What a send raises once the client's end of stdout is gone (found by attack: a client that quit with a call
    in flight made the answer's write raise ConnectionResetError, which the SDK, dropping only anyio's broken and
    closed stream errors, raised again writing the error answer: the server died, status 1, with 8 KB of
    tracebacks). The calls still in flight are not waited for at the end of input (`_Unanswered.gone`): their
    answers have nowhere to go, and the wait would hold the state folder's lock up to `EOF_DRAIN_S`."""
    unanswered.gone()
    return anyio.BrokenResourceError()


@asynccontextmanager
async def stdio_streams() -> AsyncIterator[tuple[ReadStream[SessionMessage | Exception], WriteStream[SessionMessage]]]:
    """The server's ends of the stdio wire, for as long as the context lasts."""
    loop = asyncio.get_running_loop()
    unanswered = _Unanswered()
    with _claimed(0) as wire_in, _claimed(1) as wire_out:
        async with AsyncExitStack() as cleanup:
            if _is_pipe(wire_in):
                reader = asyncio.StreamReader(limit=MAX_LINE_BYTES)
                in_transport: asyncio.BaseTransport
                sock = _stream_socket(wire_in)
                if sock is not None:  # a socket transport: a peer's reset is an error it raises, not one it logs
                    in_transport, _ = await loop.connect_accepted_socket(
                        lambda: asyncio.StreamReaderProtocol(reader), sock
                    )
                else:
                    in_transport, _ = await loop.connect_read_pipe(
                        lambda: asyncio.StreamReaderProtocol(reader),
                        os.fdopen(wire_in, "rb", buffering=0, closefd=False),
                    )
                cleanup.callback(in_transport.close)
                read_line = _pipe_lines(reader)
            else:
                read_line = _file_lines(wire_in)
            writer: _LineWriter | _FdWriter
            if _is_fifo(wire_out):
                out_transport, out_protocol = await loop.connect_write_pipe(
                    asyncio.streams.FlowControlMixin, os.fdopen(wire_out, "wb", buffering=0, closefd=False)
                )
                cleanup.callback(out_transport.close)
                writer = _LineWriter(out_transport, out_protocol, unanswered)
            else:
                if _is_pipe(wire_out):  # a socket: never written blocking on the loop (`_claimed` restores it)
                    os.set_blocking(wire_out, False)
                    unanswered.hung_up = functools.partial(_hung_up, wire_out)
                writer = _FdWriter(wire_out, unanswered)
            cleanup.push_async_callback(writer.flush, 5)
            yield _LineReader(read_line, unanswered), writer

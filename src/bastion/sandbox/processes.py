"""Host side of a sandbox's pipes: output capture, and the records of background processes.

A foreground command's output is read to EOF into a capped buffer (`PipeCapture`); each read is charged to the
sandbox's byte rate (more past the cap), so a command printing without end waits on its full pipe rather than
costing the server's CPU (which is not the sandbox's cgroup) to read what is dropped. A
background process outlives the call that started it: its output is read as it comes
into a ring that keeps the newest bytes (`RingCapture`), so the host never holds more
than the ring; once the process outruns its reader it waits on a full pipe (`RingCapture.pace`),
rather than costing the host a core to read what would be dropped; its stdin is a pipe the host
writes to (`BackgroundProcess.write`). Reading never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import os
import select
import struct
import termios
import time
from collections.abc import Callable, Sequence
from typing import Final

from bastion.safety.errors import Conflict
from bastion.safety.rates import ByteRate

READ_CHUNK_BYTES: Final = 65_536
# After its command returned, a pipe still held by a process it left running is drained one chunk per
# pause: a `yes &` read at full speed cost the server's event loop 60 % of a core until the sandbox
# closed. The writer waits on its full pipe instead (at most 1.3 MB/s gets through). A paced ring
# (`RingCapture.pace`) reads so once the writer has outrun its reader.
DRAIN_PAUSE_S: Final = 0.05
OUTPUT_BYTES_PER_S: Final = 64 * 1024 * 1024
"""A sandbox's commands' output read, all together. Found by attack: `cat /dev/zero` in one `run_command` had the
server read it at full speed for the command's whole timeout, 0.4 to 0.6 cores of the server's (0.8 with four
commands), outside the sandbox's `cpu_cores`, and another sandbox's `run_command("true")` p50 went from 11.6 to 19.9
ms with a writer of one byte at a time. Past the cap a read counts as a whole chunk (at most 1,024 a second a
sandbox); within it, as `READ_COST_BYTES` at least (review: commands writing a byte a read up to their caps cost
0.46 cores, the cap being up to 16 MiB)."""
OUTPUT_BURST_BYTES: Final = 16 * 1024 * 1024
READ_COST_BYTES: Final = 16 * 1024
"""At the default rate, at most 4,096 reads a second a sandbox: a paced reader finds more in the pipe at each read."""


OutputSink = Callable[[bytes], None]
"""Sees each chunk a pipe gives as it is read (a progress reporter), before any cap."""


def readable(fd: int) -> bool:
    """Whether `fd` has input waiting, now. poll, not select: a busy server's fds pass FD_SETSIZE (1024)."""
    ready = select.poll()
    ready.register(fd, select.POLLIN)
    return bool(ready.poll(0))


class PipeCapture:
    """Reads one pipe to EOF, keeping at most `cap` bytes and counting the rest. Each read spends `rate` (the
    sandbox's), `READ_COST_BYTES` at least, a whole `READ_CHUNK_BYTES` past the cap, and waits while it is in
    debt."""

    def __init__(self, fd: int, cap: int, on_chunk: OutputSink | None = None, rate: ByteRate | None = None) -> None:
        # Held, so close() works from outside the loop too (e.g. at server shutdown).
        self._loop = asyncio.get_running_loop()
        self.fd = fd
        self.cap = cap
        self._on_chunk = on_chunk
        self._rate = rate
        self.data = bytearray()
        self.total = 0
        self.closed = False
        self._dropping = False
        self._drain_timer: asyncio.TimerHandle | None = None
        self.done: asyncio.Future[None] = self._loop.create_future()
        os.set_blocking(fd, False)
        self._loop.add_reader(fd, self._on_readable)

    def _on_readable(self) -> None:
        try:
            chunk = os.read(self.fd, READ_CHUNK_BYTES)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
            return
        self.total += len(chunk)
        self._keep(chunk)
        if self._on_chunk is not None:
            self._on_chunk(chunk)
        if self._pausing():
            self._pause(DRAIN_PAUSE_S)
        elif self._rate is not None:
            wait = self._rate.owed_s(self._cost(chunk))
            if wait > 0:
                self._pause(wait)

    def _cost(self, chunk: bytes) -> int:
        """What a read spends of the rate: a whole chunk past the cap (what is read there is thrown away)."""
        return READ_CHUNK_BYTES if self.total > self.cap else max(len(chunk), READ_COST_BYTES)

    def _pause(self, seconds: float) -> None:
        self._loop.remove_reader(self.fd)
        self._drain_timer = self._loop.call_later(seconds, self._read_again)

    def _pausing(self) -> bool:
        """Whether to wait DRAIN_PAUSE_S before the next read."""
        return self._dropping

    def _read_again(self) -> None:
        self._drain_timer = None
        if not self.closed:
            self._loop.add_reader(self.fd, self._on_readable)

    def _keep(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]

    def drop_rest(self) -> None:
        """Keep reading until the pipe closes, but keep nothing more (nor what was kept): the
        writer, left running, must not block on a full pipe nor die of a closed one. Its sandbox
        bounds how many such pipes it keeps reading (`WarmSandbox._hold`), and closes the oldest past that."""
        if not self.closed:
            self.cap = 0
            self.data = bytearray()
            self._on_chunk = None  # its command is over: a process left running must not feed its progress
            self._dropping = True

    def close(self) -> None:
        """Stop reading and close the pipe (idempotent; `done` may have been cancelled by a waiter)."""
        if self.closed:
            return
        self.closed = True
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        self._loop.remove_reader(self.fd)
        os.close(self.fd)
        if not self.done.done():
            self.done.set_result(None)


class RingCapture(PipeCapture):
    """Reads one pipe as long as it is open, keeping its newest `cap` bytes.

    Offsets count every byte the pipe ever gave: `start` is the offset of the oldest
    byte still kept, `total` the offset just past the newest.
    """

    def __init__(self, fd: int, cap: int, rate: ByteRate | None = None) -> None:
        self._ring = bytearray()
        self._paced = False
        self._read_to = 0  # the end of what `read` has given
        super().__init__(fd, cap, rate=rate)

    def _cost(self, chunk: bytes) -> int:
        # A ring past its cap is a process that has printed a lot, not output thrown away: each read costs its
        # bytes, `READ_COST_BYTES` at least (found by attack: 16 background processes writing a byte at a time
        # were read free, half a core of the server's CPU, the ring never full so never paced).
        return max(len(chunk), READ_COST_BYTES)

    def pace(self) -> None:
        """Read one chunk per DRAIN_PAUSE_S while the ring has dropped bytes nobody read: a `yes` read
        at full speed cost the server 63 % of a core only to be thrown away. The writer waits on its
        full pipe instead; the ring still holds the newest of what was read."""
        self._paced = True

    def _pausing(self) -> bool:
        return super()._pausing() or (self._paced and self.start > self._read_to)

    @property
    def start(self) -> int:
        return self.total - len(self._ring)

    def _keep(self, chunk: bytes) -> None:
        self._ring += chunk
        self._trim()

    def _trim(self) -> None:
        excess = len(self._ring) - self.cap
        if excess > 0:
            del self._ring[:excess]  # O(1) at the front of a bytearray

    def limit(self, cap: int) -> None:
        """Keep at most the newest `cap` bytes from now on (the server's share for it: `OutputShares`)."""
        self.cap = cap
        self._trim()

    def read(self, offset: int, limit: int) -> tuple[int, bytes]:
        """At most `limit` bytes from `offset` (or from `start`, if that is later); and where they begin."""
        begin = max(offset, self.start)
        index = begin - self.start
        data = bytes(self._ring[index : index + limit])
        self._read_to = max(self._read_to, begin + len(data))
        return begin, data


class BackgroundProcess:
    """A command running in the background of a sandbox, as the host sees it."""

    def __init__(
        self, command_id: int, argv: Sequence[str], stdin_fd: int, stdout: RingCapture, stderr: RingCapture
    ) -> None:
        self.command_id = command_id  # the agent's name for it (it is PID 1 of its own namespace)
        self.argv = tuple(argv)
        self.started = time.monotonic()
        self.stdout = stdout
        self.stderr = stderr
        self.status: int | None = None  # exit code or 128 + signal; None if the sandbox ended first
        self._stdin_fd: int | None = stdin_fd
        self._exited = asyncio.Event()
        self._write_lock = asyncio.Lock()
        self._writable: asyncio.Future[None] | None = None
        os.set_blocking(stdin_fd, False)

    @property
    def exited(self) -> bool:
        return self._exited.is_set()

    @property
    def stdin_open(self) -> bool:
        return self._stdin_fd is not None

    def finish(self, status: int | None) -> None:
        """Record the end of the process (first call wins); its input closes with it."""
        if self.exited:
            return
        self.status = status
        self._exited.set()
        self.close_stdin()

    async def wait_exit(self) -> None:
        await self._exited.wait()

    async def wait_output(self, timeout_s: float) -> None:
        """Wait, at most `timeout_s`, for both output pipes to reach EOF (never cancels them)."""
        pending = [c.done for c in (self.stdout, self.stderr) if not c.done.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)

    async def write(self, data: bytes, *, timeout_s: float) -> int:
        """Write `data` to the process's stdin; return how many bytes went in before `timeout_s`.

        Raises:
            Conflict: its input is closed, or the process closed its end.
        """
        async with self._write_lock:
            written = 0
            try:
                async with asyncio.timeout(timeout_s):
                    while written < len(data):
                        written += await self._write_some(memoryview(data)[written:])
            except TimeoutError:
                pass
            return written

    async def _write_some(self, data: memoryview) -> int:
        fd = self._stdin_fd
        if fd is None:
            raise Conflict("the process's input is closed (it exited, or eof was sent)")
        try:
            return os.write(fd, data)
        except BlockingIOError:
            pass
        except BrokenPipeError:
            raise Conflict("the process closed its input") from None
        loop = asyncio.get_running_loop()
        self._writable = loop.create_future()
        loop.add_writer(fd, self._on_writable)
        try:
            await self._writable
        finally:
            if self._stdin_fd == fd and self._writable is not None:
                loop.remove_writer(fd)
            self._writable = None
        return 0

    def _on_writable(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def close_stdin(self) -> None:
        """Close the host's end of stdin: the process reads EOF."""
        fd, self._stdin_fd = self._stdin_fd, None
        if fd is None:
            return
        if self._writable is not None:
            self._writable.get_loop().remove_writer(fd)
            self._on_writable()
            self._writable = None
        os.close(fd)

    def close(self) -> None:
        """Release every host-side fd (the sandbox is ending); what was captured stays readable."""
        self.finish(None)
        self.stdout.close()
        self.stderr.close()


class OutputLog:
    """Cleaned output of both streams in the order it was cleaned, keeping the newest `cap` characters.

    Offsets count characters from the first one ever logged, across both streams, so one
    offset says where a reader stopped in both.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.start = 0
        self.end = 0
        self._chunks: collections.deque[tuple[int, int, str]] = collections.deque()  # (offset, stream, text)

    def append(self, stream: int, text: str) -> None:
        if not text:
            return
        self._chunks.append((self.end, stream, text))
        self.end += len(text)
        self._trim()

    def limit(self, cap: int) -> None:
        """Keep at most the newest `cap` characters from now on."""
        self.cap = cap
        self._trim()

    def _trim(self) -> None:
        while self.end - self.start > self.cap:
            offset, kind, chunk = self._chunks[0]
            excess = self.end - self.cap - offset
            if excess >= len(chunk):
                self._chunks.popleft()
                self.start = offset + len(chunk)
            else:
                self._chunks[0] = (offset + excess, kind, chunk[excess:])
                self.start = offset + excess

    def read(self, since: int, limit: int) -> tuple[int, tuple[str, str], int]:
        """At most `limit` characters from `since` (or the oldest kept): (first offset, (stdout, stderr), next)."""
        position = first = max(since, self.start)
        parts: tuple[list[str], list[str]] = ([], [])
        room = limit
        for offset, kind, chunk in self._chunks:
            if room <= 0:
                break
            if offset + len(chunk) <= position:
                continue
            piece = chunk[position - offset : position - offset + room]
            parts[kind].append(piece)
            position += len(piece)
            room -= len(piece)
        return first, ("".join(parts[0]), "".join(parts[1])), position


class PtyProcess:
    """A command on a pseudo-terminal of a sandbox, as the host sees it: its id, its exit, and
    the master end of its terminal (`fd`, non-blocking, close-on-exec), whose reader owns and closes it.

    The slave end, the command's controlling tty, never leaves the sandbox.
    """

    def __init__(self, command_id: int, argv: Sequence[str], fd: int) -> None:
        self.command_id = command_id
        self.argv = tuple(argv)
        self.fd = fd
        self.started = time.monotonic()
        self.status: int | None = None  # exit code or 128 + signal; None if the sandbox ended first
        self._exited = asyncio.Event()

    @property
    def exited(self) -> bool:
        return self._exited.is_set()

    def finish(self, status: int | None) -> None:
        """Record the end of the process (first call wins)."""
        if not self.exited:
            self.status = status
            self._exited.set()

    async def wait_exit(self) -> None:
        await self._exited.wait()

    def resize(self, rows: int, cols: int) -> None:
        """Give the terminal a new size (the kernel sends SIGWINCH to its foreground).

        Raises:
            OSError: the terminal is closed.
        """
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

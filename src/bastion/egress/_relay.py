"""Carrying an allowed connection's bytes, and closing its sockets. PART OF A SECURITY BOUNDARY.

`bastion.egress.proxy` decides and connects; `carry` then moves bytes between exactly the
two sockets it is given, the sandbox's client and the upstream address that was checked. It
guarantees:

- Bytes go only between those two sockets, uninspected (a CONNECT tunnel's TLS is end to
  end); each direction is copied until EOF, then the EOF is passed on (half-close), and its
  bytes are counted into the attempt's audit record as they move.
- The connection ends when a direction fails, when no byte has moved for the idle timeout,
  and, for plain HTTP, as soon as the server's side ends: the client's next request must come
  on a new connection, to be checked. Cancelling `carry` ends both directions.
- Every byte moved, and every pass, is spent from the sandbox's `Budget` (shared by its connections, both
  ways): a direction in debt waits before it reads again, so the relay's CPU (the server's) stays bounded
  per sandbox. A wait is not idleness: the idle timeout counts from its end.
- splice(2) through a pipe when the kernel allows it (the bytes never enter this process);
  otherwise reads and writes of `CHUNK_BYTES`. A pipe grows to `PIPE_BYTES` only after
  `GROW_AFTER_BYTES`, and stays small if the user's pipe budget refuses.
- A refusal reaches the client: `answer_and_linger` sends it, half-closes, then drops what
  the client still sends, for at most `LINGER_S` and `LINGER_BYTES`, before the close.
- `close_socket` unregisters a socket from the loop before closing it, so a cancelled operation
  cannot unregister another socket that reuses the number.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import socket
from dataclasses import dataclass
from typing import Final, Protocol

from bastion.safety.rates import ByteRate

CHUNK_BYTES: Final = 1024 * 1024
# A direction's pipe starts at the kernel's default (64 KiB) and grows to PIPE_BYTES once it has
# carried GROW_AFTER_BYTES: a bulk transfer then moves up to 1 MiB per splice (a 50 MiB download:
# ~190 splices instead of ~430 with 256 KiB, and a third less proxy CPU), while short and idle
# directions do not spend the user's pipe budget (fs.pipe-user-pages-soft).
PIPE_BYTES: Final = 1024 * 1024
GROW_AFTER_BYTES: Final = 1024 * 1024
SOCKET_BUFFER_BYTES: Final = 4 * 1024 * 1024
PASSES_PER_S: Final = 1024
PASS_BURST: Final = 256
"""A sandbox's relay passes (a wake-up of a direction, its reads and writes: costly whatever they move) a second, and
at once: found by review, 32 tunnels fed a byte at a time (0.3 MB/s, under 1% of the byte rate) cost the relay 0.75
cores. Counted apart from the bytes, so a byte rate set low neither slows honest passes nor, with a large byte
burst, lets the burst hold a million of them."""
USE_SPLICE = hasattr(os, "splice")  # Linux, Python >= 3.10; tests turn it off to cover the fallback
LINGER_S: Final = 2.0
LINGER_BYTES: Final = 1024 * 1024


class _Tally(Protocol):
    """What the relay writes in an attempt's audit record (`bastion.egress.proxy._Attempt`)."""

    reason: str
    bytes_up: int
    bytes_down: int


async def carry(
    client: socket.socket,
    upstream: socket.socket,
    forward: bytes,
    attempt: _Tally,
    *,
    budget: Budget,
    idle_timeout_s: float,
    one_response: bool,
) -> None:
    """Send `forward` upstream, then copy both ways until the connection ends (see above).

    Args:
        forward: bytes already read from the client, for the server first.
        budget: the sandbox's bytes and passes a second, spent by every pass either way.
        one_response: plain HTTP: end when the server's side ends.
    """
    loop = asyncio.get_running_loop()
    last = [loop.time()]
    try:
        if forward:
            await loop.sock_sendall(upstream, forward)
            attempt.bytes_up += len(forward)
        up = loop.create_task(_copy(_Direction(loop, client, upstream, attempt, "bytes_up", last, budget)))
        down = loop.create_task(_copy(_Direction(loop, upstream, client, attempt, "bytes_down", last, budget)))
    except OSError as exc:
        attempt.reason = f"ended: {exc.strerror or exc}"
        return
    pending = {up, down}
    try:
        while pending:
            wait = last[0] + idle_timeout_s - loop.time()
            done, pending = await asyncio.wait(pending, timeout=max(wait, 0), return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                failure = task.exception()
                if failure is not None:
                    attempt.reason = f"ended: {getattr(failure, 'strerror', None) or failure}"
                    return
            # Plain HTTP: the response is complete when the server closes; the client's
            # next request must come on a new connection, to be checked.
            if one_response and down in done:
                return
            if not done and loop.time() - last[0] >= idle_timeout_s:
                attempt.reason = f"ended: idle for {idle_timeout_s:g} s"
                return
    finally:
        for task in (up, down):
            task.cancel()
        await asyncio.wait([up, down])


@dataclass(frozen=True)
class _Direction:
    """One direction of a connection: where its bytes come from and go, and where they are counted."""

    loop: asyncio.AbstractEventLoop
    src: socket.socket
    dst: socket.socket
    attempt: _Tally
    counter: str  # the attempt's field: "bytes_up" or "bytes_down"
    last: list[float]  # when a byte last moved either way (the idle timeout's clock), shared by both
    budget: Budget

    async def moved(self, count: int) -> None:
        """Count `count` bytes moved, then wait while the sandbox's budget is in debt; the wait counts as moving
        (the idle timeout starts after it)."""
        setattr(self.attempt, self.counter, getattr(self.attempt, self.counter) + count)
        wait = self.budget.owed_s(count)
        self.last[0] = self.loop.time() + wait
        if wait > 0:
            await asyncio.sleep(wait)


@dataclass(frozen=True)
class Budget:
    """What a sandbox's egress may spend: bytes a second, and reads a second (passes of the relay, or reads of
    request heads), each read costing the server's CPU whatever it moves."""

    bytes: ByteRate
    reads: ByteRate

    def owed_s(self, count: int) -> float:
        """Spend one read of `count` bytes; the seconds to wait before the next."""
        return max(self.bytes.owed_s(count), self.reads.owed_s(1))


async def _copy(way: _Direction) -> None:
    """Copy until EOF, then pass the EOF on (half-close).

    splice(2) through a pipe when the kernel allows it: the bytes never enter this
    process, which halves the proxy's CPU per byte; otherwise large reads and writes.
    """
    if not (USE_SPLICE and await _splice(way)):
        await _read_write(way)
    with contextlib.suppress(OSError):
        way.dst.shutdown(socket.SHUT_WR)


async def _read_write(way: _Direction) -> None:
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    while True:
        count = await way.loop.sock_recv_into(way.src, buf)
        if not count:
            return
        await way.loop.sock_sendall(way.dst, view[:count])
        await way.moved(count)


async def _splice(way: _Direction) -> bool:
    """Copy with splice(2); False if the kernel refuses it before any byte moved."""
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
    moved = 0
    woken = False
    try:
        while True:
            try:
                count = os.splice(way.src.fileno(), write_end, CHUNK_BYTES, flags=flags)
            except BlockingIOError:
                if woken and await _past_urgent_mark(way):
                    return True
                await ready(way.loop, way.src, write=False)
                woken = True
                continue
            except OSError as exc:
                if not moved and exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    return False
                raise
            woken = False
            if not count:
                # Also what splice answers at an urgent mark once the peer's FIN is in: only a recv tells.
                if await _past_urgent_mark(way):
                    return True
                await ready(way.loop, way.src, write=False)
                continue
            if moved < GROW_AFTER_BYTES <= moved + count:
                with contextlib.suppress(OSError):  # refused past the user's pipe budget: the pipe stays small
                    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            moved += count
            left = count
            while left:
                try:
                    left -= os.splice(read_end, way.dst.fileno(), left, flags=flags)
                except BlockingIOError:
                    await ready(way.loop, way.dst, write=True)
            await way.moved(count)
    finally:
        os.close(read_end)
        os.close(write_end)


async def _past_urgent_mark(way: _Direction) -> bool:
    """Splice stopped, though the socket is readable: TCP urgent data (MSG_OOB) stops splice at its mark for
    good, answering EAGAIN while the poll says readable for ever (a peer could spin the proxy's loop), or
    0 as if the stream ended once the peer's FIN is in (the bytes after the mark were lost). A recv reads
    past the mark (the urgent byte is dropped, as the read-and-write copy drops it); True if it read the
    stream's end."""
    try:
        data = way.src.recv(CHUNK_BYTES)
    except (BlockingIOError, InterruptedError):
        return False  # a wake-up with nothing to read after all
    if not data:
        return True
    await way.loop.sock_sendall(way.dst, data)
    await way.moved(len(data))
    return False


async def ready(loop: asyncio.AbstractEventLoop, sock: socket.socket, *, write: bool) -> None:
    """Wait until `sock` is readable (or writable)."""
    waiter: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    if write:
        loop.add_writer(sock, wake)
    else:
        loop.add_reader(sock, wake)
    try:
        await waiter
    finally:
        if sock.fileno() != -1:
            (loop.remove_writer if write else loop.remove_reader)(sock)


async def answer_and_linger(client: socket.socket, message: bytes) -> None:
    """Send a refusal, then read and drop what the client still sends, for a moment.

    Closing with unread data makes the kernel reset the connection, which can destroy
    the refusal before the client reads it (RFC 9112 §9.6, "tear-down").
    """
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(LINGER_S):
            await loop.sock_sendall(client, message)
            client.shutdown(socket.SHUT_WR)
            dropped = 0
            while dropped < LINGER_BYTES:
                count = len(await loop.sock_recv(client, 65536))
                if not count:
                    break
                dropped += count


def grow_buffers(sock: socket.socket) -> None:
    # Fewer, larger copies: the kernel caps the request at net.core.[rw]mem_max.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def close_socket(sock: socket.socket) -> None:
    """Close a socket an `await loop.sock_*` may still be registered for.

    Removing the reader and writer first cancels their handles, so the cancelled
    operation's late clean-up cannot unregister another socket that reuses the number.
    """
    if sock.fileno() != -1:
        loop = asyncio.get_running_loop()
        loop.remove_reader(sock)
        loop.remove_writer(sock)
    sock.close()

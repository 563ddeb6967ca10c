"""The host's end of a microVM's stream port: egress out of the guest, previews and terminals in. SECURITY BOUNDARY.

A microVM has no network device. Its forwarder (inside/forwarder.py, on 127.0.0.1:3128 as in a
namespace sandbox) connects to a unix socket of the guest, which inside/egress_port.py carries
as numbered streams over a second virtio-serial port (a unix socket of the VMM on the host).
Here each stream becomes one connection to the sandbox's egress proxy socket, the same one a
namespace sandbox reaches at /run/bastion: the same allowlist, the same audit of every attempt,
the same blocked ranges, decided by `bastion.egress.proxy`. The guest names no destination here.

The host opens streams the other way (ids with the top bit set, `open_tcp` and `reserve` +
`attach`): a preview's connection to the guest's 127.0.0.1:PORT, a terminal's pty master. The
caller gets one end of a socket pair; the other is carried with the same flow control.

The guest is hostile: a frame larger than it may send ends the port; a stream that sends past
its window, credits what it was never sent, sends a kind it may not, opens past the cap, opens
an id of the host's, sends before the host's stream is accepted or reuses a live id is ended (X);
frames for ids it does not have open are ignored. A host stream the guest does not accept in
time is ended too (the caller gets TimeoutError), and never holds its caller.
Frames and flow control are described in inside/egress_port.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import socket
import struct
import time
from collections.abc import Callable
from typing import Final

__all__ = ["FRAME_COST_BYTES", "HOST_IDS", "MAX_HOST_STREAMS", "Budget", "EgressPort", "cut_by_close"]

logger = logging.getLogger(__name__)

_HEADER: Final = struct.Struct(">IcI")
WINDOW: Final = 131072  # as inside/egress_port.py's
CHUNK: Final = 65536
MAX_STREAMS: Final = 128
MAX_HOST_STREAMS: Final = 128  # previews' connections and terminals open at once
HOST_IDS: Final = 0x80000000  # the top bit of a stream id: the host opened it
_MAX_FRAME: Final = 5 + CHUNK
_READ_BYTES: Final = 65536
SEND_TIMEOUT_S: Final = 60.0
"""A frame the guest has not taken by then ends the port (the agent port's rule, `microvm._SEND_TIMEOUT_S`)."""
# Every frame a guest sends, on either of its ports, draws on one budget per guest (`Budget.per_guest`): a guest
# flooding frames of any kind, valid or for ids that do not exist, holds at most ~1% of the event loop.
FRAME_COST_BYTES: Final = 128  # a frame's own cost in its reader (~4 us), counted as that many bytes
GUEST_RATE_BYTES_S: Final = 256 << 10
GUEST_BURST_BYTES: Final = 1 << 20  # thousands of commands' exits, or 8,192 frames at once


class Budget:
    """A token bucket: `rate` a second, at most `burst` saved up; a spend past it is owed, and waited for."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = time.monotonic()

    @classmethod
    def per_guest(cls) -> Budget:
        """What one guest's frames may cost the event loop: 2,048 frames a second (128 MiB/s of full ones)."""
        return cls(GUEST_RATE_BYTES_S, GUEST_BURST_BYTES)

    def spend(self, amount: int) -> float:
        """Take `amount`; return how long to wait before the work it pays for (0: at once)."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate) - amount
        self.stamp = now
        return max(0.0, -self.tokens / self.rate)


class _Stream:
    def __init__(self, opening: asyncio.Future[bool] | None = None) -> None:
        self.opening = opening  # a host stream: True once the guest accepts it, False if it is ended first
        self.upstream: socket.socket | None = None
        self.handout: socket.socket | None = None  # a host stream's caller's end, until `attach` gives it
        self.pending = bytearray()  # from the guest, not yet taken by the proxy
        self.guest_eof = False
        self.credit = WINDOW  # bytes the guest will still take
        self.allowance = WINDOW  # bytes the guest may still send: the window less what is not credited back
        self.wake = asyncio.Event()  # more pending, or the guest's EOF
        self.credited = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []


def _current_task() -> asyncio.Task[object] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # closed from outside any loop (a sync close at the end)
        return None


def cut_by_close(write: asyncio.Task[None]) -> bool:
    """Whether a CancelledError met while awaiting a shielded `write` comes from the write itself, cancelled
    by a close of the channel, rather than from the awaiting task's own cancellation (which must go on)."""
    task = asyncio.current_task()
    return write.cancelled() and (task is None or task.cancelling() == 0)


def _forget_write(writes: set[asyncio.Task[None]]) -> Callable[[asyncio.Task[None]], None]:
    def forget(write: asyncio.Task[None]) -> None:
        writes.discard(write)
        if not write.cancelled():
            write.exception()  # retrieved: its sender, if still waiting, has it too

    return forget


class EgressPort:
    """Carries one guest's egress streams to `proxy_path` (None: the sandbox has no egress; every
    stream is refused), over `sock`, the VMM's egress chardev, until it ends or `close`. Each frame the
    guest sends draws on `budget` (the guest's, shared with its agent port; a new one if None)."""

    def __init__(self, sock: socket.socket, proxy_path: str | None, name: str, budget: Budget | None = None) -> None:
        self._sock = sock
        self._budget = budget if budget is not None else Budget.per_guest()
        self._proxy = proxy_path
        self._name = name
        self._streams: dict[int, _Stream] = {}
        self._sending = asyncio.Lock()
        self._writes: set[asyncio.Task[None]] = set()  # frames being written, each to its end
        self._later: set[asyncio.Task[None]] = set()  # frames sent for sync callers (resize, a give-up's X)
        self._task: asyncio.Task[None] | None = None
        self._host_ids = itertools.count(1)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        inbox = bytearray()
        try:
            while data := await loop.sock_recv(self._sock, _READ_BYTES):
                inbox += data
                while len(inbox) >= 4:
                    size = int.from_bytes(inbox[:4], "big")
                    if not 5 <= size <= _MAX_FRAME:
                        logger.warning("microVM %s sent an egress frame of %d bytes: egress ended", self._name, size)
                        with contextlib.suppress(OSError):
                            self._sock.shutdown(socket.SHUT_RDWR)
                        return
                    if len(inbox) < 4 + size:
                        break
                    _, kind, stream_id = _HEADER.unpack_from(inbox)
                    payload = bytes(inbox[_HEADER.size : 4 + size])
                    del inbox[: 4 + size]
                    # Found by attack: with no budget here, a guest's root writing 9-byte frames for an id it never
                    # opened held the loop 50 to 80% busy, and another sandbox's `true` went from 2.4 to 67 ms.
                    if (wait_s := self._budget.spend(FRAME_COST_BYTES)) > 0:
                        await asyncio.sleep(wait_s)  # the port is not read meanwhile: the guest waits
                    await self._on_frame(kind, stream_id, payload)
                # sock_recv returns at once while data waits: a guest that always has more would hold the loop.
                await asyncio.sleep(0)
        except OSError:
            return
        finally:
            self._end_streams()

    async def _on_frame(self, kind: bytes, stream_id: int, payload: bytes) -> None:
        if kind == b"C":
            await self._open(stream_id)
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        if stream.opening is not None and not stream.opening.done():
            await self._on_opening(kind, stream_id, stream)
            return
        if kind == b"D" and len(payload) <= stream.allowance and not stream.guest_eof:
            stream.allowance -= len(payload)
            stream.pending += payload
        elif kind == b"K" and len(payload) == 4 and stream.credit + int.from_bytes(payload, "big") <= WINDOW:
            stream.credit += int.from_bytes(payload, "big")
            stream.credited.set()
            return
        elif kind == b"F":
            stream.guest_eof = True
        elif kind == b"X":
            self._drop(stream_id)
            return
        else:  # past its window, a credit never owed, a malformed frame: the guest broke the protocol
            await self._refuse(stream_id)
            return
        stream.wake.set()

    async def _on_opening(self, kind: bytes, stream_id: int, stream: _Stream) -> None:
        """A host stream the guest has not accepted yet: A accepts it, X refuses it, anything else breaks it."""
        assert stream.opening is not None
        if kind == b"A":
            stream.opening.set_result(True)
        elif kind == b"X":
            self._drop(stream_id)
        else:
            await self._refuse(stream_id)

    async def _open(self, stream_id: int) -> None:
        guest_streams = sum(1 for key in self._streams if not key & HOST_IDS)
        if self._proxy is None or stream_id & HOST_IDS or stream_id in self._streams or guest_streams >= MAX_STREAMS:
            await self._refuse(stream_id)
            return
        stream = self._streams[stream_id] = _Stream()
        loop = asyncio.get_running_loop()
        stream.tasks.append(loop.create_task(self._carry(stream_id, stream, self._proxy)))

    async def _refuse(self, stream_id: int) -> None:
        self._drop(stream_id)
        with contextlib.suppress(OSError):
            await self._send(b"X", stream_id)

    async def _carry(self, stream_id: int, stream: _Stream, proxy: str | None) -> None:
        """Carry a stream both ways: to a new connection to `proxy`, or (None) to its host socket."""
        loop = asyncio.get_running_loop()
        try:
            if stream.upstream is None:  # at the server's fd limit (EMFILE): refused below, as a proxy's refusal
                stream.upstream = socket.socket(
                    socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
                )
            upstream = stream.upstream
            if proxy is not None:
                await loop.sock_connect(upstream, proxy)
            both = (
                loop.create_task(self._upward(stream_id, stream, upstream)),
                loop.create_task(self._downward(stream_id, stream, upstream)),
            )
            stream.tasks.extend(both)
            # Either way's error ends the stream at once: the other may wait on a peer that sends nothing more.
            await asyncio.wait(both, return_when=asyncio.FIRST_EXCEPTION)
            for way in both:
                if way.done():
                    way.result()  # raises its error; with none, both are done
        except OSError:
            if self._streams.get(stream_id) is stream:
                await self._refuse(stream_id)
            return
        if self._streams.get(stream_id) is stream:
            self._drop(stream_id)

    async def _upward(self, stream_id: int, stream: _Stream, upstream: socket.socket) -> None:
        """Guest -> proxy: give the proxy what the guest sent, crediting the guest as it goes."""
        loop = asyncio.get_running_loop()
        while True:
            await stream.wake.wait()
            stream.wake.clear()
            taken = 0
            while stream.pending:
                chunk = bytes(stream.pending[:CHUNK])
                await loop.sock_sendall(upstream, chunk)
                del stream.pending[: len(chunk)]
                taken += len(chunk)
            if taken:
                stream.allowance += taken
                await self._send(b"K", stream_id, taken.to_bytes(4, "big"))
            if stream.guest_eof and not stream.pending:
                upstream.shutdown(socket.SHUT_WR)
                return

    async def _downward(self, stream_id: int, stream: _Stream, upstream: socket.socket) -> None:
        """Proxy -> guest: at most the credit the guest has given, then its EOF."""
        loop = asyncio.get_running_loop()
        while True:
            while stream.credit <= 0:
                stream.credited.clear()
                await stream.credited.wait()
            data = await loop.sock_recv(upstream, min(CHUNK, stream.credit))
            if not data:
                await self._send(b"F", stream_id)
                return
            stream.credit -= len(data)
            await self._send(b"D", stream_id, data)

    async def _send(self, kind: bytes, stream_id: int, payload: bytes = b"") -> None:
        """Send one frame whole: a sender cancelled meanwhile (its stream dropped) leaves the write to
        finish, holding the lock, for a frame cut short would garble every frame after it."""
        frame = _HEADER.pack(len(payload) + 5, kind, stream_id) + payload
        await self._sending.acquire()
        write = asyncio.get_running_loop().create_task(self._write(frame))
        self._writes.add(write)
        write.add_done_callback(_forget_write(self._writes))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            if cut_by_close(write):  # the port closed: an OSError, as for a broken socket, to every caller
                raise ConnectionResetError(errno.ECONNRESET, "the microVM's stream port was closed") from None
            raise

    async def _write(self, frame: bytes) -> None:
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await asyncio.get_running_loop().sock_sendall(self._sock, frame)
        except TimeoutError:
            # The guest took nothing for that long: the port is stuck. Its reader may be the one waiting here (a
            # refusal of the guest's frame), and would never see the guest's end: shut the port down instead.
            logger.warning(
                "microVM %s took no egress frame in %g s: its stream port is ended", self._name, SEND_TIMEOUT_S
            )
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            raise ConnectionResetError(errno.ECONNRESET, "the microVM's stream port is stuck") from None
        finally:
            self._sending.release()

    def reserve(self) -> int:
        """A new host stream, waiting for the guest to accept it: its id, to name in the request. Its socket
        pair is made here, before the guest is asked for anything: at the server's fd limit nothing is opened.

        Raises:
            ConnectionResetError: the port has ended, or MAX_HOST_STREAMS are open.
            OSError: the socket pair could not be made (EMFILE, ENFILE); no stream was reserved.
        """
        if self._task is None or self._task.done():
            raise ConnectionResetError("the sandbox's stream port has ended")
        if sum(1 for key in self._streams if key & HOST_IDS) >= MAX_HOST_STREAMS:
            raise ConnectionResetError(f"{MAX_HOST_STREAMS} connections into the sandbox are open already")
        stream = _Stream(asyncio.get_running_loop().create_future())
        stream.upstream, stream.handout = socket.socketpair(
            socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
        )
        stream_id = HOST_IDS | next(self._host_ids) % HOST_IDS
        self._streams[stream_id] = stream
        return stream_id

    async def attach(self, stream_id: int, timeout_s: float) -> socket.socket:
        """Wait for the guest to accept a reserved stream; return the caller's end of a socket pair
        carried to it (non-blocking, close-on-exec). The stream is ended on any failure.

        Raises:
            ConnectionRefusedError: the guest refused it (or the port ended).
            TimeoutError: no answer within `timeout_s`.
        """
        stream = self._streams.get(stream_id)
        if stream is None or stream.opening is None:
            raise ConnectionRefusedError("the stream was ended")
        try:
            async with asyncio.timeout(timeout_s):
                accepted = await asyncio.shield(stream.opening)
        except BaseException:
            self.end_soon(stream_id)
            raise
        if not accepted or self._streams.get(stream_id) is not stream or stream.handout is None:
            raise ConnectionRefusedError("the sandbox refused the connection")
        theirs, stream.handout = stream.handout, None
        stream.tasks.append(asyncio.get_running_loop().create_task(self._carry(stream_id, stream, None)))
        return theirs

    async def open_tcp(self, port: int, timeout_s: float) -> socket.socket:
        """A socket carried to a new connection to 127.0.0.1:`port` in the guest (see `reserve`, `attach`)."""
        stream_id = self.reserve()
        try:
            async with asyncio.timeout(timeout_s):
                await self._send(b"T", stream_id, port.to_bytes(2, "big"))
        except BaseException:
            self.end_soon(stream_id)
            raise
        return await self.attach(stream_id, timeout_s)

    def resize(self, stream_id: int, rows: int, cols: int) -> None:
        """Tell a terminal's stream its new size (the guest sets it on its pty master)."""
        if stream_id in self._streams:
            self._send_soon(b"W", stream_id, rows.to_bytes(2, "big") + cols.to_bytes(2, "big"))

    def end_soon(self, stream_id: int) -> None:
        """End a stream now and tell the guest when the port is free (a sync caller, or one giving up)."""
        if self._streams.get(stream_id) is not None:
            self._drop(stream_id)
            self._send_soon(b"X", stream_id)

    def _send_soon(self, kind: bytes, stream_id: int, payload: bytes = b"") -> None:
        """Send without waiting; dropped when the port has ended, or when MAX_HOST_STREAMS such frames
        wait already (a guest that stops reading its port must not make the host queue without bound)."""
        if self._task is None or self._task.done() or len(self._later) >= MAX_HOST_STREAMS:
            return
        task = asyncio.get_running_loop().create_task(self._send_quietly(kind, stream_id, payload))
        self._later.add(task)
        task.add_done_callback(self._later.discard)

    async def _send_quietly(self, kind: bytes, stream_id: int, payload: bytes) -> None:
        with contextlib.suppress(OSError):
            await self._send(kind, stream_id, payload)

    def _drop(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return
        if stream.opening is not None and not stream.opening.done():
            stream.opening.set_result(False)
        for task in stream.tasks:
            if not task.done() and task is not _current_task():
                loop = task.get_loop()
                if stream.upstream is not None and not loop.is_closed():
                    loop.remove_reader(stream.upstream.fileno())
                    loop.remove_writer(stream.upstream.fileno())
                task.cancel()
        for sock in (stream.upstream, stream.handout):
            if sock is not None:
                sock.close()

    def _end_streams(self) -> None:
        for stream_id in list(self._streams):
            self._drop(stream_id)

    @property
    def streams(self) -> int:
        """Streams open now."""
        return len(self._streams)

    def close(self) -> None:
        """End every stream and stop reading (in the loop's thread, if it still runs), so the caller
        can close the socket under no reader."""
        if self._task is not None and not self._task.done():
            loop = self._task.get_loop()
            if not loop.is_closed():
                loop.remove_reader(self._sock.fileno())
                loop.remove_writer(self._sock.fileno())
            self._task.cancel()
        self._end_streams()
        for task in list(self._later):
            task.cancel()
        for write in list(self._writes):  # the port is closing: a frame cut now is read by nobody
            loop = write.get_loop()
            if not loop.is_closed():  # now, before the fd number can be reused, not in the cancel's callback
                loop.remove_writer(self._sock.fileno())
            write.cancel()

"""The host's end of a microVM's egress port: each stream the guest opens, a connection to its proxy. SECURITY BOUNDARY.

A microVM has no network device. Its forwarder (inside/forwarder.py, on 127.0.0.1:3128 as in a
namespace sandbox) connects to a unix socket of the guest, which inside/egress_port.py carries
as numbered streams over a second virtio-serial port (a unix socket of the VMM on the host).
Here each stream becomes one connection to the sandbox's egress proxy socket, the same one a
namespace sandbox reaches at /run/bastion: the same allowlist, the same audit of every attempt,
the same blocked ranges, decided by `bastion.egress.proxy`. The guest names no destination here.

The guest is hostile: a frame larger than it may send ends the port; a stream that sends past
its window, credits what it was never sent, sends a kind it may not, opens past the cap or reuses
a live id is ended (X); frames for ids it does not have open are ignored.
Frames and flow control are described in inside/egress_port.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable
from typing import Final

__all__ = ["EgressPort"]

logger = logging.getLogger(__name__)

_HEADER: Final = struct.Struct(">IcI")
WINDOW: Final = 131072  # as inside/egress_port.py's
CHUNK: Final = 65536
MAX_STREAMS: Final = 128
_MAX_FRAME: Final = 5 + CHUNK
_READ_BYTES: Final = 65536


class _Stream:
    def __init__(self) -> None:
        self.upstream: socket.socket | None = None
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


def _forget_write(writes: set[asyncio.Task[None]]) -> Callable[[asyncio.Task[None]], None]:
    def forget(write: asyncio.Task[None]) -> None:
        writes.discard(write)
        if not write.cancelled():
            write.exception()  # retrieved: its sender, if still waiting, has it too

    return forget


class EgressPort:
    """Carries one guest's egress streams to `proxy_path` (None: the sandbox has no egress; every
    stream is refused), over `sock`, the VMM's egress chardev, until it ends or `close`."""

    def __init__(self, sock: socket.socket, proxy_path: str | None, name: str) -> None:
        self._sock = sock
        self._proxy = proxy_path
        self._name = name
        self._streams: dict[int, _Stream] = {}
        self._sending = asyncio.Lock()
        self._writes: set[asyncio.Task[None]] = set()  # frames being written, each to its end
        self._task: asyncio.Task[None] | None = None

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

    async def _open(self, stream_id: int) -> None:
        if self._proxy is None or stream_id in self._streams or len(self._streams) >= MAX_STREAMS:
            await self._refuse(stream_id)
            return
        stream = self._streams[stream_id] = _Stream()
        loop = asyncio.get_running_loop()
        stream.tasks.append(loop.create_task(self._carry(stream_id, stream, self._proxy)))

    async def _refuse(self, stream_id: int) -> None:
        self._drop(stream_id)
        with contextlib.suppress(OSError):
            await self._send(b"X", stream_id)

    async def _carry(self, stream_id: int, stream: _Stream, proxy: str) -> None:
        loop = asyncio.get_running_loop()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        stream.upstream = upstream
        try:
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
        await asyncio.shield(write)

    async def _write(self, frame: bytes) -> None:
        try:
            await asyncio.get_running_loop().sock_sendall(self._sock, frame)
        finally:
            self._sending.release()

    def _drop(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return
        for task in stream.tasks:
            if not task.done() and task is not _current_task():
                loop = task.get_loop()
                if stream.upstream is not None and not loop.is_closed():
                    loop.remove_reader(stream.upstream.fileno())
                    loop.remove_writer(stream.upstream.fileno())
                task.cancel()
        if stream.upstream is not None:
            stream.upstream.close()

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
        for write in list(self._writes):  # the port is closing: a frame cut now is read by nobody
            loop = write.get_loop()
            if not loop.is_closed():  # now, before the fd number can be reused, not in the cancel's callback
                loop.remove_writer(self._sock.fileno())
            write.cancel()

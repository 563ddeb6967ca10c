"""A microVM guest's end of egress: a unix socket in the guest -> a virtio-serial port -> the host.

Runs INSIDE a microVM as root of the guest, started by inside/relay.py as
``python3 -I -S egress_port.py PORT_FD LISTENER_FD``: PORT_FD is the open egress port
(/dev/vport0p2), LISTENER_FD the listening socket the relay bound at the guest's
/run/bastion/egress.sock before the agent started (so no connection finds it missing), where
the sandbox's forwarder (inside/forwarder.py, as in a namespace sandbox) connects. Each connection to it
becomes a numbered stream over the port; the host joins each stream to the sandbox's egress
proxy (bastion.sandbox._vmegress), which decides every destination. This program decides
nothing: it is plumbing. Standard library only.

Frame (as inside/relay.py's): 4-byte big-endian length of the rest, a kind byte, a 4-byte
stream id, the payload.
  both ways: C (guest -> host only: a new stream), D (bytes), F (this side's EOF),
             X (the stream is gone), K (credit: a 4-byte count of D bytes delivered)
Flow control: a side sends at most WINDOW bytes of a stream the other has not credited back,
so the port is always read at once, and one slow stream never holds up the others.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import selectors
import socket
import struct
import sys

HEADER = struct.Struct(">IcI")
WINDOW = 131072
CHUNK = 65536
MAX_STREAMS = 128
PORT_BACKLOG = 1 << 20  # stop reading clients while this much waits to go out on the port
PR_SET_DUMPABLE = 4


class Stream:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.credit = WINDOW  # bytes the host will still take
        self.out = bytearray()  # from the host, not yet taken by the client
        self.delivered = 0  # taken by the client, not yet credited back
        self.client_eof = False
        self.host_eof = False
        self.shut = False


class Mux:
    def __init__(self, port: int, listener: socket.socket) -> None:
        self.port = port
        self.listener = listener
        self.sel = selectors.DefaultSelector()
        self.inbox = bytearray()
        self.portout = bytearray()
        self.streams: dict[int, Stream] = {}
        self.ids = itertools.count(1)
        self.masks: dict[int, int] = {}

    def send(self, kind: bytes, stream_id: int, payload: bytes = b"") -> None:
        self.portout += HEADER.pack(len(payload) + 5, kind, stream_id) + payload

    def want(self, fd: int, mask: int, data: object) -> None:
        old = self.masks.get(fd, 0)
        if mask == old:
            return
        if not mask:
            self.sel.unregister(fd)
            del self.masks[fd]
        elif old:
            self.sel.modify(fd, mask, data)
        else:
            self.sel.register(fd, mask, data)
        if mask:
            self.masks[fd] = mask

    def interest(self) -> None:
        port_mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if self.portout else 0)
        self.want(self.port, port_mask, None)
        room = len(self.portout) < PORT_BACKLOG
        for stream_id, stream in self.streams.items():
            mask = selectors.EVENT_READ if room and stream.credit > 0 and not stream.client_eof else 0
            mask |= selectors.EVENT_WRITE if stream.out else 0
            self.want(stream.sock.fileno(), mask, stream_id)

    def loop(self) -> None:
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")
        while True:
            self.interest()
            for key, events in self.sel.select():
                if key.data == "listen":
                    self.on_accept()
                elif key.data is None:
                    self.on_port(events)
                elif key.data in self.streams:
                    self.on_client(key.data, events)

    def on_accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        if len(self.streams) >= MAX_STREAMS:
            sock.close()
            return
        sock.setblocking(False)
        stream_id = next(self.ids)
        self.streams[stream_id] = Stream(sock)
        self.send(b"C", stream_id)

    def on_port(self, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            with contextlib.suppress(BlockingIOError):
                del self.portout[: os.write(self.port, self.portout)]
        if events & selectors.EVENT_READ:
            try:
                data = os.read(self.port, CHUNK)
            except BlockingIOError:
                return
            if not data:
                sys.exit(0)
            self.inbox += data
            self.on_frames()

    def on_frames(self) -> None:
        while len(self.inbox) >= 4:
            size = int.from_bytes(self.inbox[:4], "big")
            if len(self.inbox) < 4 + size:
                return
            _, kind, stream_id = HEADER.unpack_from(self.inbox)
            payload = bytes(self.inbox[HEADER.size : 4 + size])
            del self.inbox[: 4 + size]
            stream = self.streams.get(stream_id)
            if stream is not None:
                self.on_frame(stream_id, stream, kind, payload)

    def on_frame(self, stream_id: int, stream: Stream, kind: bytes, payload: bytes) -> None:
        if kind == b"D":
            stream.out += payload
            self.deliver(stream_id, stream)
        elif kind == b"K":
            stream.credit += int.from_bytes(payload, "big")
        elif kind == b"F":
            stream.host_eof = True
            self.deliver(stream_id, stream)
        elif kind == b"X":
            self.drop(stream_id, tell=False)

    def on_client(self, stream_id: int, events: int) -> None:
        stream = self.streams[stream_id]
        if events & selectors.EVENT_WRITE:
            self.deliver(stream_id, stream)
        if events & selectors.EVENT_READ and stream_id in self.streams:
            self.take(stream_id, stream)

    def take(self, stream_id: int, stream: Stream) -> None:
        try:
            data = stream.sock.recv(min(CHUNK, stream.credit))
        except BlockingIOError:
            return
        except OSError:
            self.drop(stream_id, tell=True)
            return
        if data:
            stream.credit -= len(data)
            self.send(b"D", stream_id, data)
            return
        stream.client_eof = True
        self.send(b"F", stream_id)
        self.end_if_done(stream_id, stream)

    def deliver(self, stream_id: int, stream: Stream) -> None:
        try:
            while stream.out:
                sent = stream.sock.send(stream.out)
                del stream.out[:sent]
                stream.delivered += sent
        except BlockingIOError:
            pass
        except OSError:
            self.drop(stream_id, tell=True)
            return
        if stream.delivered and (stream.delivered >= WINDOW // 4 or not stream.out):
            self.send(b"K", stream_id, stream.delivered.to_bytes(4, "big"))
            stream.delivered = 0
        if stream.host_eof and not stream.out and not stream.shut:
            stream.shut = True
            with contextlib.suppress(OSError):
                stream.sock.shutdown(socket.SHUT_WR)
            self.end_if_done(stream_id, stream)

    def end_if_done(self, stream_id: int, stream: Stream) -> None:
        if stream.client_eof and stream.shut:
            self.drop(stream_id, tell=False)

    def drop(self, stream_id: int, *, tell: bool) -> None:
        stream = self.streams.pop(stream_id)
        self.want(stream.sock.fileno(), 0, None)
        stream.sock.close()
        if tell:
            self.send(b"X", stream_id)


def main(port: int, listener: socket.socket) -> None:
    # Commands run as another uid without capabilities; undumpable, this root process is out of their reach.
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    os.set_blocking(port, False)
    listener.setblocking(False)
    Mux(port, listener).loop()


if __name__ == "__main__":
    main(int(sys.argv[1]), socket.socket(fileno=int(sys.argv[2])))

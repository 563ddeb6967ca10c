"""A microVM guest's stream port: egress out of the guest, previews and terminals into it.

Runs INSIDE a microVM as root of the guest, started by inside/relay.py as
``python3 -I -S egress_port.py PORT_FD LISTENER_FD [CONTROL_FD]``: PORT_FD is the open second
port (/dev/vport0p2), LISTENER_FD the listening socket the relay bound at the guest's
/run/bastion/egress.sock before the agent started (so no connection finds it missing), where
the sandbox's forwarder (inside/forwarder.py, as in a namespace sandbox) connects. Each connection to it
becomes a numbered stream over the port; the host joins each stream to the sandbox's egress
proxy (bastion.sandbox._vmegress), which decides every destination. The host opens streams too
(ids with the top bit set): T asks for a TCP connection to the guest's 127.0.0.1:PORT (a
preview), and CONTROL_FD is a socket on which the relay hands over a terminal's pty master
with the id of the stream the host chose for it. This program decides nothing: it is plumbing.
Standard library only.

Frame (as inside/relay.py's): 4-byte big-endian length of the rest, a kind byte, a 4-byte
stream id, the payload.
  both ways: C (guest -> host only: a new stream), D (bytes), F (this side's EOF),
             X (the stream is gone), K (credit: a 4-byte count of D bytes delivered)
  host -> guest: T (open: connect to 127.0.0.1:<2-byte port>), W (a terminal's new size: 2-byte
             rows, 2-byte cols); guest -> host: A (a stream the host opened is connected)
Flow control: a side sends at most WINDOW bytes of a stream the other has not credited back,
so the port is always read at once, and one slow stream never holds up the others.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
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
HOST_IDS = 0x80000000  # the top bit: a stream the host opened (a preview's connection, a terminal)


class Stream:
    """A stream's guest end: a socket (a client of egress, a preview's connection) or a pty master."""

    def __init__(self, sock: socket.socket | None, fd: int = -1) -> None:
        self.sock = sock
        self.fd = sock.fileno() if sock is not None else fd
        self.connecting = False  # a preview's connection, not yet accepted
        self.credit = WINDOW  # bytes the host will still take
        self.out = bytearray()  # from the host, not yet taken by the client
        self.delivered = 0  # taken by the client, not yet credited back
        self.client_eof = False
        self.host_eof = False
        self.shut = False


class Mux:
    def __init__(self, port: int, listener: socket.socket, control: socket.socket | None = None) -> None:
        self.port = port
        self.listener = listener
        self.control = control
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
            if stream.connecting:
                self.want(stream.fd, selectors.EVENT_WRITE, stream_id)
                continue
            mask = selectors.EVENT_READ if room and stream.credit > 0 and not stream.client_eof else 0
            mask |= selectors.EVENT_WRITE if stream.out else 0
            self.want(stream.fd, mask, stream_id)

    def loop(self) -> None:
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")
        if self.control is not None:
            self.sel.register(self.control, selectors.EVENT_READ, "control")
        while True:
            self.interest()
            for key, events in self.sel.select():
                if key.data == "listen":
                    self.on_accept()
                elif key.data == "control":
                    self.on_control()
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

    def on_control(self) -> None:
        """The relay hands over a terminal's pty master and the id of the stream the host chose for it."""
        assert self.control is not None
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.control, 16, 1)
        except OSError:
            data, fds = b"", []
        if not data and not fds:
            self.sel.unregister(self.control)
            self.control.close()
            self.control = None
            return
        stream_id = int.from_bytes(data[:4], "big") if len(data) == 4 else 0
        if len(fds) != 1 or not stream_id & HOST_IDS or stream_id in self.streams:
            for fd in fds:
                os.close(fd)
            return
        os.set_blocking(fds[0], False)
        self.streams[stream_id] = Stream(None, fds[0])
        self.send(b"A", stream_id)

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
            elif kind == b"T" and stream_id & HOST_IDS and len(payload) == 2:
                self.open_tcp(stream_id, int.from_bytes(payload, "big"))

    def open_tcp(self, stream_id: int, port: int) -> None:
        """A preview's connection to 127.0.0.1:port in the guest: A once connected, else X."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        code = sock.connect_ex(("127.0.0.1", port))
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            self.send(b"X", stream_id)
            return
        stream = self.streams[stream_id] = Stream(sock)
        stream.connecting = code != 0
        if not stream.connecting:
            self.send(b"A", stream_id)

    def on_connected(self, stream_id: int, stream: Stream) -> None:
        assert stream.sock is not None
        if stream.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
            self.drop(stream_id, tell=True)
            return
        stream.connecting = False
        self.send(b"A", stream_id)

    def on_frame(self, stream_id: int, stream: Stream, kind: bytes, payload: bytes) -> None:
        if kind == b"W" and stream.sock is None and len(payload) == 4:
            set_window(stream.fd, int.from_bytes(payload[:2], "big"), int.from_bytes(payload[2:], "big"))
        elif stream.connecting:
            if kind == b"X":
                self.drop(stream_id, tell=False)
        elif kind == b"D":
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
        if stream.connecting:
            self.on_connected(stream_id, stream)
            return
        if events & selectors.EVENT_WRITE:
            self.deliver(stream_id, stream)
        if events & selectors.EVENT_READ and stream_id in self.streams:
            self.take(stream_id, stream)

    def take(self, stream_id: int, stream: Stream) -> None:
        try:
            data = os.read(stream.fd, min(CHUNK, stream.credit))
        except BlockingIOError:
            return
        except OSError as exc:
            if stream.sock is not None or exc.errno != errno.EIO:
                self.drop(stream_id, tell=True)
                return
            data = b""  # a pty master: EIO once no process holds the terminal
        if data:
            stream.credit -= len(data)
            self.send(b"D", stream_id, data)
            return
        stream.client_eof = True
        self.send(b"F", stream_id)
        if stream.sock is None:  # a terminal's program is gone: nothing more to give it either
            self.drop(stream_id, tell=False)
            return
        self.end_if_done(stream_id, stream)

    def deliver(self, stream_id: int, stream: Stream) -> None:
        try:
            while stream.out:
                sent = os.write(stream.fd, stream.out)
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
            if stream.sock is None:  # a terminal cannot be half-closed: the host is done with it
                self.drop(stream_id, tell=False)
                return
            with contextlib.suppress(OSError):
                stream.sock.shutdown(socket.SHUT_WR)
            self.end_if_done(stream_id, stream)

    def end_if_done(self, stream_id: int, stream: Stream) -> None:
        if stream.client_eof and stream.shut:
            self.drop(stream_id, tell=False)

    def drop(self, stream_id: int, *, tell: bool) -> None:
        stream = self.streams.pop(stream_id)
        self.want(stream.fd, 0, None)
        if stream.sock is not None:
            stream.sock.close()
        else:
            os.close(stream.fd)
        if tell:
            self.send(b"X", stream_id)


def set_window(tty: int, rows: int, cols: int) -> None:
    """TIOCSWINSZ on a terminal's master: the kernel sends SIGWINCH to its foreground. Imported here:
    only terminals pay."""
    import fcntl
    import termios

    with contextlib.suppress(OSError):
        fcntl.ioctl(tty, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def main(port: int, listener: socket.socket, control: socket.socket | None) -> None:
    # Commands run as another uid without capabilities; undumpable, this root process is out of their reach.
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    os.set_blocking(port, False)
    listener.setblocking(False)
    Mux(port, listener, control).loop()


if __name__ == "__main__":
    main(
        int(sys.argv[1]),
        socket.socket(fileno=int(sys.argv[2])),
        socket.socket(fileno=int(sys.argv[3])) if len(sys.argv) > 3 else None,
    )

"""The sandbox's end of the egress path: 127.0.0.1:PORT inside -> the proxy's unix socket.

Runs inside the sandbox as ``python3 -I -S -c <this source> PORT SOCKET_PATH``, so it
imports nothing from bastion and only the standard library. The sandbox's network
namespace has only loopback: this relay is its one way out, and it leads only to the
host's egress proxy (bastion.egress.proxy), which decides every destination. This
program decides nothing; it is not a security boundary, only plumbing.

One thread, one selector: no thread per connection, so the sandbox's pids limit is
not spent on relaying. Each direction moves through a kernel pipe with splice(2) (or,
where the kernel refuses it, a large buffer), written at once rather than after another
wait; an EOF is passed on as a half-close (shutdown SHUT_WR); any error ends the pair.

It starts with every sandbox allowed a network, which waits for its "ready": it imports only
modules written in C (the C modules under socket, selectors and os; no contextlib), whose Python
(enum, collections, abc...) cost about 8 ms of each start. A forward reference is quoted.
"""

import _socket
import errno
import fcntl
import posix
import select
import sys
import time

CHUNK = 1024 * 1024
# A pipe starts at the kernel's default (64 KiB) and grows once its direction has carried
# GROW_AFTER bytes: bulk transfers move up to 1 MiB per splice, short ones spend no pipe budget.
PIPE_BYTES = 1024 * 1024
GROW_AFTER = 1024 * 1024
UNIX_BUFFER_BYTES = 4 * 1024 * 1024  # fewer, larger copies; the kernel caps it at [rw]mem_max
MAX_PAIRS = 1024
CONNECT_TIMEOUT_S = 10.0
_SOFT_ERRORS = (BlockingIOError, InterruptedError)
SPLICE = hasattr(posix, "splice")
_SPLICE_FLAGS = getattr(posix, "SPLICE_F_MOVE", 0) | getattr(posix, "SPLICE_F_NONBLOCK", 0)
READ, WRITE = select.EPOLLIN, select.EPOLLOUT


class Pipe:
    """One direction of a pair: bytes taken from `src` wait here until `dst` takes them.

    They wait in a kernel pipe, moved with splice(2) so they never enter this process;
    where splice is refused, in a buffer.
    """

    def __init__(self, src: _socket.socket, dst: _socket.socket) -> None:
        self.src = src
        self.dst = dst
        self.eof = False
        self.queued = 0
        self.moved = 0
        self.fds: tuple[int, int] | None = None
        self.buf = memoryview(b"")
        self.start = 0
        if SPLICE:
            try:  # noqa: SIM105 - contextlib would cost import time at every start
                self.fds = posix.pipe2(posix.O_NONBLOCK | posix.O_CLOEXEC)
            except OSError:
                pass
        if self.fds is None:
            self.buf = memoryview(bytearray(CHUNK))

    @property
    def pending(self) -> bool:
        return self.queued > 0

    def done(self) -> bool:
        return self.eof and not self.pending

    def fill(self) -> None:
        """Take what `src` has (at most CHUNK); the caller only calls this when nothing is queued."""
        if self.fds is not None:
            try:
                count = posix.splice(self.src.fileno(), self.fds[1], CHUNK, flags=_SPLICE_FLAGS)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                self.close()
                self.buf = memoryview(bytearray(CHUNK))
                count = self.src.recv_into(self.buf)
        else:
            count = self.src.recv_into(self.buf)
        if self.fds is not None and self.moved < GROW_AFTER <= self.moved + count:
            try:  # noqa: SIM105
                fcntl.fcntl(self.fds[1], fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:
                pass  # refused past the user's pipe budget: it stays small
        self.moved += count
        self.start, self.queued = 0, count
        self.eof = not count

    def drain(self) -> None:
        """Give `dst` what it takes without blocking."""
        while self.queued:
            if self.fds is not None:
                sent = posix.splice(self.fds[0], self.dst.fileno(), self.queued, flags=_SPLICE_FLAGS)
            else:
                sent = self.dst.send(self.buf[self.start : self.start + self.queued])
            self.start += sent
            self.queued -= sent

    def close(self) -> None:
        if self.fds is not None:
            for fd in self.fds:
                posix.close(fd)
            self.fds = None


class Pair:
    def __init__(self, relay: "Relay", client: _socket.socket, upstream: _socket.socket) -> None:
        self.relay = relay
        self.up = Pipe(client, upstream)
        self.down = Pipe(upstream, client)
        self.socks = (client, upstream)
        self.closed = False

    def masks(self) -> dict[_socket.socket, int]:
        """epoll interest per socket: read while its outgoing pipe is empty, write while its incoming one is not."""
        out: dict[_socket.socket, int] = {}
        for sock in self.socks:
            mask = 0
            for pipe in (self.up, self.down):
                if pipe.src is sock and not pipe.eof and not pipe.pending:
                    mask |= READ
                if pipe.dst is sock and pipe.pending:
                    mask |= WRITE
            out[sock] = mask
        return out

    def pump_read(self, pipe: Pipe) -> None:
        try:
            pipe.fill()
        except _SOFT_ERRORS:
            return
        self.pump_write(pipe)

    def pump_write(self, pipe: Pipe) -> None:
        # Write at once rather than waiting for epoll: usually the peer has room.
        try:  # noqa: SIM105
            pipe.drain()
        except _SOFT_ERRORS:
            pass
        if pipe.done():
            try:
                pipe.dst.shutdown(_socket.SHUT_WR)
            except OSError as exc:
                if exc.errno != errno.ENOTCONN:
                    raise

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.up.close()
        self.down.close()
        for sock in self.socks:
            self.relay.forget(sock)
            try:  # noqa: SIM105
                sock.close()
            except OSError:
                pass


class Relay:
    def __init__(self, listener: _socket.socket, socket_path: str) -> None:
        self.listener = listener
        self.socket_path = socket_path
        self.epoll = select.epoll()
        self.epoll.register(listener.fileno(), READ)
        self.pairs: set[Pair] = set()
        self.registered: dict[_socket.socket, int] = {}
        self.owners: dict[int, tuple[_socket.socket, Pair]] = {}  # fd -> its socket and pair

    def forget(self, sock: _socket.socket) -> None:
        if self.registered.pop(sock, 0):
            self.epoll.unregister(sock.fileno())
            del self.owners[sock.fileno()]

    def update(self, pair: Pair) -> None:
        if pair.up.done() and pair.down.done():
            pair.close()
            self.pairs.discard(pair)
            return
        for sock, mask in pair.masks().items():
            old = self.registered.get(sock, 0)
            if mask == old:
                continue
            if not old:
                self.epoll.register(sock.fileno(), mask)
                self.owners[sock.fileno()] = (sock, pair)
            elif not mask:
                self.epoll.unregister(sock.fileno())
                del self.owners[sock.fileno()]
            else:
                self.epoll.modify(sock.fileno(), mask)
            self.registered[sock] = mask

    def accept(self) -> None:
        while True:
            try:
                fd, _ = self.listener._accept()  # type: ignore[attr-defined]  # socket.accept's own call
            except _SOFT_ERRORS:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: leave the backlog for later, without spinning on it.
                    time.sleep(0.05)
                    return
                if exc.errno == errno.ECONNABORTED:
                    continue
                raise
            client = _socket.socket(fileno=fd)
            if len(self.pairs) >= MAX_PAIRS:
                client.close()
                continue
            upstream = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            try:
                upstream.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDBUF, UNIX_BUFFER_BYTES)
                upstream.setsockopt(_socket.SOL_SOCKET, _socket.SO_RCVBUF, UNIX_BUFFER_BYTES)
                upstream.settimeout(CONNECT_TIMEOUT_S)
                upstream.connect(self.socket_path)
            except OSError:
                upstream.close()
                client.close()
                continue
            client.setblocking(False)
            upstream.setblocking(False)
            client.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
            pair = Pair(self, client, upstream)
            self.pairs.add(pair)
            self.update(pair)

    def run(self) -> None:
        listening = self.listener.fileno()
        while True:
            for fd, events in self.epoll.poll():
                if fd == listening:
                    self.accept()
                    continue
                owner = self.owners.get(fd)
                if owner is None:  # forgotten by an earlier event of this round
                    continue
                sock, pair = owner
                # As selectors does: a hang-up or an error counts as both, so the next read or write meets it.
                readable, writable = events & ~WRITE, events & ~READ
                try:
                    for pipe in (pair.up, pair.down):
                        if writable and pipe.dst is sock and pipe.pending:
                            pair.pump_write(pipe)
                        if readable and pipe.src is sock and not pipe.pending and not pipe.eof:
                            pair.pump_read(pipe)
                    self.update(pair)
                except OSError:
                    pair.close()
                    self.pairs.discard(pair)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not argv[1].isdigit():
        sys.stderr.write("usage: forwarder.py PORT UNIX_SOCKET_PATH\n")
        return 2
    listener = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    listener.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", int(argv[1])))
    listener.listen(128)
    listener.setblocking(False)
    # The port actually bound (PORT may be 0): whoever started us may wait for this line.
    sys.stdout.write(f"ready {listener.getsockname()[1]}\n")
    sys.stdout.flush()
    Relay(listener, argv[2]).run()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except KeyboardInterrupt:
        posix._exit(0)

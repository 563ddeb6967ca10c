"""TCP connections the host makes inside a sandbox's network namespace (a preview's request).

The agent answers a connect with a socket it made, a round trip through a process of the sandbox
(0.4 to 0.8 ms here, most of it waiting to be scheduled). Once the agent has handed over its network
namespace, the host makes the socket there itself: `setns` on a thread of its own, then a connect
on the event loop. The namespace decides what 127.0.0.1 is, so the socket reaches exactly what the
agent's would, and nothing outside the sandbox.

Written by hand because Python 3.11 has no `os.setns` (3.12 has): ctypes calls libc's. `setns`
moves only the calling thread, so one dedicated thread does it and nothing else: no other socket of
the server's is ever made in a sandbox's namespace, whatever namespace that thread was left in.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import ctypes
import fcntl
import os
import socket
import threading
from typing import Final

from bastion.executors import started_pool

__all__ = ["NamespaceUnusable", "NetworkNamespace", "is_foreign_netns"]

CLONE_NEWNET: Final = 0x40000000
NS_GET_NSTYPE: Final = 0xB703  # _IO(0xb7, 0x3), linux/nsfs.h
SPARES: Final = 2  # sockets kept made in each namespace in use

_libc = ctypes.CDLL(None, use_errno=True)
_lock = threading.Lock()
_thread: concurrent.futures.ThreadPoolExecutor | None = None
_home = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)  # the server's own network namespace


class NamespaceUnusable(Exception):
    """The host cannot enter the namespace (no CAP_SYS_ADMIN over it, or not a namespace)."""


def is_foreign_netns(fd: int) -> bool:
    """Whether `fd` is a network namespace other than the server's own."""
    try:
        if fcntl.ioctl(fd, NS_GET_NSTYPE) != CLONE_NEWNET:
            return False
        return os.fstat(fd).st_ino != os.fstat(_home).st_ino
    except OSError:
        return False


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        raise NamespaceUnusable(os.strerror(ctypes.get_errno()))


def _socket_in(netns_fd: int) -> socket.socket:
    """A TCP socket made inside the namespace; runs on the dedicated thread only."""
    _setns(netns_fd)
    try:
        return socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    finally:
        # Back home, so the thread does not keep a closed sandbox's namespace alive. Should that fail,
        # nothing is lost: the thread makes sockets only right after entering a namespace.
        with contextlib.suppress(NamespaceUnusable):
            _setns(_home)


def _sockets_in(netns_fd: int, count: int) -> list[socket.socket]:
    """`count` sockets made in the namespace; closes `netns_fd` (the caller's own duplicate)."""
    try:
        return [_socket_in(netns_fd) for _ in range(count)]
    finally:
        os.close(netns_fd)


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _thread
    with _lock:
        if _thread is None:
            # Its thread started now: a task queued where the start failed would run later, unasked (`started_pool`).
            _thread = started_pool(1, "bastion-netns")
        return _thread


def _close_made(job: concurrent.futures.Future[list[socket.socket]]) -> None:
    if not job.cancelled() and job.exception() is None:
        for sock in job.result():
            sock.close()


class NetworkNamespace:
    """A sandbox's network namespace, held by the host, with a few sockets made in it ahead of need:
    the thread hop to make one costs about what the agent's round trip does, a spare costs nothing.
    An unconnected socket is nothing the sandbox can see."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._spares: collections.deque[socket.socket] = collections.deque()
        self._refilling = False
        self._closed = False
        self._state = threading.Lock()  # `close` against a refill's end, which runs on the thread

    async def connect(self, port: int, timeout_s: float) -> socket.socket:
        """A non-blocking socket connected to 127.0.0.1:`port` in the namespace; the caller owns it.

        Raises:
            NamespaceUnusable: the namespace cannot be entered (or was closed).
            OSError: nothing accepts connections on the port (TimeoutError after `timeout_s`).
        """
        if self._closed:
            raise NamespaceUnusable("closed")
        loop = asyncio.get_running_loop()
        if self._spares:
            sock = self._spares.popleft()
        else:
            # Each job gets a duplicate of the fd: closing the namespace meanwhile cannot hand the thread
            # a reused fd number (another sandbox's namespace).
            job = _executor().submit(_sockets_in, os.dup(self._fd), 1)
            try:
                sock = (await asyncio.shield(asyncio.wrap_future(job)))[0]
            except asyncio.CancelledError:
                job.add_done_callback(_close_made)  # on the thread: the socket still being made is nobody's
                raise
        self._refill()
        try:
            sock.setblocking(False)
            async with asyncio.timeout(timeout_s):
                await loop.sock_connect(sock, ("127.0.0.1", port))
        except BaseException:
            sock.close()
            raise
        return sock

    def _refill(self) -> None:
        if self._refilling or self._closed or len(self._spares) >= SPARES:
            return
        executor = _executor()  # first: a thread that cannot start leaves the next call to try again
        self._refilling = True
        # Its end is handled on the thread, not the loop: a loop closed meanwhile (the server's end)
        # would never run a callback, and the sockets made would be dropped unclosed.
        job = executor.submit(_sockets_in, os.dup(self._fd), SPARES - len(self._spares))
        job.add_done_callback(self._refilled)

    def _refilled(self, job: concurrent.futures.Future[list[socket.socket]]) -> None:
        if job.cancelled() or job.exception() is not None:
            self._refilling = False
            return  # the next connect makes its own socket, and says why if it cannot
        with self._state:
            self._refilling = False
            if not self._closed:
                self._spares.extend(job.result())
                return
        for sock in job.result():
            sock.close()

    def close(self) -> None:
        with self._state:
            self._closed = True
            spares, self._spares = self._spares, collections.deque()
        for sock in spares:
            sock.close()
        os.close(self._fd)

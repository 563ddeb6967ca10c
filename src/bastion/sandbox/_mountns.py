"""Mount namespaces of the sandboxes' own, made and entered by one thread of the server. DANGEROUS.

Root only: it makes mount namespaces and mounts in them. A sandbox's /tmp and /dev/shm are
tmpfs the server mounts (`_devices`); mounted in the host's namespace, each open sandbox would
add two entries to the host's mount table, and bubblewrap 0.8.0 reads that whole table at each
of a start's ~30 binds, so every start would slow as sandboxes accumulate (bwrap alone with 14
binds: 4.4 ms, 12.1 ms with 200 more host mounts). Here they are mounted in a namespace of the
sandbox's own instead, which bubblewrap starts in: the host never sees them, and they go when
the namespace does (the server's fd to it closed, and no process left in it), a crash included.

A process's threads share one mount namespace only while they share their filesystem attributes:
after `unshare(CLONE_FS)` one thread may `unshare(CLONE_NEWNS)` or `setns` on its own, and the
children it spawns start where it is (checked on Linux 6.18: the mount was not in the host's
table, and the main thread did not see it by path). So one worker thread does it all, always
going back to the host's namespace after each task; the rest of the server never leaves it.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final, TypeVar

from bastion.safety.errors import Unavailable

_CLONE_FS: Final = 0x200
_CLONE_NEWNS: Final = 0x20000
_MS_REC: Final = 0x4000
_MS_SLAVE: Final = 1 << 19

_libc = ctypes.CDLL(None, use_errno=True)
_libc.unshare.argtypes = (ctypes.c_int,)
_libc.setns.argtypes = (ctypes.c_int, ctypes.c_int)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)

T = TypeVar("T")


def _check(result: int, what: str) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


class MountNamespace:
    """One sandbox's mount namespace: alive while this holds its fd (or a process is in it)."""

    def __init__(self, owner: MountNamespaces, fd: int) -> None:
        self._owner = owner
        self._fd: int | None = fd

    def run(self, action: Callable[[], T]) -> T:
        """`action()` on the namespace thread, inside this namespace: what it spawns starts here."""
        fd = self._fd
        if fd is None:
            raise Unavailable("the sandbox's mount namespace is closed")
        return self._owner.run_in(fd, action)

    def close(self) -> None:
        """Let the namespace go: its mounts end with the last process in it."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class MountNamespaces:
    """The worker thread that makes and enters the sandboxes' namespaces.

    Raises (at construction):
        Unavailable: this process may not make namespaces (not root).
    """

    def __init__(self) -> None:
        self._host = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        self._lost: str | None = None  # why the thread may no longer be trusted to be in the host's namespace
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bastion-mountns")
        try:
            self._thread.submit(self._own_fs).result()
        except OSError as exc:
            self.close()
            raise Unavailable(f"cannot give the mount thread a namespace of its own: {exc.strerror}") from None

    @staticmethod
    def _own_fs() -> None:
        _check(_libc.unshare(_CLONE_FS), "unshare(CLONE_FS)")

    def make(self, mounts: Callable[[], None]) -> MountNamespace:
        """A new namespace, a copy of the host's made a slave of it, with `mounts()` done in it.

        Mounts the host makes later under a private mount do not reach it: make what its bwrap binds first."""
        return MountNamespace(self, self._submit(lambda: self._make(mounts)))

    def run_in(self, fd: int, action: Callable[[], T]) -> T:
        return self._submit(lambda: self._inside(fd, action))

    def _submit(self, task: Callable[[], T]) -> T:
        if self._lost is not None:
            raise Unavailable(f"the mount thread is unusable: {self._lost}")
        return self._thread.submit(task).result()

    def _make(self, mounts: Callable[[], None]) -> int:
        _check(_libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        try:
            # The copy shares the host's peer groups. Made a slave first: nothing mounted in it
            # propagates back to the host's table, while mounts and unmounts the host makes under a
            # shared mount still reach it (as `unshare --propagation slave`).
            _check(_libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE, None), "make / a slave")
            mounts()
            return os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            self._go_home()

    def _inside(self, fd: int, action: Callable[[], T]) -> T:
        _check(_libc.setns(fd, _CLONE_NEWNS), "setns into a sandbox's mount namespace")
        try:
            return action()
        finally:
            self._go_home()

    def _go_home(self) -> None:
        if _libc.setns(self._host, _CLONE_NEWNS) != 0:
            # Never seen; should it happen, no later task may run in a sandbox's namespace by mistake.
            self._lost = f"setns back to the host's namespace failed: {os.strerror(ctypes.get_errno())}"
            raise Unavailable(self._lost)

    def close(self) -> None:
        """Stop the thread (after its tasks). The namespaces it made live on while their fds are open."""
        self._thread.shutdown(wait=True)
        host, self._host = self._host, -1
        if host >= 0:
            os.close(host)

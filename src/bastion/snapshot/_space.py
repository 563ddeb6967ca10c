"""Free space kept on the state filesystem while snapshots and restores write to it.

The state folder holds the audit log, and the audit fails closed: a full disk stops every
mutating call. `SpaceGuard` keeps `reserve_bytes` free on one filesystem: `require` checks
before an operation writes (statvfs), `wrote` checks again every `CHECK_EVERY_BYTES` written,
after flushing the file being written so that the filesystem's count includes it.

`sync_filesystem` flushes a whole filesystem and reports its write-back errors: a restore
into a loop-mounted disk image learns only then that the image's blocks did not fit.

What it does not guarantee: the checks are points in time. Another writer (a sandbox filling
its disk image, a second restore) may use the room between two checks; the reserve is sized
to absorb that, not to prevent it. ``f_bavail`` is used (the room an unprivileged writer has),
so a root server keeps the filesystem's own root reserve on top of this one.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Final

from bastion.safety.errors import OperationFailed, ResourceLimit

CHECK_EVERY_BYTES: Final = 16 * 1024 * 1024

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syncfs.argtypes = (ctypes.c_int,)
_libc.syncfs.restype = ctypes.c_int


def sync_filesystem(fd: int) -> None:
    """syncfs(2) the filesystem holding `fd`: its dirty data and metadata written out.

    Since Linux 5.8 it returns the write-back errors of the filesystem (EIO, ENOSPC from a full
    disk under a loop-mounted image) that plain writes never saw (Python's `os` has no syncfs).

    Raises:
        OSError: the error syncfs reported.
    """
    if _libc.syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class NoRoom(ResourceLimit):
    """No room for the write now (the reserve, a byte cap, a full disk): it may fit once room is freed.

    The client sees RESOURCE_LIMIT, as for any bound. Crash recovery keeps a workspace it could
    not snapshot for this reason, for the next start; a snapshot refused by the workspace's own
    size, entry count or depth is refused at every start, so that workspace is deleted.
    """


class OverBound(ResourceLimit):
    """The workspace itself is over a snapshot's bounds (entries, file data, depth): refused at every attempt.

    Crash recovery deletes a workspace refused for this reason alone; any other failure (no room,
    an unreadable file of a damaged image, too many open files) may pass later, so it is kept.
    """


class SpaceGuard:
    """Keeps `reserve_bytes` free on the filesystem holding `folder` (a path, or a folder fd it does not own)."""

    def __init__(self, folder: int | Path, reserve_bytes: int) -> None:
        self._folder = folder
        self.reserve_bytes = reserve_bytes
        self._unchecked = 0

    def free_bytes(self) -> int:
        """Bytes an unprivileged writer may still use on the filesystem."""
        try:
            st = os.statvfs(self._folder)
        except OSError as exc:
            raise OperationFailed(f"the free space of the state folder cannot be read: {exc.strerror}") from exc
        return st.f_bavail * st.f_frsize

    def room(self) -> int:
        """Bytes that may still be written before the reserve is reached (0 or more)."""
        return max(0, self.free_bytes() - self.reserve_bytes)

    def require(self, needed: int, what: str) -> None:
        """Refuse `what` if writing `needed` bytes would leave less than the reserve.

        Raises:
            NoRoom: naming the reserve and how to free room.
        """
        free = self.free_bytes()
        if free - needed < self.reserve_bytes:
            raise NoRoom(self._message(what, free, needed))

    def wrote(self, size: int, fd: int, what: str) -> None:
        """Count `size` bytes written to `fd`; every `CHECK_EVERY_BYTES`, flush it and check the reserve.

        Raises:
            NoRoom: the filesystem went below the reserve while writing.
        """
        self._unchecked += size
        if self._unchecked < CHECK_EVERY_BYTES:
            return
        self._unchecked = 0
        # Delayed allocation (and a loop-mounted disk image) count blocks only once they are flushed.
        os.fdatasync(fd)
        free = self.free_bytes()
        if free < self.reserve_bytes:
            raise NoRoom(self._message(what, free, 0))

    def _message(self, what: str, free: int, needed: int) -> str:
        wants = f" and {needed} more are needed" if needed else ""
        return (
            f"{what} refused: the state filesystem keeps {self.reserve_bytes} bytes free for the audit log "
            f"(state_reserve_bytes), it has {free}{wants}: delete snapshots with delete_snapshot or free disk space"
        )

"""Space kept allocated past the audit log's end, so a full state filesystem does not stop every call.

Sandboxes' disk images are sparse files on the state filesystem, like the audit log: an agent that
fills its disk can fill that filesystem, and a log that cannot grow refuses every call of every
client (fail-closed). With blocks allocated ahead (fallocate(2), FALLOC_FL_KEEP_SIZE: the file's size
does not change), appends land in blocks the log already holds, and the administrator is warned
while records still have room.

Written by hand with ctypes: os.posix_fallocate changes the file's size, which O_APPEND writes and
the chain's readers go by.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from typing import Final

__all__ = ["Reserve"]

FALLOC_FL_KEEP_SIZE: Final = 1

_log = logging.getLogger("bastion.audit")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
_libc.fallocate.restype = ctypes.c_int


def _fallocate(fd: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


class Reserve:
    """Keeps `size` bytes allocated past a file's end, topped up once less than half is left."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._end = 0  # where the allocated room ends; 0: unknown (nothing counted on)
        self._short = False  # the last top-up failed for want of space (warned once)
        self._unsupported = False

    def top_up(self, fd: int, offset: int) -> None:
        """Make sure [offset, offset + size) is allocated, unless more than half of it already is."""
        if self.size == 0 or self._unsupported or self._end - offset >= self.size // 2:
            return
        try:
            _fallocate(fd, offset, self.size)
        except OSError as exc:
            self._failed(exc, max(0, self._end - offset))
            return
        self._end = offset + self.size
        if self._short:
            _log.warning("the state filesystem has room again: the audit log's reserve is back")
            self._short = False

    def forget(self) -> None:
        """The file was cut or replaced: what was allocated past its end is not counted on any more."""
        self._end = 0

    def _failed(self, exc: OSError, left: int) -> None:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
            self._unsupported = True
            _log.info("the state filesystem cannot allocate ahead (%s): the audit log keeps no reserve", exc.strerror)
            return
        if not self._short:
            self._short = True
            _log.warning(
                "audit log reserve not topped up (%s): %d bytes of room left; calls are refused when they are"
                " used up: free space on the state filesystem",
                exc.strerror or exc,
                left,
            )

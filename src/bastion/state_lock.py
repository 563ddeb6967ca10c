"""One server per state folder: an exclusive flock on ``<state_dir>/server.lock``, held for the server's life.

Why: at start a server treats every sandbox folder it does not run as a crashed server's
leftover (`SandboxManager.recover` snapshots and deletes it), unmounts the idmapped mounts
it finds, and appends to the audit chain. A second server on a state folder in use would do
all of that to the first one's live sandboxes. The lock is taken before any of it.

The kernel drops an flock when its holder dies (even by SIGKILL), so a crash never leaves
the folder locked. The file is never deleted: unlinking a lock file lets two servers each
lock a different inode. Commands that only read the state folder (``bastion doctor``,
``bastion audit verify``, the approvals admin) do not take the lock.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path
from typing import Final

from bastion.safety.errors import ConfigError

LOCK_NAME: Final = "server.lock"
_MAX_PID_BYTES: Final = 32


class StateLock:
    """The exclusive lock of one state folder, with the holder's pid written in the file."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_NAME
        self._fd = -1

    def acquire(self) -> None:
        """Lock the state folder for this process, or refuse with one line naming the holder.

        Raises:
            ConfigError: another process holds the lock, or the lock file cannot be opened.
        """
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        except OSError as exc:
            raise ConfigError(f"state folder lock {self.path} cannot be opened: {exc.strerror or exc}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ConfigError(f"state folder lock {self.path} is not a regular file: remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ConfigError(
                f"state folder {self.path.parent} is in use by another bastion server ({holder}): "
                "stop it, or give this server a state_dir of its own"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise ConfigError(f"state folder lock {self.path} cannot be taken: {exc.strerror or exc}") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise ConfigError(f"state folder lock {self.path} cannot be written: {exc.strerror or exc}") from None
        self._fd = fd

    def release(self) -> None:
        """Unlock (closing the fd drops the flock); the file stays. Releasing twice is harmless."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def _holder(fd: int) -> str:
    """'pid N' as the holder wrote it in the lock file: a hint for the message, never trusted further."""
    try:
        text = os.pread(fd, _MAX_PID_BYTES, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "pid unknown"

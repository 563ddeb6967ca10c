"""One server per state folder: an exclusive flock on the folder, held for the server's life.

Why: at start a server treats every sandbox folder it does not run as a crashed server's
leftover (`SandboxManager.recover` snapshots and deletes it), unmounts the idmapped mounts
it finds, and appends to the audit chain. A second server on a state folder in use would do
all of that to the first one's live sandboxes. The lock is taken before any of it.

The flock is on the folder's own fd, so it needs nothing written: a read-only or full state
folder still locks, and the start then fails on what cannot be written (the audit log) with
its own message. The holder writes its pid to ``server.lock`` beside it, a hint read only to
name the holder when the lock is busy. The kernel drops an flock when its holder dies (even
by SIGKILL), so a crash never leaves the folder locked. Commands that only read the state
folder (``bastion doctor``, ``bastion audit verify``, the approvals and admin commands) do
not take the lock.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
from pathlib import Path
from typing import Final

from bastion.safety.errors import ConfigError

PID_FILE: Final = "server.lock"
_MAX_PID_BYTES: Final = 32
_FILE_FLAGS: Final = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK

logger = logging.getLogger("bastion.state")


class StateLock:
    """The exclusive lock of one state folder, with the holder's pid written beside it."""

    def __init__(self, state_dir: Path) -> None:
        self.folder = state_dir
        self.pid_path = state_dir / PID_FILE
        self._fd = -1

    def acquire(self) -> None:
        """Lock the state folder for this process, or refuse with one line naming the holder.

        Raises:
            ConfigError: another process holds the lock, or the folder cannot be opened.
        """
        try:
            fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigError(f"state folder {self.folder} cannot be opened: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"state folder {self.folder} is in use by another bastion server ({self._holder()}): "
                "stop it, or give this server a state_dir of its own"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise ConfigError(f"state folder {self.folder} cannot be locked: {exc.strerror or exc}") from None
        self._fd = fd
        self._write_pid()

    def release(self) -> None:
        """Unlock (closing the fd drops the flock). Releasing twice is harmless."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def _write_pid(self) -> None:
        """Best effort: a folder that cannot take it still locks, and its holder is named 'pid unknown'."""
        try:
            fd = os.open(self.pid_path, os.O_WRONLY | os.O_CREAT | _FILE_FLAGS, 0o600)
        except OSError as exc:
            logger.debug("cannot write %s: %s", self.pid_path, exc)
            return
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as exc:
            logger.debug("cannot write %s: %s", self.pid_path, exc)
        finally:
            os.close(fd)

    def _holder(self) -> str:
        """'pid N' as the holder wrote it, when that process lives: a hint for the message, never trusted further."""
        try:
            fd = os.open(self.pid_path, os.O_RDONLY | _FILE_FLAGS)
        except OSError:
            return "pid unknown"
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
            text = os.read(fd, _MAX_PID_BYTES).decode("ascii", "replace").strip() if regular else ""
        except OSError:
            text = ""
        finally:
            os.close(fd)
        # A pid left by an earlier server (the holder had not written its own yet) names nobody alive.
        if text.isdigit() and os.path.exists(f"/proc/{text}"):
            return f"pid {text}"
        return "pid unknown"

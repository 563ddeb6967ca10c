"""One server per state folder: an exclusive flock on ``server.lock`` in it, held for the server's life.

Why: at start a server treats every sandbox folder it does not run as a crashed server's
leftover (`SandboxManager.recover` snapshots and deletes it), unmounts the idmapped mounts
it finds, and appends to the audit chain. A second server on a state folder in use would do
all of that to the first one's live sandboxes. The lock is taken before any of it.

The flock is on ``server.lock``, a file only the server's user can open (0600, its own, one
link): an flock needs only an fd open for reading, so a lock on the folder itself could be
taken by any local user who can read the folder (a 0755 ``/var/lib/bastion``), and no server
would start. The state folder must be the server user's and not writable by group or others:
whoever can write to it can replace the lock file, the audit log and the sandboxes. Only when
``server.lock`` cannot be created (a read-only folder) is the folder's own fd locked instead,
so the start then fails on what cannot be written (the audit log) with its own message. The
holder's pid is written in the file, a hint read only to name the holder when the lock is
busy. The kernel drops an flock when its holder dies (even by SIGKILL), so a crash never
leaves the folder locked. Commands that only read the state folder (``bastion doctor``,
``bastion audit verify``, the approvals and admin commands) do not take the lock.

Nor may anyone else be able to replace the folder, through any folder above it
(`replaceable_problem`): a root server unmounts its sandboxes' mounts under it by path
(umount's UMOUNT_NOFOLLOW covers the last component only), and a user who owns a folder above
could rename the state folder away and put a link there while it runs, so that root's
unmounts at stop follow it to the host's /tmp, /dev/shm or /dev/pts.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Final

from bastion.safety.errors import ConfigError
from bastion.safety.paths import folder_replaceable_by, owners_phrase

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
            ConfigError: another process holds the lock, the folder or its lock file is unsafe
                (see the module docstring), or the folder cannot be opened.
        """
        try:
            folder = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigError(f"state folder {self.folder} cannot be opened: {exc.strerror or exc}") from None
        try:
            self._check_folder(os.fstat(folder))
            problem = replaceable_problem(self.folder, "state folder", "choose a state_dir elsewhere")
            if problem is not None:
                raise ConfigError(problem)
            fd = self._open_lock_file(folder)
        except BaseException:
            os.close(folder)
            raise
        if fd != folder:
            os.close(folder)
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
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            self._write_pid(fd)

    def _check_folder(self, info: os.stat_result) -> None:
        if info.st_uid != os.geteuid():
            raise ConfigError(
                f"state folder {self.folder} is owned by uid {info.st_uid}, not {os.geteuid()}: "
                "give the server a folder of its own user"
            )
        if info.st_mode & 0o022:
            raise ConfigError(
                f"state folder {self.folder} is writable by group or others: chmod 700 it (whoever can write "
                "to it can replace the audit log and the sandboxes)"
            )

    def _open_lock_file(self, folder: int) -> int:
        """The fd of ``server.lock`` (created 0600), or `folder` itself when the folder is read-only."""
        try:
            fd = os.open(PID_FILE, os.O_RDWR | os.O_CREAT | _FILE_FLAGS, 0o600, dir_fd=folder)
        except OSError as exc:
            if exc.errno in (errno.EROFS, errno.EACCES):
                return folder  # nothing can be written, so the start fails on the audit log, in its words
            if exc.errno in (errno.ELOOP, errno.ENXIO):
                raise ConfigError(f"{self.pid_path} is not a regular file: remove it") from None
            raise ConfigError(f"{self.pid_path} cannot be opened: {exc.strerror or exc}") from None
        try:
            problem = _lock_file_problem(os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        if problem is not None:
            os.close(fd)
            raise ConfigError(f"{self.pid_path} {problem}: remove it (the server makes a new one)")
        return fd

    def release(self) -> None:
        """Unlock (closing the fd drops the flock). Releasing twice is harmless."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def _write_pid(self, fd: int) -> None:
        """Best effort: a file that cannot take it still locks, and its holder is named 'pid unknown'."""
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            logger.debug("cannot write %s: %s", self.pid_path, exc)

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


def replaceable_problem(
    folder: Path, what: str, elsewhere: str, judge: Callable[[str, tuple[int, int]], str | None] = folder_replaceable_by
) -> str | None:
    """One line refusing `folder` if a user besides root and this process's could replace it, or None.

    Args:
        folder: an absolute path; when it does not exist yet, where it would be made is judged.
        what: how the line names it ("state folder").
        elsewhere: the other fix, after chown and chmod ("choose a state_dir elsewhere").
        judge: who could change it (`folder_changeable_by` for a folder whose entries are trusted by name).
    """
    owner = (os.geteuid(), os.getegid())
    try:
        who = judge(str(folder), owner)
    except OSError as exc:
        return f"{what} {folder} cannot be examined ({exc.strerror or exc}): fix its path"
    if who is None:
        return None
    ours = owners_phrase(owner)
    return (
        f"{what} {folder} could be replaced by {who}: make it and every folder above it {ours} and not "
        f"writable by others (chown, chmod go-w), or {elsewhere}"
    )


def _lock_file_problem(info: os.stat_result) -> str | None:
    """Why ``server.lock`` could be opened by someone else (who could then hold the lock), or None."""
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not {os.geteuid()}"
    if info.st_nlink != 1:
        return f"has {info.st_nlink} hard links"
    if info.st_mode & 0o077:
        return "can be opened by group or others"
    return None

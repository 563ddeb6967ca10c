"""Who a sandbox is on the host: an unprivileged uid and gid, never the server's root. SECURITY BOUNDARY.

bubblewrap maps the sandbox's uid 1000 to the identity that starts it. When the server runs
as root, that would be root: every file a command makes would be root's on the host, and the
host's /dev nodes bound in would be "its own" to chmod. So a root server starts each sandbox
as a uid and gid of its own from `[sandboxes] host_id_range` (`setpriv` in `_spawn`), a range
checked at start to hold no user or group of the host (/etc/passwd, /etc/group) and to
overlap no subordinate range (/etc/subuid, /etc/subgid). Two sandboxes never share one while
both live, so a bug elsewhere still leaves one sandbox unable to touch another's files.

Two servers on one host (each stdio client starts its own) may share a range: an id is
held by an flock on `/run/bastion-ids/<uid>` for as long as a sandbox uses it, so no two
servers hand out one id at once, and a crashed server's locks go with its process.

A server running as an ordinary user has no other identity to give: that user is every
sandbox's identity, and the kernel already refuses it the host's files and /dev nodes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from bastion.safety.errors import ResourceLimit, Unavailable

# Above systemd's container ranges (0x00080000-0x6FFFFFFF) and below its "foreign" range
# (0x7FFE0000): no distribution or systemd component hands these out (systemd UIDS-GIDS.md).
DEFAULT_HOST_ID_FIRST: Final = 0x70000000
DEFAULT_HOST_ID_COUNT: Final = 65_536
OVERFLOW_ID: Final = 65_534  # nobody/nogroup: what an unmapped id shows as
MAX_ID: Final = 0xFFFFFFFE  # (uid_t)-1 means "no change" to the kernel
LOCK_DIR: Final = Path("/run/bastion-ids")  # one lock file per id in use, shared by every server of the host
_LOCK_DIR_ATTEMPTS: Final = 4  # another server may remove the folder as it closes, each time we make it
ACCOUNT_FILES: Final = ("/etc/passwd", "/etc/group")
SUBORDINATE_FILES: Final = ("/etc/subuid", "/etc/subgid")


@dataclass(frozen=True)
class HostIdentity:
    """The host uid and gid a sandbox's processes run as; `switch` says the server must drop to it."""

    uid: int
    gid: int
    switch: bool


def parse_range(text: str) -> tuple[int, int]:
    """`"FIRST:COUNT"` (the format of /etc/subuid) into (first, count).

    Raises:
        ValueError: not two integers, or a range that reaches a reserved id.
    """
    first_text, sep, count_text = text.partition(":")
    if not sep or not first_text.isdigit() or not count_text.isdigit():
        raise ValueError(f"host_id_range {text!r} must be FIRST:COUNT, e.g. '{DEFAULT_HOST_ID_FIRST}:65536'")
    first, count = int(first_text), int(count_text)
    if count < 1 or count > 1 << 24:
        raise ValueError(f"host_id_range {text!r}: COUNT must be between 1 and {1 << 24}")
    last = first + count - 1
    if first <= OVERFLOW_ID + 1 or last > MAX_ID:
        raise ValueError(f"host_id_range {text!r} must lie between 65536 and {MAX_ID}: lower ids are real accounts")
    return first, count


def _account_ids(path: str) -> Iterable[tuple[str, int]]:
    """(name, id) of each entry of a passwd- or group-format file; missing file: none."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) >= 3 and fields[2].isdigit():
            yield fields[0], int(fields[2])


def _subordinate_ranges(path: str) -> Iterable[tuple[str, int, int]]:
    """(owner, first, count) of each line of /etc/subuid or /etc/subgid; missing file: none."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return
    for line in text.splitlines():
        fields = line.strip().split(":")
        if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
            yield fields[0], int(fields[1]), int(fields[2])


def range_conflict(
    first: int,
    count: int,
    *,
    account_files: Iterable[str] = ACCOUNT_FILES,
    subordinate_files: Iterable[str] = SUBORDINATE_FILES,
) -> str | None:
    """One line naming the first account or subordinate range inside [first, first+count); else None."""
    last = first + count - 1
    for path in account_files:
        for name, number in _account_ids(path):
            if first <= number <= last:
                return f"{path} has {name!r} with id {number}, inside host_id_range {first}:{count}"
    for path in subordinate_files:
        for owner, sub_first, sub_count in _subordinate_ranges(path):
            if sub_first <= last and first <= sub_first + sub_count - 1:
                return f"{path} gives {owner!r} {sub_first}:{sub_count}, which overlaps host_id_range {first}:{count}"
    return None


class IdentityPool:
    """Hands out one identity per live sandbox, from the configured range when the server is root.

    Ids are taken round-robin, so a released id is the last to be handed out again; one another
    server holds (its lock file is locked) is skipped.
    """

    def __init__(
        self,
        first: int,
        count: int,
        *,
        server_uid: int | None = None,
        server_gid: int | None = None,
        lock_dir: Path = LOCK_DIR,
    ) -> None:
        self._first = first
        self._count = count
        self._uid = os.geteuid() if server_uid is None else server_uid
        self._gid = os.getegid() if server_gid is None else server_gid
        self._lock_dir = lock_dir
        self._held: dict[int, int] = {}  # offset -> fd of its locked file
        self._next = 0
        self._lock = threading.Lock()

    @property
    def switches(self) -> bool:
        """Whether sandboxes run as ids of their own (the server is root)."""
        return self._uid == 0

    @property
    def range(self) -> tuple[int, int]:
        return self._first, self._count

    def acquire(self) -> HostIdentity:
        """A fresh identity (the server's own when it is not root).

        Raises:
            ResourceLimit: every id of the range belongs to a live sandbox, of this server or another.
            Unavailable: the shared lock folder kept being removed by other servers closing.
        """
        if not self.switches:
            return HostIdentity(self._uid, self._gid, switch=False)
        with self._lock:
            _make_folder(self._lock_dir)
            for step in range(self._count):
                offset = (self._next + step) % self._count
                if offset in self._held:
                    continue
                fd = self._take(self._first + offset)
                if fd is not None:
                    self._held[offset] = fd
                    self._next = (offset + 1) % self._count
                    number = self._first + offset
                    return HostIdentity(number, number, switch=True)
        raise ResourceLimit(f"all {self._count} ids of host_id_range are in use: close a sandbox or widen the range")

    def _take(self, number: int) -> int | None:
        """The locked fd of `number`'s lock file, or None if another server holds it."""
        path = self._lock_dir / str(number)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        for _ in range(_LOCK_DIR_ATTEMPTS):
            try:
                fd = os.open(path, flags, 0o600)
                break
            except FileNotFoundError:
                # Another server, closing as the last one, removed the (then empty) folder after our
                # mkdir: make it again (seen under a parallel test run, as a traceback at start).
                _make_folder(self._lock_dir)
        else:
            raise Unavailable(
                f"{self._lock_dir} was removed {_LOCK_DIR_ATTEMPTS} times while taking an id "
                "(other servers closing): try again"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # A holder that released meanwhile unlinked the file we opened: ours is then no lock at all.
            if os.fstat(fd).st_ino != os.stat(path, follow_symlinks=False).st_ino:
                raise BlockingIOError
        except (BlockingIOError, FileNotFoundError):
            os.close(fd)
            return None
        return fd

    def release(self, identity: HostIdentity) -> None:
        if not identity.switch:
            return
        with self._lock:
            fd = self._held.pop(identity.uid - self._first, None)
            if fd is not None:
                # Unlinked while still locked, so whoever opens the name next makes a new file.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._lock_dir / str(identity.uid))
                os.close(fd)

    def in_use(self) -> int:
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        """Release every id (the server is ending), remove the lock files of servers that crashed, and
        remove the lock folder if no server uses it."""
        with self._lock:
            held, self._held = self._held, {}
        for offset, fd in held.items():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._lock_dir / str(self._first + offset))
            os.close(fd)
        if held:
            self._remove_stale()
            with contextlib.suppress(OSError):
                self._lock_dir.rmdir()

    def _remove_stale(self) -> None:
        """Unlink the lock files nobody holds: a crashed server's (the kernel drops its locks, not its files),
        which would keep the folder in /run for good. Each is locked first and unlinked while locked, as
        `release` does: a server opening that name meanwhile finds its file unlinked and takes another."""
        try:
            names = [name for name in os.listdir(self._lock_dir) if name.isdigit()]
        except OSError:
            return
        for name in names:
            path = self._lock_dir / name
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino:
                    os.unlink(path)
            except OSError:  # held by a live server (BlockingIOError), or gone meanwhile
                pass
            finally:
                os.close(fd)


def _make_folder(path: Path) -> None:
    """The lock folder, made if missing. Not `Path.mkdir(exist_ok=True)`: after EEXIST it checks `is_dir()`,
    and raised FileExistsError when another server, closing, removed the folder in between (seen under a
    parallel test run). A folder removed after this returns is met by `_take`'s retries."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)


def unreachable_folder(path: Path) -> Path | None:
    """The first folder on the way to `path` that a sandbox's own id could not pass through (no o+x); else None.

    A sandbox's bubblewrap runs as its own id, so it resolves its binds' paths as that id.
    """
    current = Path("/")
    for part in path.resolve().parts[1:]:
        current /= part
        try:
            mode = current.stat().st_mode
        except FileNotFoundError:
            return None  # made by bastion later, with the mode it needs
        if not mode & stat.S_IXOTH:
            return current
    return None

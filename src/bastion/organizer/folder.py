"""An organizer folder reached only through directory fds. THIS MODULE IS A SECURITY BOUNDARY.

What it guarantees:

- Paths are validated lexically by the jail (`bastion.safety.paths.Jail.relative`): no ``..``
  above the root, no absolute path outside it, no ``~``, no control or invisible characters.
- Every folder is opened one component at a time from the root's fd with ``O_NOFOLLOW |
  O_DIRECTORY``: a symbolic link anywhere in a path is refused, never followed, even one that
  stays inside the folder. A folder swapped for a symlink after a plan was made is refused at
  the open that counts.
- Every move is ``renameat2(RENAME_NOREPLACE)`` between two directory fds: the kernel refuses
  to replace an existing destination, including one created a microsecond earlier by a racing
  process. There is no fallback to rename(2).
- Nothing is deleted: the only removal is ``rmdir`` of a folder, which the kernel refuses
  unless it is empty.

What it does not guarantee:

- A directory fd follows its folder: if another process renames a folder the organizer holds
  open to somewhere else on the same file system, a move lands there (as with the jail).
  The inbox itself is checked (`Folder.check_root`) at every call: one renamed, deleted or
  replaced at its configured path is refused until the server restarts, point-in-time.
- Bind mounts inside the folder are crossed; a move across one fails with EXDEV.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from types import TracebackType
from typing import Final

from bastion.organizer._rename import RENAME_NOREPLACE, load_renameat2
from bastion.safety.errors import (
    BastionError,
    Conflict,
    InvalidRequest,
    NotFound,
    OperationFailed,
    PathEscape,
    ResourceLimit,
    Unavailable,
)
from bastion.safety.paths import Jail

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_DIR_MODE: Final = 0o755
MAX_SCAN_ENTRIES: Final = 100_000


def split(rel: str) -> tuple[str, str]:
    """(parent, name) of a relative path; the parent of a top-level name is ``.``."""
    parent, _, name = rel.rpartition("/")
    return parent or ".", name


def _plain(name: str) -> str:
    """`name` when it is one plain path component; ``..`` would climb out of the folder even with O_NOFOLLOW.

    Callers pass paths from `Folder.relative`, which never have such components; this refuses
    the rest (e.g. a path read back from a damaged journal) at the calls that touch the disk.
    """
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise PathEscape("a path with an empty, '.' or '..' component is refused: pass a plain path inside the folder")
    return name


def _rename_error(code: int, src: str, dst: str) -> BastionError:
    detail = f"renameat2 {src} -> {dst}: {errno.errorcode.get(code, str(code))}"
    if code in (errno.EEXIST, errno.ENOTEMPTY):
        return Conflict(f"'{dst}' already exists: nothing is overwritten; choose another name", detail=detail)
    if code == errno.ENOENT:
        return NotFound(f"'{src}' does not exist (any more): list the files again", detail=detail)
    if code == errno.EXDEV:
        return OperationFailed(f"'{src}' and '{dst}' are on different file systems: move within one", detail=detail)
    if code == errno.EINVAL:
        return InvalidRequest(
            f"the kernel refused to move '{src}' to '{dst}' (a folder into itself, or a file system "
            "without RENAME_NOREPLACE)",
            detail=detail,
        )
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EMLINK):
        return ResourceLimit(f"no room to move '{src}' to '{dst}': free space", detail=detail)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS, errno.EBUSY):
        return OperationFailed(f"the operating system refused to move '{src}': check permissions", detail=detail)
    return OperationFailed(f"could not move '{src}' to '{dst}' ({os.strerror(code)})", detail=detail)


class Folder:
    """One organizer folder (an inbox), held open as a directory fd from construction to `close`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        """Open the folder.

        Raises:
            BastionError: NotFound, InvalidRequest, Unavailable (no openat2 or renameat2).
        """
        self._rename = load_renameat2()
        self._configured = Path(root)
        # The jail resolves the root once and provides the lexical path rules.
        self._jail = Jail(os.fspath(root), secret_patterns=())
        path_fd = self._jail.open_dir_fd(".")
        try:
            self._fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=path_fd)
        finally:
            os.close(path_fd)
        held = os.fstat(self._fd)
        self._held = (held.st_dev, held.st_ino)

    @property
    def root(self) -> Path:
        return Path(self._jail.root)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
        self._jail.close()

    def check_root(self) -> None:
        """Refuse when the configured path no longer names the folder held open since the start.

        An inbox deleted and re-created (or renamed away) under a running server would otherwise
        be served from the old folder: empty listings, "moved: 0", NOT_FOUND.

        Raises:
            Unavailable: the path is gone or is another folder now.
        """
        try:
            info = os.stat(self._configured)
        except OSError:
            now = "was deleted or renamed"
        else:
            if (info.st_dev, info.st_ino) == self._held:
                return
            now = "was replaced by another folder"
        raise Unavailable(
            f"the inbox folder {self._configured} {now} while the server ran, and the server still holds the "
            "old one: restart the server to organize the folder now at that path"
        )

    def relative(self, path: str) -> str:
        """The normalized folder-relative path (``.`` for the root), checked without touching the disk.

        Raises:
            BastionError: InvalidRequest (unsafe characters, too long), PathEscape.
        """
        return self._jail.relative(path)

    def open_dir(self, rel: str, *, create: bool = False, created: list[str] | None = None) -> int:
        """Open a folder, one component at a time, never following a link; the caller closes the fd.

        Args:
            rel: a path from `relative`.
            create: create missing folders (mode 0755) with mkdirat under their parent's fd.
            created: receives the relative path of each folder this call created, in order.

        Raises:
            BastionError: NotFound (missing, without create), PathEscape (a symbolic link),
                InvalidRequest (not a folder), OperationFailed.
        """
        if rel == ".":
            return os.dup(self._fd)
        parts = [_plain(part) for part in rel.split("/")]
        current = os.dup(self._fd)
        try:
            for index, part in enumerate(parts):
                prefix = "/".join(parts[: index + 1])
                following = self._open_child(current, part, prefix, create, created)
                os.close(current)
                current = following
        except BaseException:
            os.close(current)
            raise
        return current

    def _open_child(self, parent: int, name: str, prefix: str, create: bool, created: list[str] | None) -> int:
        for _ in range(3):
            try:
                return os.open(name, _DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError as exc:
                if not create:
                    raise NotFound(f"the folder '{prefix}' does not exist", detail=f"{prefix}: ENOENT") from exc
                try:
                    os.mkdir(name, _NEW_DIR_MODE, dir_fd=parent)
                except FileExistsError:
                    continue  # created by someone else meanwhile: open it, still without following links
                except OSError as mk_exc:
                    raise OperationFailed(f"could not create the folder '{prefix}' ({mk_exc.strerror})") from mk_exc
                if created is not None:
                    created.append(prefix)
            except (NotADirectoryError, OSError) as exc:
                if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise OperationFailed(f"could not open the folder '{prefix}' ({exc.strerror})") from exc
                raise self._not_a_folder(parent, name, prefix) from exc
        raise OperationFailed(f"the folder '{prefix}' kept changing while it was opened: try again")

    @staticmethod
    def _not_a_folder(parent: int, name: str, prefix: str) -> BastionError:
        try:
            info = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except OSError:
            return OperationFailed(f"the folder '{prefix}' changed while it was opened: try again")
        if stat.S_ISLNK(info.st_mode):
            return PathEscape(f"'{prefix}' is a symbolic link: the organizer never follows links")
        return InvalidRequest(f"'{prefix}' is not a folder")

    def lstat_at(self, dir_fd: int, name: str) -> os.stat_result | None:
        """lstat of `name` in an open folder; None when it does not exist."""
        try:
            return os.stat(_plain(name), dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def lstat(self, rel: str) -> os.stat_result | None:
        """lstat of a path, its parents opened without following links; None when it or a parent is missing.

        Raises:
            BastionError: PathEscape (a parent is a symbolic link), InvalidRequest (a parent is not a folder).
        """
        if rel == ".":
            return os.fstat(self._fd)
        parent, name = split(rel)
        try:
            fd = self.open_dir(parent)
        except NotFound:
            return None
        try:
            return self.lstat_at(fd, name)
        finally:
            os.close(fd)

    def scan(self, rel: str) -> list[tuple[str, os.stat_result]]:
        """Every entry of a folder with its lstat, sorted by name; entries that vanish meanwhile are left out.

        Raises:
            BastionError: ResourceLimit (more than ``MAX_SCAN_ENTRIES``), or as `open_dir`.
        """
        fd = self.open_dir(rel)
        found: list[tuple[str, os.stat_result]] = []
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if len(found) >= MAX_SCAN_ENTRIES:
                        raise ResourceLimit(
                            f"'{rel}' has more than {MAX_SCAN_ENTRIES} entries: tidy part of it by hand first"
                        )
                    try:
                        found.append((entry.name, entry.stat(follow_symlinks=False)))
                    except FileNotFoundError:
                        continue
        finally:
            os.close(fd)
        found.sort(key=lambda item: item[0])
        return found

    def rename(self, src_fd: int, src_name: str, dst_fd: int, dst_name: str, *, src: str, dst: str) -> None:
        """renameat2(RENAME_NOREPLACE) between two open folders.

        Raises:
            BastionError: Conflict (the destination exists), NotFound, InvalidRequest, OperationFailed.
        """
        old, new = os.fsencode(_plain(src_name)), os.fsencode(_plain(dst_name))
        result = self._rename(src_fd, old, dst_fd, new, RENAME_NOREPLACE)
        if result < 0:
            raise _rename_error(-result, src, dst)

    def rmdir_if_empty(self, rel: str) -> bool:
        """Remove a folder only if it is empty (the kernel decides); True when it was removed."""
        parent, name = split(rel)
        try:
            fd = self.open_dir(parent)
        except NotFound:
            return False
        try:
            os.rmdir(_plain(name), dir_fd=fd)
        except OSError:
            return False
        finally:
            os.close(fd)
        return True

    def __enter__(self) -> Folder:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Dirs:
    """Folder fds opened once per operation (``rel -> fd``), closed together; fsync'd on request."""

    def __init__(self, folder: Folder) -> None:
        self._folder = folder
        self._fds: dict[str, int] = {}

    def get(self, rel: str, *, create: bool = False, created: list[str] | None = None) -> int:
        fd = self._fds.get(rel)
        if fd is None:
            fd = self._folder.open_dir(rel, create=create, created=created)
            self._fds[rel] = fd
        return fd

    def forget(self, rel: str) -> None:
        """Drop (and close) the fds of `rel` and everything below it, e.g. after it was removed."""
        for key in [key for key in self._fds if key == rel or key.startswith(rel + "/")]:
            os.close(self._fds.pop(key))

    def sync(self) -> None:
        """fsync every folder opened, so the renames in them are on disk."""
        for fd in self._fds.values():
            os.fsync(fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Dirs:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

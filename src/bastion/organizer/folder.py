"""An organizer folder reached only through directory fds. THIS MODULE IS A SECURITY BOUNDARY.

What it guarantees:

- The inbox is opened by one lookup that follows no symbolic link (`paths.open_real_folder`):
  a configured path with a symbolic link anywhere on it is refused,
  never resolved, so a local user who owns a folder on the path cannot point the root
  organizer elsewhere (``Downloads -> /etc``). `Folder.check_root` opens it the same way.
- Paths are validated lexically by the jail (`bastion.safety.paths.Jail.relative`): no ``..``
  above the root, no absolute path outside it, no ``~``, no control or invisible characters.
- Every folder is opened one component at a time from the root's fd with ``O_NOFOLLOW |
  O_DIRECTORY``: a symbolic link anywhere in a path is refused, never followed, even one that
  stays inside the folder. A folder swapped for a symlink after a plan was made is refused at
  the open that counts.
- A folder the organizer creates is given the inbox's owner and group (a root server's would
  be root's, and the user could no longer rename or delete what was moved into it). It is
  chowned through an fd opened right after the mkdir, never by name: a name can be swapped
  (``renameat2(RENAME_EXCHANGE)``) for a hard link to another file, which root would then
  chown. Anything but the new empty folder found there refuses the action.
- Every move is ``renameat2(RENAME_NOREPLACE)`` between two directory fds: the kernel refuses
  to replace an existing destination, including one created a microsecond earlier by a racing
  process. There is no fallback to rename(2).
- Nothing is deleted: the only removal is ``rmdir`` of a folder, which the kernel refuses
  unless it is empty.

What it does not guarantee:

- A directory fd follows its folder: if another process renames a folder the organizer holds
  open to somewhere else on the same file system, a move lands there (as with the jail).
  The inbox itself is checked (`Folder.check_root`) at every call: one renamed, deleted or
  replaced (by another folder or a symbolic link) at its configured path is refused until the
  server restarts, point-in-time.
- A server not running as root cannot give a folder away: the folders it makes are its own.
- Bind mounts inside the folder are crossed; a move across one fails with EXDEV.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TypeVar, cast

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
from bastion.safety.paths import (
    Jail,
    acting_as,
    moved_into_by,
    open_real_folder,
    owner_identity,
    writers_besides,
)

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


def _absolute(path: str) -> str:
    """`path` with empty and ``.`` components dropped; refused unless absolute and free of ``..``."""
    if not os.path.isabs(path) or "\0" in path:
        raise InvalidRequest(f"the inbox path {path} is not absolute: configure an absolute path")
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise InvalidRequest(f"the inbox path {path} has a '..' in it: configure the folder's real path")
    return "/" + "/".join(parts)


def _not_made(prefix: str, found: str) -> Conflict:
    return Conflict(
        f"'{prefix}' is not the empty folder the organizer just created there ({found}), so it was not given the "
        "inbox's owner and the action was refused: look at what is there now"
    )


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


_F = TypeVar("_F", bound=Callable[..., Any])


def _as_owner(method: _F) -> _F:
    """A `Folder` operation run as the inbox's owner when the organizer acts as them (`Folder._acts_as`)."""

    @functools.wraps(method)
    def acting(self: Folder, *args: Any, **kwargs: Any) -> Any:
        with acting_as(*self._acts_as) if self._acts_as is not None else contextlib.nullcontext():
            return method(self, *args, **kwargs)

    return cast(_F, acting)


class Folder:
    """One organizer folder (an inbox), held open as a directory fd from construction to `close`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        """Open the folder.

        Raises:
            BastionError: NotFound, InvalidRequest (also: another user could replace it), PathEscape (a
                symbolic link on the path), Unavailable (no openat2 or renameat2).
        """
        self._rename = load_renameat2()
        self._path = _absolute(os.fspath(root))
        path_fd = open_real_folder(self._path, what="the inbox path")
        try:
            self._fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=path_fd)
        finally:
            os.close(path_fd)
        held = os.fstat(self._fd)
        self._held = (held.st_dev, held.st_ino)
        owner = (held.st_uid, held.st_gid)
        self._owner = owner
        # A root organizer acts as the inbox's owner: it never moves what they could not (another user's
        # folder in the inbox), and what it makes is theirs.
        self._acts_as = owner_identity(owner)
        try:
            self._refuse_replaceable(owner)
            self._jail = self._lexical_rules()
        except BaseException:
            os.close(self._fd)
            raise

    def _refuse_replaceable(self, owner: tuple[int, int]) -> None:
        """A root organizer refuses an inbox another user could swap for a folder of theirs, or, root-owned, write
        (`moved_into_by`): a root-owned one renamed into the path would have its files moved about by root."""
        if os.geteuid() != 0:
            return
        try:
            who = moved_into_by(self._path, owner)
        except OSError as exc:
            raise InvalidRequest(f"the inbox {self._path} cannot be examined ({exc.strerror})") from exc
        if who is not None:
            raise InvalidRequest(
                f"the inbox {self._path} (owned by uid {owner[0]}) could be replaced by another folder by {who}: "
                "move the inbox to a folder only root or its owner can write"
            )

    def _lexical_rules(self) -> Jail:
        """The jail, for its lexical path rules only: nothing is ever opened through its fd."""
        jail = Jail(self._path, secret_patterns=())
        if jail.root != self._path:  # its own lookup met a link put there since ours
            jail.close()
            raise OperationFailed(f"the inbox path {self._path} changed while it was opened: try again")
        return jail

    @property
    def root(self) -> Path:
        return Path(self._path)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
        self._jail.close()

    def check_root(self) -> None:
        """Refuse when the configured path no longer names the folder held open since the start.

        An inbox deleted and re-created (or renamed away) under a running server would otherwise
        be served from the old folder: empty listings, "moved: 0", NOT_FOUND. The path is opened
        as at the start, following no link: a link put on it is refused, not followed.

        Raises:
            Unavailable: the path is gone, is another folder now, or goes through a symbolic link.
        """
        try:
            fd = open_real_folder(self._path, what="the inbox path")
        except PathEscape:
            raise Unavailable(
                f"the inbox folder {self._path} was replaced by a symbolic link (it or a folder on its path) while "
                "the server ran, and the organizer follows no link there: configure the folder's real path and "
                "restart the server"
            ) from None
        except BastionError:
            now = "was deleted or renamed"
        else:
            try:
                info = os.fstat(fd)
            finally:
                os.close(fd)
            if (info.st_dev, info.st_ino) == self._held:
                return
            now = "was replaced by another folder"
        raise Unavailable(
            f"the inbox folder {self._path} {now} while the server ran, and the server still holds the "
            "old one: restart the server to organize the folder now at that path"
        )

    def foreign(self, rel: str, info: os.stat_result) -> str | None:
        """Who besides the inbox's owner and root owns folder `rel` of the inbox (`info`: its lstat), or may
        write it (its mode or ACL), said as "owned by ..." or "writable by ..."; None if no one.

        Point-in-time, by path: a folder swapped after it is judged is refused at the open that counts only
        if it became a link; the owner of a folder in the inbox can always change its mode.
        """
        if info.st_uid not in (0, self._owner[0]):
            return f"owned by uid {info.st_uid}"
        try:
            who = writers_besides(os.path.join(self._path, rel), self._owner)
        except OSError as exc:
            return f"unreadable ({exc.strerror})"
        return None if who is None else f"writable by {who}"

    def relative(self, path: str) -> str:
        """The normalized folder-relative path (``.`` for the root), checked without touching the disk.

        Raises:
            BastionError: InvalidRequest (unsafe characters, too long), PathEscape.
        """
        return self._jail.relative(path)

    @_as_owner
    def open_dir(self, rel: str, *, create: bool = False, created: list[str] | None = None) -> int:
        """Open a folder, one component at a time, never following a link; the caller closes the fd.

        Args:
            rel: a path from `relative`.
            create: create missing folders (mode 0755, the inbox's owner) with mkdirat under their parent's fd.
            created: receives the relative path of each folder this call created, in order.

        Raises:
            BastionError: NotFound (missing, without create), PathEscape (a symbolic link),
                InvalidRequest (not a folder), Conflict (a folder just made was swapped), OperationFailed.
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
            except OSError as exc:
                if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise OperationFailed(f"could not open the folder '{prefix}' ({exc.strerror})") from exc
                raise self._not_a_folder(parent, name, prefix) from exc
            if self._make(parent, name, prefix):
                if created is not None:
                    created.append(prefix)
                return self._open_made(parent, name, prefix)
            # created by someone else meanwhile: open it, still without following links
        raise OperationFailed(f"the folder '{prefix}' kept changing while it was opened: try again")

    @staticmethod
    def _make(parent: int, name: str, prefix: str) -> bool:
        """mkdirat; False when the name was taken meanwhile."""
        try:
            os.mkdir(name, _NEW_DIR_MODE, dir_fd=parent)
        except FileExistsError:
            return False
        except OSError as exc:
            raise OperationFailed(f"could not create the folder '{prefix}' ({exc.strerror})") from exc
        return True

    def _open_made(self, parent: int, name: str, prefix: str) -> int:
        """Open the folder just made and give it the inbox's owner through that fd, never by name.

        Between the mkdir and this open, whoever can write the parent can swap the new folder for
        a hard link to another file (renameat2 RENAME_EXCHANGE): O_DIRECTORY refuses a file,
        O_NOFOLLOW a symbolic link, and a folder cannot be hard-linked.
        """
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                raise _not_made(prefix, "it was removed, or replaced by a file or a link") from exc
            raise OperationFailed(f"could not open the folder '{prefix}' just created ({exc.strerror})") from exc
        try:
            self._give_owner(fd, prefix)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _give_owner(self, fd: int, prefix: str) -> None:
        try:
            root, made = os.fstat(self._fd), os.fstat(fd)
            owner = (root.st_uid, root.st_gid)
            if self._acts_as is not None:  # made as the owner: theirs, with the group a setgid parent gives
                if made.st_uid != owner[0]:
                    raise _not_made(prefix, f"a folder owned by uid {made.st_uid}")
                return
            # Only root can give a folder away; a server not running as root keeps its own.
            if (made.st_uid, made.st_gid) == owner or os.geteuid() != 0:
                return
            if made.st_uid != 0:
                raise _not_made(prefix, f"a folder owned by uid {made.st_uid}")
            if _has_entries(fd):
                raise _not_made(prefix, "a folder with entries in it")
            os.fchown(fd, *owner)
        except OSError as exc:
            raise OperationFailed(
                f"could not give the new folder '{prefix}' the inbox's owner ({exc.strerror}): the action was refused"
            ) from exc

    @staticmethod
    def _not_a_folder(parent: int, name: str, prefix: str) -> BastionError:
        try:
            info = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except OSError:
            return OperationFailed(f"the folder '{prefix}' changed while it was opened: try again")
        if stat.S_ISLNK(info.st_mode):
            return PathEscape(f"'{prefix}' is a symbolic link: the organizer never follows links")
        return InvalidRequest(f"'{prefix}' is not a folder")

    @_as_owner
    def lstat_at(self, dir_fd: int, name: str) -> os.stat_result | None:
        """lstat of `name` in an open folder; None when it does not exist."""
        try:
            return os.stat(_plain(name), dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:  # acting as the owner: a folder they cannot search (mode 0644)
            raise OperationFailed(f"'{name}' cannot be examined ({exc.strerror})") from exc

    @_as_owner
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

    @_as_owner
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
                    except OSError as exc:  # acting as the owner: a folder they can list but not search
                        raise OperationFailed(f"'{rel}' cannot be examined ({exc.strerror})") from exc
        finally:
            os.close(fd)
        found.sort(key=lambda item: item[0])
        return found

    @_as_owner
    def rename(self, src_fd: int, src_name: str, dst_fd: int, dst_name: str, *, src: str, dst: str) -> None:
        """renameat2(RENAME_NOREPLACE) between two open folders.

        Raises:
            BastionError: Conflict (the destination exists), NotFound, InvalidRequest, OperationFailed.
        """
        old, new = os.fsencode(_plain(src_name)), os.fsencode(_plain(dst_name))
        result = self._rename(src_fd, old, dst_fd, new, RENAME_NOREPLACE)
        if result < 0:
            raise _rename_error(-result, src, dst)

    @_as_owner
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


def _has_entries(fd: int) -> bool:
    with os.scandir(fd) as entries:
        return next(entries, None) is not None


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

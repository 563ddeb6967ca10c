"""Extracting a snapshot archive into an empty folder, never writing outside it. THIS MODULE IS A SECURITY BOUNDARY.

`bastion.sandbox.snapshot.restore_snapshot` checks the archive's sha256 against its record,
then calls `_extract` on the same open fd. The archive is treated as hostile even though this
server wrote it:

- `tarfile.TarFile.extractall` is not used. Member names must be relative, without ``..``,
  empty or ``.`` components, backslashes, control or invisible characters. Only regular
  files, folders and symlinks are accepted: hard links, devices, FIFOs and anything else
  refuse the whole restore.
- Every write happens relative to a folder fd opened ``O_DIRECTORY | O_NOFOLLOW`` one
  component at a time from the target, and files are created ``O_CREAT | O_EXCL |
  O_NOFOLLOW``: a symlink made by an earlier member (``a -> /etc``) can never redirect a
  later one (``a/passwd``), and nothing existing is ever overwritten.
- Symlink targets are restored verbatim. That is safe only because they are resolved inside
  the sandbox or through the openat2 jail (`bastion.safety.paths`); host code must never
  follow a path inside a workspace by string.
- Modes (minus setuid/setgid) and mtimes are set through fds, or ``dir_fd`` with
  ``follow_symlinks=False``; folders get theirs last, deepest first.
- Size, entry count and depth are bounded (`MAX_SNAPSHOT_BYTES`, `MAX_ENTRIES`, `MAX_DEPTH`,
  defined here and enforced by `bastion.sandbox._archive` too), and so is the decompressed
  stream.

What it does not guarantee:

- `tarfile` parses headers before the checks here see them; the decompressed stream is
  bounded, but a PAX header is read into memory whole, and the read side keeps one
  `tarfile.TarInfo` per member (bounded by `MAX_ENTRIES`).
- Restored entries belong to the server's uid: ownership is not restored.
- On a failed restore the target is left partly filled: the caller discards it, without
  following the symlinks it may now contain.
"""

from __future__ import annotations

import errno
import gzip
import math
import os
import stat
import tarfile
import zlib
from typing import TYPE_CHECKING, BinaryIO, Final, Literal

from bastion.safety.errors import InvalidRequest, OperationFailed, PathEscape, PolicyDenied, ResourceLimit
from bastion.safety.paths import name_problem

if TYPE_CHECKING:
    from bastion.sandbox.snapshot import SnapshotInfo

MAX_SNAPSHOT_BYTES: Final = 2 * 1024**3
MAX_ENTRIES: Final = 200_000
MAX_DEPTH: Final = 128
# setuid and setgid are never restored.
_KEPT_MODE_BITS: Final = 0o7777 & ~(stat.S_ISUID | stat.S_ISGID)
_MAX_PATH_BYTES: Final = 4096
_MAX_LINK_BYTES: Final = 4095
# The decompressed tar stream holds content plus, per member, a header, a PAX header with
# path, linkpath and mtime, and padding; the slack covers read-ahead and the end blocks.
# Together they bound what a hostile header could make `tarfile` read.
_STREAM_BYTES_PER_ENTRY: Final = 5 * tarfile.BLOCKSIZE + 2 * _MAX_PATH_BYTES
_STREAM_SLACK_BYTES: Final = 1 << 20
_MTIME_LIMIT_S: Final = 2.0**40
_CHUNK_BYTES: Final = 1 << 20
_IMPLICIT_DIR_MODE: Final = 0o755

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC

_Kind = Literal["file", "dir", "symlink"]


class _BoundedReader:
    """The decompressed tar stream, refused once it is longer than any honest snapshot could be."""

    def __init__(self, inner: gzip.GzipFile, limit: int) -> None:
        self._inner = inner
        self._limit = limit
        self._used = 0

    def read(self, size: int, /) -> bytes:
        data = self._inner.read(size)
        self._used += len(data)
        if self._used > self._limit:
            raise ResourceLimit(f"the snapshot unpacks to over {self._limit} bytes: it cannot be restored")
        return data

    def write(self, data: bytes, /) -> int:
        raise OSError(errno.EBADF, "the snapshot stream is read-only")

    def tell(self) -> int:
        return self._used

    def seek(self, pos: int, /) -> int:
        raise OSError(errno.ESPIPE, "the snapshot stream is not seekable")

    def close(self) -> None:
        return None


def _extract(raw: BinaryIO, target_fd: int, info: SnapshotInfo, owner: tuple[int, int] | None = None) -> None:
    limit = MAX_SNAPSHOT_BYTES + MAX_ENTRIES * _STREAM_BYTES_PER_ENTRY + _STREAM_SLACK_BYTES
    extractor = _Extractor(target_fd, owner)
    try:
        with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
            # Stream mode ("r|"): members are read once, in order, never by seeking back.
            reader = _BoundedReader(stream, limit)
            with tarfile.open(fileobj=reader, mode="r|", encoding="utf-8", errors="strict") as tar:
                for member in tar:
                    extractor.add(member, tar)
        extractor.finish()
    except (tarfile.TarError, gzip.BadGzipFile, EOFError, zlib.error, UnicodeError) as exc:
        raise OperationFailed(f"snapshot {info.id} is corrupt: delete it and take a new one", detail=repr(exc)) from exc
    finally:
        extractor.close()
    if (extractor.files, extractor.bytes) != (info.files, info.bytes):
        raise OperationFailed(f"snapshot {info.id} is corrupt: its content does not match its record")


class _Extractor:
    """Creates members beneath the target fd only, one ``*at`` call under a held folder fd at a time."""

    def __init__(self, root_fd: int, owner: tuple[int, int] | None = None) -> None:
        self._root_fd = root_fd
        # The sandbox's host identity: what it restores must be its own, not the server's root.
        self._owner = owner
        # Open fds of the parent folder of the last member, one per component.
        self._chain: list[tuple[str, int]] = []
        self._dirs: dict[tuple[str, ...], tuple[int, float]] = {}
        self.entries = 0
        self.files = 0
        self.bytes = 0

    def add(self, member: tarfile.TarInfo, tar: tarfile.TarFile) -> None:
        self.entries += 1
        if self.entries > MAX_ENTRIES:
            raise ResourceLimit(f"the snapshot has more than {MAX_ENTRIES} entries: it cannot be restored")
        parts = _member_parts(member.name)
        kind = _member_kind(member)
        mtime = _member_mtime(member)
        parent_fd = self._parent(parts[:-1], member.name)
        name = parts[-1]
        if kind == "dir":
            self._make_dir(parent_fd, name, member.name)
            self._dirs[parts] = (member.mode & _KEPT_MODE_BITS, mtime)
        elif kind == "symlink":
            problem = _link_problem(member.linkname)
            if problem is not None:
                raise InvalidRequest(f"the symlink '{member.name}' in the snapshot {problem}: it cannot be restored")
            try:
                os.symlink(member.linkname, name, dir_fd=parent_fd)
            except FileExistsError as exc:
                raise _duplicate(member.name) from exc
            self._own(parent_fd, name)
            os.utime(name, times=(mtime, mtime), dir_fd=parent_fd, follow_symlinks=False)
        else:
            self._make_file(parent_fd, name, member, tar, mtime)

    def finish(self) -> None:
        self._close_chain(0)
        # Deepest first: setting a folder's mtime must come after everything created in it,
        # and a read-only folder must still let us into its subfolders.
        for parts, (mode, mtime) in sorted(self._dirs.items(), key=lambda item: len(item[0]), reverse=True):
            fd = self._open_path(parts)
            try:
                os.fchmod(fd, mode)
                os.utime(fd, times=(mtime, mtime))
            finally:
                os.close(fd)

    def close(self) -> None:
        self._close_chain(0)

    def _make_dir(self, parent_fd: int, name: str, rel: str) -> None:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError as exc:
            if not stat.S_ISDIR(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode):
                raise _duplicate(rel) from exc
            return
        self._own(parent_fd, name)

    def _own(self, parent_fd: int, name: str) -> None:
        """chown what was just made, never through a link (nothing else writes here during a restore)."""
        if self._owner is not None:
            os.chown(name, *self._owner, dir_fd=parent_fd, follow_symlinks=False)

    def _make_file(
        self, parent_fd: int, name: str, member: tarfile.TarInfo, tar: tarfile.TarFile, mtime: float
    ) -> None:
        size = member.size
        if self.bytes + size > MAX_SNAPSHOT_BYTES:
            raise ResourceLimit(
                f"the snapshot unpacks to over {MAX_SNAPSHOT_BYTES} bytes at '{member.name}': it cannot be restored"
            )
        source = tar.extractfile(member)
        if source is None:
            raise OperationFailed(f"snapshot member '{member.name}' has no content: the snapshot is corrupt")
        try:
            # O_EXCL: an existing name, even a dangling symlink, fails instead of being followed.
            fd = os.open(name, _CREATE_FLAGS, 0o600, dir_fd=parent_fd)
        except FileExistsError as exc:
            raise _duplicate(member.name) from exc
        copied = 0
        try:
            if self._owner is not None:
                os.fchown(fd, *self._owner)
            while chunk := source.read(_CHUNK_BYTES):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
                copied += len(chunk)
            if copied != size:
                raise OperationFailed(f"snapshot member '{member.name}' is truncated: the snapshot is corrupt")
            os.fchmod(fd, member.mode & _KEPT_MODE_BITS)
            os.utime(fd, times=(mtime, mtime))
        finally:
            os.close(fd)
        self.files += 1
        self.bytes += size

    def _parent(self, parts: tuple[str, ...], rel: str) -> int:
        common = 0
        while common < min(len(self._chain), len(parts)) and self._chain[common][0] == parts[common]:
            common += 1
        self._close_chain(common)
        for index in range(common, len(parts)):
            parent_fd = self._chain[-1][1] if self._chain else self._root_fd
            fd = self._open_or_make_dir(parent_fd, parts[index], rel, "/".join(parts[: index + 1]))
            self._chain.append((parts[index], fd))
        return self._chain[-1][1] if self._chain else self._root_fd

    def _open_or_make_dir(self, parent_fd: int, name: str, rel: str, prefix: str) -> int:
        try:
            return self._open_dir(parent_fd, name, rel, prefix)
        except FileNotFoundError:
            pass
        try:
            os.mkdir(name, _IMPLICIT_DIR_MODE, dir_fd=parent_fd)
        except FileExistsError:
            pass
        else:
            self._own(parent_fd, name)
        return self._open_dir(parent_fd, name, rel, prefix)

    def _open_dir(self, parent_fd: int, name: str, rel: str, prefix: str) -> int:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            # O_DIRECTORY | O_NOFOLLOW on a symlink fails with ENOTDIR or ELOOP: look at what is there.
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_symlink(parent_fd, name):
                raise PathEscape(
                    f"snapshot member '{rel}' would be written through the symlink '{prefix}': the snapshot is refused"
                ) from exc
            if exc.errno == errno.ENOTDIR:
                raise OperationFailed(
                    f"snapshot member '{rel}' needs '{prefix}' to be a folder: the snapshot is corrupt"
                ) from exc
            raise

    def _open_path(self, parts: tuple[str, ...]) -> int:
        fd = os.open(".", _DIR_FLAGS, dir_fd=self._root_fd)
        try:
            for index, part in enumerate(parts):
                following = self._open_dir(fd, part, "/".join(parts), "/".join(parts[: index + 1]))
                os.close(fd)
                fd = following
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _close_chain(self, keep: int) -> None:
        for _, fd in self._chain[keep:]:
            os.close(fd)
        del self._chain[keep:]


def _is_symlink(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _duplicate(rel: str) -> OperationFailed:
    return OperationFailed(f"snapshot member '{rel}' appears twice: the snapshot is corrupt")


def _member_parts(name: str) -> tuple[str, ...]:
    """The components of a member name, refusing anything that is not a plain relative path."""
    if name.startswith("/"):
        raise PathEscape(f"snapshot member {name!r} is an absolute path: the snapshot is refused")
    parts = tuple(name.split("/"))
    if ".." in parts:
        raise PathEscape(f"snapshot member {name!r} climbs out with '..': the snapshot is refused")
    if len(name.encode("utf-8", "surrogatepass")) > _MAX_PATH_BYTES:
        raise InvalidRequest(f"a snapshot member name is over {_MAX_PATH_BYTES} bytes: the snapshot is refused")
    if len(parts) > MAX_DEPTH + 1:
        raise ResourceLimit(f"snapshot member {name!r} is nested over {MAX_DEPTH} folders deep: it cannot be restored")
    for part in parts:
        problem = name_problem(part)
        if problem is not None:
            raise InvalidRequest(f"snapshot member {name!r} has a name that {problem}: the snapshot is refused")
    return parts


def _member_kind(member: tarfile.TarInfo) -> _Kind:
    kind = member.type
    if kind in (tarfile.REGTYPE, tarfile.AREGTYPE):
        return "file"
    if kind == tarfile.DIRTYPE:
        return "dir"
    if kind == tarfile.SYMTYPE:
        return "symlink"
    what = {
        tarfile.LNKTYPE: "a hard link",
        tarfile.CHRTYPE: "a character device",
        tarfile.BLKTYPE: "a block device",
        tarfile.FIFOTYPE: "a named pipe",
    }.get(kind, "not a file, folder or symlink")
    raise PolicyDenied(f"snapshot member {member.name!r} is {what}: the snapshot is refused")


def _member_mtime(member: tarfile.TarInfo) -> float:
    mtime = float(member.mtime)
    if not math.isfinite(mtime) or abs(mtime) > _MTIME_LIMIT_S:
        raise OperationFailed(f"snapshot member {member.name!r} has an impossible mtime: the snapshot is corrupt")
    return mtime


def _link_problem(target: str) -> str | None:
    """Why a symlink target cannot be stored; its text is otherwise kept verbatim."""
    if not target:
        return "is empty"
    if "\x00" in target:
        return "contains a NUL byte"
    try:
        encoded = target.encode("utf-8")
    except UnicodeEncodeError:
        return "is not UTF-8"
    if len(encoded) > _MAX_LINK_BYTES:
        return f"is over {_MAX_LINK_BYTES} bytes"
    return None

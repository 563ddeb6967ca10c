"""Extracting a snapshot archive into an empty folder, never writing outside it. THIS MODULE IS A SECURITY BOUNDARY.

`bastion.snapshot.store.restore_snapshot` checks the archive's sha256 against its record,
then calls `extract` on the same open fd. The archive is treated as hostile even though this
server wrote it:

- `tarfile.TarFile.extractall` is not used. Member names must be relative, without ``..``,
  empty or ``.`` components, backslashes, control or invisible characters. Only regular
  files, folders, symlinks and hard links to a file restored before are accepted: devices,
  FIFOs and anything else refuse the whole restore.
- A hard link member's target follows the member name rules; it is reached from the target
  folder's fd one component at a time (``O_NOFOLLOW``, never made) and must be a regular file
  of the target's filesystem (and the owner's, with an owner): ``linkat`` without
  ``AT_SYMLINK_FOLLOW`` then makes the new name. A link to a host file, a symlink, a folder or
  a name not restored yet refuses the restore. A link adds a name, never data.
- Every write happens relative to a folder fd opened ``O_DIRECTORY | O_NOFOLLOW`` one
  component at a time from the target, and files are created ``O_CREAT | O_EXCL |
  O_NOFOLLOW``: a symlink made by an earlier member (``a -> /etc``) can never redirect a
  later one (``a/passwd``), and nothing existing is ever overwritten.
- Symlink targets are restored verbatim. That is safe only because they are resolved inside
  the sandbox or through the openat2 jail (`bastion.safety.paths`); host code must never
  follow a path inside a workspace by string.
- Modes (minus setuid/setgid) and mtimes are set through fds, or ``dir_fd`` with
  ``follow_symlinks=False``; folders get theirs last, deepest first, from a tree that keeps
  each folder's own name only (its memory does not grow with depth).
- Headers are read by `bastion.snapshot._tarread`, which bounds each one before reading it
  (PAX header, GNU long name, sparse map), never by `tarfile`.
- Size, entry count and depth are bounded (`MAX_SNAPSHOT_BYTES`, `MAX_ENTRIES`, `MAX_DEPTH`,
  defined here and enforced by `bastion.snapshot._archive` too), and so is the decompressed
  stream. The size is the file data written (a sparse file's holes are free); a folder made
  for a member inside it, which no member names, counts as an entry.
- Sparse files stay sparse: a GNU sparse member's holes are never written, and every 4 KiB
  block of zeros in a file's content is skipped (seeked over) rather than written, so a
  1.5 GiB file of holes takes its data's blocks, not 1.5 GiB.
- With a `SpaceGuard`, the free space of the state filesystem is checked every 16 MiB
  written, a block counted for every folder and symlink made (30,000 empty folders, a 432 KB
  snapshot, took 125 MB of the disk image); a full disk (``ENOSPC``) is a ResourceLimit.
- mtimes are restored to the nanosecond (`os.utime` with ``ns``, never through a float).

What it does not guarantee:

- Restored entries belong to the server's uid unless an owner is given: ownership is not
  restored from the archive.
- Blocks of zeros become holes: the content is the same, the allocation may differ from the
  snapshotted file's.
- A sparse file's size is bounded by the target filesystem's largest file, not by
  `MAX_SNAPSHOT_BYTES`: its holes take no blocks (as in the workspace it came from).
- On a failed restore the target is left partly filled: the caller discards it, without
  following the symlinks it may now contain.
"""

from __future__ import annotations

import errno
import gzip
import os
import stat
import tarfile
import zlib
from typing import BinaryIO, Final, Literal, Protocol

from bastion.safety.errors import InvalidRequest, OperationFailed, PathEscape, PolicyDenied, ResourceLimit
from bastion.safety.paths import name_problem
from bastion.snapshot._space import SpaceGuard
from bastion.snapshot._tarread import (
    MAX_SPARSE_SEGMENTS_TOTAL,
    SPARSE_MAP_BYTES_PER_SEGMENT,
    CorruptArchive,
    Member,
    TarReader,
)


class Recorded(Protocol):
    """What `extract` checks an archive against: its snapshot's record (`store.SnapshotInfo`)."""

    @property
    def id(self) -> str: ...
    @property
    def files(self) -> int: ...
    @property
    def bytes(self) -> int: ...


MAX_SNAPSHOT_BYTES: Final = 2 * 1024**3
MAX_ENTRIES: Final = 200_000
MAX_DEPTH: Final = 128
# setuid and setgid are never restored.
KEPT_MODE_BITS: Final = 0o7777 & ~(stat.S_ISUID | stat.S_ISGID)
MAX_PATH_BYTES: Final = 4096
_MAX_LINK_BYTES: Final = 4095
# The decompressed tar stream holds content plus, per member, a header, a PAX header with
# path, linkpath and mtime, and padding, plus the sparse maps; the slack covers the end
# blocks. Together they bound the decompression work a hostile archive can cause.
_STREAM_BYTES_PER_ENTRY: Final = 5 * tarfile.BLOCKSIZE + 2 * MAX_PATH_BYTES
_STREAM_SLACK_BYTES: Final = 1 << 20
MTIME_LIMIT_S: Final = 2.0**40
_MTIME_LIMIT_NS: Final = int(MTIME_LIMIT_S) * 1_000_000_000
CHUNK_BYTES: Final = 1 << 20
_HOLE_BYTES: Final = 4096  # the block size of ext4 and tmpfs: a block of zeros is left a hole
_ENTRY_BLOCK_BYTES: Final = 4096  # what a folder (its first block) or a long symlink's target takes
_ZERO_HOLE: Final = bytes(_HOLE_BYTES)
_ZERO_CHUNK: Final = bytes(CHUNK_BYTES)
_IMPLICIT_DIR_MODE: Final = 0o755

DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC

_Kind = Literal["file", "dir", "symlink", "link"]


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


def _stream_limit() -> int:
    sparse_maps = MAX_SPARSE_SEGMENTS_TOTAL * SPARSE_MAP_BYTES_PER_SEGMENT
    return MAX_SNAPSHOT_BYTES + MAX_ENTRIES * _STREAM_BYTES_PER_ENTRY + sparse_maps + _STREAM_SLACK_BYTES


def extract(
    raw: BinaryIO,
    target_fd: int,
    info: Recorded,
    owner: tuple[int, int] | None = None,
    guard: SpaceGuard | None = None,
) -> None:
    extractor = _Extractor(target_fd, owner, guard)
    try:
        with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
            # Members are read once, in order, never by seeking back.
            reader = TarReader(_BoundedReader(stream, _stream_limit()))
            while (member := reader.next()) is not None:
                extractor.add(member, reader)
        extractor.finish()
    except (CorruptArchive, gzip.BadGzipFile, EOFError, zlib.error, UnicodeError) as exc:
        raise OperationFailed(f"snapshot {info.id} is corrupt: delete it and take a new one", detail=repr(exc)) from exc
    finally:
        extractor.close()
    if (extractor.files, extractor.bytes) != (info.files, info.bytes):
        raise OperationFailed(f"snapshot {info.id} is corrupt: its content does not match its record")


class _HoleWriter:
    """Writes a file's content at given offsets, leaving each 4 KiB block of zeros a hole."""

    def __init__(self, fd: int, guard: SpaceGuard | None) -> None:
        self._fd = fd
        self._guard = guard

    def write(self, offset: int, data: bytes) -> None:
        if len(data) == CHUNK_BYTES and data == _ZERO_CHUNK:
            return
        start: int | None = None  # where the run of non-zero blocks being gathered begins
        for position in range(0, len(data), _HOLE_BYTES):
            block = data[position : position + _HOLE_BYTES]
            zero = block == _ZERO_HOLE if len(block) == _HOLE_BYTES else not block.strip(b"\x00")
            if zero and start is not None:
                self._write_run(offset + start, data[start:position])
                start = None
            elif not zero and start is None:
                start = position
        if start is not None:
            self._write_run(offset + start, data[start:])

    def _write_run(self, offset: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.pwrite(self._fd, view, offset)
            view = view[written:]
            offset += written
        if self._guard is not None:
            self._guard.wrote(len(data), self._fd, "restore")


class _Folder:
    """A restored folder in the tree `_Extractor.finish` sets modes and mtimes from.

    One per folder, holding its children by their own names only: a folder's cost does not
    grow with its depth (a path per folder, 200,000 sibling folders at depth 127, took 2.3 GB).
    """

    __slots__ = ("children", "mode", "mtime_ns")

    def __init__(self) -> None:
        self.mode: int | None = None  # None: made for a member inside it, left as made
        self.mtime_ns = 0
        self.children: dict[str, _Folder] | None = None

    def child(self, name: str) -> _Folder:
        if self.children is None:
            self.children = {}
        found = self.children.get(name)
        if found is None:
            found = self.children[name] = _Folder()
        return found


class _Extractor:
    """Creates members beneath the target fd only, one ``*at`` call under a held folder fd at a time."""

    def __init__(self, root_fd: int, owner: tuple[int, int] | None = None, guard: SpaceGuard | None = None) -> None:
        self._root_fd = root_fd
        # The sandbox's host identity: what it restores must be its own, not the server's root.
        self._owner = owner
        self._guard = guard
        # The parent folder of the last member, one (name, open fd, tree node) per component.
        self._chain: list[tuple[str, int, _Folder]] = []
        # The folder of the last hard link's target, one (name, open fd) per component: many links to one file
        # 127 folders deep open them once.
        self._link_chain: list[tuple[str, int]] = []
        self._root_dev = os.fstat(root_fd).st_dev
        self._root = _Folder()
        self.entries = 0
        self.files = 0
        self.bytes = 0
        self.data_bytes = 0

    def add(self, member: Member, reader: TarReader) -> None:
        self._count_entry()
        parts = _member_parts(member.name)
        kind = _member_kind(member)
        mtime_ns = _member_mtime_ns(member)
        parent_fd, parent = self._parent(parts[:-1], member.name)
        name = parts[-1]
        if kind == "dir":
            self._make_dir(parent_fd, name, member.name)
            folder = parent.child(name)
            folder.mode, folder.mtime_ns = member.mode & KEPT_MODE_BITS, mtime_ns
        elif kind == "symlink":
            problem = link_problem(member.linkname)
            if problem is not None:
                raise InvalidRequest(f"the symlink '{member.name}' in the snapshot {problem}: it cannot be restored")
            try:
                os.symlink(member.linkname, name, dir_fd=parent_fd)
            except FileExistsError as exc:
                raise _duplicate(member.name) from exc
            self._made_block(parent_fd)
            self._own(parent_fd, name)
            os.utime(name, ns=(mtime_ns, mtime_ns), dir_fd=parent_fd, follow_symlinks=False)
        elif kind == "link":
            self._make_link(parent_fd, name, member)
        else:
            self._make_file(parent_fd, name, member, reader, mtime_ns)

    def finish(self) -> None:
        self._close_chain(0)
        self._close_link_chain(0)
        self._set_folders(self._root_fd, self._root, "")

    def close(self) -> None:
        self._close_chain(0)
        self._close_link_chain(0)

    def _make_link(self, parent_fd: int, name: str, member: Member) -> None:
        """Another name for a regular file restored before, inside the target (see the module docstring)."""
        parts = _member_parts(member.linkname)
        source_fd = self._link_folder(parts[:-1], member)
        try:
            found = os.stat(parts[-1], dir_fd=source_fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            found = None
        owned = self._owner is None or (found is not None and (found.st_uid, found.st_gid) == self._owner)
        if found is None or not stat.S_ISREG(found.st_mode) or found.st_dev != self._root_dev or not owned:
            raise PolicyDenied(
                f"snapshot member '{member.name}' is a hard link to '{member.linkname}', which is not a file "
                "restored before it: the snapshot is refused"
            )
        try:
            os.link(parts[-1], name, src_dir_fd=source_fd, dst_dir_fd=parent_fd, follow_symlinks=False)
        except FileExistsError as exc:
            raise _duplicate(member.name) from exc

    def _link_folder(self, parts: tuple[str, ...], member: Member) -> int:
        """The fd of the folder holding a hard link's target, opened (never made) one component at a time."""
        common = 0
        while common < min(len(self._link_chain), len(parts)) and self._link_chain[common][0] == parts[common]:
            common += 1
        self._close_link_chain(common)
        for index in range(common, len(parts)):
            parent_fd = self._link_chain[-1][1] if self._link_chain else self._root_fd
            prefix = "/".join(parts[: index + 1])
            try:
                fd = self._open_dir(parent_fd, parts[index], member.name, prefix)
            except FileNotFoundError as exc:
                raise PolicyDenied(
                    f"snapshot member '{member.name}' is a hard link into '{prefix}', which was not restored before "
                    "it: the snapshot is refused"
                ) from exc
            self._link_chain.append((parts[index], fd))
        return self._link_chain[-1][1] if self._link_chain else self._root_fd

    def _close_link_chain(self, keep: int) -> None:
        for _, fd in self._link_chain[keep:]:
            os.close(fd)
        del self._link_chain[keep:]

    def _count_entry(self) -> None:
        self.entries += 1
        if self.entries > MAX_ENTRIES:
            raise ResourceLimit(f"the snapshot has more than {MAX_ENTRIES} entries: it cannot be restored")

    def _set_folders(self, fd: int, folder: _Folder, prefix: str) -> None:
        """Set the modes and mtimes of the folders under `folder`, each one's after its subfolders'.

        Deepest first: setting a folder's mtime must come after everything created in it, and a
        read-only folder must still let us into its subfolders. Each folder is opened once, from
        its parent's fd.
        """
        for name, child in (folder.children or {}).items():
            if child.mode is None and not child.children:
                continue
            rel = prefix + name
            child_fd = self._open_dir(fd, name, rel, rel)
            try:
                self._set_folders(child_fd, child, rel + "/")
                if child.mode is not None:
                    os.fchmod(child_fd, child.mode)
                    os.utime(child_fd, ns=(child.mtime_ns, child.mtime_ns))
            finally:
                os.close(child_fd)

    def _make_dir(self, parent_fd: int, name: str, rel: str) -> None:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError as exc:
            if not stat.S_ISDIR(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode):
                raise _duplicate(rel) from exc
            return
        self._made_block(parent_fd)
        self._own(parent_fd, name)

    def _made_block(self, parent_fd: int) -> None:
        """Count the block a folder or symlink just made takes: `_HoleWriter` counts only file data."""
        if self._guard is not None:
            self._guard.wrote(_ENTRY_BLOCK_BYTES, parent_fd, "restore")

    def _own(self, parent_fd: int, name: str) -> None:
        """chown what was just made, never through a link (nothing else writes here during a restore)."""
        if self._owner is not None:
            os.chown(name, *self._owner, dir_fd=parent_fd, follow_symlinks=False)

    def _make_file(self, parent_fd: int, name: str, member: Member, reader: TarReader, mtime_ns: int) -> None:
        size = member.realsize
        segments = reader.sparse_map(member) if member.sparse else ((0, member.size),)
        # The data written, as `bastion.snapshot._archive` counts it: a sparse file's holes are free.
        data = sum(length for _, length in segments)
        if self.data_bytes + data > MAX_SNAPSHOT_BYTES:
            raise ResourceLimit(
                f"the snapshot unpacks to over {MAX_SNAPSHOT_BYTES} bytes at '{member.name}': it cannot be restored"
            )
        try:
            # O_EXCL: an existing name, even a dangling symlink, fails instead of being followed.
            fd = os.open(name, _CREATE_FLAGS, 0o600, dir_fd=parent_fd)
        except FileExistsError as exc:
            raise _duplicate(member.name) from exc
        try:
            if self._owner is not None:
                os.fchown(fd, *self._owner)
            writer = _HoleWriter(fd, self._guard)
            for offset, length in segments:
                for chunk in reader.content(length):
                    writer.write(offset, chunk)
                    offset += len(chunk)
            # The size, past a final hole that was never written.
            os.ftruncate(fd, size)
            os.fchmod(fd, member.mode & KEPT_MODE_BITS)
            os.utime(fd, ns=(mtime_ns, mtime_ns))
        finally:
            os.close(fd)
        self.files += 1
        self.bytes += size
        self.data_bytes += data

    def _parent(self, parts: tuple[str, ...], rel: str) -> tuple[int, _Folder]:
        """The fd and tree node of the folder `parts`, opened (or made) one component at a time."""
        common = 0
        while common < min(len(self._chain), len(parts)) and self._chain[common][0] == parts[common]:
            common += 1
        self._close_chain(common)
        for index in range(common, len(parts)):
            parent_fd, parent = self._innermost()
            fd = self._open_or_make_dir(parent_fd, parts[index], rel, "/".join(parts[: index + 1]))
            self._chain.append((parts[index], fd, parent.child(parts[index])))
        return self._innermost()

    def _innermost(self) -> tuple[int, _Folder]:
        """The fd and tree node of the chain's last folder: the target's when the chain is empty."""
        if not self._chain:
            return self._root_fd, self._root
        _, fd, folder = self._chain[-1]
        return fd, folder

    def _open_or_make_dir(self, parent_fd: int, name: str, rel: str, prefix: str) -> int:
        try:
            return self._open_dir(parent_fd, name, rel, prefix)
        except FileNotFoundError:
            pass
        # A folder no member named (this server's archives name every folder first) is an entry too:
        # else each member could make 127 of them, and the tree 127 nodes.
        self._count_entry()
        try:
            os.mkdir(name, _IMPLICIT_DIR_MODE, dir_fd=parent_fd)
        except FileExistsError:
            pass
        else:
            self._made_block(parent_fd)
            self._own(parent_fd, name)
        return self._open_dir(parent_fd, name, rel, prefix)

    def _open_dir(self, parent_fd: int, name: str, rel: str, prefix: str) -> int:
        try:
            return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
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

    def _close_chain(self, keep: int) -> None:
        for _, fd, _ in self._chain[keep:]:
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
    if len(name.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise InvalidRequest(f"a snapshot member name is over {MAX_PATH_BYTES} bytes: the snapshot is refused")
    if len(parts) > MAX_DEPTH + 1:
        raise ResourceLimit(f"snapshot member {name!r} is nested over {MAX_DEPTH} folders deep: it cannot be restored")
    for part in parts:
        problem = name_problem(part)
        if problem is not None:
            raise InvalidRequest(f"snapshot member {name!r} has a name that {problem}: the snapshot is refused")
    return parts


def _member_kind(member: Member) -> _Kind:
    kind = member.type
    if kind in (tarfile.REGTYPE, tarfile.AREGTYPE):
        return "file"
    if kind == tarfile.DIRTYPE:
        return "dir"
    if kind == tarfile.SYMTYPE:
        return "symlink"
    if kind == tarfile.LNKTYPE:
        return "link"
    what = {
        tarfile.CHRTYPE: "a character device",
        tarfile.BLKTYPE: "a block device",
        tarfile.FIFOTYPE: "a named pipe",
        tarfile.GNUTYPE_SPARSE: "an old-style GNU sparse file",
    }.get(kind, "not a file, folder or symlink")
    raise PolicyDenied(f"snapshot member {member.name!r} is {what}: the snapshot is refused")


def _member_mtime_ns(member: Member) -> int:
    if abs(member.mtime_ns) > _MTIME_LIMIT_NS:
        raise OperationFailed(f"snapshot member {member.name!r} has an impossible mtime: the snapshot is corrupt")
    return member.mtime_ns


def link_problem(target: str) -> str | None:
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

"""Snapshots of a sandbox workspace, and restoring one into a new workspace. THIS MODULE IS A SECURITY BOUNDARY.

A snapshot is ``<archive_dir>/<id>.tar.gz`` (PAX tar, gzip level 6) plus ``<id>.json`` (its
`SnapshotInfo`, written last: a snapshot without its JSON does not exist). Both are written
under a temporary name in the same folder, fsynced and renamed, so a crash leaves at most a
``.tmp-*`` file behind, never a half snapshot.

The workspace was written by the agent, so its content is hostile in both directions.

Taking a snapshot (`create_snapshot`), the agent may be changing the tree at the same time:

- Nothing is followed. Every folder is opened with ``O_DIRECTORY | O_NOFOLLOW`` relative to
  the fd of its parent and every file with ``O_NOFOLLOW`` relative to the fd of its folder;
  the ``fstat`` of the opened fd (compared with the ``lstat`` that chose how to handle the
  entry) decides, and content is read from that fd. A folder or file swapped for a symlink
  between the listing and the open is stored as the symlink it now is, never followed
  (`os.walk` and `os.fwalk` classify entries by following symlinks, hence the own walk).
- Symlinks are stored as symlinks: their target text, never what it points at.
- FIFOs, sockets and devices are skipped, never opened for I/O (files are opened
  ``O_NONBLOCK``), and counted in ``metadata["skipped"]``, as are names a restore would
  refuse (control or invisible characters, backslash, not UTF-8, over 255 bytes).
- setuid and setgid bits are dropped; owners are not stored (uid/gid 0, no names).
- Size, entry count and depth are bounded (`MAX_SNAPSHOT_BYTES`, `MAX_ENTRIES`, `MAX_DEPTH`).

Restoring (`restore_snapshot`), the archive is treated as hostile even though this module wrote it:

- The archive's sha256 must match the JSON before anything is extracted; the same open fd
  is hashed and then read.
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

What it does not guarantee:

- A snapshot of a workspace that is being written is not atomic: each file is read from one
  fd, but different files may come from different moments; a file that shrinks while it is
  read fails the snapshot, one that grows is cut at the size it had when opened.
- Hard links are stored as separate files, with the content of the linked inode. On the same
  file system an agent can hard-link a file from outside the workspace that it could read
  (``fs.protected_hardlinks``); its content is then stored like any workspace file.
- Mount points inside the workspace are crossed.
- The sha256 detects corruption, not an attacker who can write ``archive_dir``. `tarfile`
  parses headers before the checks here see them; the decompressed stream is bounded, but a
  PAX header is read into memory whole, and the read side keeps one `tarfile.TarInfo` per
  member (bounded by `MAX_ENTRIES`).
- Restored entries belong to the server's uid: ownership is not restored.
- On a failed restore the target is left partly filled: the caller discards it, without
  following the symlinks it may now contain.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import json
import math
import os
import re
import secrets
import stat
import tarfile
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Final, Literal, final

from bastion.safety.errors import (
    BastionError,
    Conflict,
    InvalidRequest,
    NotFound,
    OperationFailed,
    PathEscape,
    PolicyDenied,
    ResourceLimit,
)
from bastion.safety.paths import name_problem, unsafe_char

MAX_SNAPSHOT_BYTES: Final = 2 * 1024**3
MAX_ENTRIES: Final = 200_000
MAX_DEPTH: Final = 128
MAX_LABEL_CHARS: Final = 200
MAX_INFO_BYTES: Final = 1_048_576
GZIP_LEVEL: Final = 6

_ID_RE: Final = re.compile(r"snap-[0-9a-f]{16}")
_INFO_NAME_RE: Final = re.compile(r"(snap-[0-9a-f]{16})\.json")
_SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")
# Same classes as the jail refuses: control, invisible format (bidi, zero-width), lone
# surrogates (names that are not UTF-8), line and paragraph separators.
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
_RETRIES: Final = 8
_IMPLICIT_DIR_MODE: Final = 0o755

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CREATE_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC

_Kind = Literal["file", "dir", "symlink"]


@final
@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """One snapshot, as stored in ``<id>.json``.

    Attributes:
        id: ``snap-`` and 16 hex digits.
        label: the agent's label, if any.
        created: when it was taken, unix seconds.
        files: regular files stored.
        bytes: their total size, uncompressed.
        archive_bytes: size of ``<id>.tar.gz``.
        sha256: hex sha256 of ``<id>.tar.gz``.
        metadata: the caller's metadata plus ``skipped``: entries not stored (special files, bad names).
    """

    id: str
    label: str | None
    created: float
    files: int
    bytes: int
    archive_bytes: int
    sha256: str
    metadata: dict[str, str] = field(default_factory=dict)


def create_snapshot(
    workspace: Path, archive_dir: Path, *, label: str | None, metadata: Mapping[str, str]
) -> SnapshotInfo:
    """Archive `workspace` into `archive_dir`, never following a symlink.

    Args:
        workspace: the workspace folder; its content is untrusted.
        archive_dir: where snapshots live, outside the workspace; created (0700) if missing.
        label: a short label from the agent, or None.
        metadata: strings stored with the snapshot; the key ``skipped`` is set here.

    Returns:
        The stored `SnapshotInfo`.

    Raises:
        BastionError: InvalidRequest (label, metadata, archive_dir inside the workspace),
            NotFound (no workspace), ResourceLimit, OperationFailed.
    """
    _check_label(label)
    extra = _checked_metadata(metadata)
    if archive_dir.resolve().is_relative_to(workspace.resolve()):
        raise InvalidRequest(
            f"snapshot folder {archive_dir} is inside workspace {workspace}: keep snapshots outside the workspace"
        )
    try:
        root_fd = os.open(workspace, _DIR_FLAGS)
    except OSError as exc:
        raise NotFound(f"workspace {workspace} is not an existing folder: check the sandbox id") from exc
    created: list[str] = []
    try:
        archive_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        dir_fd = os.open(archive_dir, _DIR_FLAGS)
        try:
            snapshot_id = _new_id(dir_fd)
            archive_tmp = f".tmp-{snapshot_id}.tar.gz"
            created.append(archive_tmp)
            tally, digest, archive_bytes = _write_archive(root_fd, dir_fd, archive_tmp)
            info = SnapshotInfo(
                id=snapshot_id,
                label=label,
                created=time.time(),
                files=tally.files,
                bytes=tally.bytes,
                archive_bytes=archive_bytes,
                sha256=digest,
                metadata={**extra, "skipped": str(tally.skipped)},
            )
            payload = _info_to_json(info)
            if len(payload) > MAX_INFO_BYTES:
                raise InvalidRequest(f"the snapshot metadata is over {MAX_INFO_BYTES} bytes: store less metadata")
            os.rename(archive_tmp, f"{snapshot_id}.tar.gz", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            created.append(f"{snapshot_id}.tar.gz")
            created.append(f".tmp-{snapshot_id}.json")
            _write_atomically(dir_fd, f"{snapshot_id}.json", payload)
            created.append(f"{snapshot_id}.json")
            os.fsync(dir_fd)
        except BaseException:
            for name in created:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dir_fd)
            raise
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise OperationFailed(
            f"the snapshot could not be written: {exc.strerror or exc}", detail=f"{archive_dir}: {exc!r}"
        ) from exc
    finally:
        os.close(root_fd)
    return info


def restore_snapshot(archive_dir: Path, snapshot_id: str, target: Path) -> SnapshotInfo:
    """Extract a snapshot into `target`, an existing empty folder, without ever leaving it.

    On failure `target` is left partly filled: the caller discards it (it may hold symlinks,
    so never follow paths inside it while deleting).

    Args:
        archive_dir: where snapshots live.
        snapshot_id: ``snap-`` and 16 hex digits.
        target: an existing, empty folder (a new sandbox's workspace).

    Returns:
        The restored snapshot's `SnapshotInfo`.

    Raises:
        BastionError: InvalidRequest (bad id or member name), NotFound, Conflict (target
            missing, not a folder or not empty), PathEscape (a member leaves the target),
            PolicyDenied (hard link, device, FIFO member), ResourceLimit, OperationFailed
            (corrupt snapshot).
    """
    _check_id(snapshot_id)
    dir_fd = _open_archive_dir(archive_dir)
    try:
        info = _load_info(dir_fd, snapshot_id)
        target_fd = _open_empty_target(target)
        try:
            try:
                archive_fd = os.open(f"{snapshot_id}.tar.gz", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except FileNotFoundError as exc:
                raise NotFound(f"the archive of snapshot {snapshot_id} is missing: delete the snapshot") from exc
            with open(archive_fd, "rb") as raw:
                if hashlib.file_digest(raw, "sha256").hexdigest() != info.sha256 or raw.tell() != info.archive_bytes:
                    raise OperationFailed(f"snapshot {snapshot_id} is corrupt: delete it and take a new one")
                raw.seek(0)
                _extract(raw, target_fd, info)
        except OSError as exc:
            raise OperationFailed(
                f"snapshot {snapshot_id} could not be restored: {exc.strerror or exc}", detail=f"{target}: {exc!r}"
            ) from exc
        finally:
            os.close(target_fd)
    finally:
        os.close(dir_fd)
    return info


def list_snapshots(archive_dir: Path) -> list[SnapshotInfo]:
    """The snapshots in `archive_dir`, oldest first; unreadable records are left out.

    Raises:
        BastionError: OperationFailed when the folder cannot be read.
    """
    try:
        dir_fd = os.open(archive_dir, _DIR_FLAGS)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise OperationFailed(f"snapshot folder {archive_dir} cannot be opened: {exc.strerror}") from exc
    infos: list[SnapshotInfo] = []
    try:
        for name in sorted(os.listdir(dir_fd)):
            match = _INFO_NAME_RE.fullmatch(name)
            if match is None:
                continue
            with contextlib.suppress(BastionError):
                infos.append(_load_info(dir_fd, match[1]))
    finally:
        os.close(dir_fd)
    infos.sort(key=lambda info: (info.created, info.id))
    return infos


def delete_snapshot(archive_dir: Path, snapshot_id: str) -> None:
    """Delete a snapshot: its record first, so it is never listed without its archive.

    Raises:
        BastionError: InvalidRequest (bad id), NotFound, OperationFailed.
    """
    _check_id(snapshot_id)
    dir_fd = _open_archive_dir(archive_dir)
    try:
        removed = False
        for name in (f"{snapshot_id}.json", f"{snapshot_id}.tar.gz"):
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                continue
            removed = True
        if not removed:
            raise NotFound(f"snapshot {snapshot_id} does not exist: list the snapshots to find its id")
        os.fsync(dir_fd)
    except OSError as exc:
        raise OperationFailed(f"snapshot {snapshot_id} could not be deleted: {exc.strerror}") from exc
    finally:
        os.close(dir_fd)


# --- taking a snapshot -------------------------------------------------------------------


@dataclass
class _Tally:
    files: int = 0
    bytes: int = 0
    entries: int = 0
    skipped: int = 0


class _HashingSink:
    """The file the gzip stream is written to, hashed on the way."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes, /) -> int:
        self._raw.write(data)
        self.hash.update(data)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        self._raw.flush()


class _ExactReader:
    """Reads exactly `size` bytes of a file from its fd, or fails: the tar header already promised `size`."""

    def __init__(self, fd: int, size: int, rel: str) -> None:
        self._fd = fd
        self._left = size
        self._rel = rel

    def read(self, size: int = -1, /) -> bytes:
        want = self._left if size < 0 else min(size, self._left)
        chunks: list[bytes] = []
        while want > 0:
            chunk = os.read(self._fd, min(want, _CHUNK_BYTES))
            if not chunk:
                raise OperationFailed(
                    f"'{self._rel}' shrank while it was archived: try again when it is not being written"
                )
            chunks.append(chunk)
            want -= len(chunk)
            self._left -= len(chunk)
        return b"".join(chunks)


def _write_archive(root_fd: int, dir_fd: int, name: str) -> tuple[_Tally, str, int]:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    with open(fd, "wb") as raw:
        sink = _HashingSink(raw)
        # mtime=0 in the gzip header: the same tree gives the same archive bytes.
        with gzip.GzipFile(fileobj=sink, mode="wb", compresslevel=GZIP_LEVEL, mtime=0) as stream:
            archiver = _Archiver(stream)
            archiver.add_tree(root_fd, "", 0)
            archiver.finish()
        raw.flush()
        os.fsync(raw.fileno())
    return archiver.tally, sink.hash.hexdigest(), sink.size


class _Archiver:
    """Walks a hostile tree by fds and writes PAX tar members (`tarfile.TarInfo.tobuf`) to a stream."""

    def __init__(self, stream: gzip.GzipFile) -> None:
        self._stream = stream
        self.tally = _Tally()

    def add_tree(self, dir_fd: int, prefix: str, depth: int) -> None:
        names: list[str] = []
        with os.scandir(dir_fd) as entries:
            for entry in entries:
                if self.tally.entries + len(names) >= MAX_ENTRIES:
                    raise ResourceLimit(f"the workspace has more than {MAX_ENTRIES} entries: delete some first")
                names.append(entry.name)
        for name in sorted(names):
            if name_problem(name) is not None:
                self.tally.skipped += 1
                continue
            self._add_entry(dir_fd, name, prefix + name, depth)

    def finish(self) -> None:
        # End of archive: two zero blocks (POSIX.1-2001 ustar).
        self._stream.write(tarfile.NUL * (2 * tarfile.BLOCKSIZE))

    def _add_entry(self, dir_fd: int, name: str, rel: str, depth: int) -> None:
        # Each handler returns False when the entry changed type since the lstat: look again.
        for _ in range(_RETRIES):
            try:
                seen = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                return
            if stat.S_ISLNK(seen.st_mode):
                done = self._add_symlink(dir_fd, name, rel, seen)
            elif stat.S_ISDIR(seen.st_mode):
                done = self._add_dir(dir_fd, name, rel, seen, depth)
            elif stat.S_ISREG(seen.st_mode):
                done = self._add_file(dir_fd, name, rel, seen)
            else:
                self.tally.skipped += 1
                return
            if done:
                return
        raise OperationFailed(f"'{rel}' kept changing while it was archived: stop writing to it and try again")

    def _add_symlink(self, dir_fd: int, name: str, rel: str, seen: os.stat_result) -> bool:
        try:
            target = os.readlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False
            raise
        if _link_problem(target) is not None:
            self.tally.skipped += 1
            return True
        member = self._member(rel, tarfile.SYMTYPE, 0o777, seen.st_mtime)
        member.linkname = target
        self._write_header(member)
        return True

    def _add_dir(self, dir_fd: int, name: str, rel: str, seen: os.stat_result, depth: int) -> bool:
        if depth >= MAX_DEPTH:
            raise ResourceLimit(f"the workspace is nested more than {MAX_DEPTH} folders deep at '{rel}': flatten it")
        try:
            fd = os.open(name, _DIR_FLAGS | os.O_NONBLOCK, dir_fd=dir_fd)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                return False
            raise
        try:
            opened = os.fstat(fd)
            if not _same_file(opened, seen):
                return False
            self._write_header(self._member(rel, tarfile.DIRTYPE, opened.st_mode, opened.st_mtime))
            self.add_tree(fd, rel + "/", depth + 1)
        finally:
            os.close(fd)
        return True

    def _add_file(self, dir_fd: int, name: str, rel: str, seen: os.stat_result) -> bool:
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return True
        except OSError as exc:
            # ELOOP: now a symlink. ENXIO: now a socket.
            if exc.errno in (errno.ELOOP, errno.ENXIO):
                return False
            raise
        try:
            opened = os.fstat(fd)
            if not stat.S_ISREG(opened.st_mode) or not _same_file(opened, seen):
                return False
            size = opened.st_size
            if self.tally.bytes + size > MAX_SNAPSHOT_BYTES:
                raise ResourceLimit(
                    f"the workspace holds over {MAX_SNAPSHOT_BYTES} bytes at '{rel}': delete files before the snapshot"
                )
            member = self._member(rel, tarfile.REGTYPE, opened.st_mode, opened.st_mtime)
            member.size = size
            self._write_header(member)
            reader = _ExactReader(fd, size, rel)
            while chunk := reader.read(_CHUNK_BYTES):
                self._stream.write(chunk)
            _, remainder = divmod(size, tarfile.BLOCKSIZE)
            if remainder:
                self._stream.write(tarfile.NUL * (tarfile.BLOCKSIZE - remainder))
        finally:
            os.close(fd)
        self.tally.files += 1
        self.tally.bytes += size
        return True

    def _member(self, rel: str, kind: bytes, mode: int, mtime: float) -> tarfile.TarInfo:
        self.tally.entries += 1
        if self.tally.entries > MAX_ENTRIES:
            raise ResourceLimit(f"the workspace has more than {MAX_ENTRIES} entries: delete some first")
        member = tarfile.TarInfo(rel)
        member.type = kind
        member.mode = mode & _KEPT_MODE_BITS
        member.mtime = mtime
        member.uid = member.gid = 0
        member.uname = member.gname = ""
        return member

    def _write_header(self, member: tarfile.TarInfo) -> None:
        self._stream.write(member.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict"))


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


# --- restoring ---------------------------------------------------------------------------


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


def _extract(raw: BinaryIO, target_fd: int, info: SnapshotInfo) -> None:
    limit = MAX_SNAPSHOT_BYTES + MAX_ENTRIES * _STREAM_BYTES_PER_ENTRY + _STREAM_SLACK_BYTES
    extractor = _Extractor(target_fd)
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

    def __init__(self, root_fd: int) -> None:
        self._root_fd = root_fd
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
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, _IMPLICIT_DIR_MODE, dir_fd=parent_fd)
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


# --- records -----------------------------------------------------------------------------


def _check_id(snapshot_id: str) -> None:
    if not isinstance(snapshot_id, str) or _ID_RE.fullmatch(snapshot_id) is None:
        raise InvalidRequest("the snapshot id must be 'snap-' and 16 hex digits: use an id from list_snapshots")


def _check_label(label: str | None) -> None:
    if label is None:
        return
    if not isinstance(label, str) or len(label) > MAX_LABEL_CHARS:
        raise InvalidRequest(f"the label must be text of at most {MAX_LABEL_CHARS} characters: shorten it")
    problem = unsafe_char(label)
    if problem is not None:
        raise InvalidRequest(f"the label contains {problem}: remove it")


def _checked_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    checked: dict[str, str] = {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidRequest("snapshot metadata keys and values must be strings: convert them first")
        checked[key] = value
    return checked


def _new_id(dir_fd: int) -> str:
    while True:
        snapshot_id = "snap-" + secrets.token_hex(8)
        try:
            os.stat(f"{snapshot_id}.json", dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return snapshot_id


def _open_archive_dir(archive_dir: Path) -> int:
    try:
        return os.open(archive_dir, _DIR_FLAGS)
    except FileNotFoundError as exc:
        raise NotFound(f"snapshot folder {archive_dir} does not exist: take a snapshot first") from exc
    except OSError as exc:
        raise OperationFailed(f"snapshot folder {archive_dir} cannot be opened: {exc.strerror}") from exc


def _open_empty_target(target: Path) -> int:
    try:
        fd = os.open(target, _DIR_FLAGS)
    except FileNotFoundError as exc:
        raise Conflict(f"restore target {target} does not exist: create an empty folder first") from exc
    except OSError as exc:
        raise Conflict(f"restore target {target} is not a folder: pass an empty folder") from exc
    try:
        if os.listdir(fd):
            raise Conflict(f"restore target {target} is not empty: nothing is overwritten; pass an empty folder")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_atomically(dir_fd: int, name: str, data: bytes) -> None:
    temporary = f".tmp-{name}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    with open(fd, "wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    os.rename(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _info_to_json(info: SnapshotInfo) -> bytes:
    record = {
        "id": info.id,
        "label": info.label,
        "created": info.created,
        "files": info.files,
        "bytes": info.bytes,
        "archive_bytes": info.archive_bytes,
        "sha256": info.sha256,
        "metadata": info.metadata,
    }
    return json.dumps(record, indent=2, sort_keys=True, ensure_ascii=False).encode("utf-8") + b"\n"


def _load_info(dir_fd: int, snapshot_id: str) -> SnapshotInfo:
    try:
        fd = os.open(f"{snapshot_id}.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError as exc:
        raise NotFound(f"snapshot {snapshot_id} does not exist: list the snapshots to find its id") from exc
    except OSError as exc:
        raise OperationFailed(f"the record of snapshot {snapshot_id} cannot be opened: {exc.strerror}") from exc
    corrupt = OperationFailed(f"the record of snapshot {snapshot_id} is corrupt: delete the snapshot")
    try:
        with open(fd, "rb") as stream:
            raw = stream.read(MAX_INFO_BYTES + 1)
    except OSError as exc:
        raise corrupt from exc
    if len(raw) > MAX_INFO_BYTES:
        raise corrupt
    try:
        data: object = json.loads(raw)
    except ValueError as exc:
        raise corrupt from exc
    info = _info_from_json(data)
    if info is None or info.id != snapshot_id:
        raise corrupt
    return info


def _info_from_json(data: object) -> SnapshotInfo | None:
    if not isinstance(data, dict):
        return None
    record: dict[object, object] = data
    snapshot_id, label, created = record.get("id"), record.get("label"), record.get("created")
    sha256, metadata = record.get("sha256"), record.get("metadata")
    counts = [record.get(key) for key in ("files", "bytes", "archive_bytes")]
    if not isinstance(snapshot_id, str) or not (label is None or isinstance(label, str)):
        return None
    if isinstance(created, bool) or not isinstance(created, int | float):
        return None
    if not isinstance(sha256, str) or _SHA256_RE.fullmatch(sha256) is None or not isinstance(metadata, dict):
        return None
    numbers: list[int] = []
    for count in counts:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            return None
        numbers.append(count)
    pairs: dict[object, object] = metadata
    strings: dict[str, str] = {}
    for key, value in pairs.items():
        if not isinstance(key, str) or not isinstance(value, str):
            return None
        strings[key] = value
    return SnapshotInfo(
        id=snapshot_id,
        label=label,
        created=float(created),
        files=numbers[0],
        bytes=numbers[1],
        archive_bytes=numbers[2],
        sha256=sha256,
        metadata=strings,
    )

"""Writing a workspace into a snapshot archive, never following a symlink. THIS MODULE IS A SECURITY BOUNDARY.

`bastion.snapshot.store.create_snapshot` calls `write_archive`. The workspace was written
by the agent, which may be changing the tree at the same time:

- Nothing is followed. Every folder is opened with ``O_DIRECTORY | O_NOFOLLOW`` relative to
  the fd of its parent and every file with ``O_NOFOLLOW`` relative to the fd of its folder;
  the ``fstat`` of the opened fd (compared with the ``lstat`` that chose how to handle the
  entry) decides, and content is read from that fd. A folder or file swapped for a symlink
  between the listing and the open is stored as the symlink it now is, never followed
  (`os.walk` and `os.fwalk` classify entries by following symlinks, hence the own walk).
- Symlinks are stored as symlinks: their target text, never what it points at.
- FIFOs, sockets and devices are skipped, never opened for I/O (files are opened
  ``O_NONBLOCK``), and counted in ``metadata["skipped"]``, as are names a restore would
  refuse (control or invisible characters, backslash, not UTF-8, over 255 bytes). A skipped
  folder counts with everything under it (listed by fd, never following a link, down to
  `MAX_DEPTH`): one folder of 500 files was "skipped: 1".
- setuid and setgid bits are dropped; owners are not stored (uid/gid 0, no names).
- Times are written as the exact decimals the reader takes (never tarfile's ``str(float)``,
  which writes ``1e-05``), held within the restore's bound.
- Size, entry count and depth are bounded (`MAX_SNAPSHOT_BYTES`, `MAX_ENTRIES`, `MAX_DEPTH`,
  the same bounds `bastion.snapshot._extract` enforces on a restore). The size is the file data
  the archive holds: a sparse file's holes are not counted. Every name listed counts as an
  entry, skipped ones too, so the walk never holds more than `MAX_ENTRIES` names. The archive
  written is bounded too (`Budget`: what the snapshot caps and the state filesystem's reserve
  leave), checked as it is written, so a snapshot stops at its bound instead of filling the disk.
- A file with holes (``SEEK_DATA``/``SEEK_HOLE``) is stored as a GNU sparse 1.0 member (the
  form GNU tar and `tarfile` read): only its data is read and stored. Past
  `MAX_SPARSE_SEGMENTS` segments (per file or in total) it is stored whole instead; the
  restore still leaves its zero blocks as holes.

What it does not guarantee:

- A snapshot of a workspace that is being written is not atomic: each file is read from one
  fd, but different files may come from different moments; a file that shrinks while it is
  read fails the snapshot, one that grows is cut at the size it had when opened.
- A file with several names in the workspace (hard links) is stored once, under the first name
  the walk meets; each later name is a hard link member naming it (`bastion.snapshot._extract`
  links it to that file only). Its data counts once toward `MAX_SNAPSHOT_BYTES`: one 190 MB file
  with 10 links made a 2 GB archive and a minute of gzip at every crash recovery. Past
  `_MAX_LINK_NAME_BYTES` of first names remembered, later names are stored as separate files.
- Mount points inside the workspace are crossed.
- On the same file system an agent can hard-link a file from outside the workspace that it
  could read (``fs.protected_hardlinks``); its content is then stored like any workspace file.
- A file whose holes move while it is read is stored with the map seen when it was opened.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import os
import stat
import tarfile
from dataclasses import dataclass
from typing import BinaryIO, Final

from bastion.safety.errors import OperationFailed
from bastion.safety.paths import name_problem

# The bounds and the symlink rule are the extractor's: a snapshot never holds what a restore refuses.
from bastion.snapshot._extract import (
    CHUNK_BYTES,
    DIR_FLAGS,
    KEPT_MODE_BITS,
    MAX_DEPTH,
    MAX_ENTRIES,
    MAX_PATH_BYTES,
    MAX_SNAPSHOT_BYTES,
    MTIME_LIMIT_S,
    link_problem,
)
from bastion.snapshot._space import NoRoom, OverBound, SpaceGuard
from bastion.snapshot._tarread import MAX_SPARSE_SEGMENTS, MAX_SPARSE_SEGMENTS_TOTAL

GZIP_LEVEL: Final = 6

_RETRIES: Final = 8
# A time the restore takes (`bastion.snapshot._extract` refuses beyond 2**40 s): a later one is stored as this.
_MTIME_LIMIT_NS: Final = int(MTIME_LIMIT_S) * 1_000_000_000
_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# The first names of files with several links, kept for their later names: 200,000 paths of 4 KiB would be 800 MB.
_MAX_LINK_NAME_BYTES: Final = 16 << 20
_FIRST_NAME_OVERHEAD: Final = 256  # a dict slot, two tuples, three ints and a str header, about (CPython 3.11)


@dataclass
class _Tally:
    files: int = 0
    bytes: int = 0
    data_bytes: int = 0  # bytes of content stored: holes excluded
    entries: int = 0
    listed: int = 0  # names the walk listed, stored or skipped
    skipped: int = 0
    segments: int = 0
    links: int = 0  # later names of a stored file, as hard link members: neither files nor bytes


@dataclass(frozen=True, slots=True)
class Budget:
    """How much archive may be written: `limit` bytes (the message says which bound it is), and the reserve."""

    limit: int
    message: str
    guard: SpaceGuard | None = None


class _HashingSink:
    """The file the gzip stream is written to, hashed and counted on the way; refused past the budget."""

    def __init__(self, raw: BinaryIO, budget: Budget) -> None:
        self._raw = raw
        self._budget = budget
        self.hash = hashlib.sha256()
        self.size = 0
        self._over = False

    def write(self, data: bytes, /) -> int:
        if self._over:
            # gzip's close still flushes after the refusal: nothing more is written.
            return len(data)
        if self.size + len(data) > self._budget.limit:
            self._over = True
            raise NoRoom(self._budget.message)
        self._raw.write(data)
        self.hash.update(data)
        self.size += len(data)
        if self._budget.guard is not None:
            try:
                self._budget.guard.wrote(len(data), self._raw.fileno(), "snapshot")
            except NoRoom:
                self._over = True
                raise
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
            chunk = os.read(self._fd, min(want, CHUNK_BYTES))
            if not chunk:
                raise OperationFailed(
                    f"'{self._rel}' shrank while it was archived: try again when it is not being written"
                )
            chunks.append(chunk)
            want -= len(chunk)
            self._left -= len(chunk)
        return b"".join(chunks)


def write_archive(root_fd: int, dir_fd: int, name: str, budget: Budget) -> tuple[_Tally, str, int]:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    with open(fd, "wb") as raw:
        sink = _HashingSink(raw, budget)
        # mtime=0 in the gzip header: the same tree gives the same archive bytes.
        with gzip.GzipFile(fileobj=sink, mode="wb", compresslevel=GZIP_LEVEL, mtime=0) as stream:
            archiver = Archiver(stream)
            archiver.add_tree(root_fd, "", 0)
            archiver.finish()
        raw.flush()
        os.fsync(raw.fileno())
    return archiver.tally, sink.hash.hexdigest(), sink.size


class Archiver:
    """Walks a hostile tree by fds and writes PAX tar members (`tarfile.TarInfo.tobuf`) to a stream."""

    def __init__(self, stream: gzip.GzipFile) -> None:
        self._stream = stream
        self.tally = _Tally()
        # (st_dev, st_ino) -> the name the file is stored under, and its ctime then (`_same_file`).
        self._first_names: dict[tuple[int, int], tuple[str, int]] = {}
        self._first_name_bytes = 0

    def add_tree(self, dir_fd: int, prefix: str, depth: int) -> None:
        names = self._storable_names(dir_fd, prefix, depth)
        names.sort(reverse=True)
        # Popped as visited: while a subfolder is walked, this level keeps only the names still to come.
        while names:
            name = names.pop()
            self._add_entry(dir_fd, name, prefix + name, depth)

    def _storable_names(self, dir_fd: int, prefix: str, depth: int) -> list[str]:
        """The names in a folder a restore would take; the others are counted as skipped, never kept.

        Every name listed counts toward `MAX_ENTRIES`, skipped or not: counting only the stored
        ones let 128 nested folders of skipped names (hard links named with a control character)
        hold 25 million names in memory.
        """
        names: list[str] = []
        with os.scandir(dir_fd) as entries:
            for entry in entries:
                self._count_listed()
                name = entry.name
                too_long = len((prefix + name).encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES
                if too_long or name_problem(name) is not None:
                    under = self._skipped_under(dir_fd, name, depth) if entry.is_dir(follow_symlinks=False) else 0
                    self.tally.skipped += 1 + under
                else:
                    names.append(name)
        return names

    def _skipped_under(self, dir_fd: int, name: str, depth: int) -> int:
        """How many entries a skipped folder holds, at any depth down to `MAX_DEPTH`, each counted as listed.

        Opened by fd like any folder: a folder swapped for a symlink (or gone) counts as itself alone.
        """
        if depth >= MAX_DEPTH:
            return 0
        try:
            fd = os.open(name, DIR_FLAGS | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError:
            return 0
        found = 0
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    self._count_listed()
                    found += 1
                    if entry.is_dir(follow_symlinks=False):
                        found += self._skipped_under(fd, entry.name, depth + 1)
        finally:
            os.close(fd)
        return found

    def _count_listed(self) -> None:
        self.tally.listed += 1
        if self.tally.listed > MAX_ENTRIES:
            raise OverBound(
                f"the workspace has more than {MAX_ENTRIES} entries, counting the ones a snapshot skips "
                "(special files, bad names): delete some first"
            )

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
            elif stat.S_ISREG(seen.st_mode) and self._first_name(seen) is not None:
                done = self._add_hard_link(rel, self._first_name(seen) or "", seen)
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
        if link_problem(target) is not None:
            self.tally.skipped += 1
            return True
        member = self._member(rel, tarfile.SYMTYPE, 0o777, seen.st_mtime_ns)
        member.linkname = target
        self._write_header(member)
        return True

    def _add_dir(self, dir_fd: int, name: str, rel: str, seen: os.stat_result, depth: int) -> bool:
        if depth >= MAX_DEPTH:
            raise OverBound(f"the workspace is nested more than {MAX_DEPTH} folders deep at '{rel}': flatten it")
        try:
            fd = os.open(name, DIR_FLAGS | os.O_NONBLOCK, dir_fd=dir_fd)
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
            self._write_header(self._member(rel, tarfile.DIRTYPE, opened.st_mode, opened.st_mtime_ns))
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
            member = self._member(rel, tarfile.REGTYPE, opened.st_mode, opened.st_mtime_ns)
            segments = self._data_segments(fd, size)
            # What the archive holds: a sparse member stores its data, not its holes (`truncate -s 3G`).
            data = size if segments is None else sum(length for _, length in segments)
            if self.tally.data_bytes + data > MAX_SNAPSHOT_BYTES:
                raise OverBound(
                    f"the workspace holds over {MAX_SNAPSHOT_BYTES} bytes of file data at '{rel}': "
                    "delete files before the snapshot"
                )
            if segments is None:
                member.size = size
                self._write_header(member)
                self._copy(fd, 0, size, rel)
            else:
                self._write_sparse(fd, member, size, segments, rel)
        finally:
            os.close(fd)
        self.tally.files += 1
        self.tally.bytes += size
        self.tally.data_bytes += data
        self._remember_first_name(opened, rel)
        return True

    def _remember_first_name(self, opened: os.stat_result, rel: str) -> None:
        """Keep the name a file with other links is stored under, while the names kept stay within their bound."""
        if opened.st_nlink < 2:
            return
        # What the entry holds in memory, about: the name's UTF-8, the key and value tuples and their ints.
        cost = len(rel.encode("utf-8", "surrogateescape")) + _FIRST_NAME_OVERHEAD
        if self._first_name_bytes + cost <= _MAX_LINK_NAME_BYTES:
            self._first_names[opened.st_dev, opened.st_ino] = (rel, opened.st_ctime_ns)
            self._first_name_bytes += cost

    def _first_name(self, seen: os.stat_result) -> str | None:
        """The name this file was stored under, if it is still that file.

        An inode number is reused once its file is gone: a sandbox that deletes a stored file and makes another
        during the walk would have the new one stored as a link to the old name, its content lost. A file keeps
        its ctime unless its links or metadata change (then it is stored whole, as without links).
        """
        found = self._first_names.get((seen.st_dev, seen.st_ino))
        if found is None or found[1] != seen.st_ctime_ns:
            return None
        return found[0]

    def _add_hard_link(self, rel: str, first: str, seen: os.stat_result) -> bool:
        """Another name of a file stored already: a hard link member naming it, without its data again."""
        member = self._member(rel, tarfile.LNKTYPE, seen.st_mode, seen.st_mtime_ns)
        member.linkname = first
        self._write_header(member)
        self.tally.links += 1
        return True

    def _data_segments(self, fd: int, size: int) -> list[tuple[int, int]] | None:
        """The (offset, length) data runs of a file with holes; None to store it whole (no holes, or too many)."""
        segments: list[tuple[int, int]] = []
        offset = 0
        try:
            while offset < size:
                try:
                    start = os.lseek(fd, offset, os.SEEK_DATA)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:  # only a hole from here to the end
                        break
                    raise
                if start >= size:
                    break
                end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
                segments.append((start, end - start))
                offset = end
                if (
                    len(segments) > MAX_SPARSE_SEGMENTS
                    or self.tally.segments + len(segments) > MAX_SPARSE_SEGMENTS_TOTAL
                ):
                    return None
        except OSError:
            return None  # a filesystem without SEEK_DATA: store it whole
        if sum(length for _, length in segments) == size:
            return None
        if not segments or sum(segments[-1]) < size:
            segments.append((size, 0))  # GNU tar's mark of a file ending in a hole
        # The mark is an entry of the map the reader counts: over its caps, the restore would fail.
        if len(segments) > MAX_SPARSE_SEGMENTS or self.tally.segments + len(segments) > MAX_SPARSE_SEGMENTS_TOTAL:
            return None
        self.tally.segments += len(segments)
        return segments

    def _write_sparse(
        self, fd: int, member: tarfile.TarInfo, size: int, segments: list[tuple[int, int]], rel: str
    ) -> None:
        """A GNU sparse 1.0 member: the real name and size in PAX keys, then the map, then the data runs."""
        lines = [str(len(segments))] + [f"{offset}\n{length}" for offset, length in segments]
        sparse_map = ("\n".join(lines) + "\n").encode("ascii")
        sparse_map += tarfile.NUL * (-len(sparse_map) % tarfile.BLOCKSIZE)
        stored = sum(length for _, length in segments)
        folder, _, base = rel.rpartition("/")
        # GNU tar's placeholder name (%d/GNUSparseFile.%p/%f, pid 0 here): a reader that
        # knows no sparse files extracts the map and data under it, never as the real file.
        member.name = f"{folder}/GNUSparseFile.0/{base}" if folder else f"GNUSparseFile.0/{base}"
        member.pax_headers = {
            **member.pax_headers,
            "GNU.sparse.major": "1",
            "GNU.sparse.minor": "0",
            "GNU.sparse.name": rel,
            "GNU.sparse.realsize": str(size),
        }
        member.size = len(sparse_map) + stored
        self._write_header(member)
        self._stream.write(sparse_map)
        for offset, length in segments:
            self._copy(fd, offset, length, rel, pad=False)
        self._pad(stored)

    def _copy(self, fd: int, offset: int, size: int, rel: str, *, pad: bool = True) -> None:
        os.lseek(fd, offset, os.SEEK_SET)  # SEEK_DATA and SEEK_HOLE moved it
        reader = _ExactReader(fd, size, rel)
        while chunk := reader.read(CHUNK_BYTES):
            self._stream.write(chunk)
        if pad:
            self._pad(size)

    def _pad(self, size: int) -> None:
        _, remainder = divmod(size, tarfile.BLOCKSIZE)
        if remainder:
            self._stream.write(tarfile.NUL * (tarfile.BLOCKSIZE - remainder))

    def _member(self, rel: str, kind: bytes, mode: int, mtime_ns: int) -> tarfile.TarInfo:
        self.tally.entries += 1
        if self.tally.entries > MAX_ENTRIES:
            raise OverBound(f"the workspace has more than {MAX_ENTRIES} entries: delete some first")
        member = tarfile.TarInfo(rel)
        member.type = kind
        member.mode = mode & KEPT_MODE_BITS
        mtime_ns = max(-_MTIME_LIMIT_NS, min(mtime_ns, _MTIME_LIMIT_NS))
        seconds, fraction = divmod(mtime_ns, 1_000_000_000)
        member.mtime = seconds  # tarfile writes whole seconds right; a fraction goes in our own PAX record
        if fraction:
            member.pax_headers = {"mtime": _pax_time(mtime_ns)}
        member.uid = member.gid = 0
        member.uname = member.gname = ""
        return member

    def _write_header(self, member: tarfile.TarInfo) -> None:
        self._stream.write(member.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict"))


def _pax_time(ns: int) -> str:
    """A time as the PAX decimal the reader takes; tarfile's str(float) writes '1e-05' for 10 us past 1970."""
    seconds, fraction = divmod(abs(ns), 1_000_000_000)
    sign = "-" if ns < 0 else ""
    return f"{sign}{seconds}.{fraction:09d}".rstrip("0").rstrip(".") if fraction else f"{sign}{seconds}"


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

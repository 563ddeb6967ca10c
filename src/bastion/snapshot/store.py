"""Snapshots of a sandbox workspace, and restoring one into a new workspace. THIS MODULE IS A SECURITY BOUNDARY.

A snapshot is ``<archive_dir>/<id>.tar.gz`` (PAX tar, gzip level 6) plus ``<id>.json`` (its
`SnapshotInfo`, written last: a snapshot without its JSON does not exist). Both are written
under a temporary name in the same folder, fsynced and renamed, so a crash leaves at most a
``.tmp-*`` file behind, never a half snapshot.

The workspace was written by the agent, so its content is hostile in both directions. This
module holds the public API and the records; the archive is written by
`bastion.snapshot._archive` and extracted by `bastion.snapshot._extract`, whose docstrings say
what each refuses and what it does not guarantee. Checked here:

- Taking a snapshot (`create_snapshot`): the archive folder must be outside the workspace,
  and the label and metadata are checked before anything is written. `SnapshotLimits` caps
  the snapshots kept (count and archive bytes, in total and per source sandbox) and keeps a
  reserve of free space on the folder's filesystem (the audit log's): a snapshot past a cap
  is refused before anything is written, and the archive is bounded by what is left as it
  is written (then removed). Caps are checked and the archive written under one lock, so two
  snapshots of this process never both take the last room.
- Restoring (`restore_snapshot`), the archive is treated as hostile even though this module
  wrote it: its sha256 must match the JSON before anything is extracted; the same open fd
  is hashed and then read. The target must be an existing, empty folder, with room for the
  snapshot's data on its filesystem, and the state filesystem must keep its reserve with the
  snapshot's data and a block and an inode per entry written (the record counts them). The
  target's filesystem is synced at the end: a write-back error (a disk image whose blocks did
  not fit the state filesystem) fails the restore instead of losing its writes unseen.

What it does not guarantee:

- The sha256 detects corruption, not an attacker who can write ``archive_dir``.
- The caps count the snapshots in ``archive_dir``; another process writing there (a second
  server on the same state folder) is not counted while it writes.
- On a failed restore the target is left partly filled: the caller discards it, without
  following the symlinks it may now contain.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, final

from bastion.safety.errors import BastionError, Conflict, InvalidRequest, NotFound, OperationFailed, ResourceLimit
from bastion.safety.paths import unsafe_char

# The ``X as X`` imports re-export public bounds defined, and read, where they are enforced:
# patch them in `_archive` or `_extract`, not here.
from bastion.snapshot._archive import GZIP_LEVEL as GZIP_LEVEL
from bastion.snapshot._archive import Budget, write_archive
from bastion.snapshot._extract import DIR_FLAGS, extract
from bastion.snapshot._extract import MAX_DEPTH as MAX_DEPTH
from bastion.snapshot._extract import MAX_ENTRIES as MAX_ENTRIES
from bastion.snapshot._extract import MAX_SNAPSHOT_BYTES as MAX_SNAPSHOT_BYTES
from bastion.snapshot._space import NoRoom as NoRoom
from bastion.snapshot._space import OverBound as OverBound
from bastion.snapshot._space import SpaceGuard, sync_filesystem

MAX_LABEL_CHARS: Final = 200
MAX_INFO_BYTES: Final = 1_048_576

_ID_RE: Final = re.compile(r"snap-[0-9a-f]{16}")
_INFO_NAME_RE: Final = re.compile(r"(snap-[0-9a-f]{16})\.json")
_SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")
_LEFTOVER_RE: Final = re.compile(r"\.tmp-snap-[0-9a-f]{16}\.(tar\.gz|json)|(snap-[0-9a-f]{16})\.tar\.gz")
# Allocation of a restored entry beyond its data: a file's last, partly used block, a folder's first
# block, a long symlink's target; and its inode's slot of the inode table (ext4's 256 bytes), which a
# sparse disk image allocates only once it is written.
_BLOCK_BYTES: Final = 4096
_INODE_BYTES: Final = 256
_NO_CAP: Final = sys.maxsize
_FULL_ERRNOS: Final = (errno.ENOSPC, errno.EDQUOT)
# Taking a snapshot checks the caps and writes under this lock: two calls cannot both take the last room.
_WRITING: Final = threading.Lock()


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
        metadata: the caller's metadata plus ``skipped``: entries not stored (special files, bad names,
            everything under a skipped folder).
        data_bytes: file content stored, holes excluded: what a restore writes (``bytes`` in
            records older than this field).
        entries: files, folders and symlinks stored, each an inode and up to a block when
            restored; hard links excluded (``files`` in records older than this field).
        boot: the host's boot id and its CLOCK_BOOTTIME (seconds) when it was taken: its age within that boot,
            which a step of the wall clock does not move (`age_s`); ("", 0.0) in older records.
    """

    id: str
    label: str | None
    created: float
    files: int
    bytes: int
    archive_bytes: int
    sha256: str
    metadata: dict[str, str] = field(default_factory=dict)
    data_bytes: int = 0
    entries: int = 0
    boot: tuple[str, float] = ("", 0.0)

    def age_s(self, now: float, boot: tuple[str, float]) -> float:
        """Its age at wall time `now` and `boot` (`boot_clock`): within the boot it was taken in, the younger
        of the wall clock's and the boot clock's. Found by attack: a host that booted with its clock a month
        behind (no RTC, before NTP) stamped an agent's fresh snapshot in the past, and the sync's step forward
        had the next reap delete it, the closed sandbox's only copy; the start after it did the same to a
        crashed sandbox's recovered snapshot."""
        age = now - self.created
        if self.boot[0] and self.boot[0] == boot[0]:
            age = min(age, boot[1] - self.boot[1])
        return age


def boot_clock() -> tuple[str, float]:
    """This host's boot id and its CLOCK_BOOTTIME now (("", 0.0) where there is no boot id)."""
    return _boot_id(), time.clock_gettime(time.CLOCK_BOOTTIME)


@functools.cache
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""


@final
@dataclass(frozen=True, slots=True)
class SnapshotLimits:
    """What `create_snapshot` may keep in its folder; the defaults cap nothing.

    Attributes:
        count: snapshots kept at once, every source together.
        bytes: the total size of their archives.
        per_sandbox_count: snapshots of one source sandbox (``metadata["sandbox_id"]``).
        per_sandbox_bytes: the total archive size of one source sandbox's snapshots.
        reserve_bytes: free space on the folder's filesystem a snapshot never takes.
    """

    count: int = _NO_CAP
    bytes: int = _NO_CAP
    per_sandbox_count: int = _NO_CAP
    per_sandbox_bytes: int = _NO_CAP
    reserve_bytes: int = 0


def create_snapshot(
    workspace: Path,
    archive_dir: Path,
    *,
    label: str | None,
    metadata: Mapping[str, str],
    limits: SnapshotLimits | None = None,
) -> SnapshotInfo:
    """Archive `workspace` into `archive_dir`, never following a symlink.

    Args:
        workspace: the workspace folder; its content is untrusted.
        archive_dir: where snapshots live, outside the workspace; created (0700) if missing.
        label: a short label from the agent, or None.
        metadata: strings stored with the snapshot; the key ``skipped`` is set here. Its
            ``sandbox_id`` is the source the per-sandbox caps count.
        limits: the caps and the free-space reserve; None caps nothing.

    Returns:
        The stored `SnapshotInfo`.

    Raises:
        BastionError: InvalidRequest (label, metadata, archive_dir inside the workspace),
            NotFound (no workspace), ResourceLimit (a count cap, the workspace's size,
            entries or depth), NoRoom, a ResourceLimit (a byte cap, the reserve, a full disk:
            it may fit once room is freed), OperationFailed.
    """
    _check_label(label)
    extra = _checked_metadata(metadata)
    if archive_dir.resolve().is_relative_to(workspace.resolve()):
        raise InvalidRequest(
            "the snapshot folder is inside the workspace: keep snapshots outside the workspace",
            detail=f"snapshot folder {archive_dir}, workspace {workspace}",
        )
    try:
        root_fd = os.open(workspace, DIR_FLAGS)
    except OSError as exc:
        raise NotFound(
            "the workspace is not an existing folder: check the sandbox id", detail=f"{workspace}: {exc!r}"
        ) from exc
    created: list[str] = []
    try:
        archive_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        dir_fd = os.open(archive_dir, DIR_FLAGS)
        try:
            with _WRITING:
                budget = _budget(dir_fd, limits or SnapshotLimits(), extra.get("sandbox_id"))
                snapshot_id = _new_id(dir_fd)
                archive_tmp = f".tmp-{snapshot_id}.tar.gz"
                created.append(archive_tmp)
                tally, digest, archive_bytes = write_archive(root_fd, dir_fd, archive_tmp, budget)
                info = SnapshotInfo(
                    id=snapshot_id,
                    label=label,
                    created=time.time(),
                    files=tally.files,
                    bytes=tally.bytes,
                    archive_bytes=archive_bytes,
                    sha256=digest,
                    metadata={**extra, "skipped": str(tally.skipped)},
                    data_bytes=tally.data_bytes,
                    entries=tally.entries - tally.links,
                    boot=boot_clock(),
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
        if exc.errno in _FULL_ERRNOS:
            raise NoRoom(
                "the snapshot did not fit: the state filesystem is full: delete snapshots with delete_snapshot",
                detail=f"{archive_dir}: {exc!r}",
            ) from exc
        raise OperationFailed(
            f"the snapshot could not be written: {exc.strerror or exc}", detail=f"{archive_dir}: {exc!r}"
        ) from exc
    finally:
        os.close(root_fd)
    return info


def _budget(dir_fd: int, limits: SnapshotLimits, source: str | None) -> Budget:
    """How much archive the next snapshot may write, refusing it now if the answer is nothing.

    Raises:
        ResourceLimit: a count cap is reached.
        NoRoom: no room is left under a byte cap or the reserve.
    """
    infos = _load_all(dir_fd)
    own = [info for info in infos if source is not None and info.metadata.get("sandbox_id") == source]
    how = "delete snapshots with delete_snapshot first"
    if len(infos) >= limits.count:
        raise ResourceLimit(
            f"snapshot refused: {len(infos)} snapshots are kept, the most allowed "
            f"(max_snapshots = {limits.count}): {how}"
        )
    if source is not None and len(own) >= limits.per_sandbox_count:
        raise ResourceLimit(
            f"snapshot refused: sandbox {source} has {len(own)} snapshots, the most per sandbox "
            f"(max_snapshots_per_sandbox = {limits.per_sandbox_count}): {how}"
        )
    rooms = [
        (
            limits.bytes - sum(info.archive_bytes for info in infos),
            f"the snapshots would take over {limits.bytes} bytes (max_snapshot_bytes)",
        ),
        (
            limits.per_sandbox_bytes - sum(info.archive_bytes for info in own),
            f"the snapshots of sandbox {source} would take over {limits.per_sandbox_bytes} bytes "
            "(max_snapshot_bytes_per_sandbox)",
        ),
    ]
    guard = None
    if limits.reserve_bytes > 0:
        guard = SpaceGuard(dir_fd, limits.reserve_bytes)
        rooms.append(
            (
                guard.room() - MAX_INFO_BYTES,
                f"the state filesystem would have less than {limits.reserve_bytes} bytes free, "
                "the reserve kept for the audit log (state_reserve_bytes)",
            )
        )
    room, why = min(rooms)
    if room <= 0:
        raise NoRoom(f"snapshot refused: {why}: {how}")
    return Budget(room, f"snapshot refused: {why}: delete snapshots with delete_snapshot, or files first", guard)


def restore_snapshot(
    archive_dir: Path,
    snapshot_id: str,
    target: Path,
    *,
    owner: tuple[int, int] | None = None,
    state_dir: Path | None = None,
    reserve_bytes: int = 0,
) -> SnapshotInfo:
    """Extract a snapshot into `target`, an existing empty folder, without ever leaving it.

    On failure `target` is left partly filled: the caller discards it (it may hold symlinks,
    so never follow paths inside it while deleting).

    Args:
        archive_dir: where snapshots live.
        snapshot_id: ``snap-`` and 16 hex digits.
        target: an existing, empty folder (a new sandbox's workspace).
        owner: (uid, gid) given to everything restored: the sandbox's host identity. None: the server's.
        state_dir: a folder on the filesystem that must keep `reserve_bytes` free (where the
            target's blocks are finally allocated, e.g. its disk image's folder). None: no reserve.
        reserve_bytes: the free space kept there.

    Returns:
        The restored snapshot's `SnapshotInfo`.

    Raises:
        BastionError: InvalidRequest (bad id or member name), NotFound, Conflict (target
            missing, not a folder or not empty), PathEscape (a member leaves the target),
            PolicyDenied (hard link, device, FIFO member), ResourceLimit (the reserve, the
            target's disk, a bound of the archive), OperationFailed (corrupt snapshot).
    """
    _check_id(snapshot_id)
    dir_fd = _open_archive_dir(archive_dir, snapshot_id)
    try:
        info = _load_info(dir_fd, snapshot_id)
        target_fd = _open_empty_target(target)
        try:
            guard = _restore_guard(info, target_fd, state_dir, reserve_bytes)
            try:
                archive_fd = os.open(f"{snapshot_id}.tar.gz", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except FileNotFoundError as exc:
                raise NotFound(f"the archive of snapshot {snapshot_id} is missing: delete the snapshot") from exc
            with open(archive_fd, "rb") as raw:
                if hashlib.file_digest(raw, "sha256").hexdigest() != info.sha256 or raw.tell() != info.archive_bytes:
                    raise OperationFailed(f"snapshot {snapshot_id} is corrupt: delete it and take a new one")
                raw.seek(0)
                extract(raw, target_fd, info, owner, guard)
            _flush_restore(info, target_fd, guard)
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                raise ResourceLimit(
                    f"snapshot {snapshot_id} did not fit: the disk filled up while it was restored "
                    "(the sandbox's limits.disk_bytes, or the state filesystem): free room and try again",
                    detail=f"{target}: {exc!r}",
                ) from exc
            raise OperationFailed(
                f"snapshot {snapshot_id} could not be restored: {exc.strerror or exc}", detail=f"{target}: {exc!r}"
            ) from exc
        finally:
            os.close(target_fd)
    finally:
        os.close(dir_fd)
    return info


def _restore_guard(info: SnapshotInfo, target_fd: int, state_dir: Path | None, reserve_bytes: int) -> SpaceGuard | None:
    """Refuse a restore whose data cannot fit the target's disk or would eat the state reserve; the guard for the rest.

    Raises:
        ResourceLimit: naming the bound.
    """
    target_free = SpaceGuard(target_fd, 0).free_bytes()
    if info.data_bytes > target_free:
        raise ResourceLimit(
            f"snapshot {info.id} holds {info.data_bytes} bytes of files and the new sandbox's disk has "
            f"{target_free} free (limits.disk_bytes): ask the administrator for a larger disk_bytes"
        )
    if state_dir is None or reserve_bytes <= 0:
        return None
    guard = SpaceGuard(state_dir, reserve_bytes)
    guard.require(info.data_bytes + info.entries * (_BLOCK_BYTES + _INODE_BYTES), f"restore of snapshot {info.id}")
    return guard


def _flush_restore(info: SnapshotInfo, target_fd: int, guard: SpaceGuard | None) -> None:
    """Write the restored tree out, failing on a write-back error, then check the reserve once its blocks count.

    Raises:
        OSError: EIO or ENOSPC from the write-back (a disk image's blocks that did not fit).
        NoRoom: the state filesystem is below its reserve now.
    """
    sync_filesystem(target_fd)
    if guard is not None:
        guard.require(0, f"restore of snapshot {info.id}")


def list_snapshots(archive_dir: Path) -> list[SnapshotInfo]:
    """The snapshots in `archive_dir`, oldest first; unreadable records are left out.

    Raises:
        BastionError: OperationFailed when the folder cannot be read.
    """
    try:
        dir_fd = os.open(archive_dir, DIR_FLAGS)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise OperationFailed(
            f"the snapshot folder cannot be opened: {exc.strerror}",
            detail=f"snapshot folder {archive_dir} cannot be opened: {exc!r}",
        ) from exc
    try:
        return _load_all(dir_fd)
    finally:
        os.close(dir_fd)


def remove_leftovers(archive_dir: Path) -> int:
    """Delete what an interrupted snapshot left (``.tmp-*`` files, an archive without its record).

    Call it when no snapshot is being written (at start-up). Returns how many files went.
    """
    try:
        dir_fd = os.open(archive_dir, DIR_FLAGS)
    except OSError:
        return 0
    removed = 0
    try:
        with _WRITING:
            names = set(os.listdir(dir_fd))
            for name in names:
                match = _LEFTOVER_RE.fullmatch(name)
                if match is None or (match[2] is not None and f"{match[2]}.json" in names):
                    continue
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dir_fd)
                    removed += 1
    finally:
        os.close(dir_fd)
    return removed


def delete_snapshot(archive_dir: Path, snapshot_id: str) -> None:
    """Delete a snapshot: its record first, so it is never listed without its archive.

    Raises:
        BastionError: InvalidRequest (bad id), NotFound, OperationFailed.
    """
    _check_id(snapshot_id)
    dir_fd = _open_archive_dir(archive_dir, snapshot_id)
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


def _open_archive_dir(archive_dir: Path, snapshot_id: str) -> int:
    """The snapshot folder's fd; the errors name `snapshot_id`, and the folder's path only in their detail."""
    try:
        return os.open(archive_dir, DIR_FLAGS)
    except FileNotFoundError as exc:
        raise NotFound(
            f"snapshot {snapshot_id} does not exist: list the snapshots to find its id",
            detail=f"snapshot folder {archive_dir} does not exist",
        ) from exc
    except OSError as exc:
        raise OperationFailed(
            f"the snapshot folder cannot be opened: {exc.strerror}",
            detail=f"snapshot folder {archive_dir} cannot be opened: {exc!r}",
        ) from exc


def _open_empty_target(target: Path) -> int:
    where = f"restore target {target}"
    try:
        fd = os.open(target, DIR_FLAGS)
    except FileNotFoundError as exc:
        raise Conflict("the restore target does not exist: create an empty folder first", detail=where) from exc
    except OSError as exc:
        raise Conflict("the restore target is not a folder: pass an empty folder", detail=where) from exc
    try:
        if os.listdir(fd):
            raise Conflict(
                "the restore target is not empty: nothing is overwritten; pass an empty folder", detail=where
            )
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


def _load_all(dir_fd: int) -> list[SnapshotInfo]:
    infos: list[SnapshotInfo] = []
    for name in sorted(os.listdir(dir_fd)):
        match = _INFO_NAME_RE.fullmatch(name)
        if match is None:
            continue
        with contextlib.suppress(BastionError):
            infos.append(_load_info(dir_fd, match[1]))
    infos.sort(key=lambda info: (info.created, info.id))
    return infos


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
        "data_bytes": info.data_bytes,
        "entries": info.entries,
        "boot_id": info.boot[0],
        "boot_time": info.boot[1],
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
    # Records written before data_bytes was kept: the whole size is the bound a restore can use.
    counts.append(record.get("data_bytes", record.get("bytes")))
    # Records written before entries was kept: their files, which the restore's reserve check counted then.
    counts.append(record.get("entries", record.get("files")))
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
    boot_id, boot_time = record.get("boot_id", ""), record.get("boot_time", 0.0)  # absent in older records
    if not isinstance(boot_id, str) or isinstance(boot_time, bool) or not isinstance(boot_time, int | float):
        return None
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
        data_bytes=numbers[3],
        entries=numbers[4],
        boot=(boot_id, float(boot_time)),
    )

"""Snapshots of a sandbox workspace, and restoring one into a new workspace. THIS MODULE IS A SECURITY BOUNDARY.

A snapshot is ``<archive_dir>/<id>.tar.gz`` (PAX tar, gzip level 6) plus ``<id>.json`` (its
`SnapshotInfo`, written last: a snapshot without its JSON does not exist). Both are written
under a temporary name in the same folder, fsynced and renamed, so a crash leaves at most a
``.tmp-*`` file behind, never a half snapshot.

The workspace was written by the agent, so its content is hostile in both directions. This
module holds the public API and the records; the archive is written by
`bastion.sandbox._archive` and extracted by `bastion.sandbox._extract`, whose docstrings say
what each refuses and what it does not guarantee. Checked here:

- Taking a snapshot (`create_snapshot`): the archive folder must be outside the workspace,
  and the label and metadata are checked before anything is written.
- Restoring (`restore_snapshot`), the archive is treated as hostile even though this module
  wrote it: its sha256 must match the JSON before anything is extracted; the same open fd
  is hashed and then read. The target must be an existing, empty folder.

What it does not guarantee:

- The sha256 detects corruption, not an attacker who can write ``archive_dir``.
- On a failed restore the target is left partly filled: the caller discards it, without
  following the symlinks it may now contain.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, final

from bastion.safety.errors import BastionError, Conflict, InvalidRequest, NotFound, OperationFailed
from bastion.safety.paths import unsafe_char

# The ``X as X`` imports re-export public bounds defined, and read, where they are enforced:
# patch them in `_archive` or `_extract`, not here.
from bastion.sandbox._archive import GZIP_LEVEL as GZIP_LEVEL
from bastion.sandbox._archive import _write_archive
from bastion.sandbox._extract import _DIR_FLAGS, _extract
from bastion.sandbox._extract import MAX_DEPTH as MAX_DEPTH
from bastion.sandbox._extract import MAX_ENTRIES as MAX_ENTRIES
from bastion.sandbox._extract import MAX_SNAPSHOT_BYTES as MAX_SNAPSHOT_BYTES

MAX_LABEL_CHARS: Final = 200
MAX_INFO_BYTES: Final = 1_048_576

_ID_RE: Final = re.compile(r"snap-[0-9a-f]{16}")
_INFO_NAME_RE: Final = re.compile(r"(snap-[0-9a-f]{16})\.json")
_SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")


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


def restore_snapshot(
    archive_dir: Path, snapshot_id: str, target: Path, *, owner: tuple[int, int] | None = None
) -> SnapshotInfo:
    """Extract a snapshot into `target`, an existing empty folder, without ever leaving it.

    On failure `target` is left partly filled: the caller discards it (it may hold symlinks,
    so never follow paths inside it while deleting).

    Args:
        archive_dir: where snapshots live.
        snapshot_id: ``snap-`` and 16 hex digits.
        target: an existing, empty folder (a new sandbox's workspace).
        owner: (uid, gid) given to everything restored: the sandbox's host identity. None: the server's.

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
                _extract(raw, target_fd, info, owner)
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

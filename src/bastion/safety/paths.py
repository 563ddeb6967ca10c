"""Jailed file access beneath one workspace folder. THIS MODULE IS A SECURITY BOUNDARY.

What it guarantees:

- The object checked is the object used. The workspace root is opened once, at construction,
  with no symlink allowed anywhere in its path (`open_real_folder`: a component another user
  turned into a link cannot redirect it), as an ``O_PATH`` directory fd that the `Jail` holds
  until `Jail.close`. Every later open is
  ``openat2(root_fd, relative_path)`` (or relative to a directory fd obtained that way) with
  ``RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`` (see openat2(2)), so the kernel itself refuses,
  during the one lookup that produces the fd we then read or write, any ``..``, absolute
  symlink, symlink chain or /proc magic link that would leave the root. There is no
  check-then-use race: a folder swapped for a symlink is judged by the kernel at the open
  that counts, never by an earlier string check.
- Paths are validated lexically before any syscall: NUL, control and invisible format
  characters (bidi overrides, zero-width), backslashes, ``~``, absolute paths outside the
  root (compared component by component, never by string prefix), ``..`` above the root and
  over-long paths or names are refused. Nothing is URL-decoded or Unicode-normalised, so the
  name checked is the name the kernel sees.
- Only regular files are read or written: devices, FIFOs, sockets and folders are refused,
  and a FIFO is never opened for I/O. A file with more than one hard link is refused unless
  ``allow_hardlinks``, because a link to a file outside the workspace cannot be told apart
  from a file inside. The last component of a write never follows a symlink, truncation
  happens only after the opened file was checked, and missing parents are created one at a
  time with ``mkdirat`` under held directory fds.
- Names matching the secret-file patterns are refused for every operation (read, write,
  list, stat, a command's cwd), judged twice: on the path as given, and on the real path of
  the object the kernel opened (read back from ``/proc/self/fd``, every component beneath
  the root). A symlinked parent (``keys -> .ssh``, relative, chained or through ``..``) or an
  innocent-named link to a secret file is no way around them; a write is judged on its
  parent folder before anything is created in it, and on the file before a byte is written.
  Without a readable ``/proc/self/fd`` a jail with secret patterns refuses to start.
- Without openat2 (Linux < 5.6, or blocked by a seccomp filter) the jail refuses to start
  (`Unavailable`); it never falls back to string checks.

What it does not guarantee:

- It does not stop a process running inside the workspace from creating symlinks, hard
  links, FIFOs or device nodes there; it only makes using them unable to reach outside.
- Content is not inspected: a secret pasted into ``notes.txt`` is read like any other text.
- The secret-file rule matches names, at the moment of the check: a folder renamed to a
  secret name after it was judged (between two syscalls) is not caught, and a hard link
  (with ``allow_hardlinks``) is judged by the name it was opened through.
- Bind mounts placed inside the workspace by an administrator are crossed.
- Names returned by `Jail.list_dir` are returned as the kernel gives them; escaping them for
  display is the caller's job.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fnmatch
import functools
import grp
import os
import pwd
import re
import stat
import struct
import threading
import time
import unicodedata
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Concatenate, Final, Literal, ParamSpec, TypeVar, final

from bastion.safety._openat2 import RESOLVE, RESOLVE_NO_SYMLINKS, load_openat2
from bastion.safety.errors import (
    BastionError,
    ConfigError,
    Conflict,
    InvalidRequest,
    NotFound,
    OperationFailed,
    PathEscape,
    PolicyDenied,
    ResourceLimit,
    Unavailable,
)
from bastion.safety.trees import Walk

MAX_PATH_CHARS: Final = 4096
CLOSED_REASON: Final = "the workspace was closed (its sandbox ended, or the server is stopping): nothing was done"
MAX_NAME_BYTES: Final = 255
MAX_READ_BYTES: Final = 1_048_576
MAX_WRITE_BYTES: Final = 10_485_760
MAX_LIST_ENTRIES: Final = 10_000
MAX_WALK_ENTRIES: Final = 100_000  # Jail.walk (search_files)
_AT_FDCWD: Final = -100  # include/uapi/linux/fcntl.h
_DEADLINE_EVERY: Final = 256  # names a folder's listing reads between two looks at the walk's deadline
MAX_SCAN_ENTRIES: Final = 1_000_000  # privileged_files' walk of a host workspace at start
MAX_PRIVILEGED_NAMED: Final = 10  # privileged files one refusal names

DEFAULT_SECRET_PATTERNS: Final[tuple[str, ...]] = (
    ".env",
    ".env.*",
    "*.pem",
    "*.key",
    "id_rsa*",
    "id_ed25519*",
    "id_ecdsa*",
    "id_dsa*",
    ".ssh",
    ".aws",
    ".gnupg",
    ".netrc",
    ".git-credentials",
    ".pgpass",
    "*.kdbx",
    "credentials.json",
)


EntryKind = Literal["file", "dir", "symlink", "other"]

# openat2(2): EAGAIN means a concurrent rename made the kernel unsure a ".." stayed beneath
# the root; retrying is the documented answer. Bounded so an attacker cannot spin us forever.
_RETRIES: Final = 32
# What the kernel allows in one lookup (MAXSYMLINKS, include/linux/namei.h); `Jail._in_view` too.
_MAX_LINKS: Final = 40
# The parts `Jail._in_view` looks up for one path, links' targets included, one open each: a path
# 2,048 folders deep (PATH_MAX) with no link, and a few ms of lookups. 40 links to 1000-deep targets
# (each restarting at the root) are refused. A folder reopened after ``..`` counts one step, plus one a
# 32 parts it walks (once for a run of ``..``: a link climbing back 1,000 folders still resolves).
_MAX_VIEW_STEPS: Final = 4096
_NO_LINKS: Final = RESOLVE | RESOLVE_NO_SYMLINKS

# Control characters, invisible format characters (bidi overrides, zero-width), lone
# surrogates (os.fsencode would turn them into arbitrary bytes) and line/paragraph separators.
_REFUSED_CATEGORIES: Final = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})

_NEW_FILE_MODE: Final = 0o644
_NEW_DIR_MODE: Final = 0o755
# What the kernel clears when an unprivileged writer changes a file (setattr_should_drop_suidgid):
# the server may be root, which keeps them, so the jail clears them itself.
_PRIVILEGE_BITS: Final = stat.S_ISUID | stat.S_ISGID
_CAPABILITY_XATTR: Final = "security.capability"
_DELETED: Final = " (deleted)"


def privileged_files(
    root: str | os.PathLike[str], *, most: int = MAX_PRIVILEGED_NAMED, max_entries: int = MAX_SCAN_ENTRIES
) -> tuple[list[str], bool]:
    """Regular files beneath `root` that run with privileges (setuid, setgid with group exec, or carrying
    file capabilities), at most `most` of them, in walk order. Never follows a symlink; stays on `root`'s
    filesystem.

    Why: a command may write into a file it owns through a shared mapping, and Linux clears
    these bits on write(2) but not on a write through a mapping; so a setuid-root file the host
    left in a workspace could be given any bytes and keep its bit. Several are named at once: an
    upgrade found one per start, and each took the administrator a fix and a restart.

    Walked by fd, one entry at a time, each folder opened beneath its parent: found by attack, a listing
    kept whole with each entry's full path made a folder an agent left (100,000 names 3,800 bytes deep)
    cost every later start 470 MiB, and a folder deeper than PATH_MAX was skipped unchecked.

    Returns:
        (their paths relative to `root`; whether the walk stopped first: past `max_entries` entries, or a
        folder deeper than `MAX_WALK_DEPTH` left unchecked).
    """
    found: list[str] = []
    top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    with Walk(top, device=os.fstat(top).st_dev) as walk:
        for seen, (fd, folders, entry, info) in enumerate(walk, start=1):
            if seen > max_entries:
                return found, True
            if stat.S_ISREG(info.st_mode) and _runs_privileged(f"/proc/self/fd/{fd}/{entry.name}", info.st_mode):
                found.append("/".join((*folders, entry.name)))
                if len(found) >= most:
                    return found, False
        return found, walk.cut


def sync_folder(folder: str | os.PathLike[str]) -> None:
    """Make an entry created, renamed or removed in `folder` durable (fsync(2) of the folder: syncing the file
    is not enough).

    Raises:
        OSError: the folder cannot be opened or synced.
    """
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_real_folder(path: str, *, what: str = "the folder") -> int:
    """An ``O_PATH`` fd on the folder at the absolute `path`, refused if any component of it is a symlink.

    Why: a configured folder often sits where other users write (``/home/alice/code``). Resolved with
    ``realpath`` and then opened, a component she turned into a link (``code -> /etc``) made the root
    server serve /etc; between the two, even a check of the real path could be raced. One openat2 with
    RESOLVE_NO_SYMLINKS is the lookup that counts, and it follows no link at all.

    Raises:
        PathEscape: a component is a symbolic link (the message names it and the real path to configure).
        InvalidRequest: `path` is not absolute or not a folder.
        NotFound: nothing is at `path`.
        Unavailable: openat2 is missing or blocked.
    """
    if not os.path.isabs(path) or "\x00" in path:
        raise InvalidRequest(f"{what} '{path}' is not an absolute path: give an absolute path")
    fd = load_openat2()(_AT_FDCWD, os.fsencode(path), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0, RESOLVE_NO_SYMLINKS)
    if fd >= 0:
        return fd
    code = -fd
    if code == errno.ELOOP:
        raise PathEscape(
            f"{what} '{path}' goes through the symbolic link '{_first_link(path)}' (it leads to "
            f"'{os.path.realpath(path)}'), and bastion follows no link there: configure the folder's real path, "
            "and check who made the link"
        )
    if code == errno.ENOENT:
        raise NotFound(f"{what} '{path}' does not exist: create it first")
    if code == errno.ENOTDIR:
        raise InvalidRequest(f"{what} '{path}' is not a folder: give a folder")
    if code == errno.ENOSYS:
        raise Unavailable("openat2 is unavailable on this kernel: bastion needs Linux 5.6 or newer")
    raise InvalidRequest(f"{what} '{path}' cannot be opened ({os.strerror(code)}): fix it")


def _first_link(path: str) -> str:
    """The first component of `path` that is a symbolic link, for a refusal's message only (racy: the
    refusal itself came from the kernel's lookup); `path` itself if none is found any more."""
    reached = ""
    for part in filter(None, path.split("/")):
        reached = f"{reached}/{part}"
        try:
            if stat.S_ISLNK(os.lstat(reached).st_mode):
                return reached
        except OSError:
            break
    return path


def owner_identity(owner: tuple[int, int]) -> tuple[int, int] | None:
    """The file identity a root server takes to act in a folder of `owner`'s (`acting_as`), or None.

    Why: as root it would do what the owner could not (move another user's folder, write a file made
    read-only) and leave root's files in their folder. For a root-owned folder that identity is root's
    with its file capabilities off (found by attack: the file tools read and wrote another user's 0600
    file there, which the folder's commands, with no capability, are refused). A server that is not root
    keeps its own ids.
    """
    return owner if os.geteuid() == 0 else None


def replaceable_by(path: str, owner: tuple[int, int]) -> str | None:
    """Who, besides root and the folder's `owner`, could put another folder at `path`, or None.

    Whoever can write a folder on the way can rename any folder it holds into the configured name
    (no write permission on the moved folder is needed within one parent), and the server would
    then serve that folder as its owner: a root-owned one as root. A folder on the way is another
    user's if they own it (they can give themselves write), if its group may write and has members
    other than root and the owner, if everyone may write, or if an ACL entry lets another user or
    such a group write; with the sticky bit, only the owner of the entry on the path can rename it.

    Returns:
        One line naming who and through which folder.
    """
    parts = [part for part in path.split("/") if part]
    for depth in range(len(parts), 0, -1):
        who = _entry_replaceable_by("/" + "/".join(parts[:depth]), owner)
        if who is not None:
            return who
    return None


def _entry_replaceable_by(entry: str, owner: tuple[int, int]) -> str | None:
    """Who besides root and `owner` could put something else at `entry` through its folder (no link), or None."""
    parent = os.path.dirname(entry)
    info = os.lstat(parent)
    if info.st_uid not in (0, owner[0]):
        return f"uid {info.st_uid}, who owns {parent}"
    writers = _writers(parent, info, owner)
    if writers is None:
        return None
    if not info.st_mode & stat.S_ISVTX:
        return f"{writers}: they may write {parent}"
    entry_owner = os.lstat(entry).st_uid
    if entry_owner not in (0, owner[0]):
        return f"uid {entry_owner}, who owns {entry} in the sticky folder {parent}"
    return None


def secret_file_problem(path: str, owner: tuple[int, int]) -> str | None:
    """Why the file at `path` is not a secret only root and `owner` hold (a private key, a token), or None.

    What ssh asks of a private key, and what a neighbour could otherwise swap under a server that
    trusts the file: a regular file owned by root or `owner`, that no one else may read or write (by
    its mode or an ACL entry), reached through folders and symbolic links that no one else could
    change. Links are allowed when they are root's or `owner`'s too (/etc/letsencrypt/live/ is links).

    Raises:
        OSError: the file or a folder on the way cannot be examined.
    """
    who = file_replaceable_by(path, owner)
    if who is not None:
        return who
    real = os.path.realpath(path)
    readers = _readers(real, os.lstat(real), owner)
    if readers is not None:
        return f"{readers}: they may read {real}"
    return None


def _lookups(path: str) -> list[str]:
    """Every entry the kernel looks up to resolve `path`, symbolic links followed, each named by the real
    folder it is in (so that the folder, not a link's own mode, is what is judged)."""
    pending = [part for part in reversed(os.path.abspath(path).split("/")) if part]
    current, entries, hops = "/", [], 0
    while pending:
        part = pending.pop()
        if part == ".":
            continue
        if part == "..":
            current = os.path.dirname(current)
            continue
        entry = os.path.join(current, part)
        entries.append(entry)
        if not os.path.islink(entry):
            current = entry
            continue
        hops += 1
        if hops > _MAX_LINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
        target = os.readlink(entry)
        if target.startswith("/"):
            current = "/"
        pending.extend(part for part in reversed(target.split("/")) if part)
    return entries


def _passable_by_others(folder: str, owner: tuple[int, int]) -> bool:
    """Whether someone besides root and `owner` may pass every folder from `/` to `folder` (a real path), by
    mode or ACL. Generous where it cannot tell: a group with others in it, or an ACL that does not parse."""
    while True:
        info = os.lstat(folder)
        mode = info.st_mode
        grouped = mode & stat.S_IXGRP and not _group_only_of(info.st_gid, owner[0])
        if not (mode & stat.S_IXOTH or grouped or _acl_others(folder, _ACL_EXECUTE, owner)):
            return False
        if folder == "/":
            return True
        folder = os.path.dirname(folder)


def _readers(path: str, info: os.stat_result, owner: tuple[int, int]) -> str | None:
    """Who besides root and `owner` may read the file at `path` by its mode or its ACL, or None. A file in a
    folder only root and `owner` may pass is read by no one else, whatever its mode (certbot's archive/)."""
    if not _passable_by_others(os.path.dirname(path), owner):
        return None
    return mode_readers(info.st_mode, info.st_gid, owner[0]) or _acl_others(path, _ACL_READ, owner)


def mode_readers(mode: int, gid: int, uid: int) -> str | None:
    """Who besides root and user `uid` may read a file of `mode` and group `gid`, by its mode bits, or None."""
    if mode & stat.S_IROTH:
        return "any user"
    if mode & stat.S_IRGRP and not _group_only_of(gid, uid):
        return f"the members of group {gid}"
    return None


def folder_replaceable_by(path: str, owner: tuple[int, int]) -> str | None:
    """Who besides root and `owner` could put another folder at `path`, or change what it holds, or None.

    For a folder a root server keeps its state in (its mounts are later unmounted by path there) or
    reads its config from: the folder itself (or, not made yet, the nearest folder above it, where it
    will be made) must be root's or `owner`'s and writable by no one else unless sticky, and no folder
    above may let anyone else rename it away (`replaceable_by`). A symbolic link on the way counts as
    replaceable: whoever owns the folder holding it could point it elsewhere. Point-in-time: a folder
    made later in a sticky folder is judged when it exists (call again).

    Returns:
        One line naming who and through which folder, or None.

    Raises:
        OSError: a folder on the way cannot be examined.
    """
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if os.path.realpath(existing) != existing:
        return f"whoever may change the symbolic link {_first_link(existing)} on its path (give the real path)"
    info = os.lstat(existing)
    if info.st_uid not in (0, owner[0]):
        return f"uid {info.st_uid}, who owns {existing}"
    writers = _writers(existing, info, owner)
    if writers is not None and not info.st_mode & stat.S_ISVTX:
        return f"{writers}: they may write {existing}"
    return replaceable_by(existing, owner)


def writers_besides(folder: str, owner: tuple[int, int]) -> str | None:
    """Who besides root and `owner` may write `folder` itself, by its mode or its ACL, or None."""
    return _writers(folder, os.lstat(folder), owner)


def owners_phrase(owner: tuple[int, int]) -> str:
    """Whose a trusted path must be, as a refusal says it: "root's", or "root's or uid N's"."""
    return "root's" if owner[0] == 0 else f"root's or uid {owner[0]}'s"


def folder_changeable_by(path: str, owner: tuple[int, int]) -> str | None:
    """`folder_replaceable_by`, and who else may write the folder itself even when it is sticky, or None.

    For a folder whose entries a server trusts by name (a venv's ``bin``, a microVM's image folder): in a
    sticky folder others may still add the names that are missing, and those would be run.

    Raises:
        OSError: a folder on the way cannot be examined.
    """
    who = folder_replaceable_by(path, owner)
    if who is None and os.path.lexists(path):
        writers = writers_besides(path, owner)
        who = None if writers is None else f"{writers}: they may write {path}"
    return who


def folder_to_make_changeable_by(path: str, owner: tuple[int, int]) -> str | None:
    """`folder_changeable_by` of `path`, or, while it is missing, of the nearest folder above it, or None.

    For a folder a root command makes and then uses by path (a venv it runs, an image's root it fills):
    in a folder others may write, sticky or not, another user could make a missing name first (their
    folder, or a link), and what is made beneath it would be theirs. Point-in-time like the rest: once it
    passes, no one but root and `owner` can change any folder on the way.

    Raises:
        OSError: a folder on the way cannot be examined.
    """
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    return folder_changeable_by(existing, owner)


def file_replaceable_by(path: str, owner: tuple[int, int]) -> str | None:
    """Who besides root and `owner` could change what the file at `path` holds, or None.

    `secret_file_problem` without its readers: for a file that is public but trusted (a certificate, a
    microVM's kernel, a venv's python). A regular file owned by root or `owner` that no one else may write
    (mode or ACL), reached through folders and symbolic links no one else could change.

    Raises:
        OSError: the file or a folder on the way cannot be examined (a missing file too).
    """
    for entry in _lookups(path):
        who = _entry_replaceable_by(entry, owner)
        if who is not None:
            return f"{who}, and so could replace {path}"
    real = os.path.realpath(path)
    info = os.lstat(real)
    if not stat.S_ISREG(info.st_mode):
        return f"whoever made {real}, which is not a regular file"
    if info.st_uid not in (0, owner[0]):
        return f"uid {info.st_uid}, who owns {real}"
    writers = _writers(real, info, owner)
    if writers is not None:
        return f"{writers}: they may write {real}"
    return None


def tree_changeable_by(
    root: str, owner: tuple[int, int], *, max_entries: int = MAX_SCAN_ENTRIES, skip: frozenset[str] = frozenset()
) -> str | None:
    """Who besides root and `owner` could change an entry beneath `root` (not `root` itself), or None.

    For a tree whose every file may run (a venv: any ``.pth`` in site-packages, any module, runs with its
    python). Each entry must be root's or `owner`'s and writable by no one else (mode or ACL); a folder
    must also have no default ACL giving others write (files made in it later would be theirs to change).
    A symbolic link leading out of the tree is judged by where it leads. Never follows a link; a mount
    point inside, or more than `max_entries` entries, is refused rather than left unseen. `skip`: names at
    the top of the tree not judged (their content is never run).

    Raises:
        OSError: an entry cannot be examined.
    """
    seen = 0
    device = os.lstat(root).st_dev
    inside = os.path.realpath(root) + os.sep
    folders = [root]
    while folders:
        folder = folders.pop()
        who = _acl_others(folder, _ACL_WRITE, owner, default=True)
        if who is not None:
            return f"{who}: a default ACL of {folder} lets them write what is made in it"
        with os.scandir(folder) as entries:
            listed = list(entries)
        for entry in listed:
            if folder == root and entry.name in skip:
                continue
            seen += 1
            if seen > max_entries:
                return f"nobody known: {root} holds over {max_entries} entries, too many to check"
            who = _entry_changeable_by(entry.path, entry.stat(follow_symlinks=False), owner, inside, device)
            if who is not None:
                return who
            if entry.is_dir(follow_symlinks=False):
                folders.append(entry.path)
    return None


def _entry_changeable_by(
    path: str, info: os.stat_result, owner: tuple[int, int], inside: str, device: int
) -> str | None:
    if info.st_uid not in (0, owner[0]):
        return f"uid {info.st_uid}, who owns {path}"
    if stat.S_ISLNK(info.st_mode):
        target = os.path.realpath(path)
        if target.startswith(inside):
            return None
        # Judged through the link, so that every hop on the way to the target is judged too.
        if os.path.isdir(target):
            return folder_changeable_by(path, owner)
        return file_replaceable_by(path, owner) if os.path.lexists(target) else None
    if stat.S_ISDIR(info.st_mode) and info.st_dev != device:
        return f"whoever mounted {path}, a mount point"
    writers = _writers(path, info, owner)
    return None if writers is None else f"{writers}: they may write {path}"


def moved_into_by(path: str, owner: tuple[int, int]) -> str | None:
    """`replaceable_by`, and for a root-owned folder, who else may write the folder itself, or None.

    For a folder whose entries a root server moves about (the organizer's inbox): run as root in a
    root-owned folder others may write, it would move their files into folders of other users' (a
    sticky bit protects what is in the folder, not what is moved into a subfolder someone else made).
    """
    who = replaceable_by(path, owner)
    if who is None and owner[0] == 0:
        others = writers_besides(path, owner)
        who = None if others is None else f"{others}, who may write the root-owned folder itself"
    return who


def _writers(folder: str, info: os.stat_result, owner: tuple[int, int]) -> str | None:
    """Who besides root and `owner` may write `folder` by its mode or its ACL, or None."""
    mode = info.st_mode
    if mode & stat.S_IWOTH:
        return "any user"
    if mode & stat.S_IWGRP and not _group_only_of(info.st_gid, owner[0]):
        return f"the members of group {info.st_gid}"
    return _acl_others(folder, _ACL_WRITE, owner)


def _acl_others(path: str, permission: int, owner: tuple[int, int], *, default: bool = False) -> str | None:
    """Who besides root and `owner` an ACL entry of `path` grants `permission` (`default`: its default ACL,
    what entries made in the folder later get), or None."""
    for tag, ident in _acl_granting(path, permission, default=default):
        if tag == _UNKNOWN:
            return "someone (its ACL cannot be read)"
        if tag == _ACL_USER and ident not in (0, owner[0]):
            return f"uid {ident} (an ACL entry)"
        if tag == _ACL_GROUP and not _group_only_of(ident, owner[0]):
            return f"the members of group {ident} (an ACL entry)"
    return None


_ACL_VERSION: Final = 2  # include/uapi/linux/posix_acl_xattr.h
_ACL_USER: Final = 0x02  # include/uapi/linux/posix_acl.h
_ACL_GROUP: Final = 0x08
_ACL_MASK: Final = 0x10
_ACL_WRITE: Final = 0x02
_ACL_READ: Final = 0x04
_ACL_EXECUTE: Final = 0x01
_UNKNOWN: Final = -1  # an ACL that does not parse: who may write cannot be told


def _acl_granting(folder: str, permission: int, *, default: bool = False) -> list[tuple[int, int]]:
    """(tag, id) of the named user and group entries of `folder`'s access ACL that grant `permission`.

    Read by hand from the ``system.posix_acl_access`` attribute (a version word, then 8-byte
    entries: tag, permissions, id): the standard library has no ACL reader. A mode's group bits
    show only the ACL's mask, so a folder with ``u:alice:rwx`` can look 0755; the mask also limits
    what a named entry grants. An attribute that does not parse counts as a writer (`_UNKNOWN`).
    """
    try:
        name = "system.posix_acl_default" if default else "system.posix_acl_access"
        raw = os.getxattr(folder, name, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return []
        raise
    if len(raw) < 4 or (len(raw) - 4) % 8 or struct.unpack_from("<I", raw)[0] != _ACL_VERSION:
        return [(_UNKNOWN, -1)]
    entries = list(struct.iter_unpack("<HHI", raw[4:]))
    mask = next((perm for tag, perm, _ in entries if tag == _ACL_MASK), permission)
    return [(tag, ident) for tag, perm, ident in entries if tag in (_ACL_USER, _ACL_GROUP) and perm & mask & permission]


def _group_only_of(gid: int, uid: int) -> bool:
    """Whether group `gid` can hold no one but root and user `uid`, told from the user database alone.

    Fail closed: only the root group with no listed member, or a user private group (the user's
    primary group, named after them, listing no one else) count. Who else has a group as primary
    cannot be listed where accounts come from a directory (SSSD, LDAP: enumeration is off).
    """
    try:
        group = grp.getgrgid(gid)
    except KeyError:
        return False  # a group the system does not name: who is in it cannot be told
    if gid == 0:
        return not group.gr_mem
    try:
        account = pwd.getpwuid(uid)
    except KeyError:
        return False
    return account.pw_gid == gid and group.gr_name == account.pw_name and set(group.gr_mem) <= {account.pw_name}


def _runs_privileged(path: str, mode: int) -> bool:
    if mode & stat.S_ISUID or (mode & stat.S_ISGID and mode & stat.S_IXGRP):
        return True
    try:
        os.getxattr(path, _CAPABILITY_XATTR, follow_symlinks=False)
    except OSError:
        return False
    return True


def unsafe_char(text: str) -> str | None:
    """Describe the first character no path or file name may contain here, or None.

    Backslashes (not separators on Linux, but UNC paths elsewhere), NUL, control and
    invisible format characters, lone surrogates and Unicode line separators. The one
    definition of it: the jail and the snapshot archive both use this.
    """
    for char in text:
        if char == "\\":
            return "a backslash (backslashes are not path separators here; use '/')"
        if unicodedata.category(char) in _REFUSED_CATEGORIES:
            return "a NUL byte" if char == "\x00" else f"the control or invisible character U+{ord(char):04X}"
    return None


def name_problem(name: str) -> str | None:
    """Why `name` cannot be one path component, or None when it can (``..`` is the caller's to judge)."""
    if name in ("", "."):
        return "is empty or '.'"
    if "/" in name:
        return "contains a slash"
    problem = unsafe_char(name)
    if problem is not None:
        return f"contains {problem}"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return f"is over {MAX_NAME_BYTES} bytes"
    return None


@final
@dataclass(frozen=True, slots=True)
class ReadResult:
    """What `Jail.read` returns.

    Attributes:
        path: the normalized workspace-relative path.
        data: the bytes read, at most the requested length.
        size: the file size when it was opened.
        eof: True when the read reached the end of the file.
        before: up to `margin` bytes just before `data` (see `Jail.read`).
        after: up to `margin` bytes just after `data`.
        version: (st_dev, st_ino, st_size, st_mtime_ns) of the file read, for `Jail.replace`.
    """

    path: str
    data: bytes
    size: int
    eof: bool
    before: bytes = b""
    after: bytes = b""
    version: tuple[int, int, int, int] = (0, 0, 0, 0)


@final
@dataclass(frozen=True, slots=True)
class WriteResult:
    """What `Jail.write` returns.

    Attributes:
        path: the normalized workspace-relative path.
        bytes_written: how many bytes were written.
        created: True when the file did not exist before.
    """

    path: str
    bytes_written: int
    created: bool


@final
@dataclass(frozen=True, slots=True)
class DirEntry:
    """One entry of `Jail.list_dir`; symlinks are reported as such, never followed.

    Attributes:
        name: the entry name as the kernel returns it.
        kind: ``file``, ``dir``, ``symlink`` or ``other`` (device, FIFO, socket).
        size: the size in bytes for files, 0 for everything else.
    """

    name: str
    kind: EntryKind
    size: int


@final
@dataclass(frozen=True, slots=True)
class WalkEntry:
    """One entry of `Jail.walk`: its real path beneath the root (no symlink in it), kind and size."""

    path: str
    kind: EntryKind
    size: int


def _version(info: os.stat_result) -> tuple[int, int, int, int]:
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def _kind_of(mode: int) -> EntryKind:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _special_name(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


class _NotAFolder(NotFound):
    """ENOTDIR: a component that should be a folder is not; callers may re-word it."""


def _checked_names(names: Mapping[str, str]) -> dict[str, str]:
    for name in names:
        if not name or "/" in name or name in (".", ".."):
            raise ConfigError(f"protected name {name!r} must be one path component: fix the entry")
    return dict(names)


def _compile_secret_patterns(patterns: Sequence[str]) -> tuple[tuple[str, re.Pattern[str]], ...]:
    if isinstance(patterns, str):
        raise ConfigError("secret_patterns is a single string: give a list of patterns")
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern or "/" in pattern:
            raise ConfigError(f"secret pattern {pattern!r} must be a non-empty name without '/': fix the entry")
    return _compiled_patterns(tuple(patterns))


@functools.lru_cache(maxsize=64)
def _compiled_patterns(patterns: tuple[str, ...]) -> tuple[tuple[str, re.Pattern[str]], ...]:
    """Every jail of a server has the same list: fnmatch.translate of ~16 patterns was 1 ms of each
    sandbox's start."""
    return tuple((pattern, re.compile(fnmatch.translate(pattern), re.IGNORECASE)) for pattern in patterns)


def _pread_all(fd: int, offset: int, length: int) -> bytes:
    """Up to `length` bytes from `offset`: fewer only at the end of the file."""
    chunks: list[bytes] = []
    got = 0
    while got < length:
        chunk = os.pread(fd, length - got, offset + got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def _view_parts(view_root: str | None) -> tuple[str, ...]:
    if view_root is None:
        return ()
    parts = tuple(part for part in view_root.split("/") if part)
    if not view_root.startswith("/") or not parts or any(part in (".", "..") for part in parts):
        raise ConfigError(f"view root {view_root!r} must be an absolute, normalized folder other than '/'")
    return parts


def _remove_made(parent_fd: int, name: str, fd: int, *, is_dir: bool) -> None:
    """Remove the entry `name` the jail just made in `parent_fd`, if it is still the one `fd` holds.

    Why: a folder renamed to a secret name between its check and the create (a rename race)
    must not be left with a new empty file or folder by a write that was refused.
    """
    with contextlib.suppress(OSError):
        made, now = os.fstat(fd), os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if (made.st_dev, made.st_ino) == (now.st_dev, now.st_ino):
            if is_dir:
                os.rmdir(name, dir_fd=parent_fd)
            else:
                os.unlink(name, dir_fd=parent_fd)


def _error_from_os(exc: OSError, rel: str) -> BastionError:
    """Map an errno to the error the caller can act on; the errno goes to the audit detail."""
    code = exc.errno
    detail = f"{rel}: {errno.errorcode.get(code or 0, str(code))} {exc.strerror}"
    if code == errno.ENOENT:
        return NotFound(f"'{rel}' does not exist: check the path with list_dir", detail=detail)
    if code == errno.ENOTDIR:
        return _NotAFolder(f"a parent of '{rel}' is not a folder: check the path with list_dir", detail=detail)
    if code in (errno.EXDEV, errno.ELOOP):
        return PathEscape(
            f"'{rel}' goes through a symbolic link that leaves the workspace, loops or is a /proc link: "
            "use a path inside the workspace",
            detail=detail,
        )
    if code == errno.EISDIR:
        return InvalidRequest(f"'{rel}' is a folder, not a regular file: use list_dir", detail=detail)
    if code == errno.ENAMETOOLONG:
        return InvalidRequest(f"'{rel}' is too long for the file system: use a shorter path", detail=detail)
    if code == errno.ENXIO:
        return PolicyDenied(f"'{rel}' is not a regular file: only regular files can be read or written", detail=detail)
    if code == errno.EEXIST:
        return Conflict(f"'{rel}' already exists: choose another name", detail=detail)
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return ResourceLimit(f"no space is left for '{rel}': free space or write less", detail=detail)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return OperationFailed(f"the operating system refused access to '{rel}': check its permissions", detail=detail)
    return OperationFailed(
        f"could not access '{rel}' ({exc.strerror}): try again or ask the administrator", detail=detail
    )


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _leased(method: Callable[Concatenate[Jail, _P], _R]) -> Callable[Concatenate[Jail, _P], _R]:
    """A `Jail` operation that holds the root fd for its whole run (`Jail._lease`), as the jail's file
    identity if it has one (`acting_as`)."""

    @functools.wraps(method)
    def leased(self: Jail, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lease():
            if self._acts_as is None:
                return method(self, *args, **kwargs)
            with acting_as(*self._acts_as):
                return method(self, *args, **kwargs)

    return leased


_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_DUMPABLE: Final = 4  # include/uapi/linux/prctl.h
_RESTORE_ATTEMPTS: Final = 3  # a restore cut by a signal's exception is tried again, a real failure not for ever


def _setgroups_number() -> int | None:
    """setgroups(2)'s number for this process, to call it raw: glibc's applies the groups to every thread.

    Known for 64-bit x86 and Arm processes only: a 32-bit process on a 64-bit kernel reports the
    kernel's machine but has another table (159 there is another call), so it gets None and the
    switch refuses to run.
    """
    if struct.calcsize("P") != 8:
        return None
    return {"x86_64": 116, "amd64": 116, "aarch64": 159, "arm64": 159}.get(os.uname().machine.lower())


_SYS_SETGROUPS: Final = _setgroups_number()
_CAPABILITY_VERSION_3: Final = 0x20080522  # <linux/capability.h>: two 32-bit words per set
_FILE_CAPABILITIES: Final = (0, 1, 2, 3, 4, 9, 27, 32)
"""What the kernel takes from a thread whose fsuid leaves 0 (CAP_FS_MASK): CHOWN, DAC_OVERRIDE,
DAC_READ_SEARCH, FOWNER, FSETID, LINUX_IMMUTABLE, MKNOD, MAC_OVERRIDE."""


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32))


def _thread_capabilities() -> tuple[_CapHeader, ctypes.Array[_CapData]]:
    """This thread's capability sets (capget(2) with pid 0: the calling thread's)."""
    header, data = _CapHeader(_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if _libc.capget(ctypes.byref(header), data) != 0:
        raise Unavailable(f"could not read this thread's capabilities ({os.strerror(ctypes.get_errno())})")
    return header, data


def _set_effective_capabilities(effective: tuple[int, int]) -> None:
    """Set this thread's effective capabilities (capset(2) is per thread), its other sets unchanged."""
    header, data = _thread_capabilities()
    data[0].effective, data[1].effective = effective
    if _libc.capset(ctypes.byref(header), data) != 0:
        raise Unavailable(f"could not set this thread's capabilities ({os.strerror(ctypes.get_errno())})")


def _file_capabilities_off() -> tuple[int, int]:
    """Take this thread's file capabilities out of its effective set; the set before, to give back."""
    _, data = _thread_capabilities()
    before = (int(data[0].effective), int(data[1].effective))
    effective = [before[0], before[1]]
    for capability in _FILE_CAPABILITIES:
        effective[capability // 32] &= ~(1 << (capability % 32))
    _set_effective_capabilities((effective[0], effective[1]))
    return before


_acting = threading.local()
"""This thread's switch, if any (`acting_as`): ``ids`` (uid, gid) while one runs."""


def _set_thread_groups(groups: Sequence[int]) -> None:
    if _SYS_SETGROUPS is None:
        raise Unavailable(
            f"cannot set one thread's groups in this process ({os.uname().machine}, {struct.calcsize('P') * 8}-bit): "
            "acting as a workspace's owner needs a 64-bit x86 or Arm server"
        )
    array = (ctypes.c_uint32 * len(groups))(*groups)
    if _libc.syscall(_SYS_SETGROUPS, len(groups), array) != 0 or os.getgroups() != list(groups):
        code = ctypes.get_errno()
        raise Unavailable(f"could not set this thread's groups ({os.strerror(code)}): the server needs CAP_SETGID")


@contextlib.contextmanager
def acting_as(uid: int, gid: int) -> Iterator[None]:
    """Run the block with this thread's filesystem ids set to `uid` and `gid`, and no supplementary group.

    The kernel then checks every access as that user with only their primary group, as the
    workspace's commands run (``setpriv --clear-groups``), and gives new files to them (a setgid
    folder's group still passes on); a root thread's capabilities that override file permissions are
    off meanwhile. Per thread (setfsuid(2), setfsgid(2), the raw setgroups(2)): a jail's operations
    never await, so the event loop runs nothing else while one does. A switch inside a switch of the
    same ids does nothing (the outer one restores); of other ids, it is refused.

    The restore sets the server's own ids whatever happened, and again if an exception (a signal's,
    on the main thread) cut it short, and checks they took: a thread left as the user would do the
    server's later work as them. Changing file ids makes the kernel mark the process not dumpable; it
    is marked dumpable again, as it was.
    """
    inside = getattr(_acting, "ids", None)
    if inside is not None:
        if inside != (uid, gid):
            raise Unavailable(f"already acting as uid {inside[0]} on files: cannot act as uid {uid} inside that")
        yield
        return
    groups = os.getgroups()
    _acting.ids = (uid, gid)
    capabilities: tuple[int, int] | None = None
    try:
        _set_thread_groups(())
        _libc.setfsgid(gid)
        _libc.setfsuid(uid)
        # Neither call reports an error; asking again returns the ids in force (setfsuid(2)).
        if _libc.setfsuid(uid) != uid or _libc.setfsgid(gid) != gid:
            raise Unavailable(f"could not act as uid {uid} and gid {gid} on files: the server needs CAP_SETUID")
        if uid == 0:  # an fsuid leaving 0 takes these off; staying 0, it is done here
            capabilities = _file_capabilities_off()
        yield
    finally:
        cut: BaseException | None = None
        for _ in range(_RESTORE_ATTEMPTS):
            try:
                _restore_server_identity(groups, capabilities)
            except BaseException as exc:  # restore again first; what cut it is raised after
                cut = cut or exc
                continue
            _acting.ids = None
            break
        if cut is not None:
            raise cut


def _restore_server_identity(groups: Sequence[int], capabilities: tuple[int, int] | None) -> None:
    if capabilities is not None:
        _set_effective_capabilities(capabilities)
    uid, gid = os.geteuid(), os.getegid()
    _libc.setfsuid(uid)
    _libc.setfsgid(gid)
    if _libc.setfsuid(uid) != uid or _libc.setfsgid(gid) != gid:
        raise Unavailable("could not give this thread the server's file ids back")
    _set_thread_groups(groups)
    _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)


@final
class Jail:
    """File operations confined beneath one workspace folder, resolved by the kernel.

    Every method validates the path lexically, refuses secret-file names, then opens through
    ``openat2`` relative to the root fd held since construction. Each operation holds that fd
    for its whole run: `close` from another thread (a sandbox closed while a worker thread
    reads its files) refuses the operations that start after it and closes the fd when the
    last running one ends. Closing it under a running one would free its number for the next
    ``open`` of the process (another sandbox's root, say), beneath which the operation would
    go on resolving its paths.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        secret_patterns: Sequence[str] = DEFAULT_SECRET_PATTERNS,
        allow_hardlinks: bool = False,
        owner: tuple[int, int] | None = None,
        view_root: str | None = None,
        act_as_owner: bool = False,
        protected_names: Mapping[str, str] | None = None,
        protected_paths: Mapping[str, str] | None = None,
    ) -> None:
        """Open the workspace root and keep its fd.

        Args:
            root: absolute path of an existing folder, with no symbolic link anywhere in it (`open_real_folder`).
            secret_patterns: fnmatch patterns matched, ignoring case, against every path component.
            allow_hardlinks: dangerous; read and write files with more than one hard link,
                which may be links to files outside the workspace.
            owner: (uid, gid) given to every file and folder the jail creates: the identity the
                workspace's commands run as, so a server running as root does not leave root's
                files where they cannot change them. None: the server's own.
            view_root: where the programs using the workspace see it (a sandbox's ``/workspace``):
                paths and absolute symlink targets under it name the workspace (`Jail.relative`,
                `_in_view`); other absolute ones are refused. None: a host folder, no view.
            act_as_owner: a root server's operations run with `owner` as the thread's filesystem ids,
                so the kernel refuses what that user could not do (another user's 0600 file, a file
                made read-only, a folder that is not theirs), as it does for the workspace's commands.
            protected_names: names (exact) refused like secret files, anywhere in a path and judged by
                real path alike, each with the reason given (a host workspace's ``.git``).
            protected_paths: paths relative to the root refused so, with all beneath them (a host workspace's
                repository folder that a ``.git`` file names, its submodules' folders).

        Raises:
            InvalidRequest: the root is not absolute, not a folder, or reached through a symbolic link.
            NotFound: the root does not exist.
            Unavailable: openat2 is missing or blocked.
            ConfigError: a secret pattern is malformed.
        """
        self._fd = -1
        self._lock = threading.Lock()
        self._users = 0
        self._closing = False
        self._secret = _compile_secret_patterns(secret_patterns)
        self._protected = _checked_names(protected_names or {})
        self._protected_paths = dict(protected_paths or {})
        self._allow_hardlinks = allow_hardlinks
        self._owner = owner
        self._acts_as = owner_identity(owner) if act_as_owner and owner is not None else None
        self._view = _view_parts(view_root)
        self._openat2 = load_openat2()
        given = os.fspath(root)
        if not isinstance(given, str) or "\x00" in given:
            raise InvalidRequest("the workspace root must be a path string without NUL: fix the configuration")
        if not os.path.isabs(given):
            raise InvalidRequest(f"the workspace root '{given}' is not absolute: give an absolute path")
        real = os.path.normpath(given)
        fd = open_real_folder(real, what="the workspace root")
        probe = self._openat2(fd, b".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0, RESOLVE)
        if probe < 0:
            os.close(fd)
            raise Unavailable(
                "openat2 is unavailable (Linux before 5.6, or blocked by seccomp): bastion needs it to confine paths",
                detail=f"openat2 probe: {errno.errorcode.get(-probe, str(-probe))}",
            )
        os.close(probe)
        self._fd = fd
        self._root = real
        self._root_parts: tuple[str, ...] = tuple(part for part in real.split("/") if part)
        if self._secret or self._protected or self._protected_paths:
            self._probe_real_paths(real)

    def _probe_real_paths(self, real: str) -> None:
        # The secret-file rule judges real paths read from /proc/self/fd: without them it could not.
        try:
            seen = self._real_relative(self._fd, ".")
        except BastionError as exc:
            self.close()
            raise Unavailable(
                "/proc/self/fd cannot be read: bastion needs it to judge secret files by their real path",
                detail=exc.detail,
            ) from None
        if seen != ".":
            self.close()
            raise Unavailable(
                f"/proc/self/fd names the workspace root '{real}' differently: bastion needs it to judge secret files",
                detail=f"root seen as {seen!r}",
            )

    @property
    def root(self) -> str:
        """The real path of the workspace root, resolved once at construction."""
        return self._root

    def close(self) -> None:
        """Close the root fd, once the operations running in other threads end; later calls raise
        Unavailable. Closing twice is harmless."""
        with self._lock:
            self._closing = True
            fd = self._release_fd()
        if fd >= 0:
            os.close(fd)

    def _release_fd(self) -> int:
        """The fd to close now (the lock held): ours once closing and unused, else -1."""
        if not self._closing or self._users or self._fd < 0:
            return -1
        fd, self._fd = self._fd, -1
        return fd

    @contextlib.contextmanager
    def _lease(self) -> Iterator[None]:
        """Keep the root fd open while an operation runs (see the class docstring)."""
        with self._lock:
            if self._closing:
                raise Unavailable(CLOSED_REASON)
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                fd = self._release_fd()
            if fd >= 0:
                os.close(fd)

    def __enter__(self) -> Jail:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def relative(self, path: str) -> str:
        """Validate a path lexically and return it relative to the root, without touching the disk.

        Args:
            path: a workspace-relative path, or an absolute path lexically under the root or the view root.

        Returns:
            The normalized relative path (``.`` for the root): no ``..``, no empty components.

        Raises:
            InvalidRequest: empty, too long, control/invisible characters, backslash, name too long.
            PathEscape: ``~``, an absolute path outside the root, or ``..`` above the root.
        """
        if not isinstance(path, str):
            raise InvalidRequest("the path must be a string: pass a path relative to the workspace")
        if not path:
            raise InvalidRequest("the path is empty: use '.' for the workspace root")
        if len(path) > MAX_PATH_CHARS:
            raise InvalidRequest(f"the path is longer than {MAX_PATH_CHARS} characters: use a shorter path")
        problem = unsafe_char(path)
        if problem is not None:
            raise InvalidRequest(f"the path contains {problem}: remove it")
        if path.startswith("~"):
            raise PathEscape("no home-folder expansion here; use a path relative to the workspace")
        parts = path.split("/")
        for part in parts:
            if len(part.encode("utf-8")) > MAX_NAME_BYTES:
                raise InvalidRequest(f"a name in the path is longer than {MAX_NAME_BYTES} bytes: use a shorter name")
        if path.startswith("/"):
            absolute: list[str] = []
            for part in parts:
                if part == "..":
                    if absolute:
                        absolute.pop()
                elif part not in ("", "."):
                    absolute.append(part)
            for prefix in (self._root_parts, self._view):
                if prefix and tuple(absolute[: len(prefix)]) == prefix:
                    return "/".join(absolute[len(prefix) :]) or "."
            raise PathEscape(self._outside_reason("the absolute path"))
        stack: list[str] = []
        for part in parts:
            if part == "..":
                if not stack:
                    raise PathEscape("the path climbs above the workspace with '..': use a path inside the workspace")
                stack.pop()
            elif part not in ("", "."):
                stack.append(part)
        return "/".join(stack) or "."

    @_leased
    def read(self, path: str, *, offset: int = 0, length: int = MAX_READ_BYTES, margin: int = 0) -> ReadResult:
        """Read part of a regular file beneath the root.

        A final symlink is followed only while it stays beneath the root.

        Args:
            path: the file to read.
            offset: byte offset to start at.
            length: bytes wanted; capped at ``MAX_READ_BYTES``.
            margin: also read up to this many bytes on each side of the range, in the same open
                (``before``, ``after``), e.g. so that redaction sees a secret the range cuts.

        Returns:
            The bytes and whether the end of the file was reached.

        Raises:
            BastionError: InvalidRequest, PathEscape, PolicyDenied (secret, not a regular file,
                hard links), NotFound, OperationFailed.
        """
        rel = self._checked(path)
        if offset < 0 or length < 0 or margin < 0:
            raise InvalidRequest("offset and length must not be negative: pass 0 or more")
        length = min(length, MAX_READ_BYTES)
        start = max(0, offset - margin)
        fd = self._open_regular(self._root_fd(), rel, rel, os.O_RDONLY, RESOLVE)
        try:
            self._judge(fd, rel)
            info = os.fstat(fd)
            size = info.st_size
            # Past the end there is nothing to read, and pread(2) refuses an offset past 2**63 - 1 (OverflowError).
            window = _pread_all(fd, start, offset + length + margin - start) if start <= size else b""
        except OSError as exc:
            raise _error_from_os(exc, rel) from exc
        finally:
            os.close(fd)
        cut = offset - start
        data = window[cut : cut + length]
        got = len(data)
        return ReadResult(
            path=rel,
            data=data,
            size=size,
            eof=got < length or offset + got >= size,
            before=window[:cut],
            after=window[cut + length :],
            version=_version(info),
        )

    @_leased
    def write(
        self, path: str, data: bytes, *, append: bool = False, create_parents: bool = False, exclusive: bool = False
    ) -> WriteResult:
        """Write a regular file beneath the root, never through a final symlink.

        An existing file's content is replaced as `replace` does it (a new file renamed over it, keeping its mode
        without setuid and setgid, and its owner): readers, and a crash, see the old content or the new.

        Args:
            path: the file to write; created with mode 0644 (minus umask) when missing.
            data: at most ``MAX_WRITE_BYTES`` bytes.
            append: add to the end instead of replacing the content.
            create_parents: create missing parent folders, one ``mkdirat`` at a time.
            exclusive: only create: an existing entry of that name (of any kind) is a Conflict.

        Returns:
            How many bytes were written and whether the file was created.

        Raises:
            BastionError: InvalidRequest, PathEscape, PolicyDenied (secret, symlink, not a
                regular file, hard links), NotFound (missing parent), ResourceLimit, OperationFailed.
        """
        rel = self._checked(path, follow=False)
        if not isinstance(data, bytes):
            raise InvalidRequest("the data must be bytes: encode the text first")
        if len(data) > MAX_WRITE_BYTES:
            raise ResourceLimit(
                f"the data is {len(data)} bytes, over the {MAX_WRITE_BYTES} byte limit: write it in parts with append"
            )
        if rel == ".":
            raise InvalidRequest("the workspace root is a folder: name a file inside it")
        parent, _, name = rel.rpartition("/")
        parent_fd = self._open_parent(parent, rel, create_parents)
        try:
            fd, created = self._open_for_write(parent_fd, name, rel, append, exclusive)
            try:
                self._judge(fd, rel)
            except BaseException:
                # The parent became a secret folder after it was judged: what O_CREAT made there goes.
                if created:
                    _remove_made(parent_fd, name, fd, is_dir=False)
                os.close(fd)
                raise
            # Replaced whole, never truncated and rewritten in place: found by attack, a server killed while it
            # wrote left the file empty or part-written, its old content lost (7 of 20 random kills). In place
            # only where the new file could not keep the old one's owner and group (found by review: acting as
            # the owner, a file of a shared group lost the group, and its rights with it).
            try:
                replaced = (
                    not append
                    and not created
                    and self._rename_new(parent_fd, name, rel, data, os.fstat(fd), same_ids=True)
                )
            except BaseException:
                os.close(fd)
                raise
        finally:
            os.close(parent_fd)
        if replaced:
            os.close(fd)
            return WriteResult(path=rel, bytes_written=len(data), created=False)
        written = 0
        try:
            self._settle(fd, created)
            if not append and not created:
                os.ftruncate(fd, 0)
            view = memoryview(data)
            while written < len(data):
                written += os.write(fd, view[written:])
        except OSError as exc:
            raise _error_from_os(exc, rel) from exc
        finally:
            os.close(fd)
        return WriteResult(path=rel, bytes_written=written, created=created)

    @_leased
    def list_dir(self, path: str = ".") -> tuple[DirEntry, ...]:
        """List a folder beneath the root, sorted by name; symlinks are reported, never followed.

        Raises:
            BastionError: InvalidRequest (not a folder), PathEscape, PolicyDenied, NotFound,
                ResourceLimit (more than ``MAX_LIST_ENTRIES`` entries), OperationFailed.
        """
        rel = self._checked(path)
        fd = self._open_dir(rel, os.O_RDONLY | os.O_DIRECTORY)
        entries: list[DirEntry] = []
        try:
            self._judge(fd, rel)
            with os.scandir(fd) as iterator:
                for entry in iterator:
                    if len(entries) >= MAX_LIST_ENTRIES:
                        raise ResourceLimit(f"'{rel}' has more than {MAX_LIST_ENTRIES} entries: list a smaller folder")
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    kind = _kind_of(info.st_mode)
                    entries.append(DirEntry(name=entry.name, kind=kind, size=info.st_size if kind == "file" else 0))
        except OSError as exc:
            raise _error_from_os(exc, rel) from exc
        finally:
            os.close(fd)
        entries.sort(key=lambda entry: entry.name)
        return tuple(entries)

    @_leased
    def walk(
        self,
        path: str = ".",
        *,
        max_entries: int = MAX_WALK_ENTRIES,
        prune: frozenset[str] = frozenset(),
        deadline: float | None = None,
    ) -> tuple[tuple[WalkEntry, ...], bool]:
        """Every entry beneath a folder, depth first in name order; a symlink is reported, never followed.

        Entries with a secret-file name are left out, and nothing beneath them is listed. Each
        folder is opened beneath the root by its real path with no symlink allowed anywhere in
        it, so a folder swapped for a link while the walk runs is skipped, never entered.

        Args:
            prune: names of folders listed but not entered (e.g. ``.git``).
            deadline: a `time.monotonic` value after which no further folder is listed: a
                deep, wide tree costs more than its entry count says (each folder is opened
                from the root).

        Returns:
            The entries (paths relative to the root, real: no symlink in them), and whether the
            walk stopped early (at `max_entries` or the deadline).

        Raises:
            BastionError: for the starting folder only: InvalidRequest (not a folder), PathEscape,
                PolicyDenied, NotFound.
        """
        rel = self._checked(path)
        fd = self._judged(self._open_dir(rel, os.O_PATH | os.O_DIRECTORY), rel)
        try:
            start = self._real_relative(fd, rel)
        finally:
            os.close(fd)
        found: list[WalkEntry] = []
        listed, cut = self._walk_folder(start, max_entries, deadline)
        pending = listed[::-1]
        while pending:
            entry = pending.pop()
            if len(found) >= max_entries or (deadline is not None and time.monotonic() > deadline):
                return tuple(found), True
            found.append(entry)
            if entry.kind == "dir" and entry.path.rpartition("/")[2] not in prune:
                # What is found or waiting counts against the bound: a folder is listed only that far.
                room = max_entries - len(found) - len(pending)
                listed, folder_cut = self._walk_folder(entry.path, room, deadline)
                pending.extend(listed[::-1])
                cut = cut or folder_cut
        return tuple(found), cut

    def _walk_folder(self, folder: str, room: int, deadline: float | None) -> tuple[list[WalkEntry], bool]:
        """The entries of one folder met by `walk`, sorted, and whether its listing was cut short.

        The listing stops once `room` names were read (secret names and unreadable entries count
        too) or at the deadline: one folder can hold millions of names (hard links cost no inode),
        and listing it whole cost ~140 bytes of the server's memory and ~10 us a name. None if the
        folder cannot be opened as a folder now.
        """
        if room <= 0:
            return [], True
        try:
            fd = self._open(
                self._root_fd(), folder, folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, resolve=_NO_LINKS
            )
        except BastionError:
            return [], False
        entries: list[WalkEntry] = []
        read, cut = 0, False
        try:
            with os.scandir(fd) as iterator:
                for item in iterator:
                    read += 1
                    if read > room or (read % _DEADLINE_EVERY == 0 and _past(deadline)):
                        cut = True
                        break
                    if self._secret_name(item.name):
                        continue
                    try:
                        info = item.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    kind = _kind_of(info.st_mode)
                    path = item.name if folder == "." else f"{folder}/{item.name}"
                    entries.append(WalkEntry(path=path, kind=kind, size=info.st_size if kind == "file" else 0))
        except OSError:
            return [], False
        finally:
            os.close(fd)
        entries.sort(key=lambda entry: entry.path)
        return entries, cut

    def _secret_name(self, name: str) -> bool:
        return any(regex.match(name) for _, regex in self._secret)

    @_leased
    def replace(self, path: str, data: bytes, *, version: tuple[int, int, int, int]) -> WriteResult:
        """Replace an existing regular file's content atomically: a new file beside it, renamed over it.

        Readers see the old content or the new, never a part. The new file gets the old one's
        mode (without setuid and setgid) and owner; extended attributes and ACLs are not kept.

        Args:
            path: the file; the last component is never followed.
            data: the whole new content, at most ``MAX_WRITE_BYTES`` bytes.
            version: `ReadResult.version` of the read the new content was made from. A
                point-in-time check: a change after it and before the rename is overwritten.

        Raises:
            BastionError: as `write`, and Conflict (the file changed since it was read).
        """
        rel = self._checked(path, follow=False)
        if len(data) > MAX_WRITE_BYTES:
            raise ResourceLimit(f"the new content is {len(data)} bytes, over the {MAX_WRITE_BYTES} byte limit")
        parent, _, name = rel.rpartition("/")
        parent_fd = self._open_parent(parent, rel, create=False)
        # Acting as the owner, opened for writing, not written: the rename needs only the folder's write
        # permission, and would replace a file the owner made read-only, or root's, with one of theirs.
        access = os.O_RDWR if self._acts_as is not None else os.O_RDONLY
        try:
            fd = self._open_regular(parent_fd, name, rel, access | os.O_NOFOLLOW, _NO_LINKS)
            try:
                self._judge(fd, rel)
                info = os.fstat(fd)
            finally:
                os.close(fd)
            if _version(info) != version:
                raise Conflict(f"'{rel}' changed since it was read: read it again and redo the edit")
            self._rename_new(parent_fd, name, rel, data, info)
        finally:
            os.close(parent_fd)
        return WriteResult(path=rel, bytes_written=len(data), created=False)

    def _rename_new(
        self, parent_fd: int, name: str, rel: str, data: bytes, old: os.stat_result, *, same_ids: bool = False
    ) -> bool:
        """Write `data` to a new file in `parent_fd` and rename it over `name`; whether it was.

        Found by attack: a server killed while it wrote or synced the new file left it in the user's folder
        (`.bastion-edit-*.tmp`, with the edit's content) for good. The file is now nameless (O_TMPFILE) until
        it is whole: it gets its temporary name only for the moment before the rename.

        `same_ids`: only if the new file can have the old one's owner and group (else False, nothing done), and
        can be made in the folder at all (a folder the owner may not write: False).
        """
        temp = f".bastion-edit-{os.urandom(6).hex()}.tmp"  # fixed length: any name fits NAME_MAX
        try:
            fd = self._nameless(parent_fd, rel)
            named = fd is None
            if fd is None:  # a filesystem without O_TMPFILE
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                fd = self._open(parent_fd, temp, rel, flags, mode=0o600, resolve=_NO_LINKS)
        except (PolicyDenied, OperationFailed):  # EACCES, EPERM, EROFS: not a file the folder takes from us
            if same_ids:
                return False
            raise
        try:
            with contextlib.suppress(PermissionError):  # a server not root, or acting as a user, keeps its own ids
                os.fchown(fd, old.st_uid, old.st_gid)
            made = os.fstat(fd)
            if same_ids and (made.st_uid, made.st_gid) != (old.st_uid, old.st_gid):
                if named:
                    with contextlib.suppress(OSError):
                        os.unlink(temp, dir_fd=parent_fd)
                return False
            mode = stat.S_IMODE(old.st_mode) & ~_PRIVILEGE_BITS
            if made.st_gid != old.st_gid:
                mode &= ~0o070  # the old group's rights must not pass to the group the new file got instead
            os.fchmod(fd, mode)
            view = memoryview(data)
            written = 0
            while written < len(data):
                written += os.write(fd, view[written:])
            os.fsync(fd)
            if not named:
                os.link(f"/proc/self/fd/{fd}", temp, dst_dir_fd=parent_fd)  # linkat(AT_SYMLINK_FOLLOW)
                named = True
            os.rename(temp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
            return True
        except OSError as exc:
            if named:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=parent_fd)
            raise _error_from_os(exc, rel) from exc
        except BaseException:
            if named:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=parent_fd)
            raise
        finally:
            os.close(fd)

    def _nameless(self, parent_fd: int, rel: str) -> int | None:
        """A new, nameless file (O_TMPFILE) in the folder `parent_fd`, or None where its filesystem has none."""
        flags = os.O_WRONLY | os.O_TMPFILE | os.O_CLOEXEC
        for _ in range(_RETRIES):
            result = self._openat2(parent_fd, b".", flags, 0o600, _NO_LINKS)
            if result >= 0:
                return result
            if -result in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                return None
            if -result not in (errno.EAGAIN, errno.EINTR):
                raise _error_from_os(OSError(-result, os.strerror(-result)), rel)
        return None

    @_leased
    def real_path(self, path: str) -> str:
        """Where `path` leads beneath the root, every symlink (the last one too) resolved beneath it.

        For a tool that writes what a link names (edit_file) rather than the link. A point-in-time
        answer: `replace` re-checks the file it is given.

        Raises:
            BastionError: InvalidRequest, PathEscape (a link leaves the root), PolicyDenied, NotFound.
        """
        rel = self._checked(path)
        fd = self._open(self._root_fd(), rel, rel, os.O_PATH)
        try:
            self._judge(fd, rel)
            return self._shown_safe(self._real_relative(fd, rel), path)
        finally:
            os.close(fd)

    @_leased
    def open_dir_fd(self, path: str) -> int:
        """Open a folder beneath the root as an ``O_PATH`` fd, e.g. to use as a command's cwd.

        Returns:
            The fd; the caller must close it.

        Raises:
            BastionError: InvalidRequest (not a folder), PathEscape, PolicyDenied, NotFound.
        """
        rel = self._checked(path)
        fd = self._open_dir(rel, os.O_PATH | os.O_DIRECTORY)
        return self._judged(fd, rel)

    @_leased
    def stat(self, path: str) -> os.stat_result:
        """Stat an entry beneath the root; a final symlink is refused, not followed.

        Raises:
            BastionError: InvalidRequest, PathEscape, PolicyDenied (secret or symlink), NotFound.
        """
        rel = self._checked(path, follow=False)
        fd = self._open(self._root_fd(), rel, rel, os.O_PATH | os.O_NOFOLLOW)
        try:
            self._judge(fd, rel)
            info = os.fstat(fd)
        finally:
            os.close(fd)
        if stat.S_ISLNK(info.st_mode):
            raise PolicyDenied(f"'{rel}' is a symbolic link and stat does not follow links: use list_dir to see it")
        return info

    @_leased
    def kind(self, path: str) -> EntryKind | None:
        """What is at `path`, a final symlink not followed; None when nothing is.

        For decisions the host makes about a path a sandbox controls: its parents are resolved
        by the kernel beneath the root, so a link leaving the workspace is refused whether or
        not its target exists (the answer reveals nothing about the host's files).

        Raises:
            BastionError: InvalidRequest, PathEscape (a parent leaves the root), PolicyDenied (secret).
        """
        rel = self._checked(path, follow=False)
        try:
            fd = self._open(self._root_fd(), rel, rel, os.O_PATH | os.O_NOFOLLOW)
        except NotFound:
            return None
        try:
            self._judge(fd, rel)
            return _kind_of(os.fstat(fd).st_mode)
        finally:
            os.close(fd)

    def _root_fd(self) -> int:
        if self._fd < 0:  # only outside a lease: every public operation holds one
            raise Unavailable(CLOSED_REASON)
        return self._fd

    def _checked(self, path: str, *, follow: bool = True) -> str:
        """`relative`, secret-checked; in a view, with its symlinks resolved as the view sees them.

        Args:
            follow: in a view, resolve a last component that is a symlink too (reads, folders).
        """
        rel = self.relative(path)
        self._check_secret(rel)
        if self._view:
            rel = self._shown_safe(self._in_view(rel, follow=follow), path)
            self._check_secret(rel)
        return rel

    def _shown_safe(self, real: str, path: str) -> str:
        """`real`, unless a link led to a name the caller could not have typed (it would reach messages)."""
        problem = unsafe_char(real)
        if problem is not None:
            raise InvalidRequest(
                f"'{path}' leads through a symbolic link to a name that contains {problem}: rename it or the link"
            )
        return real

    def _outside_reason(self, what: str) -> str:
        if self._view:
            view = "/" + "/".join(self._view)
            return f"{what} is outside {view}, the workspace: use a path under {view} or relative to it"
        return f"{what} is outside the workspace: use a path relative to the workspace"

    def _in_view(self, rel: str, *, follow: bool) -> str:
        """`rel` with every symlink resolved as a program in the view would, never leaving the root.

        Why not openat2's RESOLVE_IN_ROOT: it takes the root fd for "/", so a link to
        ``/workspace/x`` would name ``<root>/workspace/x`` and one to ``/etc/passwd`` would
        silently name ``<root>/etc/passwd``, neither what the sandbox sees. Here a target under
        the view root restarts at the root, any other absolute target (``/etc``, ``/proc/self/root``)
        and any ``..`` above the root are PathEscape: the sandbox would see something outside
        the workspace. Each part is looked up beneath the folder reached so far, with no symlink
        followed, so a lookup costs one open a part; the result is a string, and the open that uses
        it is still the kernel's RESOLVE_BENEATH one, so a folder swapped for a link after this step
        is judged there.

        Raises:
            PathEscape: a link or ``..`` leads outside the root, or more than 40 links (a loop).
            InvalidRequest: more than `_MAX_VIEW_STEPS` parts to look up (links' targets included).
        """
        pending = rel.split("/")[::-1]
        done: list[str] = []
        links = steps = 0
        walk = _ViewWalk(self, rel)
        try:
            while pending:
                part = pending.pop()
                if part in ("", "."):
                    continue
                if part == "..":
                    if not done:
                        raise PathEscape(
                            self._outside_reason(f"'{rel}' climbs with '..' or through a symbolic link and")
                        )
                    done.pop()
                    walk.restart()
                    continue
                steps += 1
                if steps + walk.reopened > _MAX_VIEW_STEPS:
                    raise InvalidRequest(
                        f"'{rel}' is too deep or goes through too many long links to follow: fix the links"
                    )
                target = walk.step(done, part, last=not (pending or follow))
                if target is None:
                    done.append(part)
                    continue
                links += 1
                if links > _MAX_LINKS:
                    raise PathEscape(
                        f"'{rel}' goes through more than {_MAX_LINKS} symbolic links (a loop?): fix the links"
                    )
                if target.startswith("/"):
                    done = []
                    walk.restart()
                    target = self._view_relative(target, rel)
                pending.extend(target.split("/")[::-1])
        finally:
            walk.close()
        return "/".join(done) or "."

    def _view_relative(self, target: str, rel: str) -> str:
        """An absolute link target, relative to the root; refused unless it starts with the view root."""
        parts = [part for part in target.split("/") if part not in ("", ".")]
        depth = len(self._view)
        if tuple(parts[:depth]) != self._view:
            # The target is not shown: a sandbox chose its bytes (escapes, a secret, a fake instruction).
            raise PathEscape(self._outside_reason(f"'{rel}' goes through a symbolic link whose target"))
        return "/".join(parts[depth:])

    def _check_secret(self, rel: str) -> None:
        if rel == ".":
            return
        for path, reason in self._protected_paths.items():
            if rel == path or rel.startswith(path + "/"):
                raise PolicyDenied(f"'{path}' {reason}")
        for name in rel.split("/"):
            if name in self._protected:
                raise PolicyDenied(f"'{name}' {self._protected[name]}")
            for pattern, regex in self._secret:
                if regex.match(name):
                    raise PolicyDenied(f"'{name}' matches the secret-file rule '{pattern}': ask the administrator")

    def _judge(self, fd: int, rel: str) -> None:
        """Apply the secret-file rule to the real path of what `fd` is, beneath the root.

        It differs from `rel` when a component of `rel` (a parent or the last) is a symlink:
        ``keys -> .ssh`` makes ``keys/authorized_keys`` really ``.ssh/authorized_keys``.
        """
        if not self._secret and not self._protected and not self._protected_paths:
            return
        real = self._real_relative(fd, rel)
        if real != rel:
            self._check_secret(real)

    def _judged(self, fd: int, rel: str) -> int:
        """`fd`, once `_judge` passed; closed if it did not."""
        try:
            self._judge(fd, rel)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _judged_or_removed(self, parent_fd: int, name: str, fd: int, rel: str) -> int:
        """`_judged` for a folder just made: one that turns out to be in a secret folder is removed."""
        try:
            self._judge(fd, rel)
        except BaseException:
            _remove_made(parent_fd, name, fd, is_dir=True)
            os.close(fd)
            raise
        return fd

    def _real_relative(self, fd: int, rel: str) -> str:
        """The path of what `fd` is, relative to the root, as the kernel names both now."""
        try:
            root = os.readlink(f"/proc/self/fd/{self._root_fd()}")
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError as exc:
            if exc.errno == errno.ENAMETOOLONG:  # the kernel names no path past PATH_MAX
                raise InvalidRequest(
                    f"'{rel}' is too deep to check: with the workspace folder's own path it passes the kernel's "
                    "4,096 characters; use a shorter path",
                    detail=f"{rel}: readlink: {exc.strerror}",
                ) from exc
            raise OperationFailed(
                f"could not tell where '{rel}' leads (/proc/self/fd is unreadable): ask the administrator",
                detail=f"{rel}: readlink: {exc.strerror}",
            ) from exc
        # An entry unlinked since it was opened is named with this suffix (d_path in fs/d_path.c); a file
        # that is really named so keeps it (stripped, `notes.txt (deleted)` read as another file).
        if target.endswith(_DELETED) and os.fstat(fd).st_nlink == 0:
            target = target.removesuffix(_DELETED)
        if target == root:
            return "."
        prefix = root.rstrip("/") + "/"
        if not target.startswith(prefix):
            raise OperationFailed(
                f"'{rel}' is no longer beneath the workspace folder (was it moved?): try again",
                detail=f"{rel}: real path {target!r} outside {root!r}",
            )
        return target[len(prefix) :]

    def _open(self, dirfd: int, path: str, rel: str, flags: int, *, mode: int = 0, resolve: int = RESOLVE) -> int:
        """openat2 with retries on EAGAIN/EINTR; raises the mapped BastionError."""
        raw = os.fsencode(path)
        for _ in range(_RETRIES):
            result = self._openat2(dirfd, raw, flags | os.O_CLOEXEC, mode, resolve)
            if result >= 0:
                return result
            code = -result
            if code in (errno.EAGAIN, errno.EINTR):
                continue
            if code == errno.ENOSYS:
                raise Unavailable("openat2 is unavailable on this kernel: bastion needs Linux 5.6 or newer")
            raise _error_from_os(OSError(code, os.strerror(code), path), rel)
        raise OperationFailed(f"'{rel}' kept being renamed while it was opened: try again", detail=f"{rel}: EAGAIN")

    def _settle(self, fd: int, created: bool) -> None:
        """Give a new file the workspace's owner; take setuid and setgid off an existing one.

        A root server writing into a setuid file would keep the bit (it holds CAP_FSETID),
        so new bytes would run with the owner's privileges: the bits go before any byte does.
        """
        if created and self._owner is not None and self._acts_as is None:  # acting as the owner: theirs already
            os.fchown(fd, *self._owner)
        mode = os.fstat(fd).st_mode
        if mode & _PRIVILEGE_BITS:
            os.fchmod(fd, stat.S_IMODE(mode) & ~_PRIVILEGE_BITS)
        # File capabilities: the kernel drops them on write too, but not for every writer on every kernel.
        with contextlib.suppress(OSError):
            os.removexattr(fd, _CAPABILITY_XATTR)

    def _own_new_dir(self, fd: int, rel: str) -> None:
        """Give the folder just made, open as `fd`, the workspace's owner; `fd` is closed on a refusal.

        Through the fd, never by name: whoever can write the parent can swap the new folder for a hard
        link to any file of that filesystem (renameat2 RENAME_EXCHANGE) between mkdir and chown, and a
        chown by name, even without following links, would give that file away. What the fd holds is a
        folder (O_DIRECTORY); it is still the server's own, as a folder this call made is.
        """
        if self._owner is None:
            return
        maker = self._acts_as[0] if self._acts_as is not None else os.geteuid()
        try:
            if os.fstat(fd).st_uid != maker:
                raise Conflict(f"the folder '{rel}' was replaced while it was made (a concurrent change): try again")
            if self._acts_as is None:  # acting as the owner, it is theirs, with the group a setgid parent gives
                os.fchown(fd, *self._owner)
        except BaseException:
            os.close(fd)
            raise

    def _require_regular(self, info: os.stat_result, rel: str) -> None:
        mode = info.st_mode
        if stat.S_ISREG(mode):
            if info.st_nlink > 1 and not self._allow_hardlinks:
                raise PolicyDenied(
                    f"'{rel}' has {info.st_nlink} hard links; a link to a file outside the workspace cannot be told "
                    "apart: copy the file instead of linking it"
                )
            return
        if stat.S_ISDIR(mode):
            raise InvalidRequest(f"'{rel}' is a folder, not a regular file: use list_dir")
        if stat.S_ISLNK(mode):
            raise PolicyDenied(f"'{rel}' is a symbolic link and writes never follow links: write to its target")
        raise PolicyDenied(
            f"'{rel}' is not a regular file ({_special_name(mode)}): only regular files can be read or written"
        )

    def _open_regular(self, dirfd: int, name: str, rel: str, flags: int, resolve: int) -> int:
        """Open a regular file with `flags`, checking it first through an O_PATH fd.

        The O_PATH probe means a FIFO or device is never opened for I/O (no blocking, no
        driver side effects); the fstat of the real fd, compared to the probe, is the check
        that counts.
        """
        nofollow = flags & os.O_NOFOLLOW
        probe = self._open(dirfd, name, rel, os.O_PATH | nofollow, resolve=resolve)
        try:
            before = os.fstat(probe)
        finally:
            os.close(probe)
        self._require_regular(before, rel)
        fd = self._open(dirfd, name, rel, flags | os.O_NONBLOCK | os.O_NOCTTY, resolve=resolve)
        try:
            after = os.fstat(fd)
            if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
                raise Conflict(f"'{rel}' was replaced while it was opened (a concurrent change): try again")
            self._require_regular(after, rel)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_dir(self, rel: str, flags: int) -> int:
        try:
            return self._open(self._root_fd(), rel, rel, flags)
        except _NotAFolder as exc:
            raise InvalidRequest(f"'{rel}' or a parent of it is not a folder: check the path with list_dir") from exc

    def _open_parent(self, parent: str, rel: str, create: bool) -> int:
        # The parent is judged before anything is created in it: through `keys -> .ssh`,
        # `keys/authorized_keys` must not come into being.
        root_fd = self._root_fd()
        if not parent:
            return self._open(root_fd, ".", rel, os.O_PATH | os.O_DIRECTORY)
        try:
            return self._judged(self._open(root_fd, parent, rel, os.O_PATH | os.O_DIRECTORY), parent)
        except _NotAFolder:
            raise
        except NotFound as exc:
            if not create:
                raise NotFound(
                    f"the folder '{parent}' does not exist: create it first or pass create_parents",
                    detail=exc.detail,
                ) from exc
        return self._make_parents(parent, rel)

    def _make_parents(self, parent: str, rel: str) -> int:
        # Each missing folder is created with mkdirat under the fd of its parent, never by path
        # string, and opened with RESOLVE_NO_SYMLINKS so a symlink planted in between is refused.
        # Each part is looked up beneath the one before, not from the root again: found by attack, a
        # 2,000-deep path cost ~2 million lookups (0.8 s of the event loop a call). A part that is a
        # symbolic link is looked up from the root, as every part once was (a link beneath the root is
        # followed), and from then on each folder's real path is judged as before.
        root_fd = self._root_fd()
        current = self._open(root_fd, ".", rel, os.O_PATH | os.O_DIRECTORY)
        parts = parent.split("/")
        plain, missing = True, False  # plain: no link followed yet, so each prefix is its own real path
        try:
            for index, part in enumerate(parts):
                prefix = "/".join(parts[: index + 1])
                following = None
                if not missing:
                    following, linked = self._existing_folder(root_fd, current, part, prefix, rel)
                    plain = plain and not linked
                if following is None:
                    missing = True
                    following = self._new_folder(current, part, prefix, rel, judge=not plain)
                elif not plain:
                    following = self._judged(following, prefix)
                os.close(current)
                current = following
        except BaseException:
            os.close(current)
            raise
        return current

    def _existing_folder(self, root_fd: int, current: int, part: str, prefix: str, rel: str) -> tuple[int | None, bool]:
        """The folder `part` beneath `current` (None if missing), and whether it was reached through a link."""
        beneath = RESOLVE | RESOLVE_NO_SYMLINKS
        try:
            return self._open(current, part, rel, os.O_PATH | os.O_DIRECTORY, resolve=beneath), False
        except _NotAFolder:  # a NotFound, but no folder will be made over a file
            raise
        except NotFound:
            return None, False
        except BastionError:  # a symbolic link (ELOOP), or another refusal: the lookup from the root decides
            pass
        try:
            return self._open(root_fd, prefix, rel, os.O_PATH | os.O_DIRECTORY), True
        except _NotAFolder:
            raise
        except NotFound:
            return None, True

    def _new_folder(self, current: int, part: str, prefix: str, rel: str, *, judge: bool) -> int:
        """Make the folder `part` beneath `current` (or take the one made meanwhile) and open it."""
        made = False
        try:
            os.mkdir(part, _NEW_DIR_MODE, dir_fd=current)
            made = True
        except FileExistsError:
            pass
        except OSError as os_exc:
            raise _error_from_os(os_exc, rel) from os_exc
        # Not O_PATH: a new folder is chowned through this fd, and an O_PATH fd cannot be.
        following = self._open(current, part, rel, os.O_RDONLY | os.O_DIRECTORY, resolve=RESOLVE | RESOLVE_NO_SYMLINKS)
        if made:
            if judge:
                following = self._judged_or_removed(current, part, following, prefix)
            self._own_new_dir(following, prefix)
        elif judge:
            following = self._judged(following, prefix)
        return following

    def _open_for_write(
        self, parent_fd: int, name: str, rel: str, append: bool, exclusive: bool = False
    ) -> tuple[int, bool]:
        # The last component must not be a symlink at all (RESOLVE_NO_SYMLINKS + O_NOFOLLOW):
        # a dangling link would otherwise make O_CREAT create its target. O_TRUNC is never
        # used: truncation waits until the opened file has been checked (hard links!).
        resolve = RESOLVE | RESOLVE_NO_SYMLINKS
        flags = os.O_WRONLY | os.O_NOFOLLOW | (os.O_APPEND if append else 0)
        if exclusive:
            # O_EXCL fails on any existing entry, a symlink (even dangling) included.
            create = flags | os.O_CREAT | os.O_EXCL
            try:
                return self._open(parent_fd, name, rel, create, mode=_NEW_FILE_MODE, resolve=resolve), True
            except Conflict:
                raise Conflict(f"'{rel}' exists: choose another name, or overwrite it on purpose") from None
        for _ in range(_RETRIES):
            try:
                return self._open_regular(parent_fd, name, rel, flags, resolve), False
            except _NotAFolder:
                raise
            except NotFound:
                pass
            try:
                create = flags | os.O_CREAT | os.O_EXCL
                fd = self._open(parent_fd, name, rel, create, mode=_NEW_FILE_MODE, resolve=resolve)
            except Conflict:
                continue
            return fd, True
        raise OperationFailed(f"'{rel}' kept appearing and disappearing while it was opened: try again")


class _ViewWalk:
    """The folder `Jail._in_view` has reached, held open: each part is one lookup beneath it.

    Looking each prefix up from the root again made a lookup cost the sum of the prefixes' depths: a
    file 1,400 folders deep in a sandbox cost 0.12 s of the event loop a call (read_file looks a path up
    twice). After ``..`` or an absolute link the folder is found again from the root, by path, when the
    next part needs it. A part that is missing or not a folder holds nothing: no part beneath it is a
    link (the open that counts says what is wrong).
    """

    def __init__(self, jail: Jail, rel: str) -> None:
        self._jail = jail
        self._rel = rel
        self._fd = -1  # the folder reached; -1: the root, or nothing (`_lost`)
        self._stale = False  # the folder reached is `done`, to open from the root before the next lookup
        self._lost = False  # a part on the way is missing or not a folder
        self.reopened = 0
        """What reopening folders from the root cost, in steps: one open, plus one a 32 parts it walks."""

    def restart(self) -> None:
        """The folder reached changed by name (``..``, or an absolute link restarting at the root)."""
        self._hold(-1)
        self._stale, self._lost = True, False

    def step(self, done: list[str], part: str, *, last: bool) -> str | None:
        """The target if `part`, beneath the folder `done` names, is a symlink; otherwise None, and the
        walk is in `part`. A `last` part is not followed: nothing is looked up."""
        if last:
            return None
        here = self._here(done)
        if here < 0:
            return None
        try:
            fd = self._jail._open(here, part, self._rel, os.O_PATH | os.O_NOFOLLOW, resolve=_NO_LINKS)
        except NotFound:
            self._hold(-1)
            self._lost = True
            return None
        try:
            mode = os.fstat(fd).st_mode
            target = os.readlink("", dir_fd=fd) if stat.S_ISLNK(mode) else None
        except OSError as exc:
            os.close(fd)
            raise _error_from_os(exc, self._rel) from exc
        if target is not None or not stat.S_ISDIR(mode):
            os.close(fd)
            self._lost = target is None  # a link leaves the walk where it was; a file ends it
            return target
        self._hold(fd)
        return None

    def close(self) -> None:
        self._hold(-1)

    def _here(self, done: list[str]) -> int:
        """The fd of the folder reached (the root's at the top), or -1 if it is lost."""
        if self._stale:
            self._stale = False
            if done:
                self.reopened += 1 + len(done) // 32
                try:
                    self._hold(
                        self._jail._open(self._jail._root_fd(), "/".join(done), self._rel, os.O_PATH, resolve=_NO_LINKS)
                    )
                except NotFound:
                    self._lost = True
        if self._lost:
            return -1
        return self._fd if self._fd >= 0 else self._jail._root_fd()

    def _hold(self, fd: int) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd

"""What of a host workspace's git repository its agent must not write (`protect_git`).

A host workspace's files are its owner's, and git, run by the owner in the folder, runs what the repository
names: the hooks and the config's programs (`core.fsmonitor`, `core.pager`, aliases, filters) of the folder
that `.git` is, or that a `.git` file (`gitdir: X`) and its `commondir` name, and a status in each submodule's
folder the index names (its gitlinks), whose own `.git` it reads (found by attack and by review: an agent's
config in each ran as the owner at the owner's next `git status` at the top). What is found here is read when
the server starts, from the
owner's files as they are then: the repository folders are shown read-only to the workspace's commands (bound
over themselves: a mount point is neither renamed nor removed), a submodule's folder that has no `.git` of its
own is shown read-only whole, and one that does not exist is made as git itself makes it for a submodule not
checked out, an empty folder, shown as an empty read-only one. The file tools refuse all of them.

Not covered (SECURITY.md, "A repository in a host workspace"): a repository made after the start, a submodule's
own submodules, a bare repository the agent makes, and files other than git's whose programs the owner runs.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import stat
import struct
from dataclasses import dataclass
from typing import Final

from bastion.safety.errors import ConfigError
from bastion.sandbox import LinkOnPath, open_beneath

logger = logging.getLogger("bastion.workbench.repository")

GIT: Final = ".git"
MAX_SUBMODULES: Final = 256
_MAX_READ_BYTES: Final = 1 << 20  # a `.git` file, `commondir`, `config`
_GITDIR: Final = re.compile(rb"\Agitdir: *(.+?)\s*\Z", re.DOTALL)
_MAX_INDEX_BYTES: Final = 256 << 20
_SHA256: Final = re.compile(rb"objectformat\s*=\s*sha256")
_GITLINK: Final = 0o160000
_EXTENDED: Final = 0x4000


@dataclass(frozen=True)
class Protection:
    """Paths relative to the workspace folder, parents before what is beneath them."""

    read_only: tuple[str, ...] = ()
    """Entries that exist: each shown read-only over itself."""
    sealed: tuple[str, ...] = ()
    """Submodule folders that do not exist: each an empty read-only folder (made empty on the host)."""

    @property
    def paths(self) -> tuple[str, ...]:
        return (*self.read_only, *self.sealed)


def repository_protection(root: str, workspace_id: str) -> Protection:
    """What of the repository in `root` (a real path, no link on it) to keep from the agent.

    Raises:
        ConfigError: a part git follows is a symbolic link (the agent could rename it and make its own).
    """
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _protection(root_fd, root)
    except LinkOnPath as exc:
        raise ConfigError(
            f"workspace {workspace_id!r}: {exc} is a symbolic link (or under one), which protect_git cannot pin: "
            "the agent could rename it and make its own, and git would run that as whoever next runs git there; "
            "make it a folder (or `.git` a file 'gitdir: <folder>'), or set protect_git = false knowingly"
        ) from None
    finally:
        os.close(root_fd)


def _protection(root_fd: int, root: str) -> Protection:
    top = _lstat(root_fd, GIT)
    if top is None:
        return Protection()
    if stat.S_ISLNK(top.st_mode):
        raise LinkOnPath(GIT)
    read_only = [GIT]
    gitdir: str | None = GIT  # relative: in the workspace; absolute: outside it
    if stat.S_ISREG(top.st_mode):
        named = _GITDIR.match(_read(root_fd, GIT) or b"")
        gitdir = _inside(root, "", os.fsdecode(named[1])) if named else None
        if gitdir is not None and not posixpath.isabs(gitdir):
            _require_real(root_fd, gitdir)
            read_only.append(gitdir)
    shared: str | None = None
    common = _read_repository_file(root_fd, root, gitdir, "commondir", _MAX_READ_BYTES)
    if gitdir is not None and common:
        shared = _inside(root, gitdir, os.fsdecode(common.strip()))
        if shared is not None and not posixpath.isabs(shared):
            _require_real(root_fd, shared)
            read_only.append(shared)
    sealed: list[str] = []
    for path in _submodule_paths(root_fd, root, gitdir, shared):
        try:
            folder = _lstat(root_fd, path)
            inner = _lstat(root_fd, f"{path}/{GIT}") if folder is not None and stat.S_ISDIR(folder.st_mode) else None
        except LinkOnPath:
            continue  # git does not look for a submodule through a link
        if folder is None:
            sealed.append(path)
        elif stat.S_ISDIR(folder.st_mode):
            read_only.append(f"{path}/{GIT}" if inner is not None and not stat.S_ISLNK(inner.st_mode) else path)
    kept = _outermost(read_only)
    return Protection(read_only=kept, sealed=tuple(path for path in _outermost(sealed) if not _under(path, kept)))


def _submodule_paths(root_fd: int, root: str, gitdir: str | None, shared: str | None) -> list[str]:
    """The submodules git would run a status in: the gitlinks of the repository's index (found by review:
    `.gitmodules` is a file the agent writes, and a repository added with `git add` is in no `.gitmodules`).
    The index is read from the folder kept from the agent, or from outside the workspace."""
    index = _read_repository_file(root_fd, root, gitdir, "index", _MAX_INDEX_BYTES)
    if index is None:
        return []
    config = (_read_repository_file(root_fd, root, shared or gitdir, "config", _MAX_READ_BYTES) or b"").lower()
    hash_size = 32 if _SHA256.search(config) else 20
    paths: list[str] = []
    for raw in _gitlinks(index, hash_size):
        path = os.fsdecode(raw)
        if not path or "\x00" in path or any(part in ("", ".", "..", GIT) for part in path.split("/")):
            continue
        if len(paths) == MAX_SUBMODULES:
            logger.warning("more than %d submodules: only the first are kept from the agent", MAX_SUBMODULES)
            break
        paths.append(path)
    return paths


def _read_repository_file(root_fd: int, root: str, folder: str | None, name: str, limit: int) -> bytes | None:
    """`name` in the repository folder `folder` (relative to the workspace, or absolute outside it)."""
    if folder is None:
        return None
    if not posixpath.isabs(folder):
        return _read(root_fd, f"{folder}/{name}", limit)
    try:
        fd = os.open(posixpath.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        return file.read(limit) if stat.S_ISREG(os.fstat(fd).st_mode) else None


def _gitlinks(index: bytes, hash_size: int) -> list[bytes]:
    """The paths of the gitlink entries (mode 160000) of a git index, versions 2 to 4 (git's
    Documentation/gitformat-index.txt). Written here: no maintained library reads the index without git itself,
    which would run the repository's own config. A damaged index gives what was read before the damage."""
    if len(index) < 12 or index[:4] != b"DIRC":
        return []
    version, count = struct.unpack(">II", index[4:12])
    if version not in (2, 3, 4):
        return []
    found: list[bytes] = []
    position, previous = 12, b""
    try:
        for _ in range(count):
            start = position
            mode = int.from_bytes(index[start + 24 : start + 28], "big")
            flags = int.from_bytes(index[start + 40 + hash_size : start + 42 + hash_size], "big")
            position = start + 42 + hash_size + (2 if version >= 3 and flags & _EXTENDED else 0)
            if version == 4:
                strip, position = _varint(index, position)
                end = index.index(b"\0", position)
                if strip > len(previous):
                    break
                name = previous[: len(previous) - strip] + index[position:end]
                position = end + 1
            else:
                end = index.index(b"\0", position)
                name = index[position:end]
                position = start + ((end - start + 8) & ~7)  # padded with 1 to 8 NULs
            if end > len(index) or position > len(index):
                break
            previous = name
            if mode == _GITLINK:
                found.append(name)
    except (ValueError, IndexError):  # no NUL, or past the end: a damaged or cut index
        pass
    return found


def _varint(data: bytes, position: int) -> tuple[int, int]:
    """git's offset varint (varint.c): each continuation adds one before the shift."""
    byte = data[position]
    position += 1
    value = byte & 0x7F
    while byte & 0x80:
        byte = data[position]
        position += 1
        value = ((value + 1) << 7) | (byte & 0x7F)
    return value, position


def _inside(root: str, base: str, target: str) -> str | None:
    """`target` (absolute, or relative to `base` in the workspace) relative to the workspace; None outside it.

    Joined to the workspace's own path before it is normalised (found by review: `gitdir: ../workspace/.bare`
    was taken for outside); a path outside that leads inside through a link of the host's counts as inside."""
    if "\x00" in target:
        return None
    top = root.rstrip("/")
    joined = posixpath.normpath(posixpath.join(top, base, target))
    if not joined.startswith(top + "/"):
        joined = os.path.realpath(joined)
        if not joined.startswith(top + "/"):
            return joined if posixpath.isabs(joined) else None  # outside: out of the agent's reach
    return joined[len(top) + 1 :]


def _lstat(root_fd: int, rel: str) -> os.stat_result | None:
    try:
        fd = open_beneath(root_fd, rel)
    except LinkOnPath:
        if "/" not in rel:
            return os.stat(rel, dir_fd=root_fd, follow_symlinks=False)
        raise
    if fd is None:
        return None
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def _require_real(root_fd: int, rel: str) -> None:
    """Nothing, unless a component of `rel` is a symbolic link (`LinkOnPath`)."""
    fd = open_beneath(root_fd, rel)
    if fd is not None:
        os.close(fd)


def _read(root_fd: int, rel: str, limit: int = _MAX_READ_BYTES) -> bytes | None:
    """The start of the regular file `rel` (no link on the way), or None."""
    try:
        fd = open_beneath(root_fd, rel)
    except LinkOnPath:
        return None
    if fd is None:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with open(f"/proc/self/fd/{fd}", "rb") as file:
            return file.read(limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def _under(path: str, parents: list[str] | tuple[str, ...]) -> bool:
    return any(path == parent or path.startswith(parent + "/") for parent in parents)


def _outermost(paths: list[str]) -> tuple[str, ...]:
    """`paths` without repeats or any under another, parents first."""
    kept: list[str] = []
    for path in sorted(set(paths), key=lambda p: (p.count("/"), p)):
        if not _under(path, kept):
            kept.append(path)
    return tuple(kept)

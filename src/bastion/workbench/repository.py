"""What of a host workspace's git repository its agent must not write (`protect_git`).

A host workspace's files are its owner's, and git, run by the owner in the folder, runs what the repository
names: the hooks (in `.git/hooks`, or where `core.hooksPath` says) and the config's programs (`core.fsmonitor`,
`core.pager`, aliases, filters) of the folder that `.git` is, or that a `.git` file (`gitdir: X`) and its
`commondir` name; and a status in each submodule's folder the index names (its gitlinks), whose own `.git` it
reads. Found by attack and by four reviews: an agent's config in each of those ran as the owner at the owner's
next `git status`. What is found here is read when the server starts, from the owner's files as they are then
(the index by bastion itself, never by running git, which would run the repository's own config): the
repository folders are shown read-only to the workspace's commands (bound over themselves: a mount point is
neither renamed nor removed), a submodule's folder that has no `.git` of its own is shown read-only whole, and
one that does not exist is made as git itself makes it for a submodule not checked out, an empty folder, shown
as an empty read-only one. The file tools refuse all of them.

Not covered (SECURITY.md, "A repository in a host workspace"): a repository made after the start, the owner's
other repositories beneath the top, a submodule's own submodules, a bare repository the agent makes, and files
other than git's whose programs the owner runs.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import stat
import struct
from dataclasses import dataclass
from typing import BinaryIO, Final

from bastion.sandbox import LinkOnPath, open_beneath

logger = logging.getLogger("bastion.workbench.repository")

GIT: Final = ".git"
MAX_SUBMODULES: Final = 256
_MAX_READ_BYTES: Final = 1 << 20  # a `.git` file, `commondir`, `config`
_GITDIR: Final = re.compile(rb"\Agitdir: *(.+?)\s*\Z", re.DOTALL)
_MAX_INDEX_BYTES: Final = 256 << 20
_SHA256: Final = re.compile(rb"objectformat\s*=\s*sha256")
_GITLINK: Final = 0o160000
_HOOKS_PATH: Final = re.compile(r"(?im)^\s*hookspath\s*=\s*(.+?)\s*$")
_MAX_LINKS: Final = 4 * MAX_SUBMODULES  # read from an index: those under the workspace are kept, MAX_SUBMODULES
_PATH_MAX: Final = 4096
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

    A part git follows that is a symbolic link cannot be pinned (the agent could rename it and make its own): it
    is left out, with an error line. It does not stop the start: an agent can make such a link where no
    repository was, and would then stop the server (found by review, for a link in a subfolder).
    """
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _protection(root_fd, root)
    except LinkOnPath as exc:
        logger.error(
            "workspace %s: %s is a symbolic link (or under one), which protect_git cannot pin: git there runs what "
            "the agent writes; make it a folder (or `.git` a file 'gitdir: <folder>')",
            workspace_id,
            exc,
        )
        return Protection()
    finally:
        os.close(root_fd)


def _protection(root_fd: int, root: str) -> Protection:
    top = _lstat(root_fd, GIT)
    read_only: list[str] = []
    prefix = ""  # the workspace's path in the repository's worktree, when the repository is above it
    gitdir: str | None  # relative: in the workspace; absolute: outside it
    if top is None:
        # Found by review: a workspace that is a folder of a larger repository (a package of a monorepo) holds
        # that repository's submodules, which git runs a status in from the top or from the workspace.
        enclosing = _enclosing_repository(root)
        if enclosing is None:
            return Protection()
        worktree, gitdir = enclosing
        prefix = posixpath.relpath(root, worktree) + "/"
    elif stat.S_ISLNK(top.st_mode):
        raise LinkOnPath(GIT)
    else:
        read_only.append(GIT)
        gitdir = GIT
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
    hooks = _hooks_path(root_fd, root, shared or gitdir, prefix)
    if hooks is not None:
        read_only.append(hooks)
    submodules = _submodule_paths(root_fd, root, gitdir, shared, prefix)
    for worktree_file, worktree_gitdir in _worktrees(root_fd, root, shared or gitdir):
        # Found by review: a linked worktree in the workspace has its own index, and so its own submodules.
        read_only.append(worktree_file)
        worktree = posixpath.dirname(worktree_file)
        own = _submodule_paths(root_fd, root, worktree_gitdir, shared or gitdir, "")
        submodules += [f"{worktree}/{path}" if worktree else path for path in own]
    sealed: list[str] = []
    for path in submodules:
        try:
            folder = _lstat(root_fd, path)
            inner = _lstat(root_fd, f"{path}/{GIT}") if folder is not None and stat.S_ISDIR(folder.st_mode) else None
        except (LinkOnPath, OSError):
            continue  # git does not look for a submodule through a link; nor can a name past NAME_MAX be one
        if folder is None:
            sealed.append(path)
        elif stat.S_ISDIR(folder.st_mode):
            read_only.append(f"{path}/{GIT}" if inner is not None and not stat.S_ISLNK(inner.st_mode) else path)
            if inner is not None and stat.S_ISREG(inner.st_mode):
                read_only += _named_folder(root_fd, root, path)
    kept = _outermost(read_only)
    return Protection(read_only=kept, sealed=tuple(path for path in _outermost(sealed) if not _under(path, kept)))


def _enclosing_repository(root: str) -> tuple[str, str] | None:
    """The repository git finds above `root` (its worktree's top, its gitdir; both absolute), as git's discovery
    walks up: to a filesystem boundary or `/`. None if there is none."""
    device = os.stat(root).st_dev
    folder = posixpath.dirname(root.rstrip("/"))
    while True:
        try:
            if os.stat(folder).st_dev != device:
                return None
            found = os.stat(posixpath.join(folder, GIT))
        except FileNotFoundError:
            found = None
        except OSError:
            return None
        if found is not None and stat.S_ISDIR(found.st_mode):
            return folder, posixpath.join(folder, GIT)
        if found is not None and stat.S_ISREG(found.st_mode):
            try:
                with open(posixpath.join(folder, GIT), "rb") as file:
                    named = _GITDIR.match(_start_of(file, posixpath.join(folder, GIT), _MAX_READ_BYTES))
            except OSError:
                return None
            return (folder, posixpath.normpath(posixpath.join(folder, os.fsdecode(named[1])))) if named else None
        if folder == "/":
            return None
        folder = posixpath.dirname(folder)


def _hooks_path(root_fd: int, root: str, common: str | None, prefix: str) -> str | None:
    """The folder `core.hooksPath` names, when it is in the workspace and exists (husky's `.husky/_`): the owner's
    git runs its hooks. Relative paths are from the worktree's top (the workspace, or the repository above it)."""
    config = _read_repository_file(root_fd, root, common, "config", _MAX_READ_BYTES) or b""
    named = _HOOKS_PATH.findall(config.decode("utf-8", "replace"))
    if not named:
        return None
    value = named[-1].strip().strip('"')  # the last one set wins
    top = root if not prefix else posixpath.normpath(posixpath.join(root, "/".join([".."] * prefix.count("/"))))
    place = _inside(root, "", posixpath.join(top, value) if not posixpath.isabs(value) else value)
    try:
        if place is not None and not posixpath.isabs(place) and _lstat(root_fd, place) is not None:
            return place
    except (LinkOnPath, OSError):
        return None
    return None


def _named_folder(root_fd: int, root: str, path: str) -> list[str]:
    """The repository folder a submodule's `.git` file names, when it is in the workspace (found by review: a
    submodule cloned with `--separate-git-dir` named `../.lib-git`, whose config was the agent's to write). One
    reached through a link is skipped with a warning: the submodule is the owner's, the link perhaps not."""
    named = _GITDIR.match(_read(root_fd, f"{path}/{GIT}") or b"")
    place = _inside(root, path, os.fsdecode(named[1])) if named else None
    if place is None or posixpath.isabs(place):
        return []
    try:
        _require_real(root_fd, place)
    except LinkOnPath:
        logger.warning("%s: the repository of submodule %s is reached through a link: not kept", root, path)
        return []
    return [place]


def _worktrees(root_fd: int, root: str, common: str | None) -> list[tuple[str, str]]:
    """The repository's linked worktrees in the workspace: each one's `.git` file (found by review: the agent
    pointed the owner's worktree at a repository of its own) and its gitdir, `worktrees/<name>`."""
    return [(place, f"{common}/worktrees/{name}") for name, place in _worktree_places(root_fd, root, common)]


def _worktree_places(root_fd: int, root: str, common: str | None) -> list[tuple[str, str]]:
    """(name, the worktree's `.git` file in the workspace) for each `worktrees/<name>/gitdir` naming one."""
    if common is None:
        return []
    listing = f"{common}/worktrees" if posixpath.isabs(common) else f"{root}/{common}/worktrees"
    try:
        names = sorted(os.listdir(listing))[:MAX_SUBMODULES]
    except OSError:
        return []
    found: list[tuple[str, str]] = []
    for name in names:
        named = _read_repository_file(root_fd, root, f"{common}/worktrees/{name}", "gitdir", _MAX_READ_BYTES)
        place = _inside(root, "", os.fsdecode(named.strip())) if named else None
        try:
            if place is not None and not posixpath.isabs(place) and _lstat(root_fd, place) is not None:
                found.append((name, place))
        except (LinkOnPath, OSError):
            continue  # reached through a link (git's own worktree list names a real path), or no such name
    return found


def _submodule_paths(root_fd: int, root: str, gitdir: str | None, shared: str | None, prefix: str) -> list[str]:
    """The submodules git would run a status in: the gitlinks of the repository's index (found by review:
    `.gitmodules` is a file the agent writes, and a repository added with `git add` is in no `.gitmodules`),
    a split index's shared part included. The index is read from the folder kept from the agent, or from outside
    the workspace. With `prefix` (the workspace is a folder of the repository), those beneath it, relative to it."""
    index = _read_repository_file(root_fd, root, gitdir, "index", _MAX_INDEX_BYTES)
    if index is None:
        return []
    config = (_read_repository_file(root_fd, root, shared or gitdir, "config", _MAX_READ_BYTES) or b"").lower()
    hash_size = 32 if _SHA256.search(config) else 20
    links, base = _gitlinks(index, hash_size)
    if base is not None:  # a split index: the entries not changed since are in the shared index it names
        shared_index = _read_repository_file(root_fd, root, gitdir, f"sharedindex.{base}", _MAX_INDEX_BYTES)
        links += _gitlinks(shared_index or b"", hash_size)[0]
    paths: list[str] = []
    for raw in links:
        path = os.fsdecode(raw)
        if prefix:
            if not path.startswith(prefix):
                continue
            path = path[len(prefix) :]
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
        return _start_of(file, posixpath.join(folder, name), limit) if stat.S_ISREG(os.fstat(fd).st_mode) else None


def _gitlinks(index: bytes, hash_size: int) -> tuple[list[bytes], str | None]:
    """The paths of the gitlink entries (mode 160000) of a git index, versions 2 to 4 (git's
    Documentation/gitformat-index.txt), and the shared index a split index names (its `link` extension), if
    any. Written here: no maintained library reads the index without git itself, which would run the
    repository's own config. A damaged index gives what was read before the damage; at most `_MAX_LINKS`
    gitlinks, and no name past PATH_MAX (found by review: a crafted v4 index grew its names a byte an entry,
    805 MiB for 2.5 MiB of index)."""
    if len(index) < 12 or index[:4] != b"DIRC":
        return [], None
    version, count = struct.unpack(">II", index[4:12])
    if version not in (2, 3, 4):
        return [], None
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
                    return found, None
                name = previous[: len(previous) - strip] + index[position:end]
                position = end + 1
            else:
                end = index.index(b"\0", position)
                name = index[position:end]
                position = start + ((end - start + 8) & ~7)  # padded with 1 to 8 NULs
            if position > len(index) or len(name) > _PATH_MAX:
                return found, None
            previous = name
            if mode == _GITLINK:
                found.append(name)
                if len(found) > _MAX_LINKS:
                    return found, None
        return found, _shared_index(index, position, hash_size)
    except (ValueError, IndexError):  # no NUL, or past the end: a damaged or cut index
        return found, None


def _shared_index(index: bytes, position: int, hash_size: int) -> str | None:
    """The hex name of the shared index a split index's `link` extension names, from the extensions that
    follow the entries at `position` (each a 4-byte signature and a 4-byte size); None without one."""
    end = len(index) - hash_size  # the index's own checksum ends it
    while position + 8 <= end:
        signature, size = index[position : position + 4], int.from_bytes(index[position + 4 : position + 8], "big")
        if signature == b"link" and size >= hash_size:
            return index[position + 8 : position + 8 + hash_size].hex()
        position += 8 + size
    return None


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
            return _start_of(file, rel, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def _start_of(file: BinaryIO, name: str, limit: int) -> bytes:
    """At most `limit` bytes of `file`, read in the size it has (a read of `limit` allocates all of it first:
    256 MiB at every start for an index's bound); past `limit`, a warning."""
    size = os.fstat(file.fileno()).st_size
    if size > limit:
        logger.warning("%s is over %d bytes: only its start is read for protect_git", name, limit)
    return file.read(min(size, limit))


def _under(path: str, parents: list[str] | tuple[str, ...]) -> bool:
    return any(path == parent or path.startswith(parent + "/") for parent in parents)


def _outermost(paths: list[str]) -> tuple[str, ...]:
    """`paths` without repeats or any under another, parents first."""
    kept: list[str] = []
    for path in sorted(set(paths), key=lambda p: (p.count("/"), p)):
        if not _under(path, kept):
            kept.append(path)
    return tuple(kept)

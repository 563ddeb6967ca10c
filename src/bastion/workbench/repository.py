"""What of a host workspace's git repository its agent must not write (`protect_git`).

A host workspace's files are its owner's, and git, run by the owner in the folder, runs what the repository
names: the hooks and the config's programs (`core.fsmonitor`, `core.pager`, aliases, filters) of the folder
that `.git` is, or that a `.git` file (`gitdir: X`) and its `commondir` name, and a status in each submodule's
folder, whose own `.git` it reads (found by attack and by review: an agent's config in each of those ran as the
owner at the owner's next `git status` at the top). What is found here is read when the server starts, from the
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
from dataclasses import dataclass
from typing import Final

from bastion.safety.errors import ConfigError
from bastion.sandbox import LinkOnPath, open_beneath

logger = logging.getLogger("bastion.workbench.repository")

GIT: Final = ".git"
MAX_SUBMODULES: Final = 256
_MAX_READ_BYTES: Final = 1 << 20  # a `.git` file, `commondir`, `.gitmodules`
_GITDIR: Final = re.compile(rb"\Agitdir: *(.+?)\s*\Z", re.DOTALL)
_PATH_LINE: Final = re.compile(r'^\s*path\s*=\s*"?(.*?)"?\s*$', re.MULTILINE)


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
    gitdir: str | None = GIT
    if stat.S_ISREG(top.st_mode):
        named = _GITDIR.match(_read(root_fd, GIT) or b"")
        gitdir = _inside(root, "", os.fsdecode(named[1])) if named else None
        if gitdir is not None:
            _require_real(root_fd, gitdir)
            read_only.append(gitdir)
    if gitdir is not None:
        common = _read(root_fd, f"{gitdir}/commondir")
        shared = _inside(root, gitdir, os.fsdecode(common.strip())) if common else None
        if shared is not None:
            _require_real(root_fd, shared)
            read_only.append(shared)
    sealed: list[str] = []
    for path in _submodule_paths(_read(root_fd, ".gitmodules") or b""):
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


def _submodule_paths(text: bytes) -> list[str]:
    """The `path =` values of the owner's `.gitmodules`, each one a plain relative path, at most MAX_SUBMODULES."""
    paths: list[str] = []
    for raw in _PATH_LINE.findall(text.decode("utf-8", "replace")):
        parts = raw.split("/")
        if not raw or "\x00" in raw or any(part in ("", ".", "..", GIT) for part in parts):
            continue
        if len(paths) == MAX_SUBMODULES:
            logger.warning("more than %d submodules: only the first are kept from the agent", MAX_SUBMODULES)
            break
        paths.append(raw)
    return paths


def _inside(root: str, base: str, target: str) -> str | None:
    """`target` (absolute, or relative to `base` in the workspace) relative to the workspace, or None outside it."""
    if "\x00" in target:
        return None
    if posixpath.isabs(target):
        joined = posixpath.normpath(target)
        if not joined.startswith(root.rstrip("/") + "/"):
            return None
        relative = joined[len(root.rstrip("/")) + 1 :]
    else:
        relative = posixpath.normpath(posixpath.join(base, target))
    if relative in ("", ".") or relative == ".." or relative.startswith("../"):
        return None  # the workspace itself, or outside it: out of the agent's reach either way
    return relative


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


def _read(root_fd: int, rel: str) -> bytes | None:
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
            return file.read(_MAX_READ_BYTES)
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

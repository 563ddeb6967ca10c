"""Folder trees an agent made, walked and deleted by the server (as root) at any depth.

What it guarantees:

- No symbolic link is followed: every folder is opened with ``O_NOFOLLOW | O_DIRECTORY`` under its
  parent's fd, and entries are told apart by ``lstat``; a link is counted or unlinked as itself.
- Depth costs no recursion and no fd per level. `remove_tree` moves each subfolder into one new folder
  of the top one before it empties it (a rename within one filesystem), so it holds three folders open
  at most;
  `Walk` (`tree_bytes`, the start's setuid scan) holds one fd per level, to `MAX_WALK_DEPTH` levels.
  Python's own walks recurse once per level (``os.fwalk``, and ``shutil.rmtree`` before 3.13): 1,200 nested
  folders raised RecursionError, which made the dashboard answer 500 and a sandbox's close, and the server's
  shutdown, stop half done (mounts of other sandboxes left behind).
- A folder's entries are read a batch at a time: a folder of millions of names is never held in memory.

What it does not guarantee: `remove_tree` is for trees nothing else changes meanwhile (a closed sandbox's
state, once its processes are gone); what it cannot remove (a mount point, a read-only filesystem) stays,
and is reported by the caller's check of the top folder.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Final

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_WALK_DEPTH: Final = 256
"""Levels a `Walk` descends: below that, folders are counted, not entered (`tree_bytes` is then a lower bound)."""
_BATCH: Final = 4096
"""Entries of one folder read before any is removed or moved (the folder is then read again)."""
_PILE_PREFIX: Final = ".bastion-removing-"


def remove_tree(root: Path) -> None:
    """Delete `root` and everything beneath it, at any depth, never following a symbolic link (best effort).

    Every subfolder, wherever it is, is first moved into one new folder of `root` (the pile), under a
    name of its own; each folder of the pile is then emptied the same way and removed.
    """
    try:
        top = os.open(root, _DIR_FLAGS)
    except FileNotFoundError:
        return
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(root)  # a file or a link where the folder was: removed as itself
        return
    try:
        pile_name = _new_folder(top)
    except OSError:
        # Found by review: the pile takes a block, so on a full filesystem nothing was removed, a closed
        # sandbox's disk image included: the files go first, at any depth the walk reaches, and the pile is
        # made in the room they leave.
        _free_room(top)
        try:
            pile_name = _new_folder(top)
        except OSError:
            os.close(top)
            with contextlib.suppress(OSError):
                os.rmdir(root)  # all was within reach: nothing left in it
            return
    try:
        pile = os.open(pile_name, _DIR_FLAGS, dir_fd=top)
    except OSError:
        os.close(top)
        return
    names = (str(n) for n in itertools.count())
    try:
        todo = _empty(top, pile, names, skip=pile_name)
        while todo:
            name = todo.pop()
            with contextlib.suppress(OSError):
                fd = os.open(name, _DIR_FLAGS, dir_fd=pile)
                try:
                    todo += _empty(fd, pile, names, skip=None)
                finally:
                    os.close(fd)
                os.rmdir(name, dir_fd=pile)
        os.close(pile)
        with contextlib.suppress(OSError):
            os.rmdir(pile_name, dir_fd=top)
    finally:
        os.close(top)
    with contextlib.suppress(OSError):
        os.rmdir(root)


def _empty(fd: int, pile: int, names: Iterator[str], *, skip: str | None) -> list[str]:
    """Unlink what is in the folder `fd` and move its subfolders into `pile`; return their names there."""
    moved: list[str] = []
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o700)  # a folder made read-only: a server that is not root could not empty it
    while batch := [(name, is_dir) for name, is_dir in _entries(fd) if name != skip]:
        progress = False
        for name, is_dir in batch:
            try:
                if is_dir:
                    to = next(names)
                    os.rename(name, to, src_dir_fd=fd, dst_dir_fd=pile)  # the pile is new: nothing is replaced
                    moved.append(to)
                else:
                    os.unlink(name, dir_fd=fd)
                progress = True
            except OSError:
                continue
        if not progress:
            break  # what is left cannot be removed (a mount point, a read-only filesystem)
    return moved


def _free_room(fd: int, depth: int = 0) -> None:
    """Unlink the files beneath the folder `fd` and remove the folders that empties, down to `MAX_WALK_DEPTH`
    levels (one fd and one call a level), making nothing: what a full filesystem still allows. Best effort.
    Found by review: the space of a full filesystem sat in a workspace's subfolders, which this reaches."""
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o700)  # a folder made read-only: a server that is not root could not empty it
    while batch := _entries(fd):
        progress = False
        for name, is_dir in batch:
            with contextlib.suppress(OSError):
                if is_dir:
                    if depth < MAX_WALK_DEPTH:
                        child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                        try:
                            # Found by review: never into another filesystem mounted here (a mount point stays).
                            if os.fstat(child).st_dev == os.fstat(fd).st_dev:
                                _free_room(child, depth + 1)
                        finally:
                            os.close(child)
                    os.rmdir(name, dir_fd=fd)
                else:
                    os.unlink(name, dir_fd=fd)
                progress = True
        if not progress:
            return


def _new_folder(fd: int) -> str:
    """Make a folder in `fd` under a name not taken yet, and return the name."""
    for n in itertools.count():
        name = f"{_PILE_PREFIX}{n}"
        try:
            os.mkdir(name, 0o700, dir_fd=fd)
        except FileExistsError:
            continue
        return name
    raise AssertionError("unreachable")


def _entries(fd: int) -> list[tuple[str, bool]]:
    """Up to `_BATCH` entries of the folder `fd`, as (name, whether it is a folder, not following links)."""
    found: list[tuple[str, bool]] = []
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                found.append((entry.name, entry.is_dir(follow_symlinks=False)))
            except OSError:
                continue
            if len(found) >= _BATCH:
                break
    return found


class Walk:
    """Every entry beneath a folder, depth first, one at a time: each folder opened under its parent's fd
    following no link, one fd per level, to `MAX_WALK_DEPTH` levels. Iterate it in a `with` block (it closes
    what it holds); `cut` then says whether a folder was left unentered, too deep or out of fds."""

    def __init__(self, top: int, *, device: int | None = None) -> None:
        """`top`: an fd of the folder (the walk's, closed by it). `device`: enter no folder of another one."""
        self._device = device
        self.cut = False
        self._levels: list[tuple[int, Iterator[os.DirEntry[str]]]] = []
        self._names: list[str] = []
        try:
            self._levels.append((top, os.scandir(top)))
        except OSError:
            os.close(top)

    def __enter__(self) -> Walk:
        return self

    def __exit__(self, *_: object) -> None:
        for fd, entries in self._levels:
            entries.close()  # type: ignore[attr-defined]  # a ScandirIterator
            os.close(fd)
        self._levels.clear()

    def __iter__(self) -> Iterator[tuple[int, tuple[str, ...], os.DirEntry[str], os.stat_result]]:
        """(the fd of its folder, the names of the folders above it below the top, the entry, its lstat)."""
        while self._levels:
            fd, entries = self._levels[-1]
            entry = next(entries, None)
            if entry is None:
                entries.close()  # type: ignore[attr-defined]
                os.close(fd)
                self._levels.pop()
                if self._names:
                    self._names.pop()
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            yield fd, tuple(self._names), entry, info
            if stat.S_ISDIR(info.st_mode) and (self._device is None or info.st_dev == self._device):
                self._enter(fd, entry.name)

    def _enter(self, fd: int, name: str) -> None:
        if len(self._levels) > MAX_WALK_DEPTH:
            self.cut = True
            return
        try:
            child = os.open(name, _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            # Out of fds (found by review: a soft limit of 400 skipped a folder 200 deep, unsaid); a folder gone
            # or unreadable meanwhile is only skipped.
            self.cut = self.cut or exc.errno in (errno.EMFILE, errno.ENFILE)
            return
        try:
            self._levels.append((child, os.scandir(child)))
        except OSError as exc:
            os.close(child)
            self.cut = self.cut or exc.errno in (errno.EMFILE, errno.ENFILE)
            return
        self._names.append(name)


def tree_bytes(root: Path, *, max_entries: int) -> int:
    """Allocated bytes beneath `root` (each entry's blocks, links as themselves), from at most `max_entries`
    entries and `MAX_WALK_DEPTH` levels: past either, a lower bound."""
    try:
        top = os.open(root, _DIR_FLAGS)
    except OSError:
        return 0
    total = 0
    with Walk(top) as walk:
        for seen, (_, _, _, info) in enumerate(walk, start=1):
            if seen > max_entries:
                break
            if not stat.S_ISLNK(info.st_mode):
                total += info.st_blocks * 512
    return total

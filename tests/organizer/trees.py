"""Helpers for the organizer tests: a folder's tree as data, and reopening an organizer."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from bastion.organizer import Organizer

Tree = dict[str, tuple[str, bytes]]


def snapshot(root: Path) -> Tree:
    """Everything under `root`, never following links: path -> (kind, content or link target)."""
    found: Tree = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for name in dirnames + filenames:
            path = here / name
            info = os.lstat(path)
            rel = str(path.relative_to(root))
            if stat.S_ISLNK(info.st_mode):
                found[rel] = ("link", os.fsencode(os.readlink(path)))
            elif stat.S_ISDIR(info.st_mode):
                found[rel] = ("dir", b"")
            elif stat.S_ISREG(info.st_mode):
                found[rel] = ("file", path.read_bytes())
            else:
                found[rel] = ("special", b"")
    return found


def contents(tree: Tree) -> list[bytes]:
    """The multiset of file contents, sorted."""
    return sorted(data for kind, data in tree.values() if kind == "file")


def reopen(organizer: Organizer, state_dir: Path) -> Organizer:
    """Close and open again on the same folders, as a restarted server would."""
    organizer.close()
    again = Organizer(organizer.config, state_dir)
    again.open()
    return again

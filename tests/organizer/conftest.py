"""Fixtures for the organizer: a real inbox folder and state folder under tmp_path."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.config import InboxConfig
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


@pytest.fixture
def inbox_dir(tmp_path: Path) -> Path:
    path = tmp_path / "inbox"
    path.mkdir()
    return path


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir()
    return path


@pytest.fixture
def organizer(inbox_dir: Path, state_dir: Path) -> Iterator[Organizer]:
    built = Organizer(InboxConfig(id="inbox", path=inbox_dir), state_dir)
    assert built.open() is None
    yield built
    built.close()


def reopen(organizer: Organizer, state_dir: Path) -> Organizer:
    """Close and open again on the same folders, as a restarted server would."""
    organizer.close()
    again = Organizer(organizer.config, state_dir)
    again.open()
    return again

"""The folder and the mover below the organizer's checks: what holds when a check is raced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bastion.organizer.folder import Folder
from bastion.organizer.journal import Journal, Move, Txn
from bastion.organizer.mover import Mover
from bastion.safety.errors import Conflict, PathEscape

from .trees import snapshot


def _move(inbox: Path, src: str, dst: str) -> Move:
    info = os.lstat(inbox / src)
    return Move(src, dst, info.st_dev, info.st_ino)


def test_rename_never_replaces_a_destination(inbox_dir: Path) -> None:
    """RENAME_NOREPLACE: the kernel refuses to replace, so a destination created after any check survives."""
    (inbox_dir / "a.txt").write_bytes(b"a")
    (inbox_dir / "b.txt").write_bytes(b"b")
    with Folder(inbox_dir) as folder:
        root = folder.open_dir(".")
        try:
            with pytest.raises(Conflict):
                folder.rename(root, "a.txt", root, "b.txt", src="a.txt", dst="b.txt")
        finally:
            os.close(root)
    assert (inbox_dir / "b.txt").read_bytes() == b"b"
    assert (inbox_dir / "a.txt").read_bytes() == b"a"


def test_open_dir_refuses_a_symlink_even_inside(inbox_dir: Path) -> None:
    (inbox_dir / "real").mkdir()
    os.symlink("real", inbox_dir / "alias")
    with Folder(inbox_dir) as folder, pytest.raises(PathEscape):
        folder.open_dir("alias")


def _mover(inbox: Path, state: Path) -> tuple[Folder, Journal, Mover]:
    folder = Folder(inbox)
    journal = Journal(state / "journal.jsonl")
    journal.open()
    return folder, journal, Mover(folder, journal)


def test_destination_taken_mid_transaction_rolls_everything_back(inbox_dir: Path, state_dir: Path) -> None:
    """A destination that appears after the checks stops the transaction at that move; the moves
    already made are put back, the folders it made are removed, and nothing is overwritten."""
    for name in ("a.pdf", "b.pdf", "c.pdf"):
        (inbox_dir / name).write_bytes(name.encode())
    moves = tuple(_move(inbox_dir, n, f"Documents/{n}") for n in ("a.pdf", "b.pdf", "c.pdf"))
    (inbox_dir / "Documents").mkdir()
    (inbox_dir / "Documents" / "c.pdf").write_bytes(b"racer")
    before = snapshot(inbox_dir)
    folder, journal, mover = _mover(inbox_dir, state_dir)
    try:
        applied, error = mover.run(Txn(txn=1, kind="apply", action=1, moves=moves))
    finally:
        journal.close()
        folder.close()
    assert isinstance(error, Conflict)
    assert applied == []
    assert snapshot(inbox_dir) == before
    replay = Journal(state_dir / "journal.jsonl").open()
    assert replay.pending is None
    assert replay.history.done == []


def test_source_swapped_after_check_is_put_back(inbox_dir: Path, state_dir: Path) -> None:
    """The inode at the destination is checked after each rename: a file swapped in at the
    source after the checks is given back its name and the transaction is refused."""
    (inbox_dir / "a.pdf").write_bytes(b"a")
    (inbox_dir / "b.pdf").write_bytes(b"planned")
    moves = (_move(inbox_dir, "a.pdf", "Documents/a.pdf"), _move(inbox_dir, "b.pdf", "Documents/b.pdf"))
    os.rename(inbox_dir / "b.pdf", inbox_dir / "kept.pdf")
    (inbox_dir / "b.pdf").write_bytes(b"swapped in")
    before = snapshot(inbox_dir)
    folder, journal, mover = _mover(inbox_dir, state_dir)
    try:
        applied, error = mover.run(Txn(txn=1, kind="apply", action=1, moves=moves, mkdirs=("Documents",)))
    finally:
        journal.close()
        folder.close()
    assert isinstance(error, Conflict)
    assert applied == []
    assert snapshot(inbox_dir) == before


@pytest.mark.parametrize("rel", ["..", "a/../..", "a//b", "./a", "/etc"])
def test_folder_refuses_paths_that_are_not_plain(inbox_dir: Path, tmp_path: Path, rel: str) -> None:
    """Below the lexical jail: a '..' component would climb out even with O_NOFOLLOW, so the
    calls that touch the disk refuse it (e.g. a path read back from a damaged journal)."""
    (inbox_dir / "a").mkdir()
    (tmp_path / "victim.txt").write_bytes(b"outside")
    with Folder(inbox_dir) as folder:
        with pytest.raises(PathEscape):
            folder.open_dir(rel)
        with pytest.raises(PathEscape):
            folder.lstat(rel + "/x")
        root = folder.open_dir(".")
        try:
            with pytest.raises(PathEscape):
                folder.rename(root, "..", root, "stolen", src="..", dst="stolen")
            with pytest.raises(PathEscape):
                folder.lstat_at(root, "..")
        finally:
            os.close(root)
    assert (tmp_path / "victim.txt").read_bytes() == b"outside"

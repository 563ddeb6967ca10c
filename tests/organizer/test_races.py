"""Races won by another process after every organizer check has passed, before the first rename.

Each test lets the organizer run its checks for real, then acts from the moment the journal's
begin record is on disk (the last step before any folder is created or file renamed) and
checks that the kernel-level guarantees hold on their own: renameat2(RENAME_NOREPLACE) never
replaces a destination created in the race, and a folder swapped for a symbolic link is
refused at the O_NOFOLLOW open that counts, never followed. The whole action is rolled back.

What these do not prove: races won during the renames themselves (the kernel call is the same
one, so the guarantee is the same), or a folder renamed elsewhere while the organizer holds it
open (documented as not guaranteed in `bastion.organizer.folder`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from bastion.organizer import Organizer
from bastion.organizer.journal import Txn
from bastion.safety.errors import Conflict, PathEscape

from .trees import snapshot


def _after_checks(organizer: Organizer, monkeypatch: pytest.MonkeyPatch, race: Callable[[], object]) -> list[int]:
    """Run `race` once, right after the next begin record is written; returns the txns it raced."""
    begin = organizer.journal.begin
    raced: list[int] = []

    def begin_then_race(txn: Txn) -> None:
        begin(txn)
        if not raced:
            raced.append(txn.txn)
            race()

    monkeypatch.setattr(organizer.journal, "begin", begin_then_race)
    return raced


@pytest.mark.parametrize("folder_existed", [False, True])
def test_apply_never_overwrites_a_destination_created_in_a_race(
    organizer: Organizer, inbox_dir: Path, monkeypatch: pytest.MonkeyPatch, folder_existed: bool
) -> None:
    """Invariant: the racer's file is kept byte for byte; the moves made before it are put back."""
    for name in ("a.pdf", "b.pdf", "c.pdf"):
        (inbox_dir / name).write_bytes(name.encode())
    if folder_existed:
        (inbox_dir / "Documents").mkdir()
    plan_id = organizer.plan()["plan_id"]
    before = snapshot(inbox_dir)

    def race() -> None:
        (inbox_dir / "Documents").mkdir(exist_ok=True)
        (inbox_dir / "Documents" / "c.pdf").write_bytes(b"racer")

    raced = _after_checks(organizer, monkeypatch, race)
    with pytest.raises(Conflict, match="already exists"):
        organizer.apply(plan_id)
    assert raced
    after = snapshot(inbox_dir)
    assert after == {**before, "Documents": ("dir", b""), "Documents/c.pdf": ("file", b"racer")}
    assert organizer.history.done == []


@pytest.mark.parametrize("folder_existed", [False, True])
def test_apply_never_follows_a_folder_swapped_for_a_symlink_in_a_race(
    organizer: Organizer, inbox_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder_existed: bool
) -> None:
    """Invariant: nothing is created outside the inbox; every file stays where it was."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (inbox_dir / "x.pdf").write_bytes(b"x")
    (inbox_dir / "y.png").write_bytes(b"y")
    if folder_existed:
        (inbox_dir / "Documents").mkdir()
    plan_id = organizer.plan()["plan_id"]

    def race() -> None:
        if folder_existed:
            (inbox_dir / "Documents").rename(inbox_dir / "moved-away")
        os.symlink(outside, inbox_dir / "Documents")

    _after_checks(organizer, monkeypatch, race)
    with pytest.raises(PathEscape, match="symbolic link"):
        organizer.apply(plan_id)
    assert list(outside.iterdir()) == []
    assert (inbox_dir / "x.pdf").read_bytes() == b"x"
    assert (inbox_dir / "y.png").read_bytes() == b"y"
    assert not (inbox_dir / "Images").exists(), "a folder the rolled-back apply made was left behind"
    assert organizer.history.done == []


def test_move_file_never_overwrites_a_destination_created_in_a_race(
    organizer: Organizer, inbox_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (inbox_dir / "a.txt").write_bytes(b"mine")
    _after_checks(organizer, monkeypatch, lambda: (inbox_dir / "b.txt").write_bytes(b"racer"))
    with pytest.raises(Conflict):
        organizer.move("a.txt", "b.txt")
    assert (inbox_dir / "a.txt").read_bytes() == b"mine"
    assert (inbox_dir / "b.txt").read_bytes() == b"racer"
    assert organizer.history.done == []


def test_move_file_never_follows_a_parent_swapped_for_a_symlink_in_a_race(
    organizer: Organizer, inbox_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (inbox_dir / "a.txt").write_bytes(b"mine")
    (inbox_dir / "Docs").mkdir()

    def race() -> None:
        (inbox_dir / "Docs").rename(inbox_dir / "Docs.real")
        os.symlink(outside, inbox_dir / "Docs")

    _after_checks(organizer, monkeypatch, race)
    with pytest.raises(PathEscape):
        organizer.move("a.txt", "Docs/a.txt")
    assert list(outside.iterdir()) == []
    assert (inbox_dir / "a.txt").read_bytes() == b"mine"


@pytest.mark.parametrize("verb", ["undo", "redo"])
def test_undo_and_redo_never_overwrite_a_place_taken_in_a_race(
    organizer: Organizer, inbox_dir: Path, monkeypatch: pytest.MonkeyPatch, verb: str
) -> None:
    """Nothing is overwritten to make room: the racer keeps the name, the action stays where it was."""
    (inbox_dir / "a.pdf").write_bytes(b"a")
    (inbox_dir / "b.pdf").write_bytes(b"b")
    organizer.apply(organizer.plan()["plan_id"])
    if verb == "redo":
        organizer.undo()
    taken = inbox_dir / ("b.pdf" if verb == "undo" else "Documents/b.pdf")
    before = snapshot(inbox_dir)

    def race() -> None:
        taken.parent.mkdir(exist_ok=True)
        taken.write_bytes(b"racer")

    _after_checks(organizer, monkeypatch, race)
    with pytest.raises(Conflict):
        getattr(organizer, verb)()
    assert taken.read_bytes() == b"racer"
    rel = str(taken.relative_to(inbox_dir))
    after = snapshot(inbox_dir)
    assert after.pop(rel) == ("file", b"racer")
    assert {k: v for k, v in after.items() if k != "Documents"} == {k: v for k, v in before.items() if k != "Documents"}
    assert len(organizer.history.done if verb == "undo" else organizer.history.undone) == 1

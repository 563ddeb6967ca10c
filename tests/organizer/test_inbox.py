"""The organizer of one inbox, driven through its Python API on real folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bastion.organizer import Organizer
from bastion.organizer import inbox as inbox_module
from bastion.organizer.inbox import journal_path
from bastion.safety.errors import Conflict, InvalidRequest, NotFound, PathEscape, PolicyDenied

from .trees import contents, reopen, snapshot


def _fill(inbox: Path) -> None:
    (inbox / "report.pdf").write_bytes(b"pdf")
    (inbox / "photo.JPG").write_bytes(b"jpg")
    (inbox / "song one.mp3").write_bytes(b"mp3")
    (inbox / "backup.tar.gz").write_bytes(b"tgz")
    (inbox / "notes").write_bytes(b"no extension")
    (inbox / ".bashrc").write_bytes(b"dot")
    (inbox / "setup.exe").write_bytes(b"exe")
    (inbox / "nested").mkdir()
    (inbox / "nested" / "deep.pdf").write_bytes(b"deep")
    os.symlink("/etc/passwd", inbox / "passwd.txt")
    os.mkfifo(inbox / "pipe.pdf")


def test_plan_changes_nothing_not_even_folders(organizer: Organizer, inbox_dir: Path) -> None:
    """Invariant: plan_organize leaves the tree byte-for-byte as it was; no category folder appears."""
    _fill(inbox_dir)
    before = snapshot(inbox_dir)
    detail = organizer.plan()
    assert snapshot(inbox_dir) == before
    moves = {m["src"]: m["dst"] for m in detail["moves"]}
    assert moves == {
        "backup.tar.gz": "Archives/backup.tar.gz",
        "photo.JPG": "Images/photo.JPG",
        "report.pdf": "Documents/report.pdf",
        "song one.mp3": "Audio/song one.mp3",
    }
    skipped = {s["path"]: (s["rule"], s["layer"], s["code"]) for s in detail["skipped"]}
    assert skipped == {
        ".bashrc": ("dotfiles", "restraint", "NEEDS_EXPLICIT_REQUEST"),
        "setup.exe": ("installers", "restraint", "NEEDS_EXPLICIT_REQUEST"),
        "nested": ("folders", "restraint", "NEEDS_EXPLICIT_REQUEST"),
        "passwd.txt": ("symlinks", "protection", "POLICY_DENIED"),
        "pipe.pdf": ("special-files", "protection", "POLICY_DENIED"),
    }
    assert detail["uncategorized"] == ["notes"]


def test_a_plan_lists_at_most_a_thousand_skipped_and_uncategorized_entries(
    organizer: Organizer, inbox_dir: Path
) -> None:
    """Attack (found by review): 99,000 files of 250-character names no category takes: plan_organize
    answered every one, 25 MB. At most 1,000 of each are listed; how many more is said."""
    for n in range(1_200):
        (inbox_dir / f"{n:04d}.unknownext").write_bytes(b"")
        (inbox_dir / f".hidden{n:04d}").write_bytes(b"")  # a dotfile: skipped, by a restraint rule
    detail = organizer.plan()
    assert len(detail["uncategorized"]) == 1_000
    assert detail["uncategorized_not_listed"] == 200
    assert len(detail["skipped"]) == 1_000
    assert detail["skipped_not_listed"] == 200


def test_apply_moves_then_undo_restores_exact_tree(organizer: Organizer, inbox_dir: Path) -> None:
    _fill(inbox_dir)
    before = snapshot(inbox_dir)
    plan = organizer.plan()
    applied = organizer.apply(plan["plan_id"])
    assert applied["moved"] == 4
    assert sorted(applied["created_folders"]) == ["Archives", "Audio", "Documents", "Images"]
    assert (inbox_dir / "Documents" / "report.pdf").read_bytes() == b"pdf"
    assert not (inbox_dir / "report.pdf").exists()
    assert contents(snapshot(inbox_dir)) == contents(before)
    organizer.undo()
    assert snapshot(inbox_dir) == before
    organizer.redo()
    assert (inbox_dir / "Audio" / "song one.mp3").read_bytes() == b"mp3"
    organizer.undo()
    assert snapshot(inbox_dir) == before


def test_plan_is_single_use(organizer: Organizer, inbox_dir: Path) -> None:
    (inbox_dir / "a.pdf").write_bytes(b"a")
    plan_id = organizer.plan()["plan_id"]
    organizer.apply(plan_id)
    with pytest.raises(NotFound):
        organizer.apply(plan_id)


@pytest.mark.parametrize("change", ["content", "mtime", "replaced", "vanished"])
def test_apply_refuses_whole_plan_when_a_source_changed(organizer: Organizer, inbox_dir: Path, change: str) -> None:
    """Invariant: one changed source refuses the whole plan; nothing moves, no folder is created."""
    for name in ("a.pdf", "b.pdf", "c.png"):
        (inbox_dir / name).write_bytes(name.encode())
    plan_id = organizer.plan()["plan_id"]
    target = inbox_dir / "c.png"
    if change == "content":
        target.write_bytes(b"longer content")
    elif change == "mtime":
        os.utime(target, ns=(1, 1))
    elif change == "replaced":
        target.unlink()
        target.write_bytes(b"c.png")
    else:
        target.unlink()
    before = snapshot(inbox_dir)
    with pytest.raises(Conflict, match="nothing was moved"):
        organizer.apply(plan_id)
    assert snapshot(inbox_dir) == before
    assert organizer.history.done == []


def test_apply_refuses_destination_taken_after_plan(organizer: Organizer, inbox_dir: Path) -> None:
    (inbox_dir / "a.pdf").write_bytes(b"mine")
    (inbox_dir / "b.pdf").write_bytes(b"b")
    plan_id = organizer.plan()["plan_id"]
    (inbox_dir / "Documents").mkdir()
    (inbox_dir / "Documents" / "b.pdf").write_bytes(b"theirs")
    before = snapshot(inbox_dir)
    with pytest.raises(Conflict):
        organizer.apply(plan_id)
    assert snapshot(inbox_dir) == before


def test_apply_refuses_category_folder_swapped_for_symlink(organizer: Organizer, tmp_path: Path) -> None:
    inbox_dir = organizer.folder.root
    outside = tmp_path / "outside"
    outside.mkdir()
    (inbox_dir / "x.pdf").write_bytes(b"x")
    plan_id = organizer.plan()["plan_id"]
    os.symlink(outside, inbox_dir / "Documents")
    with pytest.raises(PathEscape):
        organizer.apply(plan_id)
    assert list(outside.iterdir()) == []
    assert (inbox_dir / "x.pdf").read_bytes() == b"x"


def test_plan_reports_occupied_destinations(organizer: Organizer, inbox_dir: Path) -> None:
    (inbox_dir / "Documents").mkdir()
    (inbox_dir / "Documents" / "a.pdf").write_bytes(b"old")
    (inbox_dir / "a.pdf").write_bytes(b"new")
    detail = organizer.plan()
    assert detail["moves"] == []
    assert detail["skipped"][0]["path"] == "a.pdf"
    assert detail["skipped"][0]["code"] == "CONFLICT"


def test_max_plan_moves_caps_the_plan(inbox_dir: Path, state_dir: Path) -> None:
    from bastion.config import InboxConfig

    for index in range(7):
        (inbox_dir / f"{index}.txt").write_bytes(b"x")
    organizer = Organizer(InboxConfig(id="inbox", path=inbox_dir, max_plan_moves=5), state_dir)
    organizer.open()
    try:
        detail = organizer.plan()
        assert len(detail["moves"]) == 5
        assert detail["left_out"] == 2
    finally:
        organizer.close()


def test_move_file_never_overwrites(organizer: Organizer, inbox_dir: Path) -> None:
    (inbox_dir / "a.txt").write_bytes(b"a")
    (inbox_dir / "Docs").mkdir()
    (inbox_dir / "Docs" / "a.txt").write_bytes(b"existing")
    with pytest.raises(Conflict):
        organizer.move("a.txt", "Docs/a.txt")
    assert (inbox_dir / "Docs" / "a.txt").read_bytes() == b"existing"
    assert (inbox_dir / "a.txt").read_bytes() == b"a"
    assert sorted(os.listdir(inbox_dir / "Docs")) == ["a.txt"]


def test_move_file_may_move_restrained_entries_on_purpose(organizer: Organizer, inbox_dir: Path) -> None:
    """Restraint binds only the planner: an installer, a dotfile and a folder move when named."""
    (inbox_dir / "setup.exe").write_bytes(b"exe")
    (inbox_dir / ".profile").write_bytes(b"dot")
    (inbox_dir / "folder").mkdir()
    (inbox_dir / "folder" / "in.txt").write_bytes(b"in")
    organizer.move("setup.exe", "Installers/setup.exe")
    organizer.move(".profile", "Dotfiles/.profile")
    organizer.move("folder", "Archive/2024/folder")
    assert (inbox_dir / "Installers" / "setup.exe").read_bytes() == b"exe"
    assert (inbox_dir / "Archive" / "2024" / "folder" / "in.txt").read_bytes() == b"in"
    organizer.undo()
    assert not (inbox_dir / "Archive").exists()
    assert (inbox_dir / "folder" / "in.txt").read_bytes() == b"in"


@pytest.mark.parametrize(
    ("src", "dest", "error"),
    [
        ("link.txt", "moved.txt", PolicyDenied),
        ("fifo", "moved", PolicyDenied),
        ("a.txt", "../a.txt", PathEscape),
        ("a.txt", "/etc/a.txt", PathEscape),
        ("a.txt", "~/a.txt", PathEscape),
        ("a.txt", "bad\x1bname.txt", InvalidRequest),
        ("a.txt", "linked/a.txt", PathEscape),
        ("a.txt", ".git/hooks/pre-commit", PolicyDenied),
        ("folder", "folder/inside", InvalidRequest),
        ("missing.txt", "x.txt", NotFound),
        ("a.txt", ".", InvalidRequest),
        ("a.txt", "folder/", InvalidRequest),
    ],
)
def test_move_file_protection(
    organizer: Organizer, inbox_dir: Path, tmp_path: Path, src: str, dest: str, error: type[Exception]
) -> None:
    (inbox_dir / "a.txt").write_bytes(b"a")
    (inbox_dir / "folder").mkdir()
    os.symlink("a.txt", inbox_dir / "link.txt")
    os.mkfifo(inbox_dir / "fifo")
    os.symlink(tmp_path, inbox_dir / "linked")
    before = snapshot(inbox_dir)
    with pytest.raises(error):
        organizer.move(src, dest)
    assert snapshot(inbox_dir) == before


def test_redo_is_cleared_by_new_work(organizer: Organizer, inbox_dir: Path) -> None:
    (inbox_dir / "a.txt").write_bytes(b"a")
    (inbox_dir / "b.txt").write_bytes(b"b")
    organizer.move("a.txt", "A/a.txt")
    organizer.undo()
    assert organizer.history.undone
    organizer.move("b.txt", "B/b.txt")
    with pytest.raises(NotFound):
        organizer.redo()


def test_undo_refuses_when_old_place_is_taken(organizer: Organizer, inbox_dir: Path) -> None:
    """Nothing is overwritten to make room: the undo is refused and nothing moves."""
    (inbox_dir / "a.txt").write_bytes(b"original")
    organizer.move("a.txt", "A/a.txt")
    (inbox_dir / "a.txt").write_bytes(b"newcomer")
    before = snapshot(inbox_dir)
    with pytest.raises(Conflict):
        organizer.undo()
    assert snapshot(inbox_dir) == before
    assert organizer.history.done


def test_undo_refuses_when_the_file_was_replaced(organizer: Organizer, inbox_dir: Path) -> None:
    """Identity is the inode: another file under the moved file's name is not moved back.

    Not proven: an unlinked file's inode number may be reused by a new file at once, which
    then passes for the old one (it is moved back to a free place; nothing is overwritten)."""
    (inbox_dir / "a.txt").write_bytes(b"original")
    organizer.move("a.txt", "A/a.txt")
    os.rename(inbox_dir / "A" / "a.txt", inbox_dir / "A" / "kept.txt")
    (inbox_dir / "A" / "a.txt").write_bytes(b"impostor")
    with pytest.raises(Conflict):
        organizer.undo()
    assert (inbox_dir / "A" / "a.txt").read_bytes() == b"impostor"


def test_history_survives_restart(organizer: Organizer, inbox_dir: Path, state_dir: Path) -> None:
    (inbox_dir / "a.pdf").write_bytes(b"a")
    organizer.apply(organizer.plan()["plan_id"])
    again = reopen(organizer, state_dir)
    try:
        again.undo()
        assert (inbox_dir / "a.pdf").read_bytes() == b"a"
        assert not (inbox_dir / "Documents").exists()
    finally:
        again.close()


def test_moves_and_undos_in_a_loop_keep_the_journal_bounded(
    organizer: Organizer, inbox_dir: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: move a file and undo it, over and over. The journal grew by every record until the next
    start, the only time it was compacted (the history in memory is capped, the file was not).
    Invariant: it is compacted while serving once large; the history, undo included, survives a restart."""
    monkeypatch.setattr(inbox_module, "COMPACT_BYTES", 4096)
    (inbox_dir / "a.txt").write_bytes(b"a")
    path = journal_path(state_dir, "inbox")
    for _ in range(100):
        organizer.move("a.txt", "A/a.txt")
        organizer.undo()
    assert path.stat().st_size < 8192
    organizer.move("a.txt", "A/a.txt")
    again = reopen(organizer, state_dir)
    try:
        again.undo()
        assert (inbox_dir / "a.txt").read_bytes() == b"a"
    finally:
        again.close()


def test_journal_lives_in_state_dir_with_relative_paths(organizer: Organizer, inbox_dir: Path, state_dir: Path) -> None:
    """The history cannot be edited from inside the inbox, and names no absolute path to replay."""
    (inbox_dir / "a.pdf").write_bytes(b"a")
    organizer.apply(organizer.plan()["plan_id"])
    path = journal_path(state_dir, "inbox")
    assert path.is_file()
    assert state_dir in path.parents
    assert str(inbox_dir) not in path.read_text()


def test_list_files_reports_why(organizer: Organizer, inbox_dir: Path) -> None:
    _fill(inbox_dir)
    (inbox_dir / "bad\x07name.pdf").write_bytes(b"bell")
    entries = {e["name"]: e for e in organizer.list_files()["entries"]}
    assert entries["report.pdf"]["would_move"] is True
    assert entries["report.pdf"]["category"] == "Documents"
    assert entries["report.pdf"]["size"] == 3
    assert entries["setup.exe"]["code"] == "NEEDS_EXPLICIT_REQUEST"
    assert entries["bad\\u0007name.pdf"]["rule"] == "unsafe-names"
    assert entries["bad\\u0007name.pdf"]["category"] == "Documents"  # kept by a rule, still categorized
    assert entries["notes"]["reason"]
    nested = organizer.list_files("nested")["entries"]
    assert nested[0]["name"] == "deep.pdf"
    assert nested[0]["would_move"] is False
    with pytest.raises(PathEscape):
        organizer.list_files("../")


def test_two_servers_cannot_share_a_journal(organizer: Organizer, state_dir: Path) -> None:
    from bastion.safety.errors import ConfigError

    other = Organizer(organizer.config, state_dir)
    with pytest.raises(ConfigError, match="in use"):
        other.open()
    other.close()


def test_unwritable_journal_moves_nothing_and_stops_changes(organizer: Organizer, inbox_dir: Path) -> None:
    """Fail closed: if the begin record cannot be written, nothing moves, and no later change runs."""
    from bastion.safety.errors import Unavailable

    (inbox_dir / "a.txt").write_bytes(b"a")
    read_only = os.open(organizer.journal.path, os.O_RDONLY)
    os.dup2(read_only, organizer.journal._fd)
    os.close(read_only)
    before = snapshot(inbox_dir)
    with pytest.raises(Unavailable, match="journal"):
        organizer.move("a.txt", "b.txt")
    assert snapshot(inbox_dir) == before
    with pytest.raises(Unavailable, match="restart"):
        organizer.move("a.txt", "c.txt")
    assert snapshot(inbox_dir) == before


def test_plan_is_lost_at_restart_with_a_typed_refusal(organizer: Organizer, inbox_dir: Path, state_dir: Path) -> None:
    """Plans live in memory: after a restart apply_plan is NOT_FOUND saying so, and nothing moves.

    Not proven: that a client re-plans; the refusal only tells it to."""
    (inbox_dir / "a.pdf").write_bytes(b"a")
    plan_id = organizer.plan()["plan_id"]
    before = snapshot(inbox_dir)
    again = reopen(organizer, state_dir)
    try:
        with pytest.raises(NotFound, match=r"expired or the server restarted .*: plan again"):
            again.apply(plan_id)
        assert snapshot(inbox_dir) == before
        assert again.history.done == []
    finally:
        again.close()


def test_used_plan_is_told_apart_from_an_expired_one(organizer: Organizer, inbox_dir: Path, state_dir: Path) -> None:
    """A refused apply spends the plan too; an applied plan is recognised from the journal after a restart."""
    (inbox_dir / "a.pdf").write_bytes(b"a")
    refused = organizer.plan()["plan_id"]
    (inbox_dir / "a.pdf").write_bytes(b"changed")
    with pytest.raises(Conflict):
        organizer.apply(refused)
    with pytest.raises(NotFound, match="already used: plans are single use"):
        organizer.apply(refused)
    applied = organizer.plan()["plan_id"]
    organizer.apply(applied)
    again = reopen(organizer, state_dir)
    try:
        with pytest.raises(NotFound, match="already used as action-1"):
            again.apply(applied)
        with pytest.raises(NotFound, match="expired or the server restarted"):
            again.apply(refused)
    finally:
        again.close()


def test_only_the_newest_plans_are_kept(organizer: Organizer, inbox_dir: Path) -> None:
    from bastion.organizer.inbox import MAX_PLANS

    (inbox_dir / "a.pdf").write_bytes(b"a")
    plans = [organizer.plan()["plan_id"] for _ in range(MAX_PLANS + 1)]
    with pytest.raises(NotFound, match="expired"):
        organizer.apply(plans[0])
    assert organizer.apply(plans[-1])["moved"] == 1


@pytest.mark.parametrize("plan_id", ["", "plan-XYZ", "../plan-0123456789abcdef", "plan-0123456789abcdef" * 1000])
def test_malformed_plan_id_is_invalid_request(organizer: Organizer, plan_id: str) -> None:
    with pytest.raises(InvalidRequest, match="not a plan id"):
        organizer.apply(plan_id)


def _protecting_kdbx(organizer: Organizer, state_dir: Path) -> Organizer:
    """Restart with a config that adds a protection rule for password stores."""
    from bastion.config import SkipRule

    organizer.close()
    extra = SkipRule(id="vaults", layer="protection", names=("*.kdbx",), reason="a password store")
    config = organizer.config.model_copy(update={"skip": (*organizer.config.skip, extra)})
    again = Organizer(config, state_dir)
    again.open()
    return again


@pytest.mark.parametrize("verb", ["undo", "redo"])
def test_undo_and_redo_enforce_the_protection_rules_in_force(
    organizer: Organizer, inbox_dir: Path, state_dir: Path, verb: str
) -> None:
    """Protection binds every tool: undo and redo replay the history under today's rules, so a
    move recorded before a file became protected is refused, nothing moves, the history stays."""
    (inbox_dir / "vault.kdbx").write_bytes(b"secrets")
    organizer.move("vault.kdbx", "Keys/vault.kdbx")
    if verb == "redo":
        organizer.undo()
    again = _protecting_kdbx(organizer, state_dir)
    try:
        before = snapshot(inbox_dir)
        with pytest.raises(PolicyDenied, match="a password store"):
            getattr(again, verb)()
        assert snapshot(inbox_dir) == before
        assert len(again.history.done if verb == "undo" else again.history.undone) == 1
    finally:
        again.close()


@pytest.mark.parametrize("path", ["../outside.txt", "/etc/passwd", "a/../../x", "a//b", "./a"])
def test_journal_naming_a_path_outside_the_inbox_stops_start_up(inbox_dir: Path, state_dir: Path, path: str) -> None:
    """The journal is replayed only with plain inbox-relative paths; anything else is damage."""
    from bastion.config import InboxConfig
    from bastion.organizer.journal import Journal, Move, Txn
    from bastion.safety.errors import ConfigError

    journal = Journal(journal_path(state_dir, "inbox"))
    journal.open()
    txn = Txn(txn=1, kind="move", action=1, moves=(Move(path, "b.txt", 1, 2),))
    journal.begin(txn)
    journal.end(txn, [0])
    journal.close()
    organizer = Organizer(InboxConfig(id="inbox", path=inbox_dir), state_dir)
    try:
        with pytest.raises(ConfigError, match="damaged at line 1"):
            organizer.open()
    finally:
        organizer.close()

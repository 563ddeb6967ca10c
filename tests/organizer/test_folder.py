"""The inbox's root and the folders the organizer makes in it, against a local user who can write there.

What these prove: a folder the organizer makes in a user's inbox belongs to that user (owner
and group of the inbox), on the way forward and on the rollback path; a new folder swapped for a
hard link to another file between mkdir and chown refuses the action and leaves that file's
owner alone; an inbox path with a symbolic link on it is refused at the start, and one that
gets a link after the start is refused at the next call, never followed.

What they do not prove: that the real race (renameat2 RENAME_EXCHANGE from another process)
is lost every time; the swap is made at the worst moment by hand, which is what counts for a
check done on an fd.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import pytest

from bastion.config import InboxConfig
from bastion.organizer import Organizer
from bastion.organizer._rename import load_renameat2
from bastion.organizer.folder import Folder
from bastion.organizer.inbox import MAX_MOVE_DEPTH
from bastion.organizer.journal import Journal, Move, Txn
from bastion.organizer.mover import Mover
from bastion.safety.errors import BastionError, Conflict, PathEscape, Unavailable

from .trees import snapshot

USER = (1000, 1000)  # the inbox's owner, not the server
OTHER = (2000, 2000)  # the owner of the file the attacker links in
RENAME_EXCHANGE = 2  # include/uapi/linux/fs.h


def _owner(path: Path) -> tuple[int, int]:
    info = os.lstat(path)
    return info.st_uid, info.st_gid


def _organizer(inbox: Path, state: Path) -> Organizer:
    built = Organizer(InboxConfig(id="inbox", path=inbox), state)
    assert built.open() is None
    return built


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="only a root server makes folders that belong to someone else")
@pytest.mark.parametrize("how", ["apply", "move_file"])
def test_folders_made_in_a_users_inbox_are_not_left_to_root(inbox_dir: Path, state_dir: Path, how: str) -> None:
    """Invariant: every folder made by a move belongs to the inbox's owner and group, so the user can
    still rename and delete what was moved into it."""
    os.chown(inbox_dir, *USER)
    organizer = _organizer(inbox_dir, state_dir)  # it acts as the owner it finds at open
    (inbox_dir / "a.pdf").write_bytes(b"a")
    if how == "apply":
        organizer.apply(organizer.plan()["plan_id"])
        made = ["Documents"]
    else:
        organizer.move("a.pdf", "Papers/2024/a.pdf")
        made = ["Papers", "Papers/2024"]
    organizer.close()
    for rel in made:
        assert _owner(inbox_dir / rel) == USER, rel


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="only a root server makes folders that belong to someone else")
def test_folder_remade_by_a_rollback_is_not_left_to_root(inbox_dir: Path, state_dir: Path) -> None:
    """Invariant: the rollback path (here the recovery of an action a crash cut short) makes folders
    the same way: the folder it puts a file back into belongs to the inbox's owner."""
    os.chown(inbox_dir, *USER)
    (inbox_dir / "a.pdf").write_bytes(b"a")
    info = os.lstat(inbox_dir / "a.pdf")
    txn = Txn(txn=1, kind="move", action=1, moves=(Move("Papers/a.pdf", "a.pdf", info.st_dev, info.st_ino),))
    journal = Journal(state_dir / "journal.jsonl")
    journal.open()
    folder = Folder(inbox_dir)
    try:
        journal.begin(txn)
        assert Mover(folder, journal).recover(txn) == []
    finally:
        journal.close()
        folder.close()
    assert (inbox_dir / "Papers" / "a.pdf").read_bytes() == b"a"
    assert _owner(inbox_dir / "Papers") == USER


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="only a root server chowns what it makes")
@pytest.mark.parametrize("how", ["apply", "move_file"])
def test_new_folder_swapped_for_a_hard_link_never_gives_the_linked_file_away(
    inbox_dir: Path, state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Invariant: a user who can write the inbox swaps the folder just made for a hard link to a file
    of another user (as to /etc/shadow) between mkdir and chown: that file keeps its owner, mode and
    bytes, the action is refused as a conflict, and nothing in the inbox is moved, deleted or overwritten."""
    os.chown(inbox_dir, *USER)
    organizer = _organizer(inbox_dir, state_dir)  # it acts as the owner it finds at open
    victim = tmp_path / "shadow"
    victim.write_bytes(b"root:secret\n")
    os.chown(victim, *OTHER)
    victim.chmod(0o640)
    (inbox_dir / "a.pdf").write_bytes(b"a")
    if how == "apply":
        plan_id = organizer.plan()["plan_id"]
        act = partial(organizer.apply, plan_id)
    else:
        act = partial(organizer.move, "a.pdf", "Documents/a.pdf")
    os.link(victim, inbox_dir / ".swap")
    exchange = load_renameat2()
    real_mkdir = os.mkdir

    def mkdir_then_swap(path: str, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        real_mkdir(path, mode, dir_fd=dir_fd)
        if path == "Documents" and dir_fd is not None:
            assert exchange(dir_fd, b".swap", dir_fd, b"Documents", RENAME_EXCHANGE) == 0

    before = snapshot(inbox_dir)
    monkeypatch.setattr("bastion.organizer.folder.os.mkdir", mkdir_then_swap)
    with pytest.raises(BastionError) as refused:
        act()
    monkeypatch.undo()
    info = os.lstat(victim)
    assert (info.st_uid, info.st_gid, info.st_mode & 0o7777) == (*OTHER, 0o640)
    assert victim.read_bytes() == b"root:secret\n"
    assert isinstance(refused.value, Conflict), refused.value
    assert "not the empty folder the organizer just created" in refused.value.reason
    after = snapshot(inbox_dir)
    # The attacker's swap is all that changed: the link now at Documents, the new folder at .swap.
    assert after == {**before, "Documents": before[".swap"], ".swap": ("dir", b"")}
    assert organizer.history.done == []
    organizer.close()


@pytest.mark.parametrize("link", ["the inbox", "a folder on its path"])
def test_inbox_configured_through_a_symlink_is_refused_at_start(tmp_path: Path, state_dir: Path, link: str) -> None:
    """Invariant: a user who owns a folder on the inbox's path (``Downloads -> /etc``) cannot point
    the organizer elsewhere: the start is refused in one line naming the path and the link and
    saying to configure the real path, and nothing outside is touched."""
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "shadow").write_bytes(b"root:secret\n")
    home = tmp_path / "home"
    if link == "the inbox":
        home.mkdir()
        (home / "Downloads").symlink_to(etc)
        named = home / "Downloads"
    else:
        (tmp_path / "real-home" / "Downloads").mkdir(parents=True)
        home.symlink_to(tmp_path / "real-home")
        named = home
    inbox = home / "Downloads"
    before = snapshot(tmp_path / "etc")
    with pytest.raises(PathEscape) as refused:
        Organizer(InboxConfig(id="inbox", path=inbox), state_dir)
    reason = refused.value.reason
    assert "\n" not in reason
    assert f"the inbox path '{inbox}' goes through the symbolic link '{named}'" in reason
    assert "configure the folder's real path" in reason
    assert snapshot(tmp_path / "etc") == before


@pytest.mark.parametrize("link", ["the inbox", "a folder on its path"])
def test_inbox_swapped_for_a_symlink_after_start_is_refused_not_followed(
    tmp_path: Path, state_dir: Path, link: str
) -> None:
    """Invariant: a link put on the inbox's path while the server runs is refused at the next call,
    even one that leads back to the very folder held open (a stat that follows links would pass it)."""
    home = tmp_path / "home"
    inbox = home / "Downloads"
    inbox.mkdir(parents=True)
    (inbox / "a.pdf").write_bytes(b"a")
    organizer = _organizer(inbox, state_dir)
    try:
        swapped = inbox if link == "the inbox" else home
        swapped.rename(swapped.with_name(swapped.name + "-real"))
        swapped.symlink_to(swapped.name + "-real")
        for call in (organizer.list_files, organizer.plan, lambda: organizer.move("a.pdf", "Documents/a.pdf")):
            with pytest.raises(Unavailable, match=f"the inbox folder {inbox} was replaced by a symbolic link"):
                call()
    finally:
        organizer.close()
    real = tmp_path / ("home/Downloads-real" if link == "the inbox" else "home-real/Downloads")
    assert snapshot(real) == {"a.pdf": ("file", b"a")}


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="a root organizer's")
def test_an_inbox_another_user_could_replace_is_refused(tmp_path: Path) -> None:
    """Attack (found by review): a user owning the inbox's parent renames a root-owned folder into the
    configured name; only links were refused, so the root organizer moved root's files about. Refused, naming
    who; the same inbox owned by the parent's owner is served."""
    home = tmp_path / "alice"
    inbox = home / "Downloads"
    inbox.mkdir(parents=True)
    os.chown(home, 12345, 12345)
    with pytest.raises(BastionError, match="could be replaced by another folder by uid 12345"):
        Folder(inbox).close()
    os.chown(inbox, 12345, 12345)
    Folder(inbox).close()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="only a root server acts as the inbox's owner")
def test_a_root_organizer_never_moves_what_the_inbox_owner_could_not(inbox_dir: Path, state_dir: Path) -> None:
    """Attack (found by review): a root organizer moved entries out of another user's 0700 folder inside the
    inbox, into folders the inbox's owner controls, who could then read them. It acts as the inbox's owner: the
    move is refused, and the file stays where it was, unread."""
    os.chown(inbox_dir, *USER)
    private = inbox_dir / "bobs"
    private.mkdir()
    (private / "diary.txt").write_text("bob's")
    os.chown(private / "diary.txt", *OTHER)
    os.chown(private, *OTHER)
    private.chmod(0o700)
    organizer = _organizer(inbox_dir, state_dir)
    try:
        with pytest.raises(BastionError):
            organizer.move("bobs/diary.txt", "Documents/diary.txt")
    finally:
        organizer.close()
    assert (private / "diary.txt").read_text() == "bob's"
    assert not (inbox_dir / "Documents" / "diary.txt").exists()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="only a root server acts as the inbox's owner")
def test_a_folder_the_owner_cannot_search_is_a_clear_refusal_and_recovery_keeps_its_move(
    inbox_dir: Path, state_dir: Path
) -> None:
    """Attack (found by review): acting as the owner, a folder of theirs made 0644 (listable, not searchable)
    raised a bare PermissionError: list_files and plan answered INTERNAL_ERROR, and a crash's recovery stopped the
    server's start with a traceback. It is a refusal now, and recovery keeps the move it cannot examine in the
    history instead of dropping it."""
    os.chown(inbox_dir, *USER)
    photos = inbox_dir / "Photos"
    photos.mkdir()
    (photos / "a.jpg").write_bytes(b"a")
    info = os.lstat(photos / "a.jpg")
    for entry in (photos, photos / "a.jpg"):
        os.chown(entry, *USER)
    photos.chmod(0o644)
    txn = Txn(txn=1, kind="move", action=1, moves=(Move("a.jpg", "Photos/a.jpg", info.st_dev, info.st_ino),))
    journal = Journal(state_dir / "journal.jsonl")
    journal.open()
    folder = Folder(inbox_dir)
    try:
        with pytest.raises(BastionError, match="cannot be examined"):
            folder.scan("Photos")
        journal.begin(txn)
        assert Mover(folder, journal).recover(txn) == [0]  # kept as in effect: it could not be examined
    finally:
        journal.close()
        folder.close()
        photos.chmod(0o755)
    assert (photos / "a.jpg").read_bytes() == b"a"


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="a root organizer's")
def test_a_root_owned_inbox_others_may_write_is_refused(tmp_path: Path) -> None:
    """Attack (found by review): a shared root-owned inbox (1777) is organized as root, which moved one user's
    file into a folder another user made there, where that user could delete it; the sticky bit protects
    what is in the inbox, not what is moved. Refused at start."""
    inbox = tmp_path / "shared-inbox"
    inbox.mkdir()
    inbox.chmod(0o1777)
    with pytest.raises(BastionError, match="who may write the root-owned folder itself"):
        Folder(inbox).close()
    inbox.chmod(0o755)
    Folder(inbox).close()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="a root organizer's, acting as the inbox's owner")
@pytest.mark.parametrize("made_by", ["another user", "the owner, 0777"])
def test_a_category_folder_someone_else_controls_is_never_moved_into(
    inbox_dir: Path, state_dir: Path, made_by: str
) -> None:
    """Attack (found by review): the inbox is its owner's and 1777 (others drop files; the sticky bit keeps
    them from the owner's). Another user makes `Documents` 0777 before the organizer runs: plan and apply moved
    the owner's 0600 report into it, where that user deleted it and put their own file in its place (which
    undo then moved back as the owner's: same inode number). A destination folder someone else owns or may
    write is refused now, in plan_organize and move_file; the report stays where it was."""
    os.chown(inbox_dir, *USER)
    inbox_dir.chmod(0o1777)
    report = inbox_dir / "report.pdf"
    report.write_text("the owner's")
    os.chown(report, *USER)
    report.chmod(0o600)
    documents = inbox_dir / "Documents"
    documents.mkdir()
    os.chown(documents, *(OTHER if made_by == "another user" else USER))
    documents.chmod(0o777)
    organizer = _organizer(inbox_dir, state_dir)
    try:
        plan = organizer.plan()
        assert plan["moves"] == []
        (skipped,) = [entry for entry in plan["skipped"] if entry["path"] == "report.pdf"]
        assert "Documents" in skipped["reason"]
        with pytest.raises(PathEscape, match=r"the destination folder 'Documents' is (owned by uid|writable by)"):
            organizer.move("report.pdf", "Documents/report.pdf")
    finally:
        organizer.close()
    assert report.read_text() == "the owner's"
    assert os.listdir(documents) == []


def test_a_move_deeper_than_the_cap_is_refused_and_undo_still_works(inbox_dir: Path, state_dir: Path) -> None:
    """Attack (found by review): a file 1,500 folders deep moved to the top: the move worked, then every undo
    raised RecursionError (INTERNAL_ERROR), and no earlier action could be undone behind it; 950 levels took
    10.7 s a move. Paths deeper than `MAX_MOVE_DEPTH` are refused; one at the cap moves and undoes."""
    deep = inbox_dir
    for _ in range(MAX_MOVE_DEPTH):  # the entry itself is one level more: over the cap
        deep = deep / "d"
    deep.mkdir(parents=True)
    (deep / "f.txt").write_text("deep")
    (deep.parent / "g.txt").write_text("at the cap")
    (inbox_dir / "top.txt").write_text("top")
    organizer = _organizer(inbox_dir, state_dir)
    try:
        organizer.move("top.txt", "moved.txt")
        too_deep = "/".join(["d"] * MAX_MOVE_DEPTH) + "/f.txt"
        with pytest.raises(BastionError, match=f"{MAX_MOVE_DEPTH + 1} folders deep"):
            organizer.move(too_deep, "f.txt")
        with pytest.raises(BastionError, match=f"{MAX_MOVE_DEPTH + 1} folders deep"):
            organizer.move("moved.txt", too_deep.replace("f.txt", "x.txt"))
        at_cap = "/".join(["d"] * (MAX_MOVE_DEPTH - 1)) + "/g.txt"
        organizer.move(at_cap, "g.txt")
        organizer.undo()  # g.txt goes back, 64 deep
        organizer.undo()  # and the move before it still undoes
    finally:
        organizer.close()
    assert (deep.parent / "g.txt").read_text() == "at the cap"
    assert (inbox_dir / "top.txt").read_text() == "top"
    assert (deep / "f.txt").read_text() == "deep"

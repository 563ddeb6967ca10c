"""The jail's walk (search_files) and atomic replace (edit_file).

``ws`` is the workspace root, ``outside`` a folder beside it. What these do not prove: the
tools' output (tests/tools/test_search_edit.py).
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.safety.errors import Conflict, PolicyDenied
from bastion.safety.paths import Jail


def test_walk_lists_depth_first_and_never_enters_a_link(jail: Jail, ws: Path, outside: Path) -> None:
    """Invariant: links (to a folder outside, to one inside) are reported as links; nothing beneath them is listed."""
    (ws / "a").mkdir()
    (ws / "a" / "f.txt").write_text("f")
    (ws / "b.txt").write_text("b")
    (ws / "out").symlink_to(outside)
    (ws / "loop").symlink_to(".")
    entries, cut = jail.walk()
    assert [(e.path, e.kind) for e in entries] == [
        ("a", "dir"),
        ("a/f.txt", "file"),
        ("b.txt", "file"),
        ("loop", "symlink"),
        ("out", "symlink"),
    ]
    assert cut is False


def test_walk_leaves_out_secret_names_and_what_is_beneath(jail: Jail, ws: Path) -> None:
    (ws / ".ssh").mkdir()
    (ws / ".ssh" / "config").write_text("x")
    (ws / ".env").write_text("x")
    (ws / "ok.txt").write_text("x")
    entries, _ = jail.walk()
    assert [e.path for e in entries] == ["ok.txt"]


def test_walk_stops_at_max_entries_and_says_so(jail: Jail, ws: Path) -> None:
    for i in range(5):
        (ws / f"f{i}").write_text("x")
    entries, cut = jail.walk(max_entries=3)
    assert len(entries) == 3
    assert cut is True


def test_walk_prunes_named_folders_but_lists_them(jail: Jail, ws: Path) -> None:
    (ws / ".git").mkdir()
    (ws / ".git" / "HEAD").write_text("x")
    entries, _ = jail.walk(prune=frozenset({".git"}))
    assert [e.path for e in entries] == [".git"]
    inside, _ = jail.walk(".git", prune=frozenset({".git"}))
    assert [e.path for e in inside] == [".git/HEAD"]


def test_walk_never_enters_a_folder_swapped_for_a_link(jail: Jail, ws: Path, outside: Path) -> None:
    """Invariant (A013 for the walk): while a thread swaps `d` for a link to outside, no walk lists outside's files.

    Does not prove every interleaving ran; it proves none of those that ran leaked.
    """
    real = ws / "d"
    real.mkdir()
    (real / "inside.txt").write_text("in")
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            os.rename(real, ws / "d.real")
            os.symlink(outside, real)
            os.unlink(real)
            os.rename(ws / "d.real", real)

    swapper = threading.Thread(target=swap)
    swapper.start()
    seen: set[str] = set()
    try:
        for _ in range(300):
            entries, _ = jail.walk()
            seen.update(e.path for e in entries)
    finally:
        stop.set()
        swapper.join()
    assert not any(path.endswith("secret.txt") for path in seen)


def test_replace_is_atomic_and_keeps_mode_and_owner(jail: Jail, ws: Path) -> None:
    """Invariant: the new content arrives under a new inode with the old mode (setuid dropped) and owner."""
    target = ws / "run.sh"
    target.write_text("old")
    target.chmod(0o4750)
    os.chown(target, 1234, 5678)
    read = jail.read("run.sh")
    jail.replace("run.sh", b"new", version=read.version)
    after = target.stat()
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(after.st_mode) == 0o750
    assert (after.st_uid, after.st_gid) == (1234, 5678)
    assert sorted(p.name for p in ws.iterdir()) == ["run.sh"]


def test_replace_refuses_a_file_changed_since_it_was_read(jail: Jail, ws: Path) -> None:
    """Invariant: a write by someone else between read and replace is a Conflict, not lost."""
    target = ws / "f.txt"
    target.write_text("one")
    read = jail.read("f.txt")
    target.write_text("two, longer")
    with pytest.raises(Conflict):
        jail.replace("f.txt", b"three", version=read.version)
    assert target.read_text() == "two, longer"
    assert sorted(p.name for p in ws.iterdir()) == ["f.txt"]


def test_replace_never_follows_a_final_link(jail: Jail, ws: Path, outside: Path) -> None:
    """Invariant: a link put where the file was is refused, and the file outside is untouched."""
    (ws / "f.txt").write_text("one")
    read = jail.read("f.txt")
    (ws / "f.txt").unlink()
    (ws / "f.txt").symlink_to(outside / "secret.txt")
    with pytest.raises(PolicyDenied):
        jail.replace("f.txt", b"x", version=read.version)
    assert (outside / "secret.txt").read_text() == "OUTSIDE-SECRET"


def test_replace_works_for_a_name_at_the_length_limit(jail: Jail, ws: Path) -> None:
    """Invariant: the temporary file's name does not grow with the file's: a 255-byte name (multi-byte
    characters) is replaced like any other, and no temporary file is left."""
    name = "é" * 127 + "x"  # 255 bytes
    (ws / name).write_text("old")
    read = jail.read(name)
    jail.replace(name, b"new", version=read.version)
    assert (ws / name).read_bytes() == b"new"
    assert [p.name for p in ws.iterdir()] == [name]


def test_walk_stops_at_its_deadline_with_cut(tmp_path: Path) -> None:
    """Attack: a deep, wide tree costs more than its entry count; a walk given a deadline that has
    passed lists no further folder and says it was cut."""
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f.txt").write_text("x")
    with Jail(tmp_path) as jail:
        entries, cut = jail.walk(deadline=time.monotonic() - 1)
        assert cut
        assert len(entries) < 6
        assert len(jail.walk()[0]) == 6


class _CountingScandir:
    """os.scandir that counts the names it hands out: what a walk really read, not what it kept."""

    def __init__(self) -> None:
        self.read = 0
        self._real = os.scandir

    def __call__(self, fd: int) -> Iterator[os.DirEntry[str]]:
        @contextlib.contextmanager
        def counted() -> Iterator[Iterator[os.DirEntry[str]]]:
            with self._real(fd) as iterator:
                yield self._count(iterator)

        return counted()  # type: ignore[return-value]

    def _count(self, iterator: Iterator[os.DirEntry[str]]) -> Iterator[os.DirEntry[str]]:
        for item in iterator:
            self.read += 1
            yield item


def _many_links(folder: Path, count: int, prefix: str = "n") -> None:
    target = folder / "one"
    target.write_text("x")
    for i in range(count):
        os.link(target, folder / f"{prefix}{i}")


def test_a_folder_of_millions_of_hard_links_is_listed_only_as_far_as_the_walk_bound(
    jail: Jail, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: hard links cost no inode, so an agent fills one folder with millions of names within its disk,
    then searches: the walk listed and stat-ed every name of a folder before it looked at its bound
    (~140 bytes of server memory and ~10 us a name). Names the walk leaves out (secret-named) count too."""
    (ws / "deep").mkdir()
    _many_links(ws / "deep", 3000)
    _many_links(ws / "deep", 500, prefix=".env.")
    counting = _CountingScandir()
    monkeypatch.setattr(os, "scandir", counting)
    entries, cut = jail.walk(max_entries=100)
    assert cut
    assert 0 < len(entries) <= 100  # secret names read are left out
    assert counting.read <= 100 + 2  # the root's one name, and the name that found the bound


def test_a_folder_listed_past_the_walk_deadline_stops_mid_listing(
    jail: Jail, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: the same folder of links with a generous entry bound: the deadline, looked at every few
    hundred names, stops the listing itself, not only the next folder."""
    _many_links(ws, 3000)
    counting = _CountingScandir()
    monkeypatch.setattr(os, "scandir", counting)
    entries, cut = jail.walk(deadline=time.monotonic() - 1)
    assert cut
    assert counting.read <= 256
    assert len(entries) < 256

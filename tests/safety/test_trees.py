"""Trees an agent made, walked and deleted at any depth without following a link (bastion.safety.trees)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bastion.safety.trees import MAX_WALK_DEPTH, remove_tree, tree_bytes


def _nest(root: Path, depth: int) -> None:
    """`depth` folders in one another under `root`, a file at the bottom (made through fds: no long paths)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "wb") as bottom:
            bottom.write(b"x" * 5000)
    finally:
        os.close(fd)


def test_a_tree_nested_past_the_recursion_limit_is_removed_and_counted(tmp_path: Path) -> None:
    """Attack: 3,000 nested folders: os.fwalk and shutil.rmtree recurse once per level and raised
    RecursionError (Python's limit is about 1,000). Removed whole; counted to `MAX_WALK_DEPTH` levels."""
    root = tmp_path / "workspace"
    root.mkdir()
    _nest(root, 3_000)
    counted = tree_bytes(root, max_entries=100_000)
    # A lower bound: the folders of the levels walked, not the file at the bottom.
    assert counted >= MAX_WALK_DEPTH * os.lstat(root / "d").st_blocks * 512 > 0
    remove_tree(root)
    assert not root.exists()
    assert os.listdir(tmp_path) == []


def test_links_are_removed_as_themselves_never_followed(tmp_path: Path) -> None:
    """Attack: links in the tree to a folder and a file outside it, and the tree's root itself a link:
    the links go, what they lead to stays."""
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "secret").write_text("stays")
    root = tmp_path / "workspace"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "to-folder").symlink_to(outside / "keep")
    (root / "a" / "to-file").symlink_to(outside / "keep" / "secret")
    (root / "loop").symlink_to(root)
    assert tree_bytes(root, max_entries=100) == sum(
        os.lstat(p).st_blocks * 512 for p in root.rglob("*") if not p.is_symlink()
    )
    remove_tree(root)
    assert not root.exists()
    link = tmp_path / "link-root"
    link.symlink_to(outside)
    remove_tree(link)
    assert not link.is_symlink()
    assert (outside / "keep" / "secret").read_text() == "stays"


def test_a_folder_of_more_entries_than_a_batch_and_read_only_folders_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "workspace"
    (root / "many").mkdir(parents=True)
    for i in range(5_000):
        (root / "many" / str(i)).write_bytes(b"")
    for i in range(50):
        (root / "many" / f"sub{i}" / "inner").mkdir(parents=True)
    (root / "locked" / "in").mkdir(parents=True)
    (root / "locked" / "in" / "f").write_text("x")
    (root / "locked").chmod(0o500)
    remove_tree(root)
    assert not root.exists()


def test_a_missing_root_is_nothing_to_do(tmp_path: Path) -> None:
    remove_tree(tmp_path / "missing")
    assert tree_bytes(tmp_path / "missing", max_entries=10) == 0


NAMES = st.sampled_from(["a", "b", "c", ".bastion-removing-0", "0", "1"])
TREES = st.recursive(
    st.one_of(st.just("file"), st.just("link-out"), st.just("link-up")),
    lambda children: st.dictionaries(NAMES, children, max_size=4),
    max_leaves=30,
)


def _build(at: Path, tree: object, outside: Path) -> None:
    if isinstance(tree, dict):
        at.mkdir()
        for name, child in tree.items():
            _build(at / name, child, outside)
    elif tree == "file":
        at.write_text("x")
    elif tree == "link-out":
        at.symlink_to(outside)
    else:
        at.symlink_to("..")


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=st.dictionaries(NAMES, TREES, max_size=5))
def test_any_tree_is_removed_whole_and_nothing_outside_it(tmp_path: Path, tree: dict[str, object]) -> None:
    """Whatever the tree (names like the removal's own, links out and up), it is gone and the rest stays."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "keep").write_text("stays")
    root = tmp_path / "workspace"
    _build(root, tree, outside)
    remove_tree(root)
    assert not root.exists()
    assert sorted(os.listdir(tmp_path)) == ["outside"]
    assert os.listdir(outside) == ["keep"]


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs")
def test_a_tree_on_a_full_filesystem_is_removed(tmp_path: Path) -> None:
    """Found by review: `remove_tree` first makes a folder (its pile), which a full filesystem refuses, and
    then removed nothing: a sandbox refused on a full state filesystem, or closed there, left its folder and
    disk image for ever, the room they held included. Files and empty folders now go first."""
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=64", "bastion-test", str(mount)], check=True)
    try:
        root = mount / "sandbox"
        (root / "workspace").mkdir(parents=True)
        (root / "workspace" / "disk.img").write_bytes(b"x" * 4096)
        (root / "nested" / "deeper").mkdir(parents=True)
        (root / "nested" / "deeper" / "file").write_text("kept until now")
        (mount / "kept").write_text("outside the tree")
        filler = root / "workspace" / "a" / "b"  # found by review: the room sits deep in the tree
        filler.mkdir(parents=True)
        with contextlib.suppress(OSError):  # every inode taken: no folder can be made
            for n in range(1000):
                (filler / str(n)).touch()
        outside = mount / "outside"
        with pytest.raises(OSError, match="No space left on device"):
            outside.mkdir()
        remove_tree(root)
        assert not root.exists()
        outside.mkdir()  # the room is back
        assert (mount / "kept").read_text() == "outside the tree"
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs and a bind mount")
def test_a_tree_on_a_full_filesystem_is_removed_without_entering_a_mount_in_it(tmp_path: Path) -> None:
    """Found by review: on a full filesystem the walk that frees room went into a filesystem mounted inside
    the tree and deleted its files. A mount point stays, with all it shows, as on a filesystem with room."""
    mount, precious = tmp_path / "small", tmp_path / "precious"
    mount.mkdir()
    precious.mkdir()
    (precious / "keep.txt").write_text("not the tree's")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=64", "bastion-test", str(mount)], check=True)
    try:
        root = mount / "sandbox"
        (root / "mounted").mkdir(parents=True)
        subprocess.run(["mount", "--bind", str(precious), str(root / "mounted")], check=True)
        try:
            filler = root / "workspace"
            filler.mkdir()
            with contextlib.suppress(OSError):  # every inode taken: no folder can be made
                for n in range(1000):
                    (filler / str(n)).touch()
            remove_tree(root)
            assert (precious / "keep.txt").read_text() == "not the tree's"
            assert not filler.exists()
        finally:
            subprocess.run(["umount", str(root / "mounted")], check=True)
    finally:
        subprocess.run(["umount", str(mount)], check=True)

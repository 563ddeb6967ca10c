"""What of a host workspace's git repository `protect_git` keeps from its agent, read from repositories the host's
real git made: each index version git writes, SHA-1 and SHA-256, a damaged index, and the forms `.git` takes.
What it does not prove: what the sandbox then enforces (tests/attacks/test_host_workspace_git_attacks.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tracemalloc
from pathlib import Path

import pytest

from bastion.workbench.repository import Protection, repository_protection
from tests.attacks.test_host_workspace_git_attacks import GIT_ENV

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="no git")

LINKS = ("vendor/a-library-with-a-long-name", "vendor/a-library-with-a-longer-name", "missing")


def git(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["git", "-C", str(folder), *args], env=GIT_ENV, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return done


def repository(folder: Path, *init: str) -> Path:
    """A repository with a file and a gitlink for each of `LINKS`; the first two have folders, one a `.git`."""
    folder.mkdir()
    git(folder, "init", "-q", *init)
    (folder / "README.md").write_text("readme\n")
    git(folder, "add", "README.md")
    head = git(folder, "hash-object", "-w", "README.md").stdout.strip()  # any object name of the right size
    for path in LINKS:
        git(folder, "update-index", "--add", "--cacheinfo", f"160000,{head},{path}")
    (folder / LINKS[0] / ".git").mkdir(parents=True)
    (folder / LINKS[1]).mkdir(parents=True)
    return folder


@pytest.mark.parametrize("version", [2, 3, 4])
def test_the_submodules_are_read_from_each_index_version(tmp_path: Path, version: int) -> None:
    """Invariant: every gitlink of the index is found, whatever version git wrote (v3: an entry with extended
    flags; v4: paths prefix-compressed), and each is kept: its `.git`, its folder whole, or a sealed empty one."""
    folder = repository(tmp_path / "repo")
    if version >= 3:
        (folder / "later.txt").write_text("later\n")
        git(folder, "add", "-N", "later.txt")  # intent-to-add: an extended flag, which needs version 3 or 4
    git(folder, "update-index", "--index-version", str(version))
    assert (folder / ".git" / "index").read_bytes()[4:8] == version.to_bytes(4, "big")
    found = repository_protection(str(folder), "ws")
    assert found == Protection(read_only=(".git", f"{LINKS[1]}", f"{LINKS[0]}/.git"), sealed=(LINKS[2],))


def test_a_sha256_repository_is_read_too(tmp_path: Path) -> None:
    probe = subprocess.run(
        ["git", "init", "-q", "--object-format=sha256", str(tmp_path / "probe")], env=GIT_ENV, capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip("this git makes no SHA-256 repository")
    folder = repository(tmp_path / "repo", "--object-format=sha256")
    assert repository_protection(str(folder), "ws").sealed == (LINKS[2],)


def test_a_damaged_index_gives_what_was_read_before_the_damage(tmp_path: Path) -> None:
    folder = repository(tmp_path / "repo")
    index = folder / ".git" / "index"
    whole = index.read_bytes()
    for cut in (0, 11, 12, 60, len(whole) // 2, len(whole) - 30):
        index.write_bytes(whole[:cut])
        assert repository_protection(str(folder), "ws").read_only[0] == ".git"
    index.write_bytes(b"DIRC" + (99).to_bytes(4, "big") + whole[8:])  # a version git never wrote: not read
    assert repository_protection(str(folder), "ws") == Protection(read_only=(".git",))


def test_gitmodules_alone_neither_seals_nor_unseals(tmp_path: Path) -> None:
    """`.gitmodules` is a file the agent writes: only the index, which is kept from it, counts."""
    folder = repository(tmp_path / "repo")
    (folder / ".gitmodules").write_text('[submodule "x"]\n\tpath = agents/choice\n')
    assert "agents/choice" not in repository_protection(str(folder), "ws").paths


def test_the_forms_of_dot_git(tmp_path: Path) -> None:
    """A `.git` file names its folder, inside the workspace (kept) or outside (its index still read); a link cannot
    be pinned (said in the log); no repository keeps nothing."""
    plain = tmp_path / "plain"
    plain.mkdir()
    assert repository_protection(str(plain), "ws") == Protection()
    beside = tmp_path / "beside"
    beside.mkdir()
    git(beside, "init", "-q", "--separate-git-dir", str(beside / ".bare"))
    (beside / ".git").write_text("gitdir: ../beside/.bare\n")
    assert set(repository_protection(str(beside), "ws").read_only) == {".git", ".bare"}
    outside = repository(tmp_path / "outside")
    worktree = tmp_path / "worktree"
    worktree.mkdir()
    (worktree / ".git").write_text(f"gitdir: {outside / '.git'}\n")
    found = repository_protection(str(worktree), "ws")  # the index outside names folders missing here
    assert (found.read_only, set(found.sealed)) == ((".git",), set(LINKS))
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(outside / ".git", linked / ".git")
    assert repository_protection(str(linked), "ws") == Protection()  # said in the log, and kept nothing


def test_a_crafted_index_costs_the_start_little(tmp_path: Path) -> None:
    """Found by review: a version 4 index whose names each grow a byte (strip nothing, add one) made the start
    hold every name, 805 MiB for 2.5 MiB of index. Only the owner writes the index, but a start must not die of
    it. Invariant: the gitlinks read are bounded, and so is the memory."""
    folder = tmp_path / "repo"
    (folder / ".git").mkdir(parents=True)
    entry = bytes(24) + (0o160000).to_bytes(4, "big") + bytes(12) + bytes(20) + (1).to_bytes(2, "big")
    count = 40_000
    body = b"".join(entry + b"\x00a\x00" for _ in range(count))  # varint 0 (strip nothing), then "a"
    (folder / ".git" / "index").write_bytes(b"DIRC" + (4).to_bytes(4, "big") + count.to_bytes(4, "big") + body)
    tracemalloc.start()
    try:
        found = repository_protection(str(folder), "ws")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"the start held {peak >> 20} MiB for a {len(body) >> 20} MiB index"
    assert len(found.sealed) <= 256


def test_a_split_index_names_its_submodules_in_its_shared_part(tmp_path: Path) -> None:
    folder = repository(tmp_path / "repo")
    git(folder, "config", "core.splitIndex", "true")
    git(folder, "update-index", "--split-index")
    assert list((folder / ".git").glob("sharedindex.*"))
    assert repository_protection(str(folder), "ws").sealed == (LINKS[2],)


def test_a_folder_of_a_larger_repository_keeps_the_submodules_beneath_it(tmp_path: Path) -> None:
    """The workspace is a package of a monorepo: git finds the repository above it."""
    folder = repository(tmp_path / "repo")
    found = repository_protection(str(folder / "vendor"), "ws")
    assert set(found.read_only) == {"a-library-with-a-longer-name", "a-library-with-a-long-name/.git"}
    assert found.sealed == ()

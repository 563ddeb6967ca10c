"""An agent plants code in a host workspace's git repository, for the folder's owner to run at their next git command.

A host workspace is a real folder of the host, and what its commands and file tools write there is the owner's, as
if the owner had written it (a root server's idmapped mount; an unprivileged server's own files). git runs the
programs `.git/config` names (`core.fsmonitor`, `core.pager`, aliases, filters) and the hooks in `.git/hooks`, and
follows `.git/commondir` to another folder's config. So the first `git status` the owner typed on the host after
an agent had worked there ran the agent's program as the owner (root, for the demo's folder), outside any sandbox:
found by attack (twenty-eighth session) through `cp`, `tar -xpf` and `write_file`, all allowed in the demo.

What this proves, against a real server, real bubblewrap, the real MCP client and the host's real git: the
repository's metadata (`.git`) is read-only to the workspace's commands and refused to its file tools, cannot be
moved away or replaced, and the owner's `git status` afterwards runs nothing the agent wrote; the agent's git
commands that only read still work, and so do its other writes.
What it does not prove: anything about a repository the agent makes itself (its `git init` there is the agent's,
SECURITY.md "A repository in a host workspace"), nor `protect_git = false`, which gives the agent `.git`.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from tests.attacks.demo import Demo
from tests.helpers import call

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap, pytest.mark.skipif(shutil.which("git") is None, reason="no git")]

GIT_ENV = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/nonexistent",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "owner",
    "GIT_AUTHOR_EMAIL": "owner@example.com",
    "GIT_COMMITTER_NAME": "owner",
    "GIT_COMMITTER_EMAIL": "owner@example.com",
}


def owners_git(workspace: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """git as the folder's owner types it on the host, outside any sandbox."""
    return subprocess.run(
        ["git", "-C", str(workspace), *args], env=GIT_ENV, capture_output=True, text=True, timeout=30, check=False
    )


def make_repository(workspace: Path) -> None:
    (workspace / "README.md").write_text("the owner's project\n")
    for args in (("init", "-q"), ("add", "README.md"), ("commit", "-q", "-m", "first")):
        assert owners_git(workspace, *args).returncode == 0


def planted(marker: Path) -> str:
    """A git config that runs a program at the owner's next `git status`."""
    return f"[core]\n\tfsmonitor = \"touch '{marker}'; echo\"\n\thooksPath = .git/hooks\n"


async def copy_planted(demo: Demo, target: str) -> tuple[Path, dict[str, Any]]:
    """The agent writes a config naming its own program and copies it over `target` with `cp` (allowed by the
    demo's policy), in one start of the server: the file that program would leave, and the copy's answer."""
    marker = demo.outside / "ran-as-the-owner"
    async with demo.client() as client:
        assert (await call(client, "write_file", path="evil.cfg", content=planted(marker)))["ok"]
        copied = await call(client, "run_command", command=f"cp evil.cfg {target}")
    return marker, copied


def hook_archive(marker: Path, config: str) -> bytes:
    """A tar of `.git/config` and an executable `.git/hooks/post-index-change`, modes kept by `tar -xp`."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, text, mode in (
            (".git/config", config, 0o644),
            (".git/hooks/post-index-change", f"#!/bin/sh\ntouch '{marker}'\n", 0o755),
        ):
            data = text.encode()
            entry = tarfile.TarInfo(name)
            entry.mode, entry.size = mode, len(data)
            archive.addfile(entry, io.BytesIO(data))
    return buffer.getvalue()


def metadata(workspace: Path) -> dict[str, bytes]:
    """What the owner's git reads and runs: every file of `.git` but the objects, as bytes."""
    git = workspace / ".git"
    return {
        str(path.relative_to(git)): path.read_bytes()
        for path in sorted(git.rglob("*"))
        if path.is_file() and "objects" not in path.relative_to(git).parts
    }


async def test_an_agent_cannot_plant_code_in_the_repository_the_owner_runs_git_in(demo: Demo) -> None:
    """Attack: in a host workspace that is the owner's git repository, the agent writes a `.git/config` naming
    `core.fsmonitor` (cp, write_file, edit_file, upload_file), an executable hook (`tar -xpf`), a `commondir`
    pointing at a config of its own, and moves `.git` away to put its own in its place. Invariant: each is
    refused, `.git` is byte for byte what it was, and the owner's `git status` runs nothing."""
    workspace = demo.workspace
    make_repository(workspace)
    marker = demo.outside / "ran-as-the-owner"
    before = metadata(workspace)
    config = planted(marker)
    async with demo.client() as client:
        for name, text in (("evil.cfg", config), ("commondir", "own\n"), ("own/config", config)):
            assert (await call(client, "write_file", path=name, content=text))["ok"]
        tar = base64.b64encode(hook_archive(marker, config)).decode("ascii")
        assert (await call(client, "upload_file", path="evil.tar", content_base64=tar))["ok"]
        attempts = [
            await call(client, "run_command", command="cp evil.cfg .git/config"),
            await call(client, "run_command", command="tar -xpf evil.tar"),
            await call(client, "run_command", command="cp commondir .git/commondir"),
            await call(client, "run_command", command="mkdir .git/hooks/new"),
            await call(client, "run_command", command="mv .git moved"),
            await call(client, "write_file", path=".git/config", content=config),
            await call(client, "write_file", path=".git/hooks/pre-commit", content="#!/bin/sh\n"),
            await call(client, "edit_file", path=".git/config", old="[core]", new=config),
            await call(client, "upload_file", path=".git/commondir", content_base64="b3duCg==", overwrite=True),
        ]
        commands = [attempt for attempt in attempts if attempt["action"] == "run_command"]
        for command in commands:  # each ran, and failed: "Read-only file system", "Device or resource busy"
            assert command["ok"], command
            assert command["detail"]["exit_status"] != 0, command["detail"]
            assert "Read-only" in command["detail"]["stderr"] or "busy" in command["detail"]["stderr"], command
        refused = [attempt for attempt in attempts if attempt["action"] != "run_command"]
        assert all(attempt["code"] == "POLICY_DENIED" for attempt in refused), refused
        assert all(".git" in attempt["reason"] for attempt in refused), refused
        # What still works: git that reads, and the agent's other files.
        status = await call(client, "run_command", command="git status --porcelain")
        assert status["ok"], status
        log = await call(client, "run_command", command="git log --oneline")
        assert "first" in log["detail"]["stdout"], log
        assert (await call(client, "write_file", path="notes.txt", content="kept\n"))["ok"]
    assert metadata(workspace) == before
    assert not (workspace / "moved").exists()
    assert owners_git(workspace, "status", "--porcelain").returncode == 0
    assert not marker.exists(), "the owner's git status ran the agent's program"
    assert (workspace / "notes.txt").read_text() == "kept\n"


async def test_a_link_to_the_repository_does_not_reach_it_for_the_file_tools(demo: Demo) -> None:
    """Attack: a symlink to `.git` (the owner's `ln -s .git meta`, or one an agent found) used as the path of a
    write: `meta/config`. Invariant: judged by where it leads, refused, the config unchanged."""
    workspace = demo.workspace
    make_repository(workspace)
    os.symlink(".git", workspace / "meta")
    before = metadata(workspace)
    async with demo.client() as client:
        written = await call(client, "write_file", path="meta/config", content="[core]\n\tpager = id\n")
        made = await call(client, "write_file", path="meta/hooks/new/pre-commit", content="#!/bin/sh\n")
    assert written["code"] == "POLICY_DENIED", written
    assert made["code"] == "POLICY_DENIED", made
    assert metadata(workspace) == before
    assert not (workspace / ".git" / "hooks" / "new").exists()


@pytest.mark.parametrize("spelling", ["./.bare", "../{name}/.bare"], ids=["beside", "through-the-parent"])
async def test_a_git_file_naming_a_folder_in_the_workspace_keeps_that_folder_from_the_agent(
    demo: Demo, spelling: str
) -> None:
    """Attack (found by review): the owner's `.git` is a file, `gitdir: ./.bare` (a bare repository beside its
    worktrees, or `git init --separate-git-dir`); only the name `.git` was kept from the agent, and `cp evil.cfg
    .bare/config` ran the agent's program at the owner's next `git status`; a second review found the same with
    the path spelled through the workspace's parent. Invariant: the folder the file names is read-only to
    commands and refused to the file tools; git there runs nothing the agent wrote."""
    workspace = demo.workspace
    (workspace / "README.md").write_text("the owner's project\n")
    assert owners_git(workspace, "init", "-q", "--separate-git-dir", str(workspace / ".bare")).returncode == 0
    (workspace / ".git").write_text(f"gitdir: {spelling.format(name=workspace.name)}\n")
    for args in (("add", "README.md"), ("commit", "-q", "-m", "first")):
        assert owners_git(workspace, *args).returncode == 0
    before = (workspace / ".bare" / "config").read_bytes()
    marker = demo.outside / "ran-as-the-owner"
    async with demo.client() as client:
        assert (await call(client, "write_file", path="evil.cfg", content=planted(marker)))["ok"]
        copied = await call(client, "run_command", command="cp evil.cfg .bare/config")
        moved = await call(client, "run_command", command="mv .bare elsewhere")
        written = await call(client, "write_file", path=".bare/hooks/post-index-change", content="#!/bin/sh\n")
        status = await call(client, "run_command", command="git status --porcelain")
    assert copied["detail"]["exit_status"] != 0, copied["detail"]
    assert moved["detail"]["exit_status"] != 0, moved["detail"]
    assert written["code"] == "POLICY_DENIED", written
    assert status["detail"]["exit_status"] == 0, status["detail"]
    assert (workspace / ".bare" / "config").read_bytes() == before
    assert owners_git(workspace, "status", "--porcelain").returncode == 0
    assert not marker.exists(), "the owner's git status ran the agent's program"


def library_at(folder: Path) -> None:
    """A repository of its own at `folder`, with one commit."""
    folder.mkdir()
    (folder / "x").write_text("x\n")
    for args in (("init", "-q"), ("add", "x"), ("commit", "-q", "-m", "library")):
        assert owners_git(folder, *args).returncode == 0


async def test_a_repository_the_owner_added_without_gitmodules_is_kept_from_the_agent(demo: Demo) -> None:
    """Attack (found by review): the owner's repository holds a repository of its own added with `git add lib`
    (a gitlink in the index, in no `.gitmodules`); submodules were found from `.gitmodules`, so `cp evil.cfg
    lib/.git/config` ran the agent's program at the owner's `git status` at the top. Invariant: the gitlinks of
    the (protected) index are what count; refused, and the owner's status runs nothing."""
    workspace = demo.workspace
    make_repository(workspace)
    library_at(workspace / "lib")
    assert owners_git(workspace, "add", "lib").returncode == 0
    assert owners_git(workspace, "commit", "-q", "-m", "vendored").returncode == 0
    before = (workspace / "lib" / ".git" / "config").read_bytes()
    marker, copied = await copy_planted(demo, "lib/.git/config")
    assert copied["detail"]["exit_status"] != 0, copied["detail"]
    assert (workspace / "lib" / ".git" / "config").read_bytes() == before
    assert owners_git(workspace, "status", "--porcelain").returncode == 0
    assert not marker.exists(), "the owner's git status at the top ran the agent's program"


async def test_the_agents_gitmodules_changes_nothing_that_is_kept_from_it(demo: Demo) -> None:
    """Attack (found by review): `.gitmodules` is a file the agent writes, and the server read it at each start:
    256 entries of the agent's own before the owner's used up the cap, the next start left the owner's submodule
    writable, and made 256 folders the agent chose. Invariant: after the restart the submodule is still kept
    from the agent, the owner's status runs nothing, and no folder the agent named is made."""
    workspace = demo.workspace
    make_repository(workspace)
    library_at(workspace / "lib")
    assert owners_git(workspace, "add", "lib").returncode == 0
    (workspace / ".gitmodules").write_text('[submodule "lib"]\n\tpath = lib\n\turl = https://example.invalid/lib\n')
    assert owners_git(workspace, "add", ".gitmodules").returncode == 0
    assert owners_git(workspace, "commit", "-q", "-m", "submodule").returncode == 0
    marker = demo.outside / "ran-as-the-owner"
    junk = "".join(f'[submodule "j{i}"]\n\tpath = lib/j{i}\n' for i in range(300))
    async with demo.client() as client:
        assert (await call(client, "write_file", path=".gitmodules", content=junk))["ok"]
    async with demo.client() as client:  # the next start
        assert (await call(client, "write_file", path="evil.cfg", content=planted(marker)))["ok"]
        copied = await call(client, "run_command", command="cp evil.cfg lib/.git/config")
    assert copied["detail"]["exit_status"] != 0, copied["detail"]
    assert not any(name.startswith("j") for name in os.listdir(workspace / "lib"))
    assert owners_git(workspace, "status", "--porcelain").returncode == 0
    assert not marker.exists(), "the owner's git status at the top ran the agent's program"


@pytest.mark.parametrize("checked_out", [False, True], ids=["folder-missing", "folder-empty"])
async def test_a_submodule_folder_cannot_become_the_agents_repository(demo: Demo, checked_out: bool) -> None:
    """Attack (found by review): the owner's repository has a submodule not checked out; the agent makes its
    folder a repository of its own (`git init` there, a config naming core.fsmonitor), and the owner's `git
    status` at the top, whose `.git` is protected, ran a status in the submodule and so the agent's program.
    Invariant: the submodule's folder is an empty read-only one to the agent (made empty on the host when
    missing, as git makes it), and the owner's status runs nothing."""
    workspace = demo.workspace
    make_repository(workspace)
    library = demo.root / "library"
    library.mkdir()
    (library / "x").write_text("x\n")
    for args in (("init", "-q"), ("add", "x"), ("commit", "-q", "-m", "library")):
        assert owners_git(library, *args).returncode == 0
    head = owners_git(library, "rev-parse", "HEAD").stdout.strip()
    (workspace / ".gitmodules").write_text('[submodule "sub"]\n\tpath = sub\n\turl = https://example.invalid/lib\n')
    assert owners_git(workspace, "update-index", "--add", "--cacheinfo", f"160000,{head},sub").returncode == 0
    assert owners_git(workspace, "add", ".gitmodules").returncode == 0
    assert owners_git(workspace, "commit", "-q", "-m", "submodule").returncode == 0
    if checked_out:
        (workspace / "sub").mkdir()  # what a clone without --recurse-submodules leaves
    marker = demo.outside / "ran-as-the-owner"
    async with demo.client() as client:
        assert (await call(client, "write_file", path="evil.cfg", content=planted(marker)))["ok"]
        made = await call(client, "run_command", command="mkdir -p sub")
        attempts = [
            await call(client, "run_command", command="git init -q sub"),
            await call(client, "run_command", command="git init -q", cwd="sub"),
            await call(client, "run_command", command="cp evil.cfg sub/.git/config"),
        ]
        written = await call(client, "write_file", path="sub/.git/config", content=planted(marker))
    assert made["detail"]["exit_status"] == 0, made["detail"]  # the folder is there
    for attempt in attempts:  # refused (a cwd there), or failed: "Read-only file system"
        assert not attempt["ok"] or attempt["detail"]["exit_status"] != 0, attempt
    assert written["code"] == "POLICY_DENIED", written
    assert sorted(os.listdir(workspace / "sub")) == []
    assert owners_git(workspace, "status", "--porcelain").returncode == 0
    assert not marker.exists(), "the owner's git status at the top ran the agent's program"


async def test_a_git_link_is_said_at_start_and_stops_nothing(demo: Demo, caplog: pytest.LogCaptureFixture) -> None:
    """Attack (found by review): a `.git` that is a symbolic link (the owner's to `.repo`, or one an agent made where
    no repository was) cannot be bound over itself, so the agent could rename it and make its own. First it was
    left alone silently; then it stopped the start, which an agent's own link could do to the whole server.
    Invariant: the start says so in one error line naming the workspace, and serves; the file tools still refuse
    `.git`, and nothing of the owner's was written by the start."""
    workspace = demo.workspace
    make_repository(workspace)
    (workspace / ".git").rename(workspace / ".repo")
    os.symlink(".repo", workspace / ".git")
    before = metadata_of(workspace / ".repo")
    with caplog.at_level("ERROR", logger="bastion.workbench.repository"):
        async with demo.client() as client:
            written = await call(client, "write_file", path=".git/config", content="[core]\n")
            listed = await call(client, "list_directory")
    lines = [record.getMessage() for record in caplog.records if "symbolic link" in record.getMessage()]
    assert len(lines) == 1, lines
    assert "workspace default" in lines[0], lines
    assert written["code"] == "POLICY_DENIED", written
    assert listed["ok"], listed
    assert metadata_of(workspace / ".repo") == before


def metadata_of(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


async def test_a_submodule_listed_only_in_the_shared_index_of_a_split_index_is_kept_from_the_agent(
    demo: Demo,
) -> None:
    """Attack (found by review): the owner's repository uses a split index (`core.splitIndex = true`, or `git
    update-index --split-index`): `.git/index` holds a `link` extension and only the changed entries, the others, the
    gitlink `lib` among them, are in `.git/sharedindex.<sha>`. `_gitlinks` reads `.git/index` alone, finds no
    gitlink, and `lib/.git` is left writable: `cp evil.cfg lib/.git/config` ran the agent's program at the
    owner's `git status` at the top. Invariant: refused, config unchanged, the owner's status runs nothing."""
    workspace = demo.workspace
    make_repository(workspace)
    library_at(workspace / "lib")
    assert owners_git(workspace, "add", "lib").returncode == 0
    assert owners_git(workspace, "commit", "-q", "-m", "vendored").returncode == 0
    assert owners_git(workspace, "config", "core.splitIndex", "true").returncode == 0
    assert owners_git(workspace, "update-index", "--split-index").returncode == 0
    assert list((workspace / ".git").glob("sharedindex.*")), "git wrote no shared index"
    before = (workspace / "lib" / ".git" / "config").read_bytes()
    marker = demo.outside / "ran-as-the-owner"
    async with demo.client() as client:
        assert (await call(client, "write_file", path="evil.cfg", content=planted(marker)))["ok"]
        copied = await call(client, "run_command", command="cp evil.cfg lib/.git/config")
        written = await call(client, "write_file", path="lib/.git/hooks/x", content="#!/bin/sh\n")
    status = owners_git(workspace, "status", "--porcelain")
    assert not marker.exists(), "the owner's git status at the top ran the agent's program"
    assert copied["detail"]["exit_status"] != 0, copied["detail"]
    assert written["code"] == "POLICY_DENIED", written
    assert (workspace / "lib" / ".git" / "config").read_bytes() == before
    assert status.returncode == 0


async def test_the_git_file_of_the_owners_worktree_in_the_workspace_is_kept_from_the_agent(demo: Demo) -> None:
    """Attack (found by review): the owner keeps a linked worktree in the workspace (`git worktree add wt`):
    `wt/.git` is a file,
    `gitdir: <workspace>/.git/worktrees/wt`. Only the top `.git` is kept; the agent makes a repository of its
    own (`git init evil`, a config naming core.fsmonitor) and points `wt/.git` at it (write_file). The owner's
    next `git status` in their worktree ran the agent's program. Invariant: `wt/.git` is read-only to
    commands and refused to the file tools (as a submodule's `.git` is), and the owner's status runs nothing."""
    workspace = demo.workspace
    make_repository(workspace)
    assert owners_git(workspace, "worktree", "add", "-q", "wt").returncode == 0
    before = (workspace / "wt" / ".git").read_bytes()
    marker = demo.outside / "ran-as-the-owner"
    async with demo.client() as client:
        assert (await call(client, "write_file", path="evil.cfg", content=planted(marker)))["ok"]
        assert (await call(client, "write_file", path="evil.gitfile", content="gitdir: ../evil/.git\n"))["ok"]
        for command in ("git init -q evil", "cp evil.cfg evil/.git/config"):
            made = await call(client, "run_command", command=command)
            assert made["ok"], made
            assert made["detail"]["exit_status"] == 0, made["detail"]
        copied = await call(client, "run_command", command="cp evil.gitfile wt/.git")
        rewritten = await call(client, "write_file", path="wt/.git", content="gitdir: ../evil/.git\n")
    status = owners_git(workspace / "wt", "status", "--porcelain")
    assert not marker.exists(), "the owner's git status in their worktree ran the agent's program"
    assert rewritten["code"] == "POLICY_DENIED", rewritten
    assert copied["detail"]["exit_status"] != 0, copied["detail"]
    assert (workspace / "wt" / ".git").read_bytes() == before
    assert status.returncode == 0


async def test_a_submodule_of_the_repository_the_workspace_is_part_of_is_kept_from_the_agent(demo: Demo) -> None:
    """Attack (found by review): the workspace is a folder of the owner's repository (a package of a monorepo: git
    finds the
    repository by walking up from the folder), and holds one of its submodules, `lib` (a gitlink of the
    enclosing repository's index). The start looks only for `<workspace>/.git`, finds none, keeps nothing;
    `cp evil.cfg lib/.git/config` ran the agent's program at the owner's `git status`, in the workspace folder
    (the suite's own harm) and at the repository's top. Invariant: refused, the owner's status runs nothing."""
    workspace = demo.workspace
    top = demo.root  # the owner's repository; the workspace is its folder `workspace`
    (workspace / "README.md").write_text("a package of the owner's monorepo\n")
    for args in (("init", "-q"), ("add", "workspace/README.md"), ("commit", "-q", "-m", "first")):
        assert owners_git(top, *args).returncode == 0
    library_at(workspace / "lib")
    assert owners_git(top, "add", "workspace/lib").returncode == 0
    assert owners_git(top, "commit", "-q", "-m", "vendored").returncode == 0
    before = (workspace / "lib" / ".git" / "config").read_bytes()
    marker, copied = await copy_planted(demo, "lib/.git/config")
    status = owners_git(workspace, "status", "--porcelain")
    assert not marker.exists(), "the owner's git status in the workspace ran the agent's program"
    assert copied["detail"]["exit_status"] != 0, copied["detail"]
    assert (workspace / "lib" / ".git" / "config").read_bytes() == before
    assert status.returncode == 0


async def test_the_hooks_folder_the_owners_config_names_in_the_workspace_is_kept_from_the_agent(demo: Demo) -> None:
    """Attack: the owner's repository keeps its hooks in the workspace, as husky does (`core.hooksPath =
    .husky/_`); the agent rewrites the pre-commit hook (cp, write_file), and the owner's next `git commit` would
    run it as the owner. Invariant: the folder `core.hooksPath` names is read-only to commands and refused to the
    file tools; the owner's commit runs the owner's hook only."""
    workspace = demo.workspace
    make_repository(workspace)
    hooks = workspace / ".husky" / "_"
    hooks.mkdir(parents=True)
    (hooks / "pre-commit").write_text("#!/bin/sh\nexit 0\n")
    (hooks / "pre-commit").chmod(0o755)
    assert owners_git(workspace, "config", "core.hooksPath", ".husky/_").returncode == 0
    marker = demo.outside / "ran-as-the-owner"
    evil = f"#!/bin/sh\ntouch '{marker}'\n"
    async with demo.client() as client:
        assert (await call(client, "write_file", path="evil.sh", content=evil))["ok"]
        copied = await call(client, "run_command", command="cp evil.sh .husky/_/pre-commit")
        written = await call(client, "write_file", path=".husky/_/pre-commit", content=evil)
    assert copied["detail"]["exit_status"] != 0, copied["detail"]
    assert written["code"] == "POLICY_DENIED", written
    assert owners_git(workspace, "commit", "-q", "--allow-empty", "-m", "after the agent").returncode == 0
    assert not marker.exists(), "the owner's git commit ran the agent's hook"


def gitlink(workspace: Path, library: Path, path: str) -> None:
    """A submodule `path` in the owner's index (and .gitmodules), committed."""
    head = owners_git(library, "rev-parse", "HEAD").stdout.strip()
    (workspace / ".gitmodules").write_text(
        f'[submodule "{path}"]\n\tpath = {path}\n\turl = https://example.invalid/l\n'
    )
    assert owners_git(workspace, "update-index", "--add", "--cacheinfo", f"160000,{head},{path}").returncode == 0
    assert owners_git(workspace, "add", ".gitmodules").returncode == 0
    assert owners_git(workspace, "commit", "-q", "-m", "submodule").returncode == 0


async def test_the_folder_a_submodules_git_file_names_in_the_workspace_is_kept_from_the_agent(demo: Demo) -> None:
    """Attack (found by review): the owner's submodule `lib` has a `.git` file naming a folder of the workspace
    outside `.git/modules`
    (`gitdir: ../.lib-git`: `git clone --separate-git-dir`, or a layout kept from before absorbgitdirs). Only
    `lib/.git` (the file) is kept; the agent writes `.lib-git/config`, and the owner's `git status` at the top runs a
    status in `lib`, which reads that config. Invariant: refused, and the owner's status runs nothing."""
    workspace = demo.workspace
    make_repository(workspace)
    library_at(workspace / "lib")
    (workspace / "lib" / ".git").rename(workspace / ".lib-git")
    (workspace / "lib" / ".git").write_text("gitdir: ../.lib-git\n")
    assert owners_git(workspace / "lib", "config", "core.worktree", str(workspace / "lib")).returncode == 0
    assert owners_git(workspace / "lib", "status", "--porcelain").stdout == ""
    assert owners_git(workspace, "add", "lib").returncode == 0
    assert owners_git(workspace, "commit", "-q", "-m", "vendored").returncode == 0
    before = (workspace / ".lib-git" / "config").read_bytes()
    marker, copied = await copy_planted(demo, ".lib-git/config")
    status = owners_git(workspace, "status", "--porcelain")
    assert not marker.exists(), "the owner's git status at the top ran the agent's program"
    assert copied["detail"]["exit_status"] != 0, copied["detail"]
    assert (workspace / ".lib-git" / "config").read_bytes() == before
    assert status.returncode == 0


async def test_a_submodule_of_the_owners_worktree_in_the_workspace_is_kept_from_the_agent(demo: Demo) -> None:
    """Attack (found by review): the owner keeps a linked worktree in the workspace (`git worktree add wt`) of a
    repository with a
    submodule `sub`; `wt/sub` is an empty folder (a worktree's submodules are not checked out). Submodules are read
    from the main index only, not from the worktree's (`.git/worktrees/wt/index`), so `wt/sub` is the agent's: its
    `git init` there with core.fsmonitor runs at the owner's `git status` in wt. Invariant: runs nothing."""
    workspace = demo.workspace
    make_repository(workspace)
    library = demo.root / "library"
    library_at(library)
    gitlink(workspace, library, "sub")
    assert owners_git(workspace, "worktree", "add", "-q", "wt").returncode == 0
    assert (workspace / "wt" / "sub").is_dir()
    marker = demo.outside / "ran-as-the-owner"
    async with demo.client() as client:
        assert (await call(client, "write_file", path="evil.cfg", content=planted(marker)))["ok"]
        made = [
            await call(client, "run_command", command="git init -q wt/sub"),
            await call(client, "run_command", command="cp evil.cfg wt/sub/.git/config"),
        ]
    status = owners_git(workspace / "wt", "status", "--porcelain")
    assert not marker.exists(), f"the owner's git status in the worktree ran the agent's program ({made})"
    assert status.returncode == 0


def link_archive(links: dict[str, str]) -> str:
    """A tar (base64) of folders and symbolic links, as `tar -xpf` makes them."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, target in links.items():
            entry = tarfile.TarInfo(name)
            if target:
                entry.type, entry.linkname = tarfile.SYMTYPE, target
            else:
                entry.type, entry.mode = tarfile.DIRTYPE, 0o755
            archive.addfile(entry)
    return base64.b64encode(buffer.getvalue()).decode("ascii")

"""An agent opens a root-owned host workspace to every local user with policy-allowed commands.

The demo's host workspace is root's; a root server runs its commands as an id of their own that acts
as the folder's owner on disk (idmapped mount). ``mkdir -m 777`` and ``tar -xpf`` of an archive whose
``./`` is 0777 made root's folder 0777 (p5_world_writable_root.py); any local user could then rename
root's files in it, or plant a setuid file that kept the server from starting. Tried against a real
root server, real bubblewrap and the real MCP client; the local user is uid 65534 (``setpriv``).

What this does not prove: anything about group write (allowed: the folder's group is the
administrator's), or about a folder the host opened before the server started (refused at start:
tests/workbench/test_workspace.py).
"""

from __future__ import annotations

import base64
import io
import os
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.attacks.demo import Demo
from tests.helpers import call, create, refused_stdio_start, sh

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

LOCAL_USER = 65534
ADMIN_DATA = "admin data\n"


def open_archive() -> bytes:
    """A tar whose ``./`` and ``./open`` are 0777 and whose ``./open/note`` is 0666."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, mode in ((".", 0o777), ("./open", 0o777)):
            folder = tarfile.TarInfo(name)
            folder.type, folder.mode = tarfile.DIRTYPE, mode
            archive.addfile(folder)
        note = tarfile.TarInfo("./open/note")
        note.mode, note.size = 0o666, 3
        archive.addfile(note, io.BytesIO(b"hi\n"))
    return buffer.getvalue()


def others_may_write(folder: Path) -> list[str]:
    """The entries of `folder`, itself included, that other users may write, as seen from the host."""
    found = [folder, *folder.rglob("*")]
    return sorted(str(path.relative_to(folder)) for path in found if path.lstat().st_mode & stat.S_IWOTH)


def as_local_user(folder: Path, script: str) -> subprocess.CompletedProcess[str]:
    """Run `script` with sh as uid 65534 in `folder`, reached through an inherited fd: the folders above it
    are pytest's (0700), and the question is what any local user who can reach the folder may do in it."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        who = [f"--reuid={LOCAL_USER}", f"--regid={LOCAL_USER}", "--clear-groups"]
        argv = ["setpriv", *who, "sh", "-c", f"cd /proc/self/fd/{fd} && {script}"]
        return subprocess.run(argv, pass_fds=(fd,), capture_output=True, text=True, timeout=10, check=False)
    finally:
        os.close(fd)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="a root-owned host workspace is a root server's")
async def test_mkdir_and_tar_cannot_open_a_root_workspace_to_local_users(demo: Demo) -> None:
    """Attack (p5_world_writable_root.py): ``mkdir -m 777``, then ``tar -xpf`` of an uploaded archive whose
    ``./`` is 0777, in the root-owned demo workspace. Invariant: each tool reports that it cannot set the
    mode, neither the workspace folder nor anything in it becomes others' to write, and a local user can
    neither rename root's file there nor plant one; the file tools and the other commands still work."""
    workspace = demo.workspace
    assert workspace.stat().st_uid == 0
    (workspace / "important.txt").write_text(ADMIN_DATA)
    before = {p.name for p in workspace.iterdir()}
    archive = base64.b64encode(open_archive()).decode("ascii")
    async with demo.client() as client:
        mkdir = await call(client, "run_command", command="mkdir -m 777 open")
        uploaded = await call(client, "upload_file", path="open.tar", content_base64=archive)
        untar = await call(client, "run_command", command="tar -xpf open.tar")
        listed = await call(client, "run_command", command="stat -c '%a %n' . open open/note important.txt")
    assert mkdir["detail"]["exit_status"] != 0, mkdir
    assert "cannot change permissions" in mkdir["detail"]["stderr"], mkdir
    assert uploaded["ok"], uploaded
    assert untar["detail"]["exit_status"] != 0, untar
    assert "Cannot change mode to rwxrwxrwx: Operation not permitted" in untar["detail"]["stderr"], untar
    assert listed["detail"]["stdout"] == "755 .\n755 open\n644 open/note\n644 important.txt\n", listed
    assert others_may_write(workspace) == []
    assert (workspace / "open" / "note").read_text() == "hi\n"
    done = as_local_user(workspace, "echo planted > planted; mv important.txt moved; ls")
    assert done.stderr.count("Permission denied") == 2, done.stderr
    assert {p.name for p in workspace.iterdir()} == before | {"open", "open.tar"}
    assert (workspace / "important.txt").read_text() == ADMIN_DATA


async def test_agent_sandbox_may_still_chmod_777_its_own_workspace(demo: Demo) -> None:
    """Control: an agent sandbox's workspace is its own, no other user's to reach: ``chmod 777`` and
    ``umask 0`` keep working there, through the real tools."""
    async with demo.client() as client:
        box = await create(client)
        made = await sh(client, box, "mkdir d && chmod 777 d && umask 0 && mkdir e && stat -c '%a %n' d e")
    assert made["ok"], made
    assert made["detail"]["stdout"] == "777 d\n777 e\n", made


ESCAPING_NAME = "x\x1b]2;PWNED\x07\x1b[2J\x1b[Hy"
"""An OSC window title and a CSI clear-screen, as a file name."""


def link_archive(name: str, target: str) -> str:
    """A tar of one hard link member `name` to `target`, base64: no command line carries a control character."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        member = tarfile.TarInfo(name)
        member.type, member.linkname = tarfile.LNKTYPE, target
        archive.addfile(member)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="the setuid walk at start is a root server's")
async def test_the_start_refusal_shows_an_agents_file_name_escaped(demo: Demo) -> None:
    """Attack (found by attack, twenty-eighth session): the host leaves a setuid file in the workspace while the
    server runs (not covered, SECURITY.md); the agent gives it a name of terminal escapes (a hard link from a tar,
    then `mv` of the first name). At the next start the refusal printed that name raw on the administrator's
    terminal: its title set, its screen cleared. Invariant: the line names the file, its escapes written as text."""
    async with demo.client() as client:
        planted = demo.workspace / "tool"
        planted.write_bytes(b"#!/bin/true\n")
        planted.chmod(0o4755)  # the host's mistake, while the server runs; gone with the test's folder
        uploaded = await call(client, "upload_file", path="l.tar", content_base64=link_archive(ESCAPING_NAME, "tool"))
        assert uploaded["ok"], uploaded
        for command in ("tar -xf l.tar", "mkdir sub", "mv tool sub/tool"):
            done = await call(client, "run_command", command=command)
            assert done["ok"], done
            assert done["detail"]["exit_status"] == 0, done["detail"]
    assert (demo.workspace / ESCAPING_NAME).exists()
    (demo.workspace / "sub" / "tool").unlink()  # the same file's other name: the scan must meet the agent's
    line = refused_stdio_start(demo.config_path)
    assert "run with privileges" in line, line
    assert "\x1b" not in line, repr(line)
    assert "\x07" not in line, repr(line)
    assert "PWNED" in line, line

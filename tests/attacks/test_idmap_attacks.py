"""A local user reads a host workspace through the root server's state folder (its idmapped mount).

A host workspace kept in a private folder (``/home/alice``, 0700) is reached by its owner's path only.
A root server shows it to the workspace's sandbox through an idmapped mount under
``<state_dir>/idmap/``; the mount's root carries the workspace's own mode (usually 0755), and
the folders above it in the state folder are passable (0711) for the sandboxes' own ids. Tried
as an ordinary local user (``setpriv``, uid 12346) against a real root server, real bubblewrap
and the real MCP client.

What this does not prove: anything about a user who is root, or who shares the workspace's own id
(a gid of ``host_id_range``, which no account holds), or a server run as an ordinary user (which
makes no idmapped mounts).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import load_config
from bastion.workbench.workspace import IDMAP_DIR
from tests.helpers import call, demo_config_at

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.bwrap,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="idmapped mounts are a root server's: run as root"),
]

OWNER = 12345  # alice: owns the private folder and the workspace in it
NEIGHBOUR = 12346  # another local user
NOTE = "alice's private note\n"
# Ids of this test process's own, away from other test runs' servers (ids are not coordinated across servers).
HOST_ID_RANGE = f"{0x70000000 + 0x10000 * (1 + os.getpid() % 0x7FF)}:65536"


@pytest.fixture
def private_workspace(tmp_path: Path) -> tuple[Path, Path]:
    """The demo config, its workspace `home/proj` (0755, alice's) in a private `home` (0700, alice's)."""
    config_path = demo_config_at(tmp_path / "demo")
    home = tmp_path / "home"
    project = home / "proj"
    project.mkdir(parents=True)
    (project / "notes.txt").write_text(NOTE)
    for path, mode in ((home, 0o700), (project, 0o755), (project / "notes.txt", 0o644)):
        os.chown(path, OWNER, OWNER)
        os.chmod(path, mode)
    text = config_path.read_text()
    assert text.count('path = "workspace"\n') == 1, "the demo config no longer names its workspace so"
    text = text.replace('path = "workspace"\n', f"path = {json.dumps(str(project))}\n")
    text = text.replace("[sandboxes]\n", f"[sandboxes]\nhost_id_range = {HOST_ID_RANGE!r}\n", 1)
    config_path.write_text(text)
    return config_path, project


def as_neighbour(*argv: str) -> subprocess.CompletedProcess[str]:
    command = ["setpriv", f"--reuid={NEIGHBOUR}", f"--regid={NEIGHBOUR}", "--clear-groups", *argv]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def mount_points_under(folder: Path) -> list[str]:
    text = Path("/proc/self/mountinfo").read_text()
    points = [line.split()[4] for line in text.splitlines()]
    return [point for point in points if point == str(folder) or point.startswith(f"{folder}/")]


async def test_a_local_user_reads_a_private_workspace_through_the_state_folder(
    private_workspace: tuple[Path, Path],
) -> None:
    """Attack (idmap_leak.sh): a neighbour who may not read alice's workspace by its path (its parent
    is 0700) reads it through the root server's idmapped mount, at a path made of the state folder and
    the workspace's id. Invariant: every mount of the workspace under the state folder refuses the
    neighbour (Permission denied) although the folders above it are passable, while the workspace's
    commands and file tools still work (bwrap binds the mount as the workspace's own id), files they
    make are alice's, and nothing is left mounted after the server closes."""
    config_path, project = private_workspace
    config = load_config(config_path)
    idmap = config.state_dir / IDMAP_DIR
    direct = as_neighbour("cat", str(project / "notes.txt"))
    assert direct.returncode != 0
    assert "Permission denied" in direct.stderr, direct.stderr
    services = build_services(config)
    try:
        mounts = mount_points_under(idmap)
        assert len(mounts) == 1, mounts  # the workspace's idmapped mount
        assert as_neighbour("stat", str(idmap)).returncode == 0  # passable: the refusals below are the mount's folder's
        for argv in (["cat", f"{mounts[0]}/notes.txt"], ["ls", mounts[0]], ["stat", f"{mounts[0]}/notes.txt"]):
            done = as_neighbour(*argv)
            assert done.returncode != 0, (argv, done.stdout)
            assert "Permission denied" in done.stderr, (argv, done.stderr)
            assert NOTE.strip() not in done.stdout
        async with Client(build_server(services, caller="test")) as client:
            ran = await call(client, "run_command", command="cat notes.txt")
            assert ran["ok"], ran
            assert ran["detail"]["stdout"] == NOTE
            read = await call(client, "read_file", path="notes.txt")
            assert read["detail"]["content"] == NOTE, read
            written = await call(client, "write_file", path="made.txt", content="by the tool\n")
            assert written["ok"], written
            made = await call(client, "run_command", command="mkdir made-by-command")
            assert made["ok"], made
            listed = await call(client, "run_command", command="ls")
            assert listed["detail"]["stdout"] == "made-by-command\nmade.txt\nnotes.txt\n", listed
    finally:
        services.close()
    assert mount_points_under(idmap) == []
    for name in ("made.txt", "made-by-command"):
        info = (project / name).stat()
        assert (info.st_uid, info.st_gid) == (OWNER, OWNER), name
    assert (project / "notes.txt").read_text() == NOTE

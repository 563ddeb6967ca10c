"""A sandbox filling its /tmp and /dev/shm (issue 13), through the real tools on a real root server.

/tmp and /dev/shm are memory (tmpfs): before, /tmp had a size cap and no inode cap, and /dev/shm
neither, so an empty-file flood or a big /dev/shm file got the whole sandbox OOM-killed, answered
UNAVAILABLE, and lost its background processes, contexts and /tmp. Now each is a tmpfs of the
sandbox's own with both caps (ENOSPC inside), and an OOM kill names what held the memory.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from mcp import Client

from bastion.app import Services, build_services
from bastion.config import Config, load_config
from bastion.safety.errors import ConfigError
from tests.helpers import Payload, call, create, mounts_under, sh

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap, pytest.mark.root]

MIB = 1024 * 1024


@pytest.fixture
def services(demo_config: Config) -> Iterator[Services]:
    if os.geteuid() != 0:
        pytest.skip("a sandbox's own /tmp and /dev/shm are the server's tmpfs: root only")
    built = build_services(demo_config)
    yield built
    built.close()
    assert mounts_under(demo_config.state_dir) == []


def _stdout(result: Payload) -> str:
    return str(result["detail"]["stdout"])


async def test_empty_file_flood_in_tmp_is_enospc_and_the_sandbox_lives(client: Client, services: Services) -> None:
    box = await create(client)
    cap = services.config.sandboxes.scratch_inodes
    flood = "i=0; while true > /tmp/f$i; do i=$((i+1)); done 2>/dev/null; echo $i; true > /tmp/one-more"
    out = await sh(client, box, flood, timeout_s=120)
    assert out["ok"], out
    made = int(_stdout(out).split()[0])
    assert cap - 8 <= made < cap  # the root folder is one inode
    assert "No space left on device" in str(out["detail"]["stderr"])
    assert services.sandboxes.get(box).workspace.sandbox.oom_kills() == 0
    after = await sh(client, box, "ls /tmp | wc -l; echo alive")
    assert _stdout(after) == f"{made}\nalive\n"


@pytest.mark.parametrize("folder", ["/tmp", "/dev/shm"])
async def test_big_file_in_scratch_folder_is_enospc_at_its_cap(client: Client, services: Services, folder: str) -> None:
    box = await create(client)
    cap = services.config.sandboxes.tmp_bytes if folder == "/tmp" else services.config.sandboxes.shm_bytes
    out = await sh(client, box, f"head -c {cap + 32 * MIB} /dev/zero > {folder}/big; stat -c %s {folder}/big")
    assert "No space left on device" in str(out["detail"]["stderr"])
    assert int(_stdout(out)) <= cap
    assert services.sandboxes.get(box).workspace.sandbox.oom_kills() == 0
    assert _stdout(await sh(client, box, f"rm {folder}/big && echo freed")) == "freed\n"


async def test_scratch_folders_are_private_and_show_no_state_path(client: Client, services: Services) -> None:
    a, b = await create(client), await create(client)
    await sh(client, a, "echo a > /tmp/x; echo a > /dev/shm/x")
    seen = await sh(client, b, "cat /tmp/x /dev/shm/x 2>&1; grep -E ' /(tmp|dev/shm) ' /proc/self/mountinfo")
    text = _stdout(seen)
    assert text.count("No such file or directory") == 2
    assert str(services.config.state_dir) not in text
    assert "nosuid" in text
    assert "nodev" in text
    owner = await sh(client, b, "stat -c '%U %a' /tmp /dev/shm")
    assert _stdout(owner) == "sandbox 1777\nsandbox 1777\n"


async def test_memory_filled_by_tmpfs_kills_the_command_as_resource_limit_naming_it(
    client: Client, services: Services
) -> None:
    box = await create(client, limits={"memory_bytes": 160 * MIB})
    await sh(client, box, "head -c 60M /dev/zero > /tmp/fill; head -c 60M /dev/zero > /dev/shm/fill")
    hog = await sh(client, box, "python3 -c 'b = bytearray(200 * 2**20); b[::4096] = b\"x\" * len(b[::4096])'")
    assert hog["code"] == "RESOURCE_LIMIT"
    reason = str(hog["reason"])
    assert "ran out of memory" in reason
    assert "/tmp and /dev/shm" in reason
    held = int(reason.split(" held ")[1].split(" MiB")[0])
    assert 115 <= held <= 160
    kept = await sh(client, box, "stat -c %s /tmp/fill /dev/shm/fill")
    assert _stdout(kept) == f"{60 * MIB}\n{60 * MIB}\n"


async def test_tmpfs_fill_that_ends_the_whole_sandbox_is_resource_limit_and_keeps_the_files(
    client: Client, services: Services
) -> None:
    """The OOM killer takes the biggest process: with the memory held by tmpfs pages and only
    small commands running, that is the agent, and the sandbox ends. The call says why (not
    'sandbox ended'), and /tmp, /dev/shm and /workspace keep their files for the next command."""
    box = await create(client, limits={"memory_bytes": 120 * MIB})
    await sh(client, box, "echo kept > notes.txt; head -c 60M /dev/zero > /tmp/fill")
    out = await sh(client, box, "head -c 60M /dev/zero > /dev/shm/fill; head -c 60M /dev/zero | tail -c 1 >/dev/null")
    assert out["code"] == "RESOURCE_LIMIT", out
    assert "the kernel ended it" in str(out["reason"])
    assert "/tmp and /dev/shm" in str(out["reason"])
    again = await sh(client, box, "cat notes.txt; stat -c %s /tmp/fill")
    assert _stdout(again) == f"kept\n{60 * MIB}\n"


async def test_an_idle_sandbox_with_files_in_dev_shm_sleeps_and_keeps_them(client: Client, services: Services) -> None:
    box = await create(client)
    await sh(client, box, "echo in-shm > /dev/shm/x; echo in-tmp > /tmp/y")
    assert services.sandboxes.sleep_idle(0) == 1
    status = await call(client, "get_sandbox_status", sandbox_id=box)
    assert status["detail"]["state"] == "asleep"
    assert _stdout(await sh(client, box, "cat /dev/shm/x /tmp/y")) == "in-shm\nin-tmp\n"


async def test_closing_a_sandbox_unmounts_its_scratch_folders(client: Client, services: Services) -> None:
    box = await create(client)
    await sh(client, box, "echo x > /tmp/x")
    folder = Path(services.config.state_dir)
    assert any(box in mount for mount in mounts_under(folder))
    assert (await call(client, "close_sandbox", sandbox_id=box))["ok"]
    assert not any(box in mount for mount in mounts_under(folder))


def test_scratch_caps_larger_than_half_the_memory_limit_are_refused(demo_config_path: Path) -> None:
    text = demo_config_path.read_text()
    assert "tmp_bytes = 67108864" in text
    demo_config_path.write_text(text.replace("tmp_bytes = 67108864", f"tmp_bytes = {600 * MIB}", 1))
    with pytest.raises(ConfigError, match=r"at most half of limits\.memory_bytes"):
        load_config(demo_config_path)


async def test_a_local_user_cannot_reach_a_sandbox_scratch_folder_from_the_host(
    client: Client, services: Services
) -> None:
    """The server's tmpfs for a sandbox's /tmp is a host path: a neighbour on the host who knows or
    guesses the name (host workspaces' are ws-<id>) must not read or plant files through it."""
    box = await create(client)
    await sh(client, box, "echo private > /tmp/note; chmod 644 /tmp/note")
    assert services.devices is not None
    for name in (box, "ws-default"):
        folder = services.devices.path / name
        for argv in (["cat", f"{folder}/tmp/note"], ["touch", f"{folder}/tmp/planted"], ["ls", f"{folder}/dev/shm"]):
            done = subprocess.run(
                ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv],
                capture_output=True,
                text=True,
                check=False,
            )
            assert done.returncode != 0, argv
            assert "Permission denied" in done.stderr, (argv, done.stderr)
    assert _stdout(await sh(client, box, "ls /tmp")) == "note\n"


async def test_sandbox_id_cannot_rename_or_plant_in_its_device_folder_to_steer_root_unmounts(
    client: Client, services: Services
) -> None:
    """Attack: the sandbox's host id (a host workspace's may be a real local user's) renames its folder's
    dev/ and puts a link there, so that root's unmount of dev/pts and dev/shm at close follows it to the
    host's /dev/pts (or, while the folder is made, root's mount of a 1777 tmpfs lands on a folder of the
    attacker's choosing). Invariant: the folder is root's, passable by that id alone (an ACL): every
    change is refused, the id still reaches /tmp and /dev/shm (bwrap binds them as it), and closing the
    sandbox leaves no mount under it and the host's /dev/pts mounted."""
    box = await create(client)
    assert services.devices is not None
    folder = services.devices.path / box
    uid = (folder / "tmp").stat().st_uid  # the sandbox's id owns its /tmp
    assert uid != 0
    assert folder.stat().st_uid == 0
    as_id = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    attempts = (
        ["mv", f"{folder}/dev", f"{folder}/dev.x"],
        ["ln", "-s", "/dev", f"{folder}/planted"],
        ["mv", f"{folder}/tmp", f"{folder}/tmp.x"],
        ["mkdir", f"{folder}/dev/x"],
        ["ls", str(folder)],
    )
    for argv in attempts:
        done = subprocess.run([*as_id, *argv], capture_output=True, text=True, check=False)
        assert done.returncode != 0, argv
        assert "Permission denied" in done.stderr, (argv, done.stderr)
    for reachable in ("tmp", "dev/shm", "dev/pts"):
        reached = subprocess.run([*as_id, "stat", f"{folder}/{reachable}"], capture_output=True, check=False)
        assert reached.returncode == 0, (reachable, reached.stderr)
    await call(client, "close_sandbox", sandbox_id=box)
    assert mounts_under(folder) == []
    assert os.path.ismount("/dev/pts")


async def test_memory_filled_by_tmpfs_kills_a_python_context_as_resource_limit_naming_it(
    client: Client, services: Services
) -> None:
    box = await create(client, limits={"memory_bytes": 160 * MIB})
    await sh(client, box, "head -c 60M /dev/zero > /tmp/fill; head -c 60M /dev/zero > /dev/shm/fill")
    hog = await call(client, "execute_code", code="b = bytearray(200 * 2**20)", sandbox_id=box)
    assert hog["code"] == "RESOURCE_LIMIT"
    assert "/tmp and /dev/shm" in str(hog["reason"])
    assert "restart=true" in str(hog["reason"])
    again = await call(client, "execute_code", code="1 + 1", sandbox_id=box, restart=True)
    assert again["detail"]["value"] == "2"

"""The sandbox manager on a full state filesystem and across a kill -9, through the real server and tools.

Each test is an attack found against a real root server: a create on a full state filesystem answered
INTERNAL_ERROR with a traceback in the log; a kill -9 during restore_sandbox made the half-restored
sandbox a `recovered` snapshot at the next start; a kill -9 between a recovery snapshot and the removal
of the crashed sandbox's folder made a second `recovered` snapshot of the same sandbox at the next start.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from mcp import Client

from bastion.app import build_services
from bastion.config import load_config
from bastion.safety.audit import verify
from bastion.sandbox.cgroups import CgroupLayout, Limits
from bastion.workbench.manager import RESTORING_MARKER
from tests.attacks.demo import configure, detail, serve
from tests.attacks.test_snapshot_attacks import small_ext4
from tests.helpers import call, create, mounts_under, sh
from tests.load.fault_server import Load, Served, fault_config, internal_errors, loops_under, unmount_all, until

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

MIB = 1024 * 1024
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="mounts filesystems and sandbox disks (root only)")


def use_every_inode(folder: Path) -> int:
    """Create empty files in `folder` until its filesystem has no inode left; how many were made."""
    made = 0
    while True:
        try:
            (folder / f"f{made}").touch()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return made
        made += 1


def use_every_block(folder: Path) -> int:
    """Write a file in `folder` until its filesystem has no block left (a MiB at a time, then a block at a
    time); how many bytes were written."""
    written = 0
    fd = os.open(folder / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (MIB, 4096):
            with contextlib.suppress(OSError):
                while True:
                    written += os.write(fd, bytes(size))
        os.fsync(fd)
    finally:
        os.close(fd)
    return written


@pytest.mark.root
@ROOT_ONLY
@pytest.mark.parametrize("fill", [use_every_inode, use_every_block], ids=["inodes", "blocks"])
async def test_create_sandbox_on_a_full_state_filesystem_is_resource_limit(
    tmp_path: Path, fill: Callable[[Path], int]
) -> None:
    """Attack: with the state filesystem full (out of inodes, or of blocks: another writer took them),
    create_sandbox failed making the sandbox's folder and answered INTERNAL_ERROR, its traceback in the log;
    failing to copy the sandbox's disk image, it answered UNAVAILABLE.

    Invariant: RESOURCE_LIMIT naming the state filesystem and no host path; nothing of the refused sandbox
    is left (folder, host id); the sandbox open before still runs; once room is freed a create works.
    """
    config_path = configure(tmp_path / "demo")
    state = tmp_path / "demo" / "state"
    with small_ext4(state, 64 * MIB, "-N", "1024"):
        async with serve(config_path) as (client, services):
            first = await create(client)
            filler = state / "filler"
            filler.mkdir()
            assert fill(filler) > 0
            held = services.sandboxes._identities.in_use()

            refused = await call(client, "create_sandbox")
            assert refused["code"] == "RESOURCE_LIMIT", refused
            assert "state filesystem is full" in str(refused["reason"])
            assert str(state) not in json.dumps(refused)
            on_disk = [name for name in os.listdir(services.config.sandboxes_dir) if name.startswith("sb-")]
            assert on_disk == [first]
            assert services.sandboxes._identities.in_use() == held
            assert detail(await sh(client, first, "echo still here"))["stdout"] == "still here\n"

            for name in os.listdir(filler):
                (filler / name).unlink()
            again = await create(client)
            assert (await call(client, "close_sandbox", sandbox_id=again))["ok"]
        verified = verify(services.config.audit_path)
        assert verified.ok, verified
    assert mounts_under(state) == []


def files_in_sandboxes(sandboxes: Path) -> dict[str, int]:
    """How many entries each sandbox's workspace holds now (a warm-pool sandbox's: 0)."""
    found = {}
    for name in os.listdir(sandboxes):
        if name.startswith("sb-"):
            with contextlib.suppress(OSError):  # made or removed meanwhile
                found[name] = len([e for e in os.listdir(sandboxes / name / "workspace") if e != "lost+found"])
    return found


@pytest.mark.root
@ROOT_ONLY
async def test_kill_9_during_a_restore_leaves_no_recovered_snapshot_of_the_half_restored_sandbox(
    tmp_path: Path,
) -> None:
    """Attack: kill -9 of the server while restore_sandbox writes 150 files; at the next start, crash
    recovery kept the half-restored workspace as a `recovered` snapshot, listed beside the real one as
    if it were work the agent had lost.

    Invariant: the next start deletes the half-restored sandbox (its folder, mount and loop device)
    without a snapshot; the snapshot it came from is kept and restores whole. The kill lands once the
    new sandbox holds some of the files and not all (a bounded wait on that condition).
    """
    root = tmp_path / "demo"
    server = Served(fault_config(root))
    sandboxes = root / "state" / "sandboxes"
    files = 150
    server.start()
    try:
        load = Load(server.mcp_url)
        async with load.session() as client:
            source = (await load.call(client, "create_sandbox"))["detail"]["sandbox_id"]
            filled = await load.call(
                client,
                "run_command",
                sandbox_id=source,
                timeout_s=120,
                # A quarter MiB each: the restore still takes far longer than the 20 ms poll that catches it.
                command=f"for i in $(seq 1 {files - 1}); do head -c {MIB // 4} /dev/urandom > f$i.bin; done; "
                "echo last > zz_last.txt; ls | wc -l",
            )
            assert filled["detail"]["stdout"] == f"{files}\n", filled
            snap = await load.call(client, "snapshot_sandbox", sandbox_id=source, label="good")
            snapshot_id = snap["detail"]["snapshot_id"]
            assert (await load.call(client, "close_sandbox", sandbox_id=source))["ok"]

        async def restore(load: Load, client: Client, _: int) -> None:
            await load.call(client, "restore_sandbox", snapshot_id=snapshot_id)

        caught: list[tuple[str, int]] = []

        def half_restored() -> bool:
            caught.extend((name, n) for name, n in files_in_sandboxes(sandboxes).items() if 3 <= n < files - 3)
            return bool(caught)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(load.run, 1, restore)
            await until(half_restored, timeout_s=60, what="a restore half done")
            server.signal(signal.SIGKILL)
        assert server.wait() == -signal.SIGKILL
        target = caught[0][0]
        assert (sandboxes / target / RESTORING_MARKER).exists()  # the state the kill left

        server.start()
        async with load.session() as client:
            listed = (await load.call(client, "list_snapshots"))["detail"]["snapshots"]
            assert [(s["snapshot_id"], s["recovered"]) for s in listed] == [(snapshot_id, False)], listed
            assert not (sandboxes / target).exists()
            assert mounts_under(sandboxes / target) == []
            assert loops_under(sandboxes / target) == []
            again = await load.call(client, "restore_sandbox", snapshot_id=snapshot_id)
            assert again["ok"], again
            box = again["detail"]["sandbox_id"]
            assert not (sandboxes / box / RESTORING_MARKER).exists()
            counted = await load.call(client, "run_command", sandbox_id=box, command="ls | wc -l; cat zz_last.txt")
            assert counted["detail"]["stdout"] == f"{files}\nlast\n", counted
        server.signal(signal.SIGTERM)
        assert server.wait() == 0, server.log()
    finally:
        server.stop()
        unmount_all(tmp_path)
    for started in (1, 2):
        assert internal_errors((root / f"server-{started}.log").read_text()) == []


def test_a_kill_between_a_recovery_snapshot_and_the_folders_removal_makes_no_second_snapshot(
    demo_config_path: Path,
) -> None:
    """Attack: kill -9 of a starting server after its recovery snapshot of a crashed sandbox and before
    it removed that sandbox's folder; the next start snapshotted the folder again: two `recovered`
    snapshots of one sandbox, each kept for orphan_retention_s.

    The state the kill leaves is built with the real recovery: a first start recovers the crashed
    workspace (its snapshot, then the folder's removal), and the folder is put back as it was.
    Invariant: the next start removes the folder and keeps the one snapshot, which restores the work.
    """
    config = load_config(demo_config_path)
    orphan = config.sandboxes_dir / "sb-0123456789ab"
    (orphan / "workspace").mkdir(parents=True)
    (orphan / "workspace" / "work.txt").write_text("only copy\n")
    kept = demo_config_path.parent / "kept-copy"
    shutil.copytree(orphan, kept, symlinks=True)
    services = build_services(config)
    try:
        (first,) = services.sandboxes.snapshots()
    finally:
        services.close()
    assert not orphan.exists()
    shutil.copytree(kept, orphan, symlinks=True)  # the folder a kill before its removal leaves

    services = build_services(config)
    try:
        assert [s.id for s in services.sandboxes.snapshots()] == [first.id]
        assert first.metadata["sandbox_id"] == "sb-0123456789ab"
    finally:
        services.close()
    assert not orphan.exists()


@pytest.mark.root
@ROOT_ONLY
async def test_a_second_server_in_the_same_process_leaves_the_first_ones_sandboxes_alone(tmp_path: Path) -> None:
    """Found by review: recovery took every group bearing this process's pid for a dead predecessor's (a
    restarted pid 1), so a second server built in the same process (as the tests build theirs) destroyed the
    first one's live sandbox groups. A group is a dead server's only if it is older than its owner."""
    async with serve(configure(tmp_path / "one")) as (first, _):
        box = await create(first)
        assert detail(await sh(first, box, "echo started"))["stdout"] == "started\n"
        groups = own_groups()
        assert groups  # the sandbox's, in every hierarchy
        async with serve(configure(tmp_path / "two")) as (second, _):
            assert own_groups() >= groups  # not taken for a dead server's and destroyed
            assert detail(await sh(first, box, "echo still here"))["stdout"] == "still here\n"
            other = await create(second)
            assert detail(await sh(second, other, "echo here too"))["stdout"] == "here too\n"
        assert detail(await sh(first, box, "echo and after"))["stdout"] == "and after\n"


def own_groups() -> set[str]:
    """The sandbox groups bearing this process's pid, in every hierarchy."""
    pattern = f"bastion/sb-{os.getpid()}-*"
    return {*glob.glob(f"/sys/fs/cgroup/{pattern}"), *glob.glob(f"/sys/fs/cgroup/*/{pattern}")}


@pytest.mark.root
@ROOT_ONLY
async def test_a_server_on_a_copy_of_another_state_folder_leaves_its_sandboxes_alone(tmp_path: Path) -> None:
    """Found by review: the cgroup owner token was whatever the state folder's file said, so a server started
    on a copy of another's state folder (a backup restored beside it, a cloned instance) took that server's
    token and destroyed its live groups. The token is kept with its folder's device and inode."""
    async with serve(configure(tmp_path / "one")) as (first, services):
        box = await create(first)
        assert detail(await sh(first, box, "echo started"))["stdout"] == "started\n"
        groups = own_groups()
        assert groups
        copy = configure(tmp_path / "copy")
        shutil.copy(services.config.state_dir / "cgroup-owner", copy.parent / "state" / "cgroup-owner")
        async with serve(copy) as (second, _):
            assert own_groups() >= groups
            other = await create(second)
            assert detail(await sh(second, other, "echo here too"))["stdout"] == "here too\n"
        assert detail(await sh(first, box, "echo still here"))["stdout"] == "still here\n"


@pytest.mark.root
@ROOT_ONLY
async def test_a_tokenless_group_holding_a_process_is_never_taken_for_a_dead_servers(tmp_path: Path) -> None:
    """Found by review: a group named by a pid this server cannot see (a server of another pid namespace, the
    doctor's trial sandbox there) was destroyed with the processes in it. A group holding a process is in use."""
    layout = CgroupLayout.detect()
    gone = 2**22 - 7  # above any pid this kernel hands out (pid_max is at most 2**22)
    name = f"sb-{gone}-1"
    group = layout.create(name, Limits(memory_bytes=None, pids=None, cpu_cores=None))
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        group.attach(sleeper.pid)
        async with serve(configure(tmp_path / "demo")):
            assert name in layout.existing()
            assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
        group.destroy()

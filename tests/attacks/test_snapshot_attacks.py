"""Snapshots that fill the state folder, and restores that inflate (issue 13), through the real tools.

Before: snapshots had no count or size cap and no tool deleted them, so a few dozen calls filled
the state folder, which holds the audit log, and stopped the server (the audit fails closed);
agent snapshots never expired; a restore wrote a sparse file's holes as real blocks. Now every
snapshot is within caps (count and archive bytes, per sandbox and in total), snapshots and
restores leave `state_reserve_bytes` free on the state filesystem, `delete_snapshot` frees room,
agent snapshots expire after `snapshot_retention_s`, and holes stay holes.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.app import Services
from bastion.config import load_config
from bastion.safety.audit import verify
from tests.attacks.demo import configure, detail, serve
from tests.helpers import call, create, mounts_under, sh

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

MIB = 1024 * 1024
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a filesystem (root only)")


@contextlib.contextmanager
def small_ext4(mountpoint: Path, size_bytes: int, *mkfs_options: str) -> Iterator[Path]:
    """A real, small ext4 filesystem loop-mounted at `mountpoint`; unmounted (and its loop device freed) after.

    `mkfs_options` go to mkfs.ext4 (``-b 4096``: the block size of a larger one; ``-N 512``: few inodes).
    """
    image = mountpoint.parent / f"{mountpoint.name}.ext4"
    with image.open("wb") as stream:
        stream.truncate(size_bytes)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", *mkfs_options, str(image)], check=True, capture_output=True)
    mountpoint.mkdir(exist_ok=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mountpoint)], check=True, capture_output=True)
    try:
        yield mountpoint
    finally:
        if subprocess.run(["umount", str(mountpoint)], check=False, capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mountpoint)], check=False, capture_output=True)
        # mount -o loop sets autoclear: the device goes with the unmount. Make sure, never leave one behind.
        listed = subprocess.run(["losetup", "-j", str(image)], check=False, capture_output=True, text=True).stdout
        for line in listed.splitlines():
            subprocess.run(["losetup", "-d", line.split(":", 1)[0]], check=False, capture_output=True)
        image.unlink()


def free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def snapshot_files(services: Services) -> list[str]:
    folder = services.config.state_dir / "snapshots"
    return sorted(os.listdir(folder)) if folder.is_dir() else []


@pytest.mark.root
@ROOT_ONLY
async def test_snapshot_flood_fills_state_folder_refused(tmp_path: Path) -> None:
    """Invariant: snapshots and restores stop at the reserve; the audit log still appends; nothing half-written stays.

    The state folder is a real 128 MiB ext4; the sandbox holds incompressible data sized so
    that one snapshot fits above the reserve and a second would not.
    Does not prove: the reserve against other writers (a sandbox filling its own disk image).
    """
    reserve = 24 * MIB
    config_path = configure(tmp_path / "demo", state_reserve_bytes=reserve, max_snapshots_per_sandbox=100)
    config_path.write_text(config_path.read_text().replace("disk_bytes = 2147483648", f"disk_bytes = {64 * MIB}"))
    state = tmp_path / "demo" / "state"
    with small_ext4(state, 128 * MIB):
        async with serve(config_path) as (client, services):
            box = await create(client)
            os.sync()
            blob = (free_bytes(state) - reserve) * 2 // 5
            made = await sh(client, box, f"head -c {blob} /dev/urandom > blob && sha256sum blob", timeout_s=60)
            assert made["ok"], made
            os.sync()  # the sandbox's blocks reach its disk image on the state filesystem

            first = await call(client, "snapshot_sandbox", sandbox_id=box)
            assert first["ok"], first
            kept = str(detail(first)["snapshot_id"])
            second = await call(client, "snapshot_sandbox", sandbox_id=box)
            assert second["code"] == "RESOURCE_LIMIT", second
            assert "state_reserve_bytes" in str(second["reason"])
            assert "delete_snapshot" in str(second["reason"])
            assert snapshot_files(services) == sorted([f"{kept}.json", f"{kept}.tar.gz"])

            restored = await call(client, "restore_sandbox", snapshot_id=kept)
            assert restored["code"] == "RESOURCE_LIMIT", restored
            assert "state_reserve_bytes" in str(restored["reason"])
            listed = await call(client, "list_sandboxes")
            assert [s["sandbox_id"] for s in detail(listed)["sandboxes"]] == [box]
            folders = [name for name in os.listdir(services.config.sandboxes_dir) if name.startswith("sb-")]
            assert folders == [box]  # the sandbox made for the refused restore is gone
            os.sync()
            assert free_bytes(state) >= reserve

            # The audit log still appends: a command runs and is recorded, and the chain verifies.
            after = await sh(client, box, "sha256sum blob")
            assert after["ok"], after
            assert detail(after)["stdout"] == detail(made)["stdout"]
            deleted = await call(client, "delete_snapshot", snapshot_id=kept)
            assert deleted["ok"], deleted
            again = await call(client, "snapshot_sandbox", sandbox_id=box)
            assert again["ok"], again
        verified = verify(services.config.audit_path)
        assert verified.ok, verified
        records = [json.loads(line) for line in services.config.audit_path.read_text().splitlines()]
        refused = [r for r in records if r.get("tool") == "snapshot_sandbox" and r.get("code") == "RESOURCE_LIMIT"]
        assert refused
        assert mounts_under(state) == [str(state)]  # the sandbox's disks and device folder are gone
    assert mounts_under(state) == []


async def test_snapshot_count_cap_per_sandbox_and_total_through_the_tools(tmp_path: Path) -> None:
    """Per source sandbox, then in total: RESOURCE_LIMIT naming the cap and delete_snapshot; nothing written."""
    config_path = configure(tmp_path / "demo", max_snapshots=3, max_snapshots_per_sandbox=2)
    async with serve(config_path) as (client, services):
        a, b = await create(client), await create(client)
        await sh(client, a, "echo a > f")
        await sh(client, b, "echo b > f")
        taken = [await call(client, "snapshot_sandbox", sandbox_id=a) for _ in range(2)]
        assert all(result["ok"] for result in taken)
        third = await call(client, "snapshot_sandbox", sandbox_id=a)
        assert third["code"] == "RESOURCE_LIMIT"
        assert "max_snapshots_per_sandbox" in str(third["reason"])
        assert "delete_snapshot" in str(third["reason"])
        assert (await call(client, "snapshot_sandbox", sandbox_id=b))["ok"]
        files = snapshot_files(services)
        total = await call(client, "snapshot_sandbox", sandbox_id=b)
        assert total["code"] == "RESOURCE_LIMIT"
        assert "max_snapshots = 3" in str(total["reason"])
        assert snapshot_files(services) == files
        # Closing the sandbox frees nothing (snapshots outlive it); deleting one does.
        await call(client, "close_sandbox", sandbox_id=a)
        assert (await call(client, "snapshot_sandbox", sandbox_id=b))["code"] == "RESOURCE_LIMIT"
        oldest = str(detail(taken[0])["snapshot_id"])
        assert (await call(client, "delete_snapshot", snapshot_id=oldest))["ok"]
        assert (await call(client, "snapshot_sandbox", sandbox_id=b))["ok"]


async def test_delete_snapshot_frees_its_files_and_refuses_unknown_ids(tmp_path: Path) -> None:
    async with serve(configure(tmp_path / "demo")) as (client, services):
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        hints = tools["delete_snapshot"].annotations
        assert hints is not None
        assert (hints.destructive_hint, hints.idempotent_hint, hints.read_only_hint) == (True, True, False)
        box = await create(client)
        await sh(client, box, "echo keep > f")
        snapshot_id = str(detail(await call(client, "snapshot_sandbox", sandbox_id=box))["snapshot_id"])
        assert snapshot_files(services) == sorted([f"{snapshot_id}.json", f"{snapshot_id}.tar.gz"])

        deleted = await call(client, "delete_snapshot", snapshot_id=snapshot_id)
        assert deleted["ok"]
        assert snapshot_files(services) == []
        assert detail(await call(client, "list_snapshots"))["snapshots"] == []
        twice = await call(client, "delete_snapshot", snapshot_id=snapshot_id)
        assert twice["code"] == "NOT_FOUND"
        bad = await call(client, "delete_snapshot", snapshot_id="../../audit")
        assert bad["code"] == "INVALID_REQUEST"
        assert (await call(client, "restore_sandbox", snapshot_id=snapshot_id))["code"] == "NOT_FOUND"
        # The sandbox it was taken from is untouched.
        assert detail(await sh(client, box, "cat f"))["stdout"] == "keep\n"
    records = [json.loads(line) for line in services.config.audit_path.read_text().splitlines()]
    ends = [r["code"] for r in records if r.get("tool") == "delete_snapshot" and r.get("event") == "end"]
    assert ends == ["OK", "NOT_FOUND", "INVALID_REQUEST"]


def age(services: Services, snapshot_id: str, seconds: float) -> None:
    """Make a snapshot look `seconds` old (its record is where its age is kept: on the wall clock and, within the
    boot it was taken in, on the boot's clock)."""
    path = services.config.state_dir / "snapshots" / f"{snapshot_id}.json"
    record = json.loads(path.read_text())
    record["created"] = time.time() - seconds
    record["boot_time"] = time.clock_gettime(time.CLOCK_BOOTTIME) - seconds
    path.write_text(json.dumps(record))


async def test_agent_snapshot_retention_expires_at_reap_and_at_start(tmp_path: Path) -> None:
    """Agent snapshots older than snapshot_retention_s go at the next reap and at start; younger ones stay."""
    config_path = configure(tmp_path / "demo", snapshot_retention_s=3600)
    async with serve(config_path) as (client, services):
        box = await create(client)
        await sh(client, box, "echo x > f")
        ids = [str(detail(await call(client, "snapshot_sandbox", sandbox_id=box))["snapshot_id"]) for _ in range(3)]
        listed = detail(await call(client, "list_snapshots"))["snapshots"]
        assert all(s["expires"] > time.time() + 3500 for s in listed)
        age(services, ids[0], 7200)
        await services.sandboxes.reap()
        remaining = [s["snapshot_id"] for s in detail(await call(client, "list_snapshots"))["snapshots"]]
        assert remaining == ids[1:]
        assert f"{ids[0]}.tar.gz" not in snapshot_files(services)
        age(services, ids[1], 7200)
    async with serve(config_path) as (client, services):
        remaining = [s["snapshot_id"] for s in detail(await call(client, "list_snapshots"))["snapshots"]]
        assert remaining == ids[2:]
        assert snapshot_files(services) == sorted([f"{ids[2]}.json", f"{ids[2]}.tar.gz"])


async def test_an_agent_snapshot_outlives_a_step_of_the_wall_clock_forward(tmp_path: Path) -> None:
    """Found by attack (wall-clock jumps, a real server under a clock shim): a host that booted with its clock a
    month behind (no RTC, before NTP) stamped an agent's fresh snapshot in the past; the sync's step forward had
    the next reap delete it, the closed sandbox's only copy. Invariant: within the boot it was taken in, a
    snapshot is young while the boot's clock says so, at the next reap and at the next start."""
    config_path = configure(tmp_path / "demo", snapshot_retention_s=3600)
    async with serve(config_path) as (client, services):
        box = await create(client)
        await sh(client, box, "echo only copy > f")
        snapshot = str(detail(await call(client, "snapshot_sandbox", sandbox_id=box))["snapshot_id"])
        assert (await call(client, "close_sandbox", sandbox_id=box))["ok"]
        path = services.config.state_dir / "snapshots" / f"{snapshot}.json"
        record = json.loads(path.read_text())
        record["created"] -= 30 * 86_400  # stamped a month back: the clock has stepped forward since
        path.write_text(json.dumps(record))
        await services.sandboxes.reap()
        listed = [s["snapshot_id"] for s in detail(await call(client, "list_snapshots"))["snapshots"]]
        assert listed == [snapshot]
    async with serve(config_path) as (client, _):
        listed = [s["snapshot_id"] for s in detail(await call(client, "list_snapshots"))["snapshots"]]
        assert listed == [snapshot]


@pytest.mark.root
@ROOT_ONLY
async def test_restore_sparse_file_stays_sparse_in_a_sandbox(tmp_path: Path) -> None:
    """A 1.5 GiB file of holes in a sandbox's disk comes back in a new sandbox with its holes (st_blocks).

    Before, the restore wrote 1.5 GiB of zeros: more than the sandbox's 2 GiB disk can hold twice.
    Does not prove: every byte (the unit test compares the files' data runs); here, the data and the size.
    """
    probe = "dd if=disk.img bs=4 skip=26214400 count=1 2>/dev/null; echo; stat -c '%s %b' disk.img"
    async with serve(configure(tmp_path / "demo")) as (client, _):
        box = await create(client)
        made = await sh(
            client,
            box,
            f"truncate -s 1536M disk.img && printf data | dd of=disk.img bs=4 seek=26214400 conv=notrunc 2>/dev/null"
            f" && {probe}",
        )
        assert made["ok"], made
        snap = await call(client, "snapshot_sandbox", sandbox_id=box)
        assert snap["ok"], snap
        assert int(str(detail(snap)["archive_bytes"])) < MIB
        restored = await call(client, "restore_sandbox", snapshot_id=str(detail(snap)["snapshot_id"]))
        assert restored["ok"], restored
        new_box = str(detail(restored)["sandbox_id"])
        after = await sh(client, new_box, probe)
        data, sizes = str(detail(after)["stdout"]).splitlines()
        assert data == "data"
        size, blocks = (int(n) for n in sizes.split())
        assert size == 1536 * MIB
        assert blocks * 512 < MIB
        status = await call(client, "get_sandbox_status", sandbox_id=new_box)
        assert detail(status)["usage"]["disk_bytes"] < 64 * MIB


async def test_recovery_keeps_a_crashed_workspace_rather_than_eat_the_reserve(tmp_path: Path) -> None:
    """A crashed server's workspace whose snapshot would go below the reserve is kept as it is, and the server starts.

    Before, recovery snapshotted whatever it found, whatever the free space (and an error there
    stopped the start). A reserve larger than any disk stands in for a full state filesystem.
    """
    config_path = configure(tmp_path / "demo", state_reserve_bytes=2**60)
    config = load_config(config_path)
    orphan = config.sandboxes_dir / "sb-0123456789ab" / "workspace"
    orphan.mkdir(parents=True)
    (orphan / "work.txt").write_text("unsaved work\n")
    async with serve(config_path) as (client, services):
        assert (orphan / "work.txt").read_text() == "unsaved work\n"
        assert snapshot_files(services) == []
        assert detail(await call(client, "list_snapshots"))["snapshots"] == []
    config_path.write_text(config_path.read_text().replace(f"state_reserve_bytes = {2**60}\n", ""))
    async with serve(config_path) as (client, services):
        listed = detail(await call(client, "list_snapshots"))["snapshots"]
        assert [(s["label"], s["recovered"]) for s in listed] == [("recovered", True)]
        assert not orphan.parent.exists()


@pytest.mark.root
@ROOT_ONLY
async def test_restores_of_a_snapshot_of_empty_folders_stop_at_the_reserve(tmp_path: Path) -> None:
    """Attack: a snapshot of 10,000 empty folders (a few hundred KB, no file data) restored again and
    again. Each restore wrote a block and an inode per folder into its sandbox's disk image on the state
    filesystem, unchecked (the reserve check counted file data and files only), and answered OK until
    the state filesystem was full; then every create and restore failed with INTERNAL_ERROR.

    Invariant: every restore that answers OK leaves state_reserve_bytes free (measured after a sync);
    the first that would not is refused with RESOURCE_LIMIT naming it, its sandbox removed; the
    sandboxes restored before keep all their folders and still take writes; the audit chain verifies.
    The state folder is a real 320 MiB ext4. Does not prove: the bound against other writers.
    """
    reserve = 64 * MIB
    folders = 10_000
    config_path = configure(tmp_path / "demo", state_reserve_bytes=reserve, max_snapshots_per_sandbox=100)
    config_path.write_text(config_path.read_text().replace("disk_bytes = 2147483648", f"disk_bytes = {1024 * MIB}"))
    state = tmp_path / "demo" / "state"
    with small_ext4(state, 320 * MIB, "-b", "4096"):
        async with serve(config_path) as (client, services):
            source = await create(client)
            made = await sh(
                client,
                source,
                f"python3 -c \"import os\nfor i in range({folders}): os.mkdir('d%05d' % i)\" && ls | wc -l",
                timeout_s=120,
            )
            assert detail(made)["stdout"] == f"{folders}\n", made
            snap = await call(client, "snapshot_sandbox", sandbox_id=source)
            assert snap["ok"], snap
            snapshot_id = str(detail(snap)["snapshot_id"])
            assert (await call(client, "close_sandbox", sandbox_id=source))["ok"]

            restored: list[str] = []
            refused = None
            for _ in range(8):
                answer = await call(client, "restore_sandbox", snapshot_id=snapshot_id)
                os.sync()
                if not answer["ok"]:
                    refused = answer
                    break
                restored.append(str(detail(answer)["sandbox_id"]))
                assert free_bytes(state) >= reserve, (len(restored), free_bytes(state))
            assert refused is not None, "no restore was refused"
            assert refused["code"] == "RESOURCE_LIMIT", refused
            assert "state_reserve_bytes" in str(refused["reason"])
            assert restored, "the first restore had room and was refused"
            listed = await call(client, "list_sandboxes")
            assert sorted(s["sandbox_id"] for s in detail(listed)["sandboxes"]) == sorted(restored)
            on_disk = [name for name in os.listdir(services.config.sandboxes_dir) if name.startswith("sb-")]
            assert sorted(on_disk) == sorted(restored)  # the refused restore's sandbox is gone
            for box in restored:
                kept = await sh(client, box, "ls | wc -l && touch new && echo written")
                assert detail(kept)["stdout"] == f"{folders}\nwritten\n", kept
            assert [s["snapshot_id"] for s in detail(await call(client, "list_snapshots"))["snapshots"]] == [
                snapshot_id
            ]
        verified = verify(services.config.audit_path)
        assert verified.ok, verified
        assert mounts_under(state) == [str(state)]
    assert mounts_under(state) == []

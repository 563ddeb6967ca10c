"""A hostile sandbox against what issue 13 built (snapshots, scratch caps, teardown), through the real tools.

Each test is an attack from inside a real sandbox; each asserts the refusal or that the server
held, and that nothing was lost: a snapshot that succeeds restores to the same content.
"""

from __future__ import annotations

import os
import time

import anyio
import pytest

from tests.attacks.test_snapshot_attacks import configure, detail, serve
from tests.helpers import call, create, sh

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

# A file of `count` data blocks 8 KiB apart that ends in a hole: `count` sparse segments, plus
# GNU tar's (size, 0) mark of a final hole.
HOLEY = (
    "python3 -c \"import os\nfd = os.open('holey', os.O_WRONLY | os.O_CREAT, 0o644)\n"
    "for k in range({count}):\n    os.pwrite(fd, b'%08d' % k, k * 8192)\n"
    'os.ftruncate(fd, {count} * 8192 + 8192)\n" && sha256sum holey && stat -c %s holey'
)


@pytest.mark.parametrize("count", [16_383, 16_384])
async def test_sparse_file_at_the_segment_cap_snapshot_restores(tmp_path: pytest.TempPathFactory, count: int) -> None:
    """Invariant: a file with as many data runs as a restore accepts (16,384) and a final hole is
    snapshotted in a form its restore reads, and comes back with the same bytes. Before, the
    writer counted its runs without the final-hole mark, stored 16,385 and the snapshot
    succeeded while every restore of it failed ("over 16384 sparse segments"): data lost.
    Does not prove the total cap across files (same code path, 16 such files)."""
    async with serve(configure(tmp_path / "demo")) as (client, _):  # type: ignore[operator]
        box = await create(client)
        made = await sh(client, box, HOLEY.format(count=count), timeout_s=120)
        assert made["ok"], made
        snap = await call(client, "snapshot_sandbox", sandbox_id=box)
        assert snap["ok"], snap
        restored = await call(client, "restore_sandbox", snapshot_id=str(detail(snap)["snapshot_id"]))
        assert restored["ok"], restored
        after = await sh(client, str(detail(restored)["sandbox_id"]), "sha256sum holey && stat -c %s holey")
        assert detail(after)["stdout"] == detail(made)["stdout"]


# Times Python prints with an exponent (10 us after and before 1970); a folder and a symlink too.
ODD_TIMES = (
    'mkdir -p old && echo kept > old/file && ln -s file old/link && python3 -c "import os\n'
    "os.utime('old/file', ns=(10_000, 10_000))\nos.utime('old/link', ns=(-10_000, -10_000), follow_symlinks=False)\n"
    "os.utime('old', ns=(50_000, 50_000))\n\" && cat old/file && stat -c '%n %.9Y' old old/file old/link"
)


async def test_mtime_printed_with_an_exponent_snapshot_restores(tmp_path: pytest.TempPathFactory) -> None:
    """Invariant: any time a workspace file can have is stored in a form the restore reads. Before,
    an mtime of 10 microseconds after 1970 went into the archive as tarfile's str(float),
    'mtime=1e-05', which the strict reader refuses: the snapshot succeeded and its restore
    said "corrupt". Does not prove mtimes past the restore's 2**40 s bound (ext4 stops in 2446)."""
    async with serve(configure(tmp_path / "demo")) as (client, _):  # type: ignore[operator]
        box = await create(client)
        made = await sh(client, box, ODD_TIMES)
        assert made["ok"], made
        snap = await call(client, "snapshot_sandbox", sandbox_id=box)
        assert snap["ok"], snap
        restored = await call(client, "restore_sandbox", snapshot_id=str(detail(snap)["snapshot_id"]))
        assert restored["ok"], restored
        after = await sh(
            client, str(detail(restored)["sandbox_id"]), "cat old/file && stat -c '%n %.9Y' old old/file old/link"
        )
        assert detail(after)["stdout"] == detail(made)["stdout"]


async def test_snapshot_call_flood_does_not_starve_the_server_threads(tmp_path: pytest.TempPathFactory) -> None:
    """Invariant: however many snapshot calls an agent makes at once, the server's other work that
    runs in threads (the audit log's commits, before and after every call) goes on. Before, each
    call waited for the snapshot lock in a thread of anyio's shared pool (40): 45 calls while one
    snapshot was written held them all, and another sandbox's run_command waited for the whole
    snapshot. Does not prove the order in which queued snapshots run."""
    config = configure(tmp_path / "demo", max_snapshots_per_sandbox=1)  # type: ignore[operator]
    async with serve(config) as (client, services):
        a, b = await create(client), await create(client)
        assert (await sh(client, a, "head -c 300M /dev/urandom > big", timeout_s=120))["ok"]
        assert (await sh(client, b, "true"))["ok"]
        folder = services.config.state_dir / "snapshots"
        results: list[dict[str, object]] = []

        async def snapshot() -> None:
            results.append(await call(client, "snapshot_sandbox", sandbox_id=a))

        def writing() -> bool:
            return folder.is_dir() and any(name.startswith(".tmp-") for name in os.listdir(folder))

        async with anyio.create_task_group() as tasks:
            for _ in range(45):
                tasks.start_soon(snapshot)
            with anyio.fail_after(60):
                while not writing():
                    await anyio.sleep(0.01)
            started = time.monotonic()
            quick = await sh(client, b, "true")
            took = time.monotonic() - started
            still_writing = writing()
        assert quick["ok"], quick
        assert still_writing, f"the snapshot ended before B's call ({took:.1f} s)"
        assert took < 2.0, took
        codes = sorted(str(result["code"]) for result in results)
        assert codes == ["OK"] + ["RESOURCE_LIMIT"] * 44, codes
        assert len([name for name in os.listdir(folder) if name.endswith(".tar.gz")]) == 1

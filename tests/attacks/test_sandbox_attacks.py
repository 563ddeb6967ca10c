"""A hostile sandbox against what issue 13 built (snapshots, scratch caps, teardown), through the real tools.

Each test is an attack from inside a real sandbox; each asserts the refusal or that the server
held, and that nothing was lost: a snapshot that succeeds restores to the same content.
"""

from __future__ import annotations

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

"""A hostile sandbox against what issue 13 built (snapshots, scratch caps, teardown), through the real tools.

Each test is an attack from inside a real sandbox; each asserts the refusal or that the server
held, and that nothing was lost: a snapshot that succeeds restores to the same content.
"""

from __future__ import annotations

import functools
import os
import subprocess
import time

import anyio
import pytest

from bastion.app import Services
from tests.attacks.demo import configure, detail, serve
from tests.helpers import LoopLag, Payload, bubblewrap, call, create, mounts_under, processes_with, sh

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
        # Incompressible: the snapshot takes seconds to write (B's call takes milliseconds), not 300 MiB's dozen.
        assert (await sh(client, a, "head -c 100M /dev/urandom > big", timeout_s=120))["ok"]
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


def leftovers(services: Services, sandbox_id: str, cgroups: tuple[str, ...]) -> list[str]:
    """What a closed sandbox left on the host: its folders, mounts, loop device, cgroup, processes."""
    root = services.config.sandboxes_dir / sandbox_id
    dev = services.config.state_dir / "dev" / sandbox_id
    found = [str(path) for path in (root, dev) if path.exists()]
    found += mounts_under(root) + mounts_under(dev)
    found += [path for path in cgroups if os.path.exists(path)]
    loops = subprocess.run(["losetup", "-a"], check=True, capture_output=True, text=True).stdout
    found += [line for line in loops.splitlines() if str(root) in line]
    found += [f"pid {pid}" for pid in processes_with(sandbox_id)]
    return found


async def test_close_twice_while_command_context_and_background_run_leaves_nothing(
    tmp_path: pytest.TempPathFactory,
) -> None:
    """Invariant: closing a sandbox while a command, a busy Python context and a background
    process run in it, twice at once and while the reaper puts sandboxes to sleep, ends each
    call with a typed answer (no traceback), closes it once, and leaves no folder, mount, loop
    device, cgroup or process; then eight sandboxes made and closed at once leave nothing either.
    Does not prove anything about a server killed mid-close (crash recovery's tests do)."""
    async with serve(configure(tmp_path / "demo")) as (client, services):  # type: ignore[operator]
        box = await create(client)
        group = bubblewrap(services.sandboxes.get(box).workspace.sandbox)._group
        cgroups = tuple(group.paths) if group is not None else ()
        assert (await sh(client, box, "echo t > /tmp/t && echo s > /dev/shm/s && echo w > w"))["ok"]
        assert (await call(client, "run_command", command="sleep 300", sandbox_id=box, background=True))["ok"]
        assert (await call(client, "execute_code", code="x = 1", sandbox_id=box))["ok"]
        runner = services.sandboxes.get(box).code
        answers: dict[str, Payload] = {}

        async def keep(name: str, tool: str, **args: object) -> None:
            answers[name] = await call(client, tool, sandbox_id=box, **args)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(functools.partial(keep, "command", "run_command", command="sleep 300"))
            tasks.start_soon(functools.partial(keep, "code", "execute_code", code="while True:\n    pass"))
            tasks.start_soon(functools.partial(keep, "starting", "execute_code", code="1", context="new"))
            with anyio.fail_after(30):
                while not bubblewrap(services.sandboxes.get(box).workspace.sandbox)._waiters or not any(
                    context["state"] == "busy" for context in runner.contexts()
                ):
                    await anyio.sleep(0.01)
            tasks.start_soon(functools.partial(keep, "close1", "close_sandbox"))
            tasks.start_soon(functools.partial(keep, "close2", "close_sandbox"))
            services.sandboxes.sleep_idle(0)
        codes = sorted(str(answers[name]["code"]) for name in ("close1", "close2"))
        assert codes == ["OK", "SANDBOX_NOT_FOUND"], answers
        for name in ("command", "code", "starting"):
            assert answers[name]["code"] in ("UNAVAILABLE", "SANDBOX_NOT_FOUND", "OPERATION_FAILED"), answers[name]
            assert "Traceback" not in str(answers[name])
        assert answers["command"]["reason"] == "the sandbox ended while a command was running", answers
        assert answers["code"]["detail"]["context_state"] == "dead", answers
        # A context cut off while it started says so; before, "it did not start in time", at once.
        assert answers["starting"]["reason"] == "the Python context did not start: the kernel exited", answers
        assert leftovers(services, box, cgroups) == []

        boxes: list[str] = []

        async def make() -> None:
            boxes.append(await create(client))

        async with anyio.create_task_group() as tasks:
            for _ in range(8):
                tasks.start_soon(make)
        groups = {b: bubblewrap(services.sandboxes.get(b).workspace.sandbox)._group for b in boxes}
        async with anyio.create_task_group() as tasks:
            for made in boxes:
                tasks.start_soon(functools.partial(call, client, "close_sandbox", sandbox_id=made))
        for made in boxes:
            group = groups[made]
            assert leftovers(services, made, tuple(group.paths) if group is not None else ()) == []
        assert (await call(client, "list_sandboxes"))["detail"]["sandboxes"] == []


@pytest.mark.parametrize("disk_quota", ["true", "false"])
async def test_close_while_a_snapshot_is_written_keeps_the_snapshot_whole(
    tmp_path: pytest.TempPathFactory, disk_quota: str
) -> None:
    """Invariant: closing a sandbox while its snapshot is being written answers both calls truly
    and cuts nothing short: the snapshot is stored and restores to the same bytes, and no mount,
    loop device, cgroup or folder is left once both are done. Before, the snapshot was written
    whole but answered CONFLICT (thawing the closed sandbox failed), so the agent was told
    there was none; without a disk of its own (disk_quota = false) the close deleted the files
    under the archiver. Does not prove the same for a server that stops mid-snapshot."""
    config = configure(tmp_path / "demo", disk_quota=disk_quota)  # type: ignore[operator]
    async with serve(config) as (client, services):
        box = await create(client)
        group = bubblewrap(services.sandboxes.get(box).workspace.sandbox)._group
        cgroups = tuple(group.paths) if group is not None else ()
        made = await sh(
            client,
            box,
            # 50 MiB of random data: the archive takes seconds, far longer than the close takes to reach it.
            "mkdir d && for i in $(seq 200); do head -c 256K /dev/urandom > d/$i; done && cat d/* | sha256sum",
        )
        assert made["ok"], made
        folder = services.config.state_dir / "snapshots"
        answers: dict[str, Payload] = {}

        async def keep(name: str, tool: str, **args: object) -> None:
            answers[name] = await call(client, tool, **args)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(functools.partial(keep, "snapshot", "snapshot_sandbox", sandbox_id=box))
            with anyio.fail_after(60):
                while not (folder.is_dir() and any(name.startswith(".tmp-") for name in os.listdir(folder))):
                    await anyio.sleep(0.01)
            closed_mid_snapshot = "snapshot" not in answers
            await keep("close", "close_sandbox", sandbox_id=box)
        assert closed_mid_snapshot, "the snapshot ended before the close: the test proved nothing"
        assert answers["close"]["ok"], answers
        assert leftovers(services, box, cgroups) == []
        snap = answers["snapshot"]
        assert snap["ok"], snap
        assert detail(snap)["files"] == 200
        restored = await call(client, "restore_sandbox", snapshot_id=str(detail(snap)["snapshot_id"]))
        assert restored["ok"], restored
        again = await sh(client, str(detail(restored)["sandbox_id"]), "cat d/* | sha256sum")
        assert detail(again)["stdout"] == detail(made)["stdout"]


async def test_snapshot_that_leaves_files_out_tells_the_agent(tmp_path: pytest.TempPathFactory) -> None:
    """Invariant: a snapshot that leaves a file out says so. A file named with a newline (a name
    the restore refuses) and a FIFO are skipped: the answer counts them (`skipped`), where it used to
    say OK with files = 0 and nothing else, and the restored sandbox lacked the file."""
    async with serve(configure(tmp_path / "demo")) as (client, _):  # type: ignore[operator]
        box = await create(client)
        assert (await sh(client, box, "printf data > \"$(printf 'a\\nb')\" && mkfifo pipe"))["ok"]
        snap = await call(client, "snapshot_sandbox", sandbox_id=box)
        assert snap["ok"], snap
        assert detail(snap).get("skipped") == 2, snap


DEEP = 1_200
"""Folders nested in one another: past Python's recursion limit (1,000) for os.fwalk and shutil.rmtree."""


@pytest.mark.parametrize("disk_quota", ["false", "true"])
async def test_folders_nested_past_the_recursion_limit_are_shown_and_closed(
    tmp_path: pytest.TempPathFactory, disk_quota: str
) -> None:
    """Attack: an agent nests 1,200 folders. Without a disk of its own, the status walk (os.fwalk) raised
    RecursionError: the dashboard's sandbox list answered 500 for every sandbox, and the close (shutil.rmtree)
    stopped half done, as did the server's shutdown, leaving other sandboxes' mounts. The status now counts
    the tree, the close removes it, and nothing is left."""
    config = configure(tmp_path / "demo", disk_quota=disk_quota)  # type: ignore[operator]
    async with serve(config) as (client, services):
        box = await create(client)
        group = bubblewrap(services.sandboxes.get(box).workspace.sandbox)._group
        cgroups = tuple(group.paths) if group is not None else ()
        made = await sh(
            client,
            box,
            f"python3 -c \"import os\nfor i in range({DEEP}):\n    os.mkdir('d'); os.chdir('d')\n"
            "open('f', 'w').write('x' * 5000)\"",
        )
        assert made["ok"], made
        status = await call(client, "get_sandbox_status", sandbox_id=box)
        assert status["ok"], status
        assert detail(status)["usage"]["disk_bytes"] > 0
        closed = await call(client, "close_sandbox", sandbox_id=box)
        assert closed["ok"], closed
        assert leftovers(services, box, cgroups) == []


async def test_a_path_deep_in_a_sandbox_is_resolved_off_the_event_loop(tmp_path: pytest.TempPathFactory) -> None:
    """Attack (p1_deep_view.py, p2_install_venv_link.py): the sandbox nests 1,400 folders and calls the tools
    on the file at the bottom. The jail resolves a sandbox's links itself, and did it on the event loop for
    read_file (twice), run_command's cwd and install_package's venv check: 0.24 s of the loop a call, 2.8 s
    for 16 calls at once, every other client waiting. Invariant: the loop's thread spends little CPU between
    two ticks, and every call still gets its answer (the file's content, the command run in that folder)."""
    depth = 1_400
    async with serve(configure(tmp_path / "demo")) as (client, _):  # type: ignore[operator]
        box = await create(client)
        made = await sh(
            client,
            box,
            f"python3 -c \"import os\nfor i in range({depth}):\n    os.mkdir('d'); os.chdir('d')\n"
            "open('f', 'w').write('deep\\n')\"",
        )
        assert made["ok"], made
        deep = "d/" * depth
        assert (await call(client, "read_file", path="warm", sandbox_id=box))["code"] == "NOT_FOUND"  # first use
        with LoopLag(0.002) as lag:
            read = await call(client, "read_file", path=f"{deep}f", sandbox_id=box)
            absolute = await call(client, "read_file", path=f"/workspace/{deep}f", sandbox_id=box)
            ran = await call(client, "run_command", command="cat f", cwd=deep, sandbox_id=box)
            missing = await call(client, "read_file", path=f"{deep}nope", sandbox_id=box)
        assert lag.cpu_worst < 0.02, lag.cpu_worst
        assert detail(read)["content"] == detail(absolute)["content"] == "deep\n", (read, absolute)
        assert ran["ok"], ran
        assert detail(ran)["stdout"] == "deep\n", ran
        assert missing["code"] == "NOT_FOUND", missing

"""Attacks on the sandbox manager's lifecycle through the real tools: the sandbox cap under concurrent calls,
a snapshot's freeze against pause and resume, and the length of the ids echoed back."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client

from bastion.app import Services, build_server, build_services
from bastion.config import load_config
from bastion.safety.paths import MAX_WRITE_BYTES
from bastion.sandbox.cgroups import SandboxCgroup, owner_pid
from bastion.sandbox.warm import START_TIMEOUT_S, WarmSandbox
from bastion.snapshot import store
from bastion.tools.sandboxes import MAX_SEED_FILES
from bastion.workbench import manager as manager_module
from bastion.workbench.workspace import HostWorkspace
from tests.helpers import Hold, Payload, bubblewrap, call, create, mounts_under, sh

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

_WAIT_S = 60  # a bound for the failure case only


@pytest.fixture
def capped(demo_config_path: Path) -> Iterator[Services]:
    """A server of the demo config with max_sandboxes = 2."""
    text = demo_config_path.read_text()
    assert "max_sandboxes = 16" in text
    demo_config_path.write_text(text.replace("max_sandboxes = 16", "max_sandboxes = 2"))
    built = build_services(load_config(demo_config_path))
    yield built
    built.close()


@pytest.fixture
async def capped_client(capped: Services) -> AsyncIterator[Client]:
    async with Client(build_server(capped, caller="test")) as connected:
        yield connected


def _own_groups(services: Services) -> set[str]:
    """The sandbox cgroups this process's servers hold."""
    if services.cgroups is None:
        return set()
    return {name for name in services.cgroups.existing() if owner_pid(name) == os.getpid()}


async def _wait_for(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(_WAIT_S):
        while not condition():
            await anyio.sleep(0.02)


async def test_a_burst_of_creates_restores_and_create_run_close_past_max_sandboxes_gets_resource_limit(
    capped_client: Client, capped: Services
) -> None:
    """Attack: 3 create_sandbox, 3 restore_sandbox and 3 create_run_close at once against max_sandboxes = 2.

    Invariant: at most 2 sandboxes exist at any moment; the calls past the cap answer RESOURCE_LIMIT; once
    they are closed nothing is left (folders, mounts, cgroups) and the full cap is free again. Before, the cap
    was checked against the registered sandboxes only, and each call awaited (warm pool, start, network)
    before registering: all 9 got a sandbox of 2 GiB disk image, 1 GiB memory ceiling and a host id.
    The create_run_close commands wait for a file the test writes, so their sandboxes are all open at once.
    Does not prove: a cap under creates from several server processes (one server owns a state folder).
    """
    client, manager = capped_client, capped.sandboxes
    groups_before = _own_groups(capped)
    source = await create(client)
    await sh(client, source, "echo kept > f")
    snapshot_id = (await call(client, "snapshot_sandbox", sandbox_id=source))["detail"]["snapshot_id"]
    assert (await call(client, "close_sandbox", sandbox_id=source))["ok"]
    calls: list[tuple[str, dict[str, object]]] = [
        *[("create_sandbox", {})] * 3,
        *[("restore_sandbox", {"snapshot_id": snapshot_id})] * 3,
        *[("create_run_close", {"command": "until [ -e go ]; do sleep 0.01; done; echo ran", "timeout_s": 60})] * 3,
    ]
    answers: dict[int, Payload] = {}

    async def one(index: int, tool: str, args: dict[str, object]) -> None:
        answers[index] = await call(client, tool, **args)

    def kept() -> set[str]:
        return {str(answers[i]["detail"]["sandbox_id"]) for i in range(6) if i in answers and answers[i]["ok"]}

    def settled() -> bool:
        # Every create and restore answered; every create_run_close answered or has its sandbox open.
        running = {box.id for box in manager.all()} - kept()
        return all(i in answers for i in range(6)) and len(running) + sum(i in answers for i in range(6, 9)) == 3

    async with anyio.create_task_group() as tasks:
        for index, (tool, args) in enumerate(calls):
            tasks.start_soon(one, index, tool, args)
        await _wait_for(settled)  # every call answered, or holding its sandbox
        peak = len(manager.all())
        for box in manager.all():
            if box.id not in kept():
                assert (await call(client, "write_file", path="go", content="", sandbox_id=box.id))["ok"]
    codes = [answers[i]["code"] for i in range(9)]
    assert peak == 2, codes
    assert sorted(codes) == ["OK"] * 2 + ["RESOURCE_LIMIT"] * 7, codes
    refused = [answers[i] for i in range(9) if answers[i]["code"] == "RESOURCE_LIMIT"]
    assert all("close one first" in str(answer["reason"]) for answer in refused)
    for sandbox_id in kept():
        assert (await call(client, "close_sandbox", sandbox_id=sandbox_id))["ok"]
    assert (await call(client, "list_sandboxes"))["detail"]["sandboxes"] == []
    # The slots came back: the cap is whole again.
    again = [await create(client), await create(client)]
    assert (await call(client, "create_sandbox"))["code"] == "RESOURCE_LIMIT"
    for sandbox_id in again:
        assert (await call(client, "close_sandbox", sandbox_id=sandbox_id))["ok"]
    capped.close()
    sandboxes_dir = capped.config.sandboxes_dir
    assert [p.name for p in sandboxes_dir.iterdir() if p.name.startswith("sb-")] == []
    assert mounts_under(sandboxes_dir) == []
    assert _own_groups(capped) <= groups_before  # the base is shared with other servers: only this process's


class _HeldSnapshot:
    """snapshot_sandbox's archive work, held in its thread until `release`: the sandbox is frozen meanwhile."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started, self._go = threading.Event(), threading.Event()
        archive = store.create_snapshot

        def held(*args: Any, **kwargs: Any) -> Any:
            self.started.set()
            assert self._go.wait(_WAIT_S)
            return archive(*args, **kwargs)

        monkeypatch.setattr(manager_module, "create_snapshot", held)

    def release(self) -> None:
        self._go.set()


@contextlib.asynccontextmanager
async def _while_copied(client: Client, box: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[dict[str, Payload]]:
    """snapshot_sandbox of `box`, its archive work held in its thread while the body runs; its answer is in the
    dict's "answer" once the block ends."""
    held = _HeldSnapshot(monkeypatch)
    taken: dict[str, Payload] = {}

    async def snapshot() -> None:
        taken["answer"] = await call(client, "snapshot_sandbox", sandbox_id=box)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(snapshot)
        assert await anyio.to_thread.run_sync(held.started.wait, _WAIT_S)
        try:
            yield taken
        finally:
            held.release()


async def _state(client: Client, sandbox_id: str) -> str:
    return str((await call(client, "get_sandbox_status", sandbox_id=sandbox_id))["detail"]["state"])


async def test_resume_during_a_snapshot_is_refused_and_the_sandbox_stays_frozen_while_copied(
    client: Client, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: resume_sandbox while snapshot_sandbox copies the workspace, then pause_sandbox.

    Invariant: the sandbox stays frozen (its cgroup, as the kernel reports it) until the copy ends; resume is
    CONFLICT saying a snapshot is being taken; a pause during the snapshot is taken, and the sandbox is still
    paused after the snapshot, until resume_sandbox. Before, resume took the snapshot's freeze for the user's
    pause and thawed the sandbox mid-copy; pause then answered "already paused", and the snapshot's end
    thawed what the user had paused. The archive work is held in its thread while the calls are made.
    """
    box = await create(client)
    await sh(client, box, "echo data > f")
    group = bubblewrap(services.sandboxes.get(box).workspace.sandbox)._group
    assert group is not None
    async with _while_copied(client, box, monkeypatch) as taken:
        resumed = await call(client, "resume_sandbox", sandbox_id=box)
        frozen_after_resume = group._frozen()
        paused = await call(client, "pause_sandbox", sandbox_id=box)
        resumed_again = await call(client, "resume_sandbox", sandbox_id=box)
        frozen_at_the_end_of_the_copy = group._frozen()
    assert resumed["code"] == "CONFLICT", resumed
    assert "snapshot" in str(resumed["reason"])
    assert frozen_after_resume
    assert paused["ok"], paused
    assert resumed_again["code"] == "CONFLICT", resumed_again
    assert frozen_at_the_end_of_the_copy
    assert taken["answer"]["ok"], taken["answer"]
    # The user's pause outlives the snapshot; resume_sandbox ends it.
    assert await _state(client, box) == "paused"
    assert group._frozen()
    assert (await call(client, "resume_sandbox", sandbox_id=box))["ok"]
    assert not group._frozen()
    assert (await sh(client, box, "cat f"))["detail"]["stdout"] == "data\n"


async def test_a_sandbox_paused_before_a_snapshot_is_not_thawed_during_or_after_it(
    client: Client, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: pause_sandbox, then snapshot_sandbox, then resume_sandbox while it copies.

    Invariant: the snapshot thaws only what it froze: a sandbox the user paused first is not thawed by resume
    during the copy (CONFLICT) nor by the snapshot's end; a sandbox the snapshot froze is running after it.
    """
    paused_box, running_box = await create(client), await create(client)
    assert (await call(client, "pause_sandbox", sandbox_id=paused_box))["ok"]
    group = bubblewrap(services.sandboxes.get(paused_box).workspace.sandbox)._group
    assert group is not None
    async with _while_copied(client, paused_box, monkeypatch) as taken:
        resumed = await call(client, "resume_sandbox", sandbox_id=paused_box)
        frozen_during = group._frozen()
    assert resumed["code"] == "CONFLICT", resumed
    assert frozen_during
    assert taken["answer"]["ok"], taken["answer"]
    assert await _state(client, paused_box) == "paused"
    assert group._frozen()
    monkeypatch.undo()
    assert (await call(client, "snapshot_sandbox", sandbox_id=running_box))["ok"]
    assert await _state(client, running_box) == "running"
    assert (await sh(client, running_box, "echo alive"))["detail"]["stdout"] == "alive\n"


@pytest.mark.parametrize("tool", ["close_sandbox", "get_sandbox_status", "resume_sandbox", "run_command"])
async def test_a_huge_sandbox_id_is_not_echoed_whole(client: Client, tool: str) -> None:
    """Attack: a 100,000-character sandbox_id. Invariant: SANDBOX_NOT_FOUND with a reason of a few hundred
    characters at most, saying the id was cut (before: the whole id, a 100,069-character reason)."""
    args: dict[str, object] = {"sandbox_id": "sb-" + "a" * 100_000}
    if tool == "run_command":
        args["command"] = "true"
    refused = await call(client, tool, **args)
    assert refused["code"] == "SANDBOX_NOT_FOUND", refused
    reason = str(refused["reason"])
    assert len(reason) < 300, len(reason)
    assert "cut" in reason


async def test_a_huge_template_name_is_not_echoed_whole(client: Client, services: Services) -> None:
    """Attack: create_sandbox with a 100,000-character template name: NOT_FOUND, a short reason, no sandbox."""
    refused = await call(client, "create_sandbox", template="t" * 100_000)
    assert refused["code"] == "NOT_FOUND", refused
    assert len(str(refused["reason"])) < 400
    assert services.sandboxes.all() == []


async def test_a_sandbox_file_hard_linked_ten_times_is_snapshotted_once_and_restored_with_its_links(
    client: Client,
) -> None:
    """Attack (a5, at the sandbox level): a 2 MiB file of random data hard-linked 10 times in a sandbox, then
    snapshot_sandbox and restore_sandbox. Invariant: the archive holds the data once (before: 11 copies, the
    cost crash recovery paid at the next start), and the restored sandbox has one inode with 11 names, owned
    as the sandbox's other files are. Does not prove: recovery's own timing (the same writer, by
    tests/snapshot/test_store.py)."""
    box = await create(client)
    made = await sh(client, box, "head -c 2097152 /dev/urandom > big && for i in $(seq 10); do ln big h$i; done")
    assert made["ok"], made
    taken = await call(client, "snapshot_sandbox", sandbox_id=box)
    assert taken["ok"], taken
    assert int(taken["detail"]["archive_bytes"]) < 3 * 1024 * 1024, taken["detail"]
    restored = await call(client, "restore_sandbox", snapshot_id=taken["detail"]["snapshot_id"])
    assert restored["ok"], restored
    check = "stat -c '%h %u' big h10; cmp big h10 && touch mine && stat -c %u mine"
    before = await sh(client, box, check)
    after = await sh(client, str(restored["detail"]["sandbox_id"]), check)
    assert after["detail"]["stdout"].split("\n")[:2] == before["detail"]["stdout"].split("\n")[:2]
    lines = str(after["detail"]["stdout"]).split()
    assert lines[0] == "11"
    assert lines[1] == lines[-1]  # owned as a file the sandbox makes itself


async def test_a_command_during_the_snapshot_of_an_asleep_sandbox_cannot_write_mid_copy(
    client: Client, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack (a review of this session's snapshot changes): snapshot an asleep sandbox (idle, stopped), then
    run a command while its workspace is copied. Nothing was frozen (nothing ran), so the command woke it and
    wrote mid-copy: the copy was not consistent, and a file made then could take a stored file's freed inode.
    Invariant: the snapshot wakes and freezes it, so the command is CONFLICT (paused) and writes nothing; after
    the snapshot the sandbox runs commands again and the snapshot holds the workspace as it was."""
    box = await create(client)
    await sh(client, box, "echo data > f")
    assert services.sandboxes.sleep_idle(0) == 1
    assert await _state(client, box) == "asleep"
    async with _while_copied(client, box, monkeypatch) as taken:
        during = await sh(client, box, "echo written-during-copy > mid")
    assert during["code"] == "CONFLICT", during
    assert "paused" in str(during["reason"])
    assert taken["answer"]["ok"], taken["answer"]
    after = await sh(client, box, "ls")
    assert after["ok"], after
    assert after["detail"]["stdout"].split() == ["f"]


async def test_a_pause_waiting_for_its_freeze_holds_no_other_call(
    client: Client, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a freeze waits for the kernel to report every process stopped (up to FREEZE_WAIT_S), and
    it ran on the event loop: an agent whose sandbox held busy commands at a tiny CPU limit stopped every call
    of the server, every agent's, for a second per pause_sandbox. Here the freeze is held in its thread until
    the test releases it. Invariant: another call is answered meanwhile, and the pause then completes."""
    box = await create(client)
    assert (await sh(client, box, "true"))["ok"]
    release, entered = threading.Event(), threading.Event()
    real = SandboxCgroup.freeze

    def held_freeze(self: SandboxCgroup) -> None:
        entered.set()
        release.wait(_WAIT_S)
        real(self)

    monkeypatch.setattr(SandboxCgroup, "freeze", held_freeze)
    answers: dict[str, Payload] = {}

    async def pause() -> None:
        answers["pause"] = await call(client, "pause_sandbox", sandbox_id=box)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(pause)
        try:
            await _wait_for(entered.is_set)
            listed = await call(client, "list_sandboxes")
            assert listed["ok"], listed
            assert "pause" not in answers  # answered while the pause still waited for its freeze
        finally:
            release.set()
    assert answers["pause"]["ok"], answers["pause"]
    assert await _state(client, box) == "paused"
    assert (await call(client, "resume_sandbox", sandbox_id=box))["ok"]


async def test_create_run_close_with_many_files_holds_no_other_call(
    client: Client, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by attack: create_run_close wrote its `files` on the event loop, with no bound on how many.
    60,000 empty files held every agent's calls for 6 s; 8,000 files 120 folders deep (2 MB of JSON) for
    11 s, and another agent's list_sandboxes waited 40 s between answers. Here the write of one file is held
    in its worker until the test releases it. Invariant: another call is answered meanwhile, and every file
    is then written before the command runs."""
    files = {f"d{n % 7}/f{n}": f"{n}\n" for n in range(200)}
    hold = Hold()
    real = HostWorkspace.write_file

    def held_write(self: HostWorkspace, path: str, content: str, **kwargs: Any) -> dict[str, object]:
        if path == "d3/f3":
            hold.wait()
        return real(self, path, content, **kwargs)

    monkeypatch.setattr(HostWorkspace, "write_file", held_write)
    ran = await hold.call(client, "create_run_close", command="cat d*/f* | wc -l && cat d3/f3", files=files)
    assert ran["ok"], ran
    assert ran["detail"]["stdout"].split() == ["200", "3"]
    assert services.sandboxes.all() == []


@pytest.mark.parametrize("too_much", ["files", "bytes"])
async def test_create_run_close_past_its_files_bounds_is_refused_before_any_sandbox(
    client: Client, services: Services, too_much: str
) -> None:
    """Attack: more files than create_run_close takes (`MAX_SEED_FILES`), or more bytes in all than one file may
    hold (`MAX_WRITE_BYTES`, here in files each under it). Invariant: INVALID_REQUEST, and no sandbox was made
    (none made and closed either: the refusal names the bound)."""
    made: list[str] = []
    real_create = services.sandboxes.create

    async def counted(**kwargs: Any) -> Any:
        box = await real_create(**kwargs)
        made.append(box.id)
        return box

    services.sandboxes.create = counted  # type: ignore[method-assign]
    if too_much == "files":
        files = {f"f{n}": "" for n in range(MAX_SEED_FILES + 1)}
    else:
        piece = "x" * (MAX_WRITE_BYTES // 4)
        files = {f"f{n}": piece for n in range(5)}
    refused = await call(client, "create_run_close", command="true", files=files)
    assert refused["code"] == "INVALID_REQUEST", refused
    assert made == []
    assert services.sandboxes.all() == []
    ran = await call(client, "create_run_close", command="cat f", files={"f": "still works"})
    assert ran["ok"], ran
    assert ran["detail"]["stdout"] == "still works"


async def test_status_of_a_sandbox_walked_for_its_disk_use_holds_no_other_call(
    client: Client, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by attack: without a disk quota (`disk_quota = false`, an unprivileged install's), get_sandbox_status
    walks the workspace for its disk use, up to 100,000 entries, and did it on the event loop: 16 status calls
    on a workspace of 100,000 files held every agent's calls for 4.8 s. Here the status is held in its worker
    until the test releases it. Invariant: another call is answered meanwhile, and the status then answers."""
    box = await create(client)
    hold = Hold()
    real = manager_module.SandboxManager.detail

    def held_detail(self: manager_module.SandboxManager, held: Any) -> dict[str, object]:
        hold.wait()
        return real(self, held)

    monkeypatch.setattr(manager_module.SandboxManager, "detail", held_detail)
    status = await hold.call(client, "get_sandbox_status", sandbox_id=box)
    assert status["ok"], status
    assert status["detail"]["sandbox_id"] == box


async def _starting(warm: WarmSandbox) -> None:
    """Until `warm`'s start waits for its agent's hello: bwrap spawned (alive), the start not over."""
    with anyio.fail_after(_WAIT_S):
        while not (warm._starting and warm.alive):
            await anyio.sleep(0)


async def _asleep(client: Client, services: Services, command: str = "true") -> tuple[str, WarmSandbox]:
    """A sandbox that ran `command`, then was put to sleep (a reaper tick with every sandbox past its threshold)."""
    box = await create(client)
    assert (await sh(client, box, command))["ok"]
    warm = bubblewrap(services.sandboxes.get(box).workspace.sandbox)
    assert services.sandboxes.sleep_idle(0) == 1
    assert warm.asleep
    return box, warm


@contextlib.asynccontextmanager
async def _waking(client: Client, box: str, warm: WarmSandbox) -> AsyncIterator[list[Payload]]:
    """The block runs while `echo awake` wakes `box`, its start waiting for the agent's hello; the command's answer
    is in the list once the block is over."""
    answers: list[Payload] = []

    async def wake() -> None:
        answers.append(await sh(client, box, "echo awake"))

    with anyio.fail_after(_WAIT_S):
        async with anyio.create_task_group() as group:
            group.start_soon(wake)
            await _starting(warm)
            yield answers


async def test_a_reaper_tick_during_a_wake_up_start_leaves_the_start_alone(client: Client, services: Services) -> None:
    """Found by attack: `WarmSandbox.sleep` asked only whether the sandbox was alive, which it is while a start
    waits for the agent's hello; a reaper tick then put the waking sandbox back to sleep under its start, and the
    command waited 10 s (the start's time limit, on the closed socket) and answered INTERNAL_ERROR ("read of closed
    file" in the server log). Invariant: a sandbox that is starting does not go to sleep, and the command answers."""
    box, warm = await _asleep(client, services)
    async with _waking(client, box, warm) as answers:
        assert services.sandboxes.sleep_idle(0) == 0  # a tick with every sandbox past the idle threshold
    assert answers[0]["code"] == "OK", answers[0]
    assert answers[0]["detail"]["stdout"] == "awake\n"
    assert (await call(client, "close_sandbox", sandbox_id=box))["ok"]


async def test_a_close_during_a_start_answers_the_waking_command_at_once(client: Client, services: Services) -> None:
    """Found by attack (the same race, with a close): the start went on waiting for the hello on the socket the
    close had shut, for its 10 s limit, then read the reaped process's closed pipe (INTERNAL_ERROR). Invariant: the
    start ends with the close, the command gets a typed refusal, and nothing of the sandbox is left."""
    box, warm = await _asleep(client, services)
    async with _waking(client, box, warm) as answers:
        started = anyio.current_time()
        warm.close()
    took = anyio.current_time() - started
    assert answers[0]["code"] not in ("OK", "INTERNAL_ERROR"), answers[0]
    assert took < START_TIMEOUT_S / 2, f"the waking command was answered {took:.1f} s after the close"
    assert not warm.alive
    assert (await call(client, "close_sandbox", sandbox_id=box))["ok"]


async def test_a_pause_during_a_wake_up_start_is_refused_and_the_start_goes_on(
    client: Client, services: Services
) -> None:
    """Found by review: a pause while a command woke an asleep sandbox (the start waiting for the agent's hello, the
    sandbox alive already) froze it before the hello: the pause answered OK, the command waited out the start's 10 s
    and failed, the pause was lost, and in 7 of 12 attempts the start's read of bwrap's stderr then blocked the
    event loop for good (the sandbox's PID 1, frozen, held the pipe). Invariant: the pause is refused (CONFLICT) or
    comes after the start, the command answers OK, and the sandbox is not left frozen."""
    box, warm = await _asleep(client, services)
    async with _waking(client, box, warm) as answers:
        paused = await call(client, "pause_sandbox", sandbox_id=box)
        if paused["ok"]:
            # The start was over by the time the pause ran: the command may be frozen mid-run, so it is resumed
            # before the block waits for the command's answer (a full run of 2026-12-07 waited here 60 s).
            assert (await call(client, "resume_sandbox", sandbox_id=box))["ok"]
    assert paused["code"] in ("CONFLICT", "OK"), paused
    if not paused["ok"]:
        assert "starting" in paused["reason"]
    assert answers[0]["code"] == "OK", answers[0]
    assert answers[0]["detail"]["stdout"] == "awake\n"
    assert not warm.paused
    assert (await call(client, "close_sandbox", sandbox_id=box))["ok"]


async def test_a_snapshot_during_a_wake_up_start_waits_for_the_start(client: Client, services: Services) -> None:
    """Found by review: with a freeze of a starting sandbox refused, an agent's snapshot sent beside the command that
    wakes its sandbox (parallel tool calls) answered CONFLICT, where a snapshot of the asleep sandbox wakes it
    itself. Invariant: the snapshot waits for the start and is taken, the command answers, nothing stays frozen."""
    box, warm = await _asleep(client, services, "echo x > f")
    async with _waking(client, box, warm) as answers:
        snapshot = await call(client, "snapshot_sandbox", sandbox_id=box)
    assert snapshot["ok"], snapshot
    assert answers[0]["code"] == "OK", answers[0]
    assert not warm.paused
    assert (await sh(client, box, "true"))["ok"]
    assert (await call(client, "close_sandbox", sandbox_id=box))["ok"]


async def _until_started(client: Client, box: str) -> None:
    """Until the command in flight in `box` has made its `started` file."""
    with anyio.fail_after(_WAIT_S):
        while not (await sh(client, box, "test -e started"))["ok"]:
            await anyio.sleep(0.01)  # polling, not timing


async def test_a_sandbox_with_a_call_in_flight_is_not_reaped_as_idle(client: Client, services: Services) -> None:
    """Found by attack (twenty-seventh session, a stalled server): the reaper asked only when a call last looked
    the sandbox up, and closed it as idle under a command running past `idle_timeout_s` (or under a server
    stalled that long mid-call): `sleep 7; echo done` with idle_timeout_s 4 answered UNAVAILABLE, the sandbox
    gone. Invariant: a sandbox with a call in flight is in use; the command answers; the reaper closes it once
    the call has ended and it has been idle since."""
    box = await create(client)
    answers: list[Payload] = []

    async def long_call() -> None:
        answers.append(await sh(client, box, "touch started; while [ ! -e go ]; do sleep 0.01; done; echo done"))

    idle = services.config.sandboxes.idle_timeout_s
    async with anyio.create_task_group() as group:
        group.start_soon(long_call)
        await _until_started(client, box)
        await anyio.sleep(0.05)  # the polling calls' own ends are behind us; only the long call is in flight
        services.sandboxes.get(box).last_used -= 10 * idle  # idle for ten times its timeout, but for the call
        assert await services.sandboxes.reap() == []
        assert services.sandboxes.sleep_idle(0) == 0
        assert (await sh(client, box, "touch go"))["ok"]
    assert answers[0]["code"] == "OK", answers[0]
    assert answers[0]["detail"]["stdout"] == "done\n"
    services.sandboxes.get(box).last_used -= 10 * idle
    assert await services.sandboxes.reap() == [box]


@pytest.mark.parametrize("tool", ["run_command", "execute_code"])
async def test_work_that_ended_while_the_server_stalled_past_its_deadline_is_answered_as_it_ran(
    client: Client, tool: str
) -> None:
    """Found by attack (twenty-seventh session): the server's process stalled (SIGSTOP: a loaded host, a paused
    VM) past a call's deadline while the command ran 1 s of its 5; its exit was waiting in the agent's socket, but
    the deadline came first: `sleep 1; echo done` was answered TIMEOUT, "killed", with exit status 0 and its
    output, and recorded so; a code cell alike, "interrupted", though it ran (a retry would run it twice).
    Here the stall is the event loop blocked in this very process. Invariant: the answer is the work's own."""
    box = await create(client)
    if tool == "run_command":
        request = call(client, "run_command", sandbox_id=box, command="touch started; echo done", timeout_s=1)
    else:
        assert (await call(client, "execute_code", sandbox_id=box, code="kept = 41"))["ok"]
        code = "open('started', 'w').close(); kept += 1; print('py', kept)"
        request = call(client, "execute_code", sandbox_id=box, code=code, timeout_s=2)
    answers: list[Payload] = []

    async def work() -> None:
        answers.append(await request)

    async with anyio.create_task_group() as group:
        group.start_soon(work)
        await _until_started(client, box)
        time.sleep(3.5)  # the stall: the loop is held past the call's deadline, after the work has ended
    assert answers[0]["code"] == "OK", answers[0]
    if tool == "run_command":
        assert answers[0]["detail"]["stdout"] == "done\n"
    else:
        assert "py 42" in answers[0]["detail"]["stdout"], answers[0]
        after = await call(client, "execute_code", sandbox_id=box, code="print('after', kept)")
        assert "after 42" in after["detail"]["stdout"], after

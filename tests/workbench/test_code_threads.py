"""Worker threads under attack, through the real MCP client in real sandboxes: what one agent's calls hold
while they compute must not make another sandbox's calls wait for a thread. asyncio's default executor,
min(32, cpus + 4) threads for the whole server, was where code contexts cleaned their cells and where
sandboxes waited for killed processes and closed runs."""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import pytest
from mcp import Client

from bastion.app import Services
from bastion.tools.threads import MAX_THREADS_PER_CALLER, ThreadShares
from tests.helpers import call, create, processes_with

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

EXECUTOR_THREADS = 6
"""asyncio's default executor on 2 cores (min(32, cpus + 4)); the test gives its loop one of this size, so
that as many attacking sandboxes fill it on any machine."""
HELD_FOR_S = 60.0
"""The most a held redaction waits for its release: a failed test must not hang."""
VICTIM_DEADLINE_S = 15.0
"""A failure bound only: the victim's calls take milliseconds when nothing holds them, and they must end while
every attacking cell is still held, whatever the machine's speed. Held behind the attack, a kill waited out its
5 s grace and ended its whole sandbox, whose close then waited too."""


class HeldRedactions:
    """The server's redactor, holding each redaction of a text that carries `marker` (in the worker thread it
    runs in) until `release`: an attacker's SVG redactions as long as the test wants them, where the real ones
    (eight SVGs of 512 KiB of secret-shaped text per cell) take seconds each."""

    def __init__(self, services: Services, marker: str) -> None:
        self._redact = services.redactor.redact
        self.marker = marker
        self._open = threading.Event()
        self._lock = threading.Lock()
        self.entered = 0

    def redact(self, text: str) -> str:
        if self.marker in text:
            with self._lock:
                self.entered += 1
            self._open.wait(HELD_FOR_S)
        return self._redact(text)

    def release(self) -> None:
        self._open.set()


def svg_cell(text: str) -> str:
    """A cell that returns one SVG image holding `text`, given in two halves so that the code (audited, hence
    redacted) never holds it whole."""
    first, second = text[: len(text) // 2], text[len(text) // 2 :]
    return (
        "import sys\nkernel = sys.modules['__main__']\ncell = kernel._current['id']\n"
        f"body = ('<svg>' + {first!r} + {second!r} + '</svg>').encode()\n"
        "kernel.emit({'event': 'image', 'id': cell, 'mime': 'image/svg+xml', 'width': 1, 'height': 1}, body)\n"
    )


async def run(client: Client, sandbox_id: str, code: str, **args: object) -> dict[str, Any]:
    return await call(client, "execute_code", code=code, sandbox_id=sandbox_id, **args)


async def started_kernels(client: Client, count: int) -> list[str]:
    """`count` sandboxes, each with its Python kernel started before the attack."""
    boxes = [await create(client) for _ in range(count)]
    for box in boxes:
        assert (await run(client, box, "1"))["ok"]
    return boxes


async def attack(client: Client, box: str, marker: str, results: dict[str, dict[str, Any]]) -> None:
    """A cell returning an SVG that holds `marker`: its redaction is held (`HeldRedactions`)."""
    results[box] = await run(client, box, svg_cell(marker))


async def victim_calls(client: Client, box: str, marker: str) -> None:
    """Another sandbox's calls, each of which needed a thread of asyncio's default executor: kill a background
    process (wait until its cgroup is empty), kill a process a command left (wait on its pidfd), run a cell
    returning an SVG (redact it), close the sandbox (wait for its run's reaping)."""
    started = await call(client, "run_command", command=f"sleep {marker}", sandbox_id=box, background=True)
    assert started["ok"], started
    left = await call(client, "run_command", command=f"sleep {marker}1 >/dev/null 2>&1 &", sandbox_id=box)
    assert left["ok"], left
    killed = await call(client, "kill_process", pid=started["detail"]["pid"], sandbox_id=box)
    assert killed["ok"], killed
    assert killed["detail"]["killed"] is True, killed
    listed = (await call(client, "list_processes", sandbox_id=box))["detail"]["processes"]
    (leftover,) = [entry for entry in listed if entry["argv"] == ["sleep", f"{marker}1"]]
    ended = await call(client, "kill_process", os_pid=leftover["os_pid"], sandbox_id=box)
    assert ended["ok"], ended
    drawn = await run(client, box, svg_cell("victim"))
    assert drawn["ok"], drawn
    assert [image["mime_type"] for image in drawn["detail"]["images"]] == ["image/svg+xml"], drawn
    closed = await call(client, "close_sandbox", sandbox_id=box)
    assert closed["ok"], closed


async def test_cells_of_six_sandboxes_held_in_svg_redaction_do_not_hold_another_sandboxs_kills_cells_or_close(
    client: Client, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: one agent's cells in 8 sandboxes each return 4 SVGs of 512 KiB of `token: a` lines; each cell's
    redaction held a thread of asyncio's default executor for seconds (6 threads on 2 cores, shared by the whole
    server). Another agent's kill_process waited 5.5-6.8 s for a thread to wait on its cgroup, and past its
    5 s grace its whole sandbox was ended. Here six sandboxes' redactions are held until the test releases them.
    Invariant: while every one of them is held, another sandbox's kill of a background process and of a left
    process, a cell returning an SVG and the sandbox's close all complete; afterwards every held cell returns
    its image and its context lives, and nothing of the closed sandbox runs. Does not prove a share of the CPU:
    real redactions still compete for it (and for the GIL) with everyone else's work."""
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(EXECUTOR_THREADS))
    held = HeldRedactions(services, f"held-{secrets.token_hex(4)}")
    monkeypatch.setattr(services.redactor, "redact", held.redact)
    victim = await create(client)
    attackers = await started_kernels(client, EXECUTOR_THREADS)
    marker = f"4264.{secrets.randbelow(10**6):06d}"
    results: dict[str, dict[str, Any]] = {}
    async with anyio.create_task_group() as tasks:
        for box in attackers:
            tasks.start_soon(attack, client, box, held.marker, results)
        try:
            with anyio.fail_after(VICTIM_DEADLINE_S):
                while held.entered < len(attackers):
                    await anyio.sleep(0.01)
                await victim_calls(client, victim, marker)
            assert held.entered == len(attackers)
            assert results == {}, "an attacking cell returned before the other sandbox's calls"
        finally:
            held.release()
    for box in attackers:
        assert results[box]["ok"], results[box]
        assert [image["mime_type"] for image in results[box]["detail"]["images"]] == ["image/svg+xml"]
        assert (await run(client, box, "2 + 2"))["detail"]["value"] == "4"
    assert processes_with(marker) == []


async def test_one_agents_cells_in_many_sandboxes_clean_in_at_most_its_callers_share_of_threads(
    client: Client, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review of the fix above: each sandbox cleaned in a share of its own, so one agent with many
    sandboxes (an administrator may allow 100) held one of anyio's 40 threads per sandbox, where its file tools
    hold at most `MAX_THREADS_PER_CALLER`. Invariant: cells of one caller in more sandboxes than its share clean
    in at most its share of threads at once; the rest wait, and every cell returns its image afterwards."""
    held = HeldRedactions(services, f"held-{secrets.token_hex(4)}")
    monkeypatch.setattr(services.redactor, "redact", held.redact)
    arrived = [0]
    real_run = ThreadShares.run

    async def counted(self: ThreadShares, place: object, work: Callable[[], Any], **kw: Any) -> Any:
        arrived[0] += 1
        return await real_run(self, place, work, **kw)

    attackers = await started_kernels(client, MAX_THREADS_PER_CALLER + 2)
    monkeypatch.setattr(ThreadShares, "run", counted)
    results: dict[str, dict[str, Any]] = {}
    async with anyio.create_task_group() as tasks:
        for box in attackers:
            tasks.start_soon(attack, client, box, held.marker, results)
        try:
            with anyio.fail_after(VICTIM_DEADLINE_S):
                while arrived[0] < len(attackers) or held.entered < MAX_THREADS_PER_CALLER:
                    await anyio.sleep(0.01)
            listed = await call(client, "list_sandboxes")  # a round trip: time for a thread to take more
            assert listed["ok"], listed
            assert held.entered == MAX_THREADS_PER_CALLER
            assert results == {}
        finally:
            held.release()
    assert held.entered == len(attackers)
    for box in attackers:
        assert results[box]["ok"], results[box]
        assert [image["mime_type"] for image in results[box]["detail"]["images"]] == ["image/svg+xml"]

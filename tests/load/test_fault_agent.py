"""Fault: a sandbox's resident agent killed from outside (kill -9 on the host) while clients work.

What this proves: the command in flight in that sandbox is answered UNAVAILABLE (a typed error, not a
hang or a traceback) and dies with the agent, the other clients' sandboxes answer every call OK
throughout, the server goes on, the hit sandbox's next call starts a new agent over the same files,
and the sandbox still closes cleanly with nothing left (process, mount, loop device, cgroup).
What it does not prove: an agent that stays alive but stops answering (the 5-second kill confirmation
in `WarmSandbox` covers that).
"""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from mcp import Client

from tests.helpers import mounts_under, processes_with

from .fault_server import (
    Load,
    Served,
    answered_calls_are_logged,
    cgroups_of,
    descendants,
    fault_config,
    loops_under,
    settled_leftovers,
    unmount_all,
    until,
)

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.bwrap,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="sandbox disks and cgroups need root"),
]

BYSTANDERS = 2


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "demo"
    unmount_all(tmp_path)


def _agent_above(pid: int) -> int:
    """The resident agent that started this command (its nearest ancestor running agent.py)."""
    while pid > 1:
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        if b"/agent.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError("no agent above the command")


async def _bystander(load: Load, client: Client, index: int) -> None:
    box = (await load.call(client, "create_sandbox", labels={"role": "bystander"}))["detail"]["sandbox_id"]
    count = 0
    while not load.stop.is_set():
        count += 1
        ran = await load.call(client, "run_command", command=f"echo {count} >> n.txt && tail -1 n.txt", sandbox_id=box)
        assert ran["ok"], ran
        assert ran["detail"]["stdout"] == f"{count}\n"


async def test_agent_killed_from_outside_fails_its_sandbox_only(root: Path) -> None:
    """Invariant: kill -9 of one sandbox's agent answers that sandbox's call in flight with
    UNAVAILABLE, within the call's time limit; every call in the other sandboxes is OK; the server
    keeps serving; closing the hit sandbox leaves nothing behind."""
    server = Served(fault_config(root))
    server.start()
    marker = f"{secrets.randbelow(10**6)}.{secrets.randbelow(10**6):06d}"  # a sleep no other test runs
    try:
        load = Load(server.mcp_url)
        hit: dict[str, object] = {}
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(load.run, BYSTANDERS, _bystander)
            async with load.session() as client:
                box = (await load.call(client, "create_sandbox"))["detail"]["sandbox_id"]
                assert (await load.call(client, "write_file", path="kept.txt", content="kept", sandbox_id=box))["ok"]

                async def in_flight() -> None:
                    hit["answer"] = await load.call(client, "run_command", command=f"sleep {marker}", sandbox_id=box)

                async with anyio.create_task_group() as inner:
                    inner.start_soon(in_flight)
                    await until(lambda: len(processes_with(f"sleep\0{marker}")) == 1, what="the sleep to start")
                    (sleeper,) = processes_with(f"sleep\0{marker}")
                    agent = _agent_above(sleeper)
                    ok_before = len(load.answers)
                    os.kill(agent, signal.SIGKILL)
                answer = hit["answer"]
                assert isinstance(answer, dict)
                assert answer["code"] == "UNAVAILABLE", answer
                # Its group is killed in a worker thread as the sandbox ends: gone within a bounded wait.
                await until(lambda: processes_with(f"sleep\0{marker}") == [], what="the command to die with its agent")
                # The others went on while it happened, and go on after.
                await until(lambda: len(load.answers) >= ok_before + 2 * BYSTANDERS, what="bystander calls")
                after = await load.call(client, "run_command", command="cat kept.txt", sandbox_id=box)
                # The next call starts a new agent, as after an idle sleep: the files were the host's all along.
                assert after["ok"], after
                assert after["detail"]["stdout"] == "kept"
                status = await load.call(client, "get_sandbox_status", sandbox_id=box)
                assert status["ok"], status
                closed = await load.call(client, "close_sandbox", sandbox_id=box)
                assert closed["ok"], closed
                assert mounts_under(root / "state" / "sandboxes" / box) == []
                assert loops_under(root / "state" / "sandboxes" / box) == []
                listed = await load.call(client, "list_sandboxes")
                assert box not in {s["sandbox_id"] for s in listed["detail"]["sandboxes"]}
            load.stop.set()
        assert load.broken == []
        assert all(a["ok"] for a in load.answers if a["action"] == "run_command" and a is not hit["answer"]), [
            a for a in load.answers if not a["ok"]
        ]
        live_pid, processes = server.pid, descendants(server.pid)
        server.signal(signal.SIGTERM)
        assert server.wait() == 0, server.log()
        assert settled_leftovers(root, live_pid, processes).none
        assert cgroups_of(live_pid) == []
    finally:
        server.stop()
    answered_calls_are_logged(load.answers, root / "state" / "audit.jsonl")
    print(load.summary("agent killed"))

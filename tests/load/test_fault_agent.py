"""Fault: a sandbox's resident agent killed from outside (kill -9 on the host) while clients work.

What this proves: the command in flight in that sandbox is answered UNAVAILABLE (a typed error, not a
hang or a traceback) and dies with the agent, the other clients' sandboxes answer every call OK
throughout, the server goes on, the hit sandbox's next call starts a new agent over the same files,
and the sandbox still closes cleanly with nothing left (process, mount, loop device, cgroup); with a
terminal, a background process and a code context open, every later call about them is a typed
answer. (From inside, a command cannot do this: the agent is PID 1 of the sandbox's PID namespace,
which ignores SIGKILL sent from within it; `kill -9 -1` there ends only the sandbox's own commands.)
What it does not prove: an agent that stays alive but stops answering (the 5-second kill confirmation
in `WarmSandbox` covers that).
"""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    internal_errors,
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


async def test_agent_killed_with_a_terminal_a_background_process_and_code_open(root: Path) -> None:
    """Invariant: the agent killed while its sandbox holds a terminal (with a read waiting on it), a
    background process and a code context answers every later call about them with a typed result
    (never INTERNAL_ERROR), the sandbox works again on its next command, and closing it leaves nothing."""
    server = Served(fault_config(root))
    server.start()
    marker = f"{secrets.randbelow(10**6)}.{secrets.randbelow(10**6):06d}"
    try:
        load = Load(server.mcp_url)
        async with load.session() as client:
            box = (await load.call(client, "create_sandbox"))["detail"]["sandbox_id"]
            background = await load.call(
                client, "run_command", command=f"sleep {marker}", background=True, sandbox_id=box
            )
            assert background["ok"], background
            pid = background["detail"]["pid"]
            code = await load.call(client, "execute_code", code="x = 41", sandbox_id=box)
            assert code["ok"], code
            terminal = await load.call(client, "open_terminal", sandbox_id=box, command="sh")
            assert terminal["ok"], terminal
            terminal_id = terminal["detail"]["terminal_id"]
            waited: dict[str, Any] = {}

            async def read_waiting() -> None:
                waited.update(
                    await load.call(
                        client, "terminal_read", terminal_id=terminal_id, wait_for="never-printed", timeout_s=30
                    )
                )

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(read_waiting)
                await until(lambda: len(processes_with(f"sleep\0{marker}")) == 1, what="the background sleep")
                (sleeper,) = processes_with(f"sleep\0{marker}")
                os.kill(_agent_above(sleeper), signal.SIGKILL)
            after = {
                "terminal_read": waited,
                "read_process_output": await load.call(client, "read_process_output", pid=pid, sandbox_id=box),
                "send_process_input": await load.call(client, "send_process_input", pid=pid, data="x", sandbox_id=box),
                "terminal_send": await load.call(client, "terminal_send", terminal_id=terminal_id, text="echo hi\n"),
                "execute_code": await load.call(client, "execute_code", code="print(1)", sandbox_id=box),
                "list_processes": await load.call(client, "list_processes", sandbox_id=box),
                "close_terminal": await load.call(client, "close_terminal", terminal_id=terminal_id),
            }
            assert all(a["code"] != "INTERNAL_ERROR" for a in after.values()), after
            assert (
                after["send_process_input"]["reason"]
                == f"process {pid} has ended with its sandbox: it reads no more input"
            )
            assert (
                after["terminal_send"]["reason"] == f"terminal {terminal_id} has ended with its sandbox: open another"
            )
            assert after["execute_code"]["code"] == "CONFLICT"  # a new agent, a new context: restart=true says so
            assert "restart=true" in after["execute_code"]["reason"]
            again = await load.call(client, "run_command", command="echo back", sandbox_id=box)
            assert again["detail"]["stdout"] == "back\n", again
            assert (await load.call(client, "close_sandbox", sandbox_id=box))["ok"]
        assert processes_with(f"sleep\0{marker}") == []
        live_pid, processes = server.pid, descendants(server.pid)
        server.signal(signal.SIGTERM)
        assert server.wait() == 0, server.log()
        assert settled_leftovers(root, live_pid, processes).none
        assert internal_errors(server.log()) == []
    finally:
        server.stop()
    answered_calls_are_logged(load.answers, root / "state" / "audit.jsonl")

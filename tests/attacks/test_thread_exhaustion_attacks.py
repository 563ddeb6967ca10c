"""A server whose host runs out of threads and processes (found by attack, 2026-12-07).

The attack: the server's own process put in a pids cgroup at its limit, as a busy host or a neighbour's fork
flood leaves it; forks and thread starts fail with EAGAIN. Forks were refused cleanly; threads started on demand
were not: the audit log's writer and flusher threads, started at their first use, broke the log for good (every
later call AUDIT_UNAVAILABLE, after the limit was lifted too, and a traceback at shutdown), and a
`close_sandbox` whose reap thread could not start answered INTERNAL_ERROR, the sandbox already forgotten, its
disk and cgroups left past the server's exit. What this proves, against a real `bastion serve --stdio` in a real
pids cgroup: each call is answered with a result, nothing is left half made, and the server works again once
the limit is lifted, its audit chain whole. What it does not prove: a cgroup v2-only host (the v1 pids hierarchy
is used here; the kernel's limit is the same).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters

from tests.helpers import BASTION, demo_config_at, mounts_under, spawned_env

PIDS = Path("/sys/fs/cgroup/pids")
pytestmark = [
    pytest.mark.anyio,
    pytest.mark.root,
    pytest.mark.bwrap,
    pytest.mark.skipif(os.geteuid() != 0 or not PIDS.is_dir(), reason="moves the server into a v1 pids cgroup"),
]


@contextlib.contextmanager
def no_new_task(pid: int, name: str) -> Iterator[None]:
    """`pid` in a pids cgroup of its own whose limit is what it holds now: no thread or process can start in it.
    Moved back, and the group removed, after."""
    group = PIDS / name
    group.mkdir()
    try:
        (group / "cgroup.procs").write_text(str(pid))
        (group / "pids.max").write_text((group / "pids.current").read_text().strip())
        yield
    finally:
        (group / "pids.max").write_text("max")
        for task in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # gone meanwhile
                (PIDS / "cgroup.procs").write_text(task)
        group.rmdir()


def serving(config: Path, pid_file: Path, log: Path) -> StdioServerParameters:
    """`bastion serve --stdio` through a shell that writes its pid first (the server is that pid: exec)."""
    command = f'echo $$ > "{pid_file}"; exec "{BASTION}" serve --config "{config}" --stdio 2>>"{log}"'
    return StdioServerParameters(command="/bin/sh", args=["-c", command], env=spawned_env())


async def call(client: Client, tool: str, **args: Any) -> dict[str, Any]:
    payload = (await client.call_tool(tool, args)).structured_content
    assert payload is not None, f"{tool} answered without a result"
    return payload


async def test_a_thread_shortage_at_the_first_mutating_call_does_not_break_the_audit_log(tmp_path: Path) -> None:
    config = demo_config_at(tmp_path / "demo")
    pid_file, log = tmp_path / "pid", tmp_path / "server.log"
    async with Client(serving(config, pid_file, log)) as client:
        with no_new_task(int(pid_file.read_text()), f"bastion-test-{os.getpid()}-audit"):
            limited = await call(client, "run_command", command="echo hi")
        assert limited["code"] in ("UNAVAILABLE", "RESOURCE_LIMIT", "OK"), limited
        for _ in range(3):
            after = await call(client, "run_command", command="echo again")
            assert after["ok"], after
            assert after["detail"]["stdout"] == "again\n"
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    verified = subprocess.run(
        [str(BASTION), "audit", "verify", "--config", str(config)], capture_output=True, timeout=60
    )
    assert verified.returncode == 0, verified.stdout


async def test_a_close_whose_reap_thread_cannot_start_still_closes_and_leaves_nothing(tmp_path: Path) -> None:
    config = demo_config_at(tmp_path / "demo")
    pid_file, log = tmp_path / "pid", tmp_path / "server.log"
    sandboxes = tmp_path / "demo" / "state" / "sandboxes"
    async with Client(serving(config, pid_file, log)) as client:
        box = (await call(client, "create_sandbox"))["detail"]["sandbox_id"]
        assert (await call(client, "run_command", sandbox_id=box, command="echo hi"))["ok"]
        with no_new_task(int(pid_file.read_text()), f"bastion-test-{os.getpid()}-close"):
            closed = await call(client, "close_sandbox", sandbox_id=box)
        assert closed["code"] in ("OK", "UNAVAILABLE"), closed
        if not closed["ok"]:  # cut short while the host had no room: "try again" closes it now
            again = await call(client, "close_sandbox", sandbox_id=box)
            assert again["ok"], again
        assert not (sandboxes / box).exists()  # before the server's exit, which would remove it anyway
        listed = [entry["sandbox_id"] for entry in (await call(client, "list_sandboxes"))["detail"]["sandboxes"]]
        assert box not in listed
    assert mounts_under(tmp_path / "demo") == []
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


async def test_a_create_refused_for_want_of_a_thread_builds_nothing_later(tmp_path: Path) -> None:
    """Found by review: a create whose builder thread could not start was answered UNAVAILABLE, but its task stayed
    queued in the pool and ran at the next create: a sandbox folder, disk image and mount nobody tracked, past
    max_sandboxes. Invariant: the pools' threads are started with the server; a create under the limit is one
    sandbox or a refusal, and after it exactly the sandboxes listed are on disk."""
    config = demo_config_at(tmp_path / "demo")
    text = config.read_text()
    config.write_text(text.replace("[sandboxes]\nenabled = true\n", "[sandboxes]\nenabled = true\nwarm_pool = 0\n", 1))
    pid_file, log = tmp_path / "pid", tmp_path / "server.log"
    sandboxes = tmp_path / "demo" / "state" / "sandboxes"
    async with Client(serving(config, pid_file, log)) as client:
        assert (await call(client, "run_command", command="echo warm"))["ok"]
        with no_new_task(int(pid_file.read_text()), f"bastion-test-{os.getpid()}-create"):
            limited = await call(client, "create_sandbox")
        assert limited["code"] in ("OK", "UNAVAILABLE"), limited
        await call(client, "create_sandbox")
        listed = [entry["sandbox_id"] for entry in (await call(client, "list_sandboxes"))["detail"]["sandboxes"]]
        on_disk = sorted(p.name for p in sandboxes.iterdir() if p.name.startswith("sb-"))
        assert on_disk == sorted(listed)
        assert len([m for m in mounts_under(sandboxes) if m.endswith("/workspace")]) == len(listed)
    assert mounts_under(tmp_path / "demo") == []
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]

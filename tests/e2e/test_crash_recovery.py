"""A server killed with SIGKILL leaves no process behind, and the next one recovers its sandboxes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import pytest
from mcp import Client, StdioServerParameters

from bastion.app import build_server, build_services
from bastion.config import load_config
from bastion.safety.audit import verify
from tests.helpers import BASTION, spawned_env, temp_socket_folders
from tests.helpers import processes_with as pids_with

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]


async def _sandbox_left_by_a_killed_server(demo_config_path: Path) -> str:
    """A stdio server that made a sandbox (with `kept.txt`) and was then killed with SIGKILL: the sandbox's id,
    once the server is gone."""
    # The SDK starts the server with a few variables only, not TMPDIR: pass it, or under xdist the killed
    # server's socket folder lands in /tmp, where neither the recovery nor the check below looks.
    args = ["serve", "--config", str(demo_config_path), "--stdio"]
    params = StdioServerParameters(command=str(BASTION), args=args, env=spawned_env(TMPDIR=tempfile.gettempdir()))
    marker = str(demo_config_path)
    seen: dict[str, str] = {}

    async def create_then_kill_the_server() -> None:
        async with Client(params) as client:
            created = await client.call_tool("create_sandbox", {})
            assert created.structured_content is not None
            seen["box"] = created.structured_content["detail"]["sandbox_id"]
            await client.call_tool("run_command", {"command": "echo survived > kept.txt", "sandbox_id": seen["box"]})
            (server_pid,) = pids_with(marker)
            os.kill(server_pid, signal.SIGKILL)
            await client.call_tool("list_sandboxes", {})

    with pytest.raises(BaseException):  # noqa: B017, PT011 - the transport breaks in whatever way it breaks
        await create_then_kill_the_server()
    box = seen["box"]
    sandbox_marker = str(demo_config_path.parent / "state" / "sandboxes" / box)
    for _ in range(100):
        if not pids_with(sandbox_marker) and not pids_with(marker):
            break
        await anyio.sleep(0.05)
    assert pids_with(marker) == []
    assert pids_with(sandbox_marker) == []
    return box


@pytest.mark.parametrize("reboot", [False, True], ids=["crash", "crash-then-reboot"])
async def test_killed_server_leaves_nothing_and_next_start_recovers(demo_config_path: Path, reboot: bool) -> None:
    """Invariant: after kill -9 of the server, no sandbox process survives; the next server
    removes the orphan cgroup and folder and keeps the workspace as a restorable snapshot."""
    sockets_before = temp_socket_folders()
    box = await _sandbox_left_by_a_killed_server(demo_config_path)
    config = load_config(demo_config_path)
    sandbox_dir = config.sandboxes_dir / box
    assert sandbox_dir.is_dir()
    if reboot:
        if not os.path.ismount(sandbox_dir / "workspace"):
            pytest.skip("no per-sandbox filesystem here (disk_quota is off): nothing is unmounted by a reboot")
        # A reboot unmounts everything; the image file stays.
        subprocess.run(["umount", str(sandbox_dir / "workspace")], check=True)
    services = build_services(config)
    try:
        assert not sandbox_dir.exists()
        async with Client(build_server(services, caller="test")) as client:
            listed = await client.call_tool("list_snapshots", {})
            assert listed.structured_content is not None
            snapshots = listed.structured_content["detail"]["snapshots"]
            (recovered,) = [s for s in snapshots if s["sandbox_id"] == box]
            assert recovered["recovered"] is True
            restored = await client.call_tool("restore_sandbox", {"snapshot_id": recovered["snapshot_id"]})
            assert restored.structured_content is not None
            new_box = restored.structured_content["detail"]["sandbox_id"]
            out = await client.call_tool("run_command", {"command": "cat kept.txt", "sandbox_id": new_box})
            assert out.structured_content is not None
            assert out.structured_content["detail"]["stdout"] == "survived\n"
    finally:
        services.close()
    # The killed server's egress socket folder (a temp folder, for this long state path) is gone too.
    assert temp_socket_folders() <= sockets_before


_RESTART_DYING_AFTER_THE_SNAPSHOT = """
import os, signal, sys
from bastion.app import build_services
from bastion.config import load_config
from bastion.workbench import manager

snapshot = manager.create_snapshot

def dying(*args, **kwargs):
    snapshot(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)  # the snapshot is made, its record is not

manager.create_snapshot = dying
build_services(load_config(sys.argv[1]))
"""


def _recoveries(audit_path: Path) -> list[dict[str, object]]:
    records = [json.loads(line) for line in audit_path.read_text().splitlines()]
    return [record for record in records if record.get("event") == "recovery"]


async def test_a_restart_killed_after_a_recovery_snapshot_leaves_its_recovery_in_the_chain(
    demo_config_path: Path,
) -> None:
    """Found by review: a start kept a crashed sandbox as a snapshot, deleted its folder, and only then wrote
    its `recovery` record, so a crash between (a kill, a full disk) left a recovered snapshot the audit chain
    never mentioned. The start's record of what it is about to keep is on disk before the snapshot, and the
    next start closes it with an end record naming the snapshot (made once: no second one)."""
    box = await _sandbox_left_by_a_killed_server(demo_config_path)
    config = load_config(demo_config_path)
    env = {**os.environ, "TMPDIR": tempfile.gettempdir()}
    dying = subprocess.run(
        [sys.executable, "-c", _RESTART_DYING_AFTER_THE_SNAPSHOT, str(demo_config_path)], env=env, check=False
    )
    assert dying.returncode == -signal.SIGKILL
    (started,) = _recoveries(config.audit_path)
    assert (started["phase"], started["what"], started["sandbox_id"]) == ("start", "sandbox", box)
    assert verify(config.audit_path).ok
    services = build_services(config)
    try:
        assert not (config.sandboxes_dir / box).exists()
        async with Client(build_server(services, caller="test")) as client:
            listed = await client.call_tool("list_snapshots", {})
            assert listed.structured_content is not None
            (recovered,) = [s for s in listed.structured_content["detail"]["snapshots"] if s["sandbox_id"] == box]
    finally:
        services.close()
    ended = [record for record in _recoveries(config.audit_path) if record["phase"] == "end"]
    assert [(record["sandbox_id"], record["snapshot_id"]) for record in ended] == [(box, recovered["snapshot_id"])]
    assert verify(config.audit_path).ok

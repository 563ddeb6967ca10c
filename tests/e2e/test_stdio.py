"""End to end over stdio: `bastion serve --stdio` spawned exactly as the README's Claude Desktop snippet does."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters

from bastion.safety.audit import verify
from bastion.serve import client_snippet
from tests.helpers import BASTION, INSPECTOR, NODE_TOOLS_MISSING, node_env, node_tools_installed, spawned_env

pytestmark = pytest.mark.anyio

TOOLS = {
    "run_command",
    "explain_command",
    "read_file",
    "write_file",
    "upload_file",
    "list_directory",
    "search_files",
    "edit_file",
    "list_templates",
    "create_sandbox",
    "list_sandboxes",
    "get_sandbox_status",
    "pause_sandbox",
    "resume_sandbox",
    "close_sandbox",
    "create_run_close",
    "snapshot_sandbox",
    "restore_sandbox",
    "list_snapshots",
    "delete_snapshot",
    "list_processes",
    "read_process_output",
    "send_process_input",
    "kill_process",
    "open_terminal",
    "terminal_send",
    "terminal_read",
    "terminal_resize",
    "close_terminal",
    "execute_code",
    "list_code_contexts",
    "install_package",
    "list_files",
    "plan_organize",
    "apply_plan",
    "move_file",
    "undo_last_action",
    "redo_last_action",
}
# The demo's gateway tools are named after it: <gateway>_<action>.
GATEWAY_PREFIX = "biscuit_"


def snippet_params(config_path: Path) -> StdioServerParameters:
    entry = json.loads(client_snippet(str(config_path)))["mcpServers"]["bastion"]
    command = entry["command"] if os.path.isabs(entry["command"]) else str(BASTION)
    return StdioServerParameters(command=command, args=entry["args"], env=spawned_env())


@pytest.mark.bwrap
async def test_stdio_session_runs_tools_and_records_them(demo_config_path: Path) -> None:
    """Invariant: over a real stdio transport every call answers an OperationResult, isError == not ok."""
    params = snippet_params(demo_config_path)
    assert params.args == ["serve", "--config", str(demo_config_path), "--stdio"]
    async with Client(params) as client:
        names = {tool.name for tool in (await client.list_tools()).tools}
        assert {name for name in names if not name.startswith(GATEWAY_PREFIX)} == TOOLS
        calls: list[tuple[str, dict[str, Any], bool]] = [
            ("run_command", {"command": "echo 'hello; world'"}, True),
            ("run_command", {"command": "echo hello; id"}, False),
            ("write_file", {"path": "notes/a.txt", "content": "hi\n"}, True),
            ("read_file", {"path": "notes/a.txt"}, True),
            ("read_file", {"path": "../../etc/passwd"}, False),
            ("list_directory", {"path": "notes"}, True),
            ("explain_command", {"command": "rm -rf /"}, True),
            ("run_command", {"command": "ls", "env": {"LD_PRELOAD": "/tmp/x.so"}}, False),
            ("no_such_tool", {}, False),
        ]
        for name, args, expect_ok in calls:
            result = await client.call_tool(name, args)
            payload = result.structured_content
            assert payload is not None, name
            assert payload["ok"] is expect_ok, (name, payload)
            assert result.is_error is (not payload["ok"])
            assert "Traceback" not in json.dumps(payload)
        echoed = await client.call_tool("run_command", {"command": "echo 'hello; world'"})
        assert echoed.structured_content is not None
        assert echoed.structured_content["detail"]["stdout"] == "hello; world\n"
    report = verify(demo_config_path.parent / "state" / "audit.jsonl")
    assert report.ok, report.first_error
    assert report.records >= len(calls)


@pytest.mark.bwrap
async def test_bastion_config_env_replaces_flag(demo_config_path: Path) -> None:
    env = {**os.environ, "BASTION_CONFIG": str(demo_config_path)}
    params = StdioServerParameters(command=str(BASTION), args=["serve", "--stdio"], env=env)
    async with Client(params) as client:
        result = await client.call_tool("run_command", {"command": "pwd"})
        assert result.structured_content is not None
        assert result.structured_content["detail"]["stdout"] == "/workspace\n"


def test_serve_without_config_exits_with_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "BASTION_CONFIG"}
    proc = subprocess.run(
        [str(BASTION), "serve", "--stdio"], env=env, capture_output=True, text=True, timeout=30, cwd=tmp_path
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "--config" in lines[0]
    assert "BASTION_CONFIG" in lines[0]


@pytest.mark.skipif(not node_tools_installed(), reason=NODE_TOOLS_MISSING)
def test_the_mcp_inspector_cli_lists_and_calls_over_stdio(demo_config_path: Path) -> None:
    """A client that is not the Python SDK (the MCP Inspector's CLI, on node) spawns
    `bastion serve --stdio`, lists the tools and calls a work tool and a sandbox tool; the
    calls are in the audit chain. The config comes through BASTION_CONFIG (the Inspector
    would take a --config after the command for its own)."""
    base = [str(INSPECTOR), "--cli", "-e", f"BASTION_CONFIG={demo_config_path}", str(BASTION), "serve", "--stdio"]

    def inspect(*args: str) -> dict[str, Any]:
        done = subprocess.run([*base, *args], capture_output=True, text=True, env=node_env(), timeout=180, check=False)
        assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-2000:]
        answer = json.loads(done.stdout)
        assert isinstance(answer, dict)
        return answer

    listed = inspect("--method", "tools/list")
    names = {tool["name"] for tool in listed["tools"]}
    assert {name for name in names if not name.startswith(GATEWAY_PREFIX)} == TOOLS
    wrote = inspect(
        "--method", "tools/call", "--tool-name", "write_file",
        "--tool-arg", "path=from-inspector.txt", "--tool-arg", "content=hello from node",
    )  # fmt: skip
    assert wrote["structuredContent"]["ok"] is True, wrote
    assert (demo_config_path.parent / "workspace" / "from-inspector.txt").read_text() == "hello from node"
    ran = inspect("--method", "tools/call", "--tool-name", "create_run_close", "--tool-arg", "command=echo $((6*7))")
    result = ran["structuredContent"]
    assert result["ok"] is True, ran
    assert result["detail"]["stdout"] == "42\n"
    assert ran["isError"] is False
    report = verify(demo_config_path.parent / "state" / "audit.jsonl")
    assert report.ok, report.first_error
    assert report.records >= 4  # two calls, each a start and an end record

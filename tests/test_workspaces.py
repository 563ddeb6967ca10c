"""Host workspace output handling through the real tools: redaction, truncation, escapes."""

from __future__ import annotations

from pathlib import Path

import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import load_config

pytestmark = pytest.mark.anyio

AWS_KEY = "AKIAIOSFODNN7EXAMPLE"


async def _run(client: Client, command: str) -> dict[str, object]:
    result = await client.call_tool("run_command", {"command": command})
    assert result.structured_content is not None
    return result.structured_content


async def test_secret_split_by_an_escape_sequence_is_still_redacted(client: Client) -> None:
    """Invariant: escapes are removed before redaction, so they cannot hide a secret from it."""
    payload = await _run(client, "printf 'AKIAIOSF\\033[0mODNN7EXAMPLE\\n'")
    stdout = payload["detail"]["stdout"]  # type: ignore[index]
    assert "\x1b" not in stdout
    assert AWS_KEY not in stdout
    assert "REDACTED" in stdout


async def test_truncation_never_leaves_half_a_secret(client: Client, workspace: object) -> None:
    """Invariant: a secret straddling the output cap leaves no prefix behind."""
    # 65,536 is the demo's max_output_bytes; the key starts 10 bytes before the cut.
    payload = await _run(client, f"printf '%065526d{AWS_KEY}tail' 0")
    detail = payload["detail"]
    assert payload["code"] == "OUTPUT_TRUNCATED"
    assert payload["ok"] is True
    stdout = detail["stdout"]  # type: ignore[index]
    assert "AKIA" not in stdout
    assert len(stdout) <= 65_536


async def test_cwd_inside_the_workspace(client: Client, workspace: object) -> None:
    await client.call_tool("run_command", {"command": "mkdir -p sub/dir"})
    result = await client.call_tool("run_command", {"command": "pwd", "cwd": "sub/dir"})
    assert result.structured_content is not None
    assert result.structured_content["detail"]["stdout"] == "/workspace/sub/dir\n"


@pytest.mark.parametrize(
    ("cwd", "code"),
    [("../..", "PATH_ESCAPE"), ("/etc", "PATH_ESCAPE"), ("missing", "NOT_FOUND"), ("README.md", "INVALID_REQUEST")],
)
async def test_cwd_outside_or_missing_is_refused(client: Client, cwd: str, code: str) -> None:
    result = await client.call_tool("run_command", {"command": "pwd", "cwd": cwd})
    assert result.structured_content is not None
    assert result.structured_content["code"] == code
    assert result.structured_content["detail"] == {}


async def test_memory_hog_is_resource_limit(demo_config_path: Path) -> None:
    """Invariant: a command past the workspace's memory limit is killed and reported RESOURCE_LIMIT."""
    text = demo_config_path.read_text()
    assert "memory_bytes = " in text
    demo_config_path.write_text(text.replace("memory_bytes = 1073741824", "memory_bytes = 67108864"))
    services = build_services(load_config(demo_config_path))
    try:
        async with Client(build_server(services, caller="test")) as client:
            result = await client.call_tool("run_command", {"command": "sort /dev/zero", "timeout_s": 20})
    finally:
        services.close()
    assert result.structured_content is not None
    assert result.structured_content["code"] == "RESOURCE_LIMIT"
    assert result.is_error is True

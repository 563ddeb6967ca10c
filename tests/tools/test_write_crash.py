"""`write_file` over an existing file, the server killed mid-call (found by attack: crash points, 2026-12-07).

The file was truncated and rewritten in place: a server killed while it wrote left it empty or part-written, its
old content lost (7 of 20 random kills; every kill at the first write after the truncate). What this proves,
against a real `bastion serve --stdio` killed by strace at the entry of one system call: the file holds its old
content or the new one, whole, and no temporary file is left in the workspace. What it does not prove: a kill
between the new file's naming and its rename (two system calls apart) leaves its `.bastion-edit-*.tmp` (SECURITY.md).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import anyio
import pytest
from mcp import Client, StdioServerParameters

from tests.helpers import BASTION, mounts_under, spawned_env

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(shutil.which("strace") is None, reason="kills the server at a system call (make test-deps)"),
]

OLD = b"old line\n" * 200_000
NEW = "NEW LINE\n" * 200_000


@pytest.mark.parametrize(
    ("syscall", "on_the_file"),
    [
        ("write", True),  # the old code's first write after its truncate
        ("linkat", False),  # the new file, whole and synced, about to be named for its rename
    ],
)
async def test_a_server_killed_while_write_file_replaces_a_file_leaves_the_old_content_or_the_new_whole(
    demo_config_path: Path, syscall: str, on_the_file: bool
) -> None:
    text = demo_config_path.read_text()
    demo_config_path.write_text(text.replace("[sandboxes]\nenabled = true\n", "[sandboxes]\nenabled = false\n", 1))
    workspace = demo_config_path.parent / "workspace"
    big = workspace / "big.txt"
    big.write_bytes(OLD)
    only = ["-P", str(big)] if on_the_file else []
    strace = ["-f", "-qq", "-o", "/dev/null", *only, "-e", f"trace={syscall}", "-e", f"inject={syscall}:signal=KILL"]
    serve = [str(BASTION), "serve", "--config", str(demo_config_path), "--stdio"]
    params = StdioServerParameters(command="strace", args=[*strace, *serve], env=spawned_env())
    killed = False
    with anyio.fail_after(120):
        try:
            async with Client(params) as client:
                await client.call_tool("write_file", {"path": "big.txt", "content": NEW})
        except Exception:  # the server died mid-call: the client's connection is gone
            killed = True
    # The next start recovers what the killed one left (its mounts), and leaves nothing at its close.
    async with Client(StdioServerParameters(command=serve[0], args=serve[1:], env=spawned_env())) as client:
        assert (await client.call_tool("list_directory", {"path": "."})).structured_content is not None
    assert mounts_under(demo_config_path.parent) == []
    data = big.read_bytes()
    assert data in (OLD, NEW.encode()), f"big.txt is neither its old content nor its new after the kill: {len(data)}"
    assert not [p.name for p in workspace.iterdir() if re.fullmatch(r"\.bastion-edit-[0-9a-f]+\.tmp", p.name)]
    if syscall == "linkat":
        assert killed, "the crash point was not reached"
        assert data == OLD

"""The naive baseline: the SDK, `subprocess.run(cmd, shell=True)` and plain `open()`.

No policy, no jail, no sandbox, no audit: what bastion is measured against.
Run: python bench/naive_server.py ROOT (serves stdio).
"""

from __future__ import annotations

import os
import subprocess
import sys

from mcp.server.mcpserver import MCPServer

ROOT = sys.argv[1]
server = MCPServer(name="naive", log_level="WARNING")


@server.tool()
async def run_command(command: str) -> dict[str, object]:
    proc = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=60)
    return {"exit_status": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


@server.tool()
async def read_file(path: str) -> dict[str, object]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        return {"content": handle.read()}


if __name__ == "__main__":
    server.run("stdio")

"""The bare baseline for bench_http.py: the SDK's `MCPServer` serving `explain_command` over Streamable HTTP.

The same tool as bastion's (the workspace's command policy decides; nothing runs), the same transport
(uvicorn, stateful /mcp with SSE responses, both protocol eras) and no auth, audit log, call contract or
bastion middleware: what bastion's HTTP tool path is measured against.
Run: python bench/bare_http_server.py CONFIG PORT
"""

from __future__ import annotations

import sys

import uvicorn
from mcp.server.mcpserver import MCPServer

from bastion.config import load_config
from bastion.safety.commands import CommandPolicy

config = load_config(sys.argv[1])
workspace = config.workspace_by_id(config.default_workspace)
assert workspace is not None
policy = CommandPolicy(workspace.policy)
server = MCPServer(name="bare", log_level="WARNING")


@server.tool(name="explain_command")
async def explain_command(command: str) -> dict[str, object]:
    decision = policy.explain(command)
    return {
        "allowed": decision.allowed,
        "rule": decision.rule,
        "reason": decision.reason,
        "argv": list(decision.argv),
        "executable": decision.executable,
    }


if __name__ == "__main__":
    uvicorn.run(
        server.streamable_http_app(),
        host="127.0.0.1",
        port=int(sys.argv[2]),
        log_level="warning",
        access_log=False,
        server_header=False,
    )

"""Run the server on a transport, telling the operator on stderr what it is doing."""

from __future__ import annotations

import json
import os
import sys

import anyio

from bastion.app import build_server, build_services
from bastion.config import Config


def client_snippet(config_path: str) -> str:
    """The Claude Desktop / Claude Code `mcpServers` entry that spawns this server over stdio."""
    command = os.path.abspath(sys.argv[0]) if os.path.basename(sys.argv[0]) == "bastion" else "bastion"
    entry = {"mcpServers": {"bastion": {"command": command, "args": ["serve", "--config", config_path, "--stdio"]}}}
    return json.dumps(entry, indent=2)


def serve_stdio(config: Config, config_path: str) -> int:
    services = build_services(config)
    server = build_server(services, caller="stdio")
    absolute = os.path.abspath(config_path)
    workspaces = ", ".join(f"{ws.id}={ws.path}" for ws in config.workspace)
    if sys.stdin.isatty():
        print(
            f"bastion: serving MCP over stdio from {absolute}\n"
            f"bastion: workspaces: {workspaces}; audit log: {config.audit_path}\n"
            "bastion: this process speaks JSON-RPC on stdin/stdout: an MCP client should start it.\n"
            "bastion: for Claude Desktop (claude_desktop_config.json) or Claude Code (.mcp.json), add:\n"
            f"{client_snippet(absolute)}\n"
            "bastion: press Ctrl-D or Ctrl-C to stop.",
            file=sys.stderr,
        )
    else:
        print(f"bastion: serving MCP over stdio from {absolute} (workspaces: {workspaces})", file=sys.stderr)
    try:
        anyio.run(server.run_stdio_async)
    finally:
        services.close()
    return 0

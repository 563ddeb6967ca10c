"""MCP wiring of preview URLs: expose_port, unexpose_port, list_exposed_ports (`bastion.workbench.previews`)."""

from __future__ import annotations

from typing import Annotated

from mcp_types import ToolAnnotations
from pydantic import Field

from bastion.tools.audited import audited_tool, workspace_of
from bastion.tools.server import BastionServer
from bastion.workbench.previews import PreviewRegistry
from bastion.workbench.registry import WorkspaceRegistry

SandboxIdArg = Annotated[str, Field(description="The sandbox id from create_sandbox, e.g. sb-1a2b3c4d5e6f.")]
PortArg = Annotated[int, Field(description="A TCP port a server listens on at 127.0.0.1 inside the sandbox, 1-65535.")]


def register_previews(server: BastionServer, previews: PreviewRegistry, registry: WorkspaceRegistry) -> None:
    """Add the preview URL tools to `server`."""
    in_sandbox = workspace_of("sandbox_id")

    def agent_owned(sandbox_id: str, what: str) -> None:
        registry.resolve(sandbox_id).workspace.require_sandbox(what)

    @audited_tool(
        server,
        "expose_port",
        mutating=True,
        # Opens a URL from outside to a server in the sandbox; replaces nothing but an earlier URL of that port.
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=True
        ),
        workspace=in_sandbox,
        title="Expose a sandbox port as a URL",
        description=(
            "Give a URL that opens, in a browser, what a server in the sandbox serves on 127.0.0.1:port (HTTP and "
            "WebSocket), e.g. after 'python3 -m http.server 8000 &'. The URL is a secret capability: it works "
            "until the sandbox closes, the URL's lifetime ends (expires_in_s) or unexpose_port; it also needs "
            "the administrator's login unless public=true (only if the administrator allows public previews). "
            "A new URL for the same port replaces the old one. The app sees paths without the /preview/<token> "
            "prefix: use relative links."
        ),
    )
    async def expose_port(sandbox_id: SandboxIdArg, port: PortArg, public: bool = False) -> dict[str, object]:
        agent_owned(sandbox_id, "expose_port")
        return previews.expose(sandbox_id, port, public=public)

    @audited_tool(
        server,
        "unexpose_port",
        mutating=True,
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False
        ),
        workspace=in_sandbox,
        title="Stop a preview URL",
        description="Stop the preview URL of a sandbox port: it answers 404 from now on. The server keeps running.",
    )
    async def unexpose_port(sandbox_id: SandboxIdArg, port: PortArg) -> dict[str, object]:
        agent_owned(sandbox_id, "unexpose_port")
        previews.unexpose(sandbox_id, port)
        return {"sandbox_id": sandbox_id, "port": port, "state": "unexposed"}

    @audited_tool(
        server,
        "list_exposed_ports",
        mutating=False,
        annotations=ToolAnnotations(
            read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False
        ),
        workspace=in_sandbox,
        title="List preview URLs",
        description="List a sandbox's live preview URLs: url, port, public, expires_in_s.",
    )
    async def list_exposed_ports(sandbox_id: SandboxIdArg) -> dict[str, object]:
        agent_owned(sandbox_id, "list_exposed_ports")
        return {"sandbox_id": sandbox_id, "previews": previews.summaries(sandbox_id)}

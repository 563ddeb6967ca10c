"""The second scope check, inside the MCP server (`ScopeMiddleware`), without the HTTP edge in front.

What this proves: even if a request reached the server without passing `RequireToken` (a future route,
a batch the edge did not parse), `tools/list` hides the tools outside the token's scopes and `tools/call`
refuses them with FORBIDDEN, on both protocol eras; with no token at all, nothing is listed or callable;
a tool registered without a toolset (bypassing `BastionServer.tool`) is neither listed nor callable.
What it does not prove: the HTTP 401/403 answers (see test_flow and test_negative).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from mcp import Client
from mcp.server.auth.middleware.auth_context import auth_context_var
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken

from bastion.app import Services, build_server
from bastion.tools.server import SCOPES, BastionServer
from bastion.transports.http.scopes import ScopeMiddleware
from tests.helpers import call

pytestmark = pytest.mark.anyio
ran: list[str] = []


async def _connected(
    services: Services, scopes: list[str] | None, mode: str, *, unscoped: bool = False
) -> AsyncIterator[Client]:
    server = build_server(services, caller="test")
    if unscoped:
        ran.clear()

        async def unscoped_tool() -> str:
            ran.append("unscoped")
            return "ran"

        # The SDK's own registration, as a future tool added without a toolset would be.
        super(BastionServer, server).tool(name="unscoped_tool", description="no toolset")(unscoped_tool)
    server.middleware.append(ScopeMiddleware(server))
    token = None
    if scopes is not None:
        user = AuthenticatedUser(AccessToken(token="t" * 43, client_id="c", scopes=scopes, subject="g"))
        token = auth_context_var.set(user)
    try:
        async with Client(server, mode=mode) as client:
            yield client
    finally:
        if token is not None:
            auth_context_var.reset(token)


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_inner_check_hides_and_refuses_tools_outside_the_scopes(services: Services, mode: str) -> None:
    async for client in _connected(services, ["organizer"], mode):
        names = {tool.name for tool in (await client.list_tools()).tools}
        assert "list_files" in names
        assert "run_command" not in names
        refused = await call(client, "run_command", command="id")
        assert refused["code"] == "FORBIDDEN"
        assert "workbench" in str(refused["reason"])
        assert (await call(client, "list_files"))["ok"]


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_inner_check_fails_closed_without_a_token(services: Services, mode: str) -> None:
    async for client in _connected(services, None, mode):
        assert (await client.list_tools()).tools == []
        assert (await call(client, "list_files"))["code"] == "FORBIDDEN"


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_a_tool_without_a_toolset_is_never_callable(services: Services, mode: str) -> None:
    async for client in _connected(services, list(SCOPES), mode, unscoped=True):
        assert "unscoped_tool" not in {tool.name for tool in (await client.list_tools()).tools}
        refused = await call(client, "unscoped_tool")
        assert refused["code"] == "INVALID_REQUEST", refused
        assert ran == []
        assert (await call(client, "list_files"))["ok"]

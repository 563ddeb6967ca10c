"""Bearer tokens and scopes at /mcp.

SECURITY BOUNDARY. Two checks, on purpose (a tools/list-only filter is a known CVE pattern):
1. At the HTTP edge (`RequireToken`): no valid token is 401 with `WWW-Authenticate` naming the
   protected-resource metadata (absolute URL) and the scopes (MCP 2025-11-25, RFC 6750 §3.1, RFC 9728
   §5.1); a `tools/call` for a tool outside the token's scopes is 403 `insufficient_scope`, naming the
   scope needed, so the client can ask the administrator for more.
2. Inside the MCP server (`ScopeMiddleware`): `tools/list` shows only the tools the token's scopes
   allow, and `tools/call` is checked again, so a path that slipped past the edge still cannot call.
"""

from __future__ import annotations

from typing import Any

from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp_types import ListToolsResult
from starlette.types import ASGIApp, Receive, Scope, Send

from bastion.safety.errors import Forbidden
from bastion.tools.server import BastionServer, to_call_result
from bastion.transports.http.bodies import BodyBudget, body_or_refusal, replay, send_json
from bastion.transports.http.sessions import body_facts, send_rpc_error


def _challenge(resource_metadata: str, scopes: str, error: str | None, description: str | None) -> str:
    parts = []
    if error:
        parts.append(f'error="{error}"')
    if description:
        parts.append(f'error_description="{description}"')
    parts.append(f'resource_metadata="{resource_metadata}"')
    parts.append(f'scope="{scopes}"')
    return "Bearer " + ", ".join(parts)


async def _send_parse_error(send: Send) -> None:
    """400 with a JSON-RPC parse error (-32700), as the SDK's transport answers a body it cannot parse."""
    await send_rpc_error(send, 400, -32700, "Parse error: the body is not valid JSON")


def _called_tools(scope: Scope, body: bytes) -> list[str] | None:
    """Names of the tools a JSON-RPC message (or batch) calls; [] if it calls none; None if it does not parse."""
    # A fast pass for most messages; JSON may also spell the method with an escape ("tools\/call", "\u0074..."),
    # which skipped this check (the inner one still refused, without the 403 that names the scope to ask for).
    if b"tools/call" not in body and b"\\" not in body:
        return []
    facts = body_facts(scope, body)
    return list(facts.tools) if facts.parsed else None


class RequireToken:
    """ASGI wrapper for /mcp: a valid token, and the scope of every tool a request calls."""

    def __init__(
        self, app: ASGIApp, *, tool_scopes: dict[str, str], resource_metadata: str, scopes: str, bodies: BodyBudget
    ) -> None:
        self.app = app
        self.tool_scopes = tool_scopes
        self.resource_metadata = resource_metadata
        self.scopes = scopes
        self.bodies = bodies

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        user = scope.get("user")
        if not isinstance(user, AuthenticatedUser):
            presented = any(key == b"authorization" for key, _ in scope.get("headers", ()))
            error = "invalid_token" if presented else None
            description = "the access token is invalid, expired or revoked" if presented else None
            header = _challenge(self.resource_metadata, self.scopes, error, description)
            body = {"error": error or "invalid_request", "error_description": description or "authorization required"}
            await send_json(send, 401, body, [(b"www-authenticate", header.encode())])
            return
        if scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        async with body_or_refusal(self.bodies, scope, receive, send) as raw:
            if raw is not None:
                await self._checked(user, raw, scope, receive, send)

    async def _checked(self, user: AuthenticatedUser, raw: bytes, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on if every tool it calls is in the token's scopes; else 403 naming the one needed."""
        called = _called_tools(scope, raw)
        if called is None:
            await _send_parse_error(send)
            return
        granted = set(user.scopes)
        for name in called:
            needed = self.tool_scopes.get(name)
            if needed is not None and needed not in granted:
                description = f"{name} needs the {needed} scope"
                header = _challenge(self.resource_metadata, needed, "insufficient_scope", description)
                body_out = {"error": "insufficient_scope", "error_description": description}
                await send_json(send, 403, body_out, [(b"www-authenticate", header.encode())])
                return
        await self.app(scope, replay(raw, receive), send)


def token_scopes(ctx: ServerRequestContext[Any, Any]) -> set[str] | None:
    """The scopes of the token behind this MCP request, or None if there is none."""
    request = ctx.request
    user = getattr(request, "scope", {}).get("user") if request is not None else None
    if isinstance(user, AuthenticatedUser):
        return set(user.scopes)
    token = get_access_token()
    return set(token.scopes) if token is not None else None


def _name(tool: object) -> str:
    name = tool.get("name") if isinstance(tool, dict) else None
    return name if isinstance(name, str) else ""


class ScopeMiddleware:
    """MCP server middleware: hide and refuse the tools outside the token's scopes. Fails closed."""

    def __init__(self, server: BastionServer) -> None:
        self.server = server

    async def __call__(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        if ctx.method == "tools/list":
            granted = token_scopes(ctx) or set()
            result = await call_next(ctx)
            # The chain returns the wire form (a dict); a model is handled too, in case that changes.
            if isinstance(result, ListToolsResult):
                allowed = [t for t in result.tools if self.server.tool_scopes.get(t.name) in granted]
                return result.model_copy(update={"tools": allowed})
            if isinstance(result, dict) and isinstance(result.get("tools"), list):
                kept = [t for t in result["tools"] if self.server.tool_scopes.get(_name(t)) in granted]
                return {**result, "tools": kept}
            return None if result is None else {"tools": []}
        if ctx.method == "tools/call":
            params = ctx.params or {}
            name = params.get("name")
            name = name if isinstance(name, str) else ""
            needed = self.server.tool_scopes.get(name)
            granted = token_scopes(ctx) or set()
            arguments = params.get("arguments")
            arguments = arguments if isinstance(arguments, dict) else {}
            if needed is None:
                # A tool without a toolset (or no tool at all) is hidden from tools/list: never callable.
                unknown = await self.server.refuse_unknown_tool(name, arguments)
                return unknown.model_dump(by_alias=True, mode="json", exclude_none=True)
            if needed not in granted:
                error = Forbidden(f"this token does not have the {needed} scope: ask the administrator to grant it")
                refused = await self.server.runner.refuse(name, arguments, error)
                return to_call_result(refused).model_dump(by_alias=True, mode="json", exclude_none=True)
        return await call_next(ctx)

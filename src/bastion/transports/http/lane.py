"""The POST /mcp lane: every tool call's request, past Starlette's stack in one layer.

SECURITY BOUNDARY (the bearer check of tool calls). A POST to exactly /mcp gets what Starlette's stack
gave it, in the same order, with the same objects: the bearer check (`AuthenticationMiddleware` with the
SDK's `BearerAuthBackend` over the cached verifier: `scope["user"]` and `scope["auth"]`), the
authenticated user in the SDK's auth context, then the /mcp endpoint itself (CORS, `RequireToken`,
`SessionCap`, the SDK's app). What it leaves out does nothing for that request: the router's matching
(the route is known), its method check (POST is allowed), and the error and exception middleware
(nothing on this path raises `HTTPException`; an exception still reaches uvicorn, which answers 500 and
logs it, as `ServerErrorMiddleware` did). Every other request goes through Starlette unchanged.
"""

from __future__ import annotations

from mcp.server.auth.middleware.auth_context import auth_context_var
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser, BearerAuthBackend
from starlette.authentication import AuthCredentials, AuthenticationError, UnauthenticatedUser
from starlette.requests import HTTPConnection
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["McpLane"]


class McpLane:
    """POST /mcp to `endpoint` after the bearer check (when `backend` is set); the rest to `app`."""

    def __init__(self, app: ASGIApp, endpoint: ASGIApp, backend: BearerAuthBackend | None) -> None:
        self.app = app
        self.endpoint = endpoint
        self.backend = backend

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/mcp":
            await self.app(scope, receive, send)
            return
        if self.backend is None:
            await self.endpoint(scope, receive, send)
            return
        try:
            found = await self.backend.authenticate(HTTPConnection(scope))
        except AuthenticationError as exc:  # as AuthenticationMiddleware's default on_error
            await PlainTextResponse(str(exc), status_code=400)(scope, receive, send)
            return
        scope["auth"], scope["user"] = found if found is not None else (AuthCredentials(), UnauthenticatedUser())
        user = scope["user"]
        if not isinstance(user, AuthenticatedUser):
            await self.endpoint(scope, receive, send)  # RequireToken answers 401
            return
        token = auth_context_var.set(user)
        try:
            await self.endpoint(scope, receive, send)
        finally:
            auth_context_var.reset(token)

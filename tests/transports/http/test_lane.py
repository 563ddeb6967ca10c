"""McpLane: POST /mcp gets Starlette's bearer check and auth context in one layer; the rest goes to Starlette."""

from __future__ import annotations

import anyio
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser, BearerAuthBackend
from mcp.server.auth.provider import AccessToken
from starlette.types import Message, Receive, Scope, Send

from bastion.transports.http.lane import McpLane

TOKEN = "t" * 43


class Tokens:
    """A TokenVerifier that knows one token (the store's own lookups are tested with the store)."""

    async def verify_token(self, token: str) -> AccessToken | None:
        if token != TOKEN:
            return None
        return AccessToken(token=token, client_id="client-1", scopes=["workbench"], expires_at=None)


class Seen:
    """An ASGI app that records what reached it: the user, the auth context's client, and which app."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[str, object, str | None]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = get_access_token()
        self.calls.append((self.name, scope.get("user"), token.client_id if token else None))


def _request(method: str, path: str, authorization: str | None) -> Scope:
    headers = [(b"host", b"127.0.0.1:8765")]
    if authorization is not None:
        headers.append((b"authorization", authorization.encode()))
    return {"type": "http", "method": method, "path": path, "headers": headers}


async def _receive() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _send(message: Message) -> None:
    del message


def _through(scope: Scope) -> tuple[Seen, Seen]:
    starlette, endpoint = Seen("starlette"), Seen("endpoint")
    lane = McpLane(starlette, endpoint, BearerAuthBackend(Tokens()))
    anyio.run(lane, scope, _receive, _send)
    return starlette, endpoint


def test_post_mcp_with_a_valid_token_reaches_the_endpoint_authenticated() -> None:
    starlette, endpoint = _through(_request("POST", "/mcp", f"Bearer {TOKEN}"))
    assert starlette.calls == []
    [(_, user, client)] = endpoint.calls
    assert isinstance(user, AuthenticatedUser)
    assert client == "client-1"
    assert get_access_token() is None  # the auth context is reset after the request


def test_post_mcp_with_a_bad_token_reaches_the_endpoint_unauthenticated() -> None:
    """The endpoint's RequireToken answers 401: the lane never lets an unknown token pass as a user."""
    for header in (f"Bearer {TOKEN}x", f"Basic {TOKEN}", None):
        _, endpoint = _through(_request("POST", "/mcp", header))
        [(_, user, client)] = endpoint.calls
        assert not isinstance(user, AuthenticatedUser)
        assert client is None


def test_other_requests_go_through_starlette_untouched() -> None:
    for method, path in (("GET", "/mcp"), ("DELETE", "/mcp"), ("POST", "/mcp/"), ("POST", "/token")):
        starlette, endpoint = _through(_request(method, path, f"Bearer {TOKEN}"))
        assert endpoint.calls == []
        [(_, user, _)] = starlette.calls
        assert user is None  # Starlette's own middleware authenticates these, as before

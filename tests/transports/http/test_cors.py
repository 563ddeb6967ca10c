"""McpCors answers exactly as Starlette's CORSMiddleware with the same arguments, with or without an Origin."""

from __future__ import annotations

import anyio
from hypothesis import given
from hypothesis import strategies as st
from starlette.middleware.cors import CORSMiddleware
from starlette.types import Message, Receive, Scope, Send

from bastion.transports.http.cors import McpCors

ORIGINS = ["http://127.0.0.1:8765", "http://localhost:6274"]
ARGUMENTS = {
    "allow_origins": ORIGINS,
    "allow_methods": ["GET", "POST", "DELETE", "OPTIONS"],
    "allow_headers": ["authorization", "content-type", "mcp-session-id"],
    "expose_headers": ["WWW-Authenticate", "Mcp-Session-Id"],
}
HEADER_NAMES = st.sampled_from([b"vary", b"content-type", b"mcp-session-id", b"x-content-type-options"])
HEADER_VALUES = st.sampled_from([b"Accept", b"Accept-Encoding", b"application/json", b"abc", b"nosniff"])
RESPONSE_HEADERS = st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=6)
REQUEST_ORIGINS = st.sampled_from([None, *ORIGINS, "http://evil.example", "null"])


class App:
    """Answers with the given headers and body, and records what it was sent."""

    def __init__(self, headers: list[tuple[bytes, bytes]]) -> None:
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": list(self.headers)})
        await send({"type": "http.response.body", "body": b"{}", "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def _answer(middleware: type[McpCors] | type[CORSMiddleware], scope: Scope, app: App) -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    anyio.run(
        middleware(
            app,
            allow_origins=ARGUMENTS["allow_origins"],
            allow_methods=ARGUMENTS["allow_methods"],
            allow_headers=ARGUMENTS["allow_headers"],
            expose_headers=ARGUMENTS["expose_headers"],
        ),
        scope,
        receive,
        send,
    )
    for message in sent:
        if "headers" in message:
            message["headers"] = sorted(tuple(pair) for pair in message["headers"])
    return sent


def _scope(method: str, origin: str | None, preflight: bool = False) -> Scope:
    headers = [(b"host", b"127.0.0.1:8765"), (b"content-type", b"application/json")]
    if origin is not None:
        headers.append((b"origin", origin.encode()))
    if preflight:
        headers += [(b"access-control-request-method", b"POST"), (b"access-control-request-headers", b"authorization")]
    return {"type": "http", "method": method, "path": "/mcp", "headers": headers}


@given(RESPONSE_HEADERS, REQUEST_ORIGINS, st.sampled_from(["GET", "POST", "DELETE"]))
def test_a_response_is_the_one_starlette_would_send(
    headers: list[tuple[bytes, bytes]], origin: str | None, method: str
) -> None:
    scope = _scope(method, origin)
    assert _answer(McpCors, scope, App(headers)) == _answer(CORSMiddleware, scope, App(headers))


@given(REQUEST_ORIGINS)
def test_a_preflight_is_the_one_starlette_would_send(origin: str | None) -> None:
    scope = _scope("OPTIONS", origin, preflight=True)
    assert _answer(McpCors, scope, App([])) == _answer(CORSMiddleware, scope, App([]))


def test_a_request_without_an_origin_gets_vary_origin_and_no_cors_grant() -> None:
    [start, *_] = _answer(McpCors, _scope("POST", None), App([(b"vary", b"Accept")]))
    assert (b"vary", b"Accept, Origin") in start["headers"]
    assert not any(key.startswith(b"access-control-") for key, _ in start["headers"])


def test_an_allowed_origin_gets_its_grant_and_the_exposed_headers() -> None:
    [start, *_] = _answer(McpCors, _scope("POST", ORIGINS[1]), App([]))
    headers = dict(start["headers"])
    assert headers[b"access-control-allow-origin"] == ORIGINS[1].encode()
    assert b"mcp-session-id" in headers[b"access-control-expose-headers"].lower()


def test_response_headers_given_as_a_one_shot_iterator_are_all_kept() -> None:
    """ASGI allows any iterable of headers (found by an attack review: it was read twice)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        headers = iter([(b"content-type", b"application/json"), (b"mcp-session-id", b"s1")])
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})

    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    anyio.run(McpCors(app, **ARGUMENTS), _scope("POST", None), receive, send)
    assert sorted(sent[0]["headers"]) == [
        (b"content-type", b"application/json"),
        (b"mcp-session-id", b"s1"),
        (b"vary", b"Origin"),
    ]

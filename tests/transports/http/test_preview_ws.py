"""A preview's WebSocket when the browser is gone (issue 16, found by a review): bastion's sends to it fail
(uvicorn raises ClientDisconnected, an OSError), and the proxy must still end cleanly with a status to
audit, never raise past it (the audit record was then never written) nor leave a task's error unread.

The browser side is an ASGI `send` that fails as uvicorn's does once the client has gone; the app side is
a real socket, with a real WebSocket server (wsproto) or nothing behind it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from collections.abc import Iterator

import pytest
from starlette.types import Message
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request

from bastion.transports.http.preview_ws import proxy_websocket

SCOPE = {"type": "websocket", "subprotocols": []}


class GoneBrowser:
    """An ASGI browser side that has left: every send fails as uvicorn's does (ClientDisconnected is an OSError)."""

    def __init__(self) -> None:
        self.sends: list[Message] = []

    async def send(self, message: Message) -> None:
        self.sends.append(message)
        raise OSError("the client disconnected")

    async def receive(self) -> Message:
        return {"type": "websocket.disconnect", "code": 1001}


async def _accepting_app(sock: socket.socket) -> None:
    """A WebSocket server on `sock` that accepts the handshake, then waits for the end."""
    reader, writer = await asyncio.open_connection(sock=sock)
    ws = WSConnection(ConnectionType.SERVER)
    try:
        while data := await reader.read(65536):
            ws.receive_data(data)
            for event in ws.events():
                if isinstance(event, Request):
                    writer.write(ws.send(AcceptConnection()))
                    await writer.drain()
    finally:
        writer.close()


def _run(proxy_side: socket.socket, app_side: socket.socket | None, browser: GoneBrowser) -> tuple[int, int]:
    """`proxy_websocket` over `proxy_side`, with an accepting app on `app_side` (None: nobody there)."""

    async def main() -> tuple[int, int]:
        app = asyncio.ensure_future(_accepting_app(app_side)) if app_side is not None else None
        try:
            return await proxy_websocket(SCOPE, browser.receive, browser.send, proxy_side, 8080, b"/ws")
        finally:
            if app is not None:
                app.cancel()
                await asyncio.gather(app, return_exceptions=True)
            gc.collect()

    return asyncio.run(main())


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    proxy_side, app_side = socket.socketpair()
    for sock in (proxy_side, app_side):
        sock.setblocking(False)
    yield proxy_side, app_side
    proxy_side.close()
    app_side.close()


def test_a_browser_gone_when_the_app_refuses_still_gets_a_status(
    pair: tuple[socket.socket, socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    """The app closes at once (no handshake): bastion closes the browser's side, which is gone too."""
    proxy_side, app_side = pair
    app_side.close()
    browser = GoneBrowser()
    with caplog.at_level(logging.WARNING, logger="asyncio"):
        assert _run(proxy_side, None, browser) == (502, 0)
    assert browser.sends == [{"type": "websocket.close", "code": 1011}]
    assert "never retrieved" not in caplog.text


def test_a_browser_gone_during_the_apps_handshake_is_audited_as_499(
    pair: tuple[socket.socket, socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    """The app accepts, but the browser left while it did: the accept bastion passes on fails."""
    proxy_side, app_side = pair
    browser = GoneBrowser()
    with caplog.at_level(logging.WARNING, logger="asyncio"):
        assert _run(proxy_side, app_side, browser) == (499, 0)
    assert browser.sends == [{"type": "websocket.accept", "subprotocol": None}]
    assert "never retrieved" not in caplog.text

"""A preview's WebSocket end to end (security review, findings 4 and 6): a live `bastion serve --http`, a
real sandbox running the app, and a WebSocket client (wsproto over a socket) with the administrator's login.

- Every preview WebSocket was cut `request_head_timeout_s` after its connection opened (10 s by default),
  with no close frame. The server here has a short head deadline; its passing is seen, not slept: a plain
  socket opened after the WebSocket, which the server closes at its own deadline.
- An app sending endless empty fragments grew the proxy's memory with no limit; now it gets 1009.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from wsproto.events import AcceptConnection, CloseConnection

from .test_preview import APPS, WAIT_LISTENING, Preview, serving_preview
from .ws_relay import BrowserWebSocket

pytestmark = pytest.mark.bwrap

HEAD_TIMEOUT_S = 0.5
WAIT_S = 10.0
"""The bound on any one wait for the server (a failure, never a pace)."""


class Client(BrowserWebSocket):
    """A browser's WebSocket to a preview URL: the session cookie, the preview origin; accepted on entry."""

    def __init__(self, preview: Preview, url: str) -> None:
        super().__init__(preview.origin, url, preview.session)

    def __enter__(self) -> Client:
        assert isinstance(self.next(), AcceptConnection)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture(scope="module")
def preview(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Preview]:
    with serving_preview(tmp_path_factory, "preview-ws", f"request_head_timeout_s = {HEAD_TIMEOUT_S}\n") as served:
        yield served


def test_a_preview_websocket_outlives_the_request_head_deadline(preview: Preview) -> None:
    sandbox_id = preview.sandbox_with_servers()
    with Client(preview, preview.expose(sandbox_id, 8001)) as client:
        assert client.echo("before") == "before"
        host, port = preview.origin.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=WAIT_S) as idle:
            assert idle.recv(1) == b""  # its head deadline, armed after the WebSocket's, has passed
        assert client.echo("after the head deadline") == "after the head deadline"
        client.sock.sendall(client.ws.send(CloseConnection(code=1000)))
        closed = client.next()
        assert isinstance(closed, CloseConnection)
        assert closed.code == 1000
    assert preview.tool("close_sandbox", sandbox_id=sandbox_id)["ok"]


def test_a_sandbox_app_sending_endless_empty_fragments_is_closed_with_1009(preview: Preview) -> None:
    sandbox_id = preview.sandbox_with_servers()
    written = preview.tool(
        "write_file", sandbox_id=sandbox_id, path="ws_fragments.py", content=Path(APPS / "ws_fragments.py").read_text()
    )
    assert written["ok"], written
    preview.run(sandbox_id, "python3 ws_fragments.py 8002 20000 >/dev/null 2>&1 &")
    preview.run(sandbox_id, WAIT_LISTENING.replace("(8000, 8001)", "(8002,)"))
    with Client(preview, preview.expose(sandbox_id, 8002)) as client:
        closed = client.next()
    assert isinstance(closed, CloseConnection)
    assert closed.code == 1009
    assert preview.tool("close_sandbox", sandbox_id=sandbox_id)["ok"]
    assert "Traceback" not in preview.server.log()


@pytest.mark.parametrize("revoke", ["unexpose_port", "close_sandbox"])
def test_an_idle_websocket_ends_when_its_preview_is_revoked(preview: Preview, revoke: str) -> None:
    """Attack: a WebSocket opened before unexpose_port (or the sandbox's close) kept carrying the app's
    messages: a revoked URL still served, for as long as the browser and the app kept it. An idle one now
    gets close 1008 within about a second (`STANDING_CHECK_S`), and the URL is a 404."""
    sandbox_id = preview.sandbox_with_servers()
    url = preview.expose(sandbox_id, 8001)
    with Client(preview, url) as client:
        assert client.echo("before") == "before"
        arguments = {"port": 8001} if revoke == "unexpose_port" else {}
        assert preview.tool(revoke, sandbox_id=sandbox_id, **arguments)["ok"]
        closed = client.next()  # nothing else is sent: the close is the server's own
    assert isinstance(closed, CloseConnection)
    assert closed.code == 1008 or revoke == "close_sandbox", closed  # a closed sandbox's app may close first
    assert preview.get(url).status_code == 404
    if revoke == "unexpose_port":
        assert preview.tool("close_sandbox", sandbox_id=sandbox_id)["ok"]

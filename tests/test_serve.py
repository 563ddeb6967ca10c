"""The uvicorn servers of `bastion serve`: what their shutdown leaves to the requests it cancels.

A request still running when the graceful shutdown ends is cancelled; its call then writes its end
record in a shielded scope. uvicorn returned without waiting for it, and asyncio.run cancelled it again,
natively, through the shield: the record was lost (found by tests/load/test_fault_sigterm.py: a start
record without its end). The app here is a minimal ASGI app whose request unwinds the same way; the
servers, uvicorn and the loop are the real ones.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import uvicorn

from bastion.serve import clean_stop_server, listen_socket, quiet_server
from bastion.systemd import Notifier

UNWIND_S = 0.3


class SlowUnwind:
    """An ASGI app whose request, once cancelled, takes UNWIND_S in a shielded scope to finish."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.unwound: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        self.started.set()
        try:
            await anyio.sleep(60)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await anyio.sleep(UNWIND_S)
                self.unwound.append("end record")
            raise


def _server(kind: str, app: SlowUnwind) -> uvicorn.Server:
    config = uvicorn.Config(app, lifespan="on", timeout_graceful_shutdown=1, log_level="critical")
    if kind == "main":
        return clean_stop_server(Notifier(None), "serving")(config)
    return quiet_server()(config)


@pytest.mark.parametrize("kind", ["main", "quiet"])
def test_a_request_cancelled_at_shutdown_finishes_unwinding_before_the_loop_ends(kind: str) -> None:
    app = SlowUnwind()
    server = _server(kind, app)
    listener = listen_socket("127.0.0.1", 0, 8)
    port = listener.getsockname()[1]
    serving = threading.Thread(target=server.run, kwargs={"sockets": [listener]})
    serving.start()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert app.started.wait(10)
        server.should_exit = True
        serving.join(20)
    assert not serving.is_alive()
    assert app.unwound == ["end record"]

"""WebSocket ends for the preview tests: for the relay alone (`preview_ws.proxy_websocket`), an ASGI browser
that records what it is sent, and a real WebSocket app (wsproto) on a socket (the conftest's `pair` joins them); for a
live server, a browser's WebSocket to a preview URL."""

from __future__ import annotations

import asyncio
import re
import socket

from starlette.types import Message
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Event, Request, TextMessage

from bastion.transports.http.admin_pages import SESSION_COOKIE

WAIT_S = 10.0
"""The bound on any one wait for the server (a failure, never a pace)."""


class RecordingBrowser:
    """An ASGI browser side that stays connected, sends nothing, and records what bastion sends it."""

    def __init__(self) -> None:
        self.sends: list[Message] = []

    async def send(self, message: Message) -> None:
        self.sends.append(message)

    async def receive(self) -> Message:
        await asyncio.Event().wait()  # until the proxy ends the connection (it cancels this)
        raise AssertionError("unreachable")


async def app_sending(sock: socket.socket, frames: bytes, received: list[Event]) -> None:
    """A WebSocket server on `sock`: accepts, writes `frames` as they are, then reads to the end."""
    reader, writer = await asyncio.open_connection(sock=sock)
    ws = WSConnection(ConnectionType.SERVER)
    try:
        while data := await reader.read(65536):
            ws.receive_data(data)
            for event in ws.events():
                received.append(event)
                if isinstance(event, Request):
                    writer.write(ws.send(AcceptConnection()) + frames)
                    await writer.drain()
    finally:
        writer.close()
        await writer.wait_closed()


def frame(opcode: int, payload: bytes, *, fin: bool) -> bytes:
    """A server's (unmasked) frame, as any app may write it."""
    length = len(payload)
    size = bytes([length]) if length < 126 else b"\x7e" + length.to_bytes(2, "big")
    return bytes([(0x80 if fin else 0) | opcode]) + size + payload


class BrowserWebSocket:
    """A browser's WebSocket to a live preview URL from `origin`, with the login cookie `session` (None: none)."""

    def __init__(self, origin: str, url: str, session: str | None) -> None:
        host, port, path = re.fullmatch(r"http://([^:]+):(\d+)(/.*)", url).groups()  # type: ignore[union-attr]
        self.sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
        self.ws = WSConnection(ConnectionType.CLIENT)
        extra = [(b"origin", origin.encode())]
        if session is not None:
            extra.append((b"cookie", f"{SESSION_COOKIE}={session}".encode()))
        self.sock.sendall(self.ws.send(Request(host=f"{host}:{port}", target=path, extra_headers=extra)))
        self.pending: list[Event] = []

    def close(self) -> None:
        self.sock.close()

    def next(self) -> Event:
        while not self.pending:
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("the server closed the connection")
            self.ws.receive_data(data)
            self.pending.extend(self.ws.events())
        return self.pending.pop(0)

    def echo(self, text: str) -> str:
        self.sock.sendall(self.ws.send(TextMessage(data=text)))
        reply = self.next()
        assert isinstance(reply, TextMessage), reply
        return reply.data

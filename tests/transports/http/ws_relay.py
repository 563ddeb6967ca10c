"""The two ends of a proxied preview WebSocket for tests of the relay (`preview_ws.proxy_websocket`): an ASGI
browser that records what it is sent, and a real WebSocket app (wsproto) on a socket."""

from __future__ import annotations

import asyncio
import socket

from starlette.types import Message
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Event, Request


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

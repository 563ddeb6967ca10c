"""A WebSocket on a guarded listener (security review, finding 4): uvicorn hands the upgraded socket to its
WebSocket protocol, so the request head's deadline, armed when the connection opened, closed every live
WebSocket `request_head_timeout_s` after its connection opened (10 s by default), with no close frame.

Against a real uvicorn server built by `serve.uvicorn_config` as the preview listener's (the guarded h11
protocol, wsproto), a real ASGI echo app, and WebSocket clients (wsproto over sockets). Time is driven by a
short head deadline, and its passing is seen, not slept: a plain socket opened after the WebSocket, which
the server closes at its own head deadline.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.websockets.wsproto_impl import WSProtocol
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Event, Request, TextMessage

from bastion.config.http import HttpConfig
from bastion.serve import uvicorn_config
from bastion.transports.http.connections import FdLimits, GuardedH11Protocol

HEAD_TIMEOUT_S = 0.3
WAIT_S = 10.0
"""The bound on any one wait for the server (a failure, never a pace)."""


async def echo_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Echoes WebSocket text; answers plain HTTP with 200."""
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    if (await receive())["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    while (message := await receive())["type"] == "websocket.receive":
        await send({"type": "websocket.send", "text": message.get("text") or ""})


class Client:
    """A WebSocket client: wsproto over an asyncio connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.pending: list[Event] = []

    @classmethod
    async def open(cls, port: int) -> Client:
        client = cls(*await asyncio.open_connection("127.0.0.1", port))
        client.writer.write(client.ws.send(Request(host=f"127.0.0.1:{port}", target="/ws")))
        assert isinstance(await client.next(), AcceptConnection)
        return client

    async def next(self) -> Event:
        while not self.pending:
            async with asyncio.timeout(WAIT_S):
                data = await self.reader.read(65536)
            if not data:
                raise EOFError("the server closed the connection")
            self.ws.receive_data(data)
            self.pending.extend(self.ws.events())
        return self.pending.pop(0)

    async def echo(self, text: str) -> str:
        self.writer.write(self.ws.send(TextMessage(data=text)))
        reply = await self.next()
        assert isinstance(reply, TextMessage), reply
        return reply.data

    async def close(self) -> None:
        """The closing handshake, then the server's end of the socket."""
        self.writer.write(self.ws.send(CloseConnection(code=1000)))
        assert isinstance(await self.next(), CloseConnection)
        await eof(self.reader)
        self.writer.close()
        await self.writer.wait_closed()


async def eof(reader: asyncio.StreamReader) -> None:
    """Wait (bounded) for the server to close this connection."""
    async with asyncio.timeout(WAIT_S):
        while await reader.read(65536):
            pass


async def until(condition: Callable[[], bool]) -> None:
    """Wait (bounded) for the server's side of a closed socket to be released (a callback or two away)."""
    async with asyncio.timeout(WAIT_S):
        while not condition():
            await asyncio.sleep(0.005)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@asynccontextmanager
async def listener(*, cap: int = 16, ping_s: float | None = None) -> AsyncIterator[tuple[uvicorn.Server, int]]:
    """The preview listener's uvicorn server (production settings, a short head deadline) on a free port."""
    http = HttpConfig(request_head_timeout_s=HEAD_TIMEOUT_S)
    config = uvicorn_config(echo_app, http, "127.0.0.1:1", FdLimits(backlog=16, cap=cap), preview=True)
    if ping_s is not None:
        config.ws_ping_interval = config.ws_ping_timeout = ping_s
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        await until(lambda: server.started)
        yield server, sock.getsockname()[1]
    finally:
        server.should_exit = True
        await serving
        sock.close()


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


def test_a_websocket_outlives_the_request_head_deadline_and_is_counted_once() -> None:
    """The WebSocket is still served after its connection's head deadline has passed; it takes the h11
    protocol's place in the count (one connection, not two, nor none) and gives it back when it ends; no
    socket or task is left."""

    async def main() -> None:
        async with listener() as (server, port):
            connections = server.server_state.connections
            fds = open_fds()
            client = await Client.open(port)
            assert await client.echo("before") == "before"
            idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
            await eof(idle_reader)  # its head deadline, armed after the WebSocket's, has passed
            idle_writer.close()
            await idle_writer.wait_closed()
            await until(lambda: all(isinstance(c, WSProtocol) for c in connections))  # the idle one released
            assert await client.echo("after the head deadline") == "after the head deadline"
            assert [type(c) for c in connections] == [WSProtocol]
            await client.close()
            await until(lambda: not connections and not server.server_state.tasks)
            assert open_fds() == fds

    run(main)


def test_websockets_at_the_cap_are_served_not_evicted_and_released_when_they_end() -> None:
    """At a cap of one, a live WebSocket fills it: a new connection is refused rather than the WebSocket
    evicted (it is being served); once the WebSocket ends, the next connection is served."""

    async def main() -> None:
        async with listener(cap=1) as (server, port):
            client = await Client.open(port)
            idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
            await eof(idle_reader)  # refused at once (over the cap), or at its head deadline at the latest
            idle_writer.close()
            await idle_writer.wait_closed()
            assert await client.echo("still here") == "still here"
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await eof(reader)  # refused: the one connection the cap allows is being served
            writer.close()
            await writer.wait_closed()
            assert await client.echo("not evicted") == "not evicted"
            await client.close()
            await until(lambda: not server.server_state.connections)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            async with asyncio.timeout(WAIT_S):
                answer = await reader.read()
            writer.close()
            await writer.wait_closed()
            assert answer.startswith(b"HTTP/1.1 200")
            assert answer.endswith(b"ok")

    run(main)


def test_an_upgraded_connection_whose_peer_stops_answering_pings_is_closed_and_uncounted() -> None:
    """An upgraded connection is still bounded: no head deadline, but the keepalive pings the preview
    listener keeps on close a peer that is gone or stops reading (1011), and its count is released."""
    production = uvicorn_config(echo_app, HttpConfig(), "127.0.0.1:1", FdLimits(16, 16), preview=True)
    assert production.ws_ping_interval is not None
    assert production.ws_ping_timeout is not None
    assert isinstance(production.http, type)
    assert issubclass(production.http, GuardedH11Protocol)

    async def main() -> None:
        async with listener(ping_s=0.05) as (server, port):
            fds = open_fds()
            client = await Client.open(port)
            events: list[Event] = []  # read, never answered: the pings go unanswered
            try:
                while True:
                    events.append(await client.next())
            except EOFError:
                pass
            client.writer.close()
            await client.writer.wait_closed()
            closes = [e for e in events if isinstance(e, CloseConnection)]
            assert [c.code for c in closes] == [1011]
            await until(lambda: not server.server_state.connections and not server.server_state.tasks)
            assert open_fds() == fds

    run(main)

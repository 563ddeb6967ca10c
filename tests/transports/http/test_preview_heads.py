"""The heads a preview's app sends before its final response: counted as read (`ResponseHeads`), capped.

Real httpcore over a real socket pair, with the preview listener's `SocketStream`; the app is a coroutine writing
raw HTTP, as a hostile app in a sandbox may.
"""

from __future__ import annotations

import asyncio
import socket

import httpcore2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bastion.safety.rates import ByteRate
from bastion.transports.http.preview import (
    MAX_INTERIM_RESPONSES,
    PREVIEW_BURST_BYTES,
    PREVIEW_BYTES_PER_S,
    ResponseHeads,
    SocketStream,
)
from tests.transports.http.ws_relay import WAIT_S

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
CONTINUE_LF = b"HTTP/1.1 100 Continue\n\n"  # h11 ends a head at a bare blank line too
HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
BODY = b"<p>one</p>\r\n\r\n<p>two</p>\r\n\r\n" * 100
FINAL = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY


async def _app(sock: socket.socket, answer: bytes, forever: bytes = b"") -> None:
    """Reads the request's head, writes `answer`, then `forever` again and again until the relay leaves."""
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        while forever:
            writer.write(forever * 1024)
            await writer.drain()
        await writer.drain()
        await reader.read()  # until the relay closes
    except OSError:
        pass
    finally:
        writer.close()


async def _exchange(proxy_side: socket.socket, app: asyncio.Future[None]) -> tuple[httpcore2.Response, bytes]:
    reader, writer = await asyncio.open_connection(sock=proxy_side)
    rate = ByteRate(PREVIEW_BYTES_PER_S, PREVIEW_BURST_BYTES)
    connection = httpcore2.AsyncHTTP11Connection(
        httpcore2.Origin(b"http", b"127.0.0.1", 8080), SocketStream(reader, writer, rate)
    )
    try:
        request = httpcore2.Request("GET", httpcore2.URL("http://127.0.0.1:8080/"), headers=[(b"host", b"x")])
        async with asyncio.timeout(WAIT_S):
            response = await connection.handle_async_request(request)
            body = b"".join([chunk async for chunk in response.aiter_stream()])
        return response, body
    finally:
        await connection.aclose()
        app.cancel()
        await asyncio.gather(app, return_exceptions=True)


@pytest.mark.parametrize("interim", [CONTINUE, CONTINUE_LF], ids=["crlf", "bare-lf"])
def test_an_app_sending_endless_interim_responses_fails_at_the_cap(
    pair: tuple[socket.socket, socket.socket], interim: bytes
) -> None:
    """Found by attack: an app answering with endless `100 Continue` had httpcore skip them for as long as they
    came (each read reset the read timeout): a core of the server, every other caller's calls 1.4 s, a request
    lasting 47 s, and the server deaf to SIGTERM with a hundred of them. Invariant: past `MAX_INTERIM_RESPONSES`
    the exchange fails as a protocol error (the listener's 502) at once. Review found heads ending in a bare blank
    line (which h11 accepts) counted as one: 5,000 of them per count, a core of the server and 0.5 s stalls."""
    proxy_side, app_side = pair

    async def main() -> float:
        loop = asyncio.get_running_loop()
        began = loop.time()
        app = asyncio.ensure_future(_app(app_side, b"", interim))
        with pytest.raises(httpcore2.RemoteProtocolError, match="interim responses"):
            await _exchange(proxy_side, app)
        return loop.time() - began

    assert asyncio.run(main()) < WAIT_S / 2


def test_interim_responses_then_a_body_with_blank_lines_pass_whole(pair: tuple[socket.socket, socket.socket]) -> None:
    """What the cap must not cost: a 100 and a 103 before the answer, and a body full of blank lines read with it."""
    proxy_side, app_side = pair

    async def main() -> tuple[httpcore2.Response, bytes]:
        return await _exchange(proxy_side, asyncio.ensure_future(_app(app_side, CONTINUE + HINTS + FINAL)))

    response, body = asyncio.run(main())
    assert response.status == 200
    assert body == BODY


def test_a_final_head_ending_in_a_bare_blank_line_passes_its_whole_body(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """Found by review: a lenient app's head ending in `\\n\\n` (h11 accepts it) was never seen to end, and its 512 KiB
    body was taken for a head and cut at the head cap, the browser getting a 200 with part of the body."""
    proxy_side, app_side = pair
    big = bytes(range(256)) * 2048
    answer = b"HTTP/1.1 200 OK\nContent-Length: %d\n\n" % len(big) + big

    async def main() -> tuple[httpcore2.Response, bytes]:
        return await _exchange(proxy_side, asyncio.ensure_future(_app(app_side, CONTINUE_LF + answer)))

    response, body = asyncio.run(main())
    assert response.status == 200
    assert body == big


def _outcome(pieces: list[bytes]) -> tuple[int, bool, str]:
    heads = ResponseHeads()
    try:
        for piece in pieces:
            heads.feed(piece)
    except httpcore2.RemoteProtocolError as exc:
        return heads.interim, heads.done, str(exc)
    return heads.interim, heads.done, ""


@given(
    st.lists(st.sampled_from([CONTINUE, CONTINUE_LF, HINTS]), max_size=MAX_INTERIM_RESPONSES + 3),
    st.lists(st.integers(0, 4000), max_size=12),
)
def test_the_heads_counted_do_not_depend_on_where_the_reads_split(interim: list[bytes], cuts: list[int]) -> None:
    """However the app's bytes come in reads, the same interim heads are counted, the same final head ends them,
    and the same cap fails."""
    stream = b"".join(interim) + FINAL
    points = sorted({min(cut, len(stream)) for cut in cuts})
    pieces = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    whole = _outcome([stream])
    assert _outcome(pieces) == whole
    if len(interim) > MAX_INTERIM_RESPONSES:
        assert "interim responses" in whole[2]
    else:
        assert whole == (len(interim), True, "")

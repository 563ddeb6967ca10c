"""What a hostile app's response body costs the preview listener, against a live `bastion serve --http` with a
real sandbox (found by attacking previews, 2026-12-06).

What this proves: a body of one-byte chunks is cut after cap / 1 KiB pieces; a body the app breaks (shorter
than its Content-Length) or one cut at the cap reaches the browser incomplete, never as a whole page; a status
past 599 is a 502; a response in flight ends when the browser leaves or the preview is unexposed, and its
audit record says what was sent, also when the server stops midway.
What it does not prove: the CPU figures (bench/), or WebSocket previews (test_preview_ws.py).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from bastion.transports.http.preview import CHUNK_CHARGE_BYTES
from bastion.workbench.previews import token_id

from .live import free_port, serve_config
from .test_preview import APPS, MAX_BODY, MAX_RESPONSE, SESSION_COOKIE, Preview, config_text

pytestmark = pytest.mark.bwrap

PORT = 8010
WAIT_LISTENING = (
    'python3 -c "\nimport socket, time\nfor _ in range(400):\n'
    f"    try:\n        socket.create_connection(('127.0.0.1', {PORT})).close(); break\n"
    '    except OSError: time.sleep(0.025)\n"'
)


@contextlib.contextmanager
def live_preview(root: Path) -> Iterator[tuple[Preview, str, str]]:
    """A live server, a sandbox of it running raw_app.py on PORT, and that port's preview URL."""
    port, preview_port = free_port(), free_port()
    with serve_config(root, config_text(root, port, preview_port), port) as server:
        live = Preview(server, preview_port)
        created = live.tool("create_sandbox")
        assert created["ok"], created
        sandbox_id = str(created["detail"]["sandbox_id"])
        written = live.tool(
            "write_file", sandbox_id=sandbox_id, path="raw_app.py", content=(APPS / "raw_app.py").read_text()
        )
        assert written["ok"], written
        live.run(sandbox_id, f"python3 raw_app.py {PORT} >/dev/null 2>&1 &")
        live.run(sandbox_id, WAIT_LISTENING)
        yield live, sandbox_id, live.expose(sandbox_id, PORT)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Preview, str, str]]:
    with live_preview(tmp_path_factory.mktemp("preview-body") / "demo") as live:
        yield live


@pytest.fixture
def raw(served: tuple[Preview, str, str]) -> tuple[Preview, str]:
    return served[0], served[2]


def _stream(preview: Preview, url: str) -> contextlib.AbstractContextManager[httpx2.Response]:
    client = httpx2.Client(timeout=10)
    stack = contextlib.ExitStack()
    stack.enter_context(client)
    return _closing(stack, client.stream("GET", url, headers={"cookie": f"{SESSION_COOKIE}={preview.session}"}))


@contextlib.contextmanager
def _closing(
    stack: contextlib.ExitStack, stream: contextlib.AbstractContextManager[httpx2.Response]
) -> Iterator[httpx2.Response]:
    with stack, stream as response:
        yield response


READ_FOR_S = 10.0
"""How long a test reads a body that should end: one still coming after that never would (the apps here
trickle for ever)."""


def _read_all(chunks: Iterator[bytes]) -> tuple[bytes, bool]:
    """The body as far as it came, and whether it ended complete (its last chunk, or its length, arrived)."""
    body = b""
    deadline = time.monotonic() + READ_FOR_S
    try:
        for chunk in chunks:
            body += chunk
            assert time.monotonic() < deadline, f"the body was still coming after {READ_FOR_S} s"
    except httpx2.RemoteProtocolError:
        return body, False
    return body, True


def _records(preview: Preview, url: str, path: str, count: int) -> list[dict[str, Any]]:
    """This preview's records of requests for `path` once there are `count` of them (each is written as its
    request ends); 10 s at most, then what there is."""
    key = token_id(url.rstrip("/").rsplit("/", 1)[1])
    deadline = time.monotonic() + 10
    while True:
        text = (preview.server.root / "state" / "audit.jsonl").read_text()
        mine = [
            r
            for r in map(json.loads, text.splitlines())
            if r.get("event") == "preview" and r["preview"] == key and r["path"] == f"/preview/<token>/{path}"
        ]
        if len(mine) >= count or time.monotonic() > deadline:
            return mine
        time.sleep(0.01)


def test_a_body_of_one_byte_chunks_is_cut_after_cap_over_1_kib_pieces(raw: tuple[Preview, str]) -> None:
    """Attack: 100,000 chunks of one byte each (600 KB on the wire). Each piece cost the server about 20 us
    whatever its size: 20 s of CPU per MiB, outside the sandbox's cgroup. A response now has at most
    cap / 1 KiB pieces, and the cut body reaches the browser incomplete."""
    preview, url = raw
    with _stream(preview, url + "tinychunks?n=100000") as response:
        assert response.status_code == 200
        body, complete = _read_all(response.iter_raw())
    assert not complete
    assert 0 < len(body) <= MAX_RESPONSE // CHUNK_CHARGE_BYTES
    assert set(body) == {ord("x")}
    record = _records(preview, url, "tinychunks", 1)[-1]
    assert (record["status"], record["bytes"]) == (200, len(body))


def test_a_small_piece_does_not_cut_a_body_short_of_the_cap(raw: tuple[Preview, str]) -> None:
    """Found by CI: a piece under 1 KiB counted 1 KiB toward the byte cap, so a body with one small piece
    (a short read from the app) was cut up to 1 KiB short of it (1,047,605 bytes of 1,048,576). Bytes are
    now counted exactly; pieces are bounded apart."""
    preview, url = raw
    with _stream(preview, url + f"smallfirst?n={2 * MAX_RESPONSE}") as response:
        assert response.status_code == 200
        body, complete = _read_all(response.iter_raw())
    assert not complete
    assert len(body) == MAX_RESPONSE
    assert body[:10] == b"0123456789"
    assert set(body[10:]) == {ord("y")}
    record = _records(preview, url, "smallfirst", 1)[-1]
    assert (record["status"], record["bytes"]) == (200, MAX_RESPONSE)


def test_a_whole_body_of_exactly_the_cap_arrives_complete(raw: tuple[Preview, str]) -> None:
    """Not a refusal: a body of exactly the cap, a small piece first, is passed on whole."""
    preview, url = raw
    with _stream(preview, url + f"smallfirst?n={MAX_RESPONSE - 10}") as response:
        body, complete = _read_all(response.iter_raw())
    assert complete
    assert len(body) == MAX_RESPONSE


def test_a_body_shorter_than_its_content_length_reaches_the_browser_incomplete(raw: tuple[Preview, str]) -> None:
    """Attack: the app declares 100 bytes, sends 10 with a year's Cache-Control and closes. The browser got a
    complete-looking response and could cache the truncated page; now its connection is closed short."""
    preview, url = raw
    with _stream(preview, url + "short") as response:
        body, complete = _read_all(response.iter_raw())
    assert (body, complete) == (b"0123456789", False)


def test_a_status_past_599_is_a_plain_502(raw: tuple[Preview, str]) -> None:
    """Attack: "HTTP/1.1 999": h11 reads statuses up to 999, uvicorn has no phrase past 599 and raised
    KeyError after the response had begun: an empty reply and an error in the log."""
    preview, url = raw
    response = preview.get(url + "status999")
    assert response.status_code == 502
    assert response.text == "Bad Gateway: the sandbox's app answered with an invalid status\n"
    assert "KeyError" not in preview.server.log()


def test_a_trickling_response_ends_when_the_browser_leaves(raw: tuple[Preview, str]) -> None:
    """Attack: an app sends a byte every 0.1 s for ever, under the read timeout; the browser leaves. Nothing
    noticed: the response, its sockets and its task lived until the sandbox closed (50 such requests held 51
    fds). It now ends with the browser, and its audit record says what was sent."""
    preview, url = raw
    with _stream(preview, url + "trickle") as response:
        first = next(response.iter_raw())  # then the browser leaves
    assert first
    record = _records(preview, url, "trickle", 1)
    assert len(record) == 1, "the request never ended after the browser left"
    assert record[0]["status"] == 200
    assert record[0]["bytes"] >= len(first)


def test_unexpose_ends_a_response_in_flight(served: tuple[Preview, str, str]) -> None:
    """Attack: a response streaming when its preview is unexposed kept delivering the app's bytes: a revoked
    URL still served. It now ends at the next piece, incomplete."""
    preview, sandbox_id, _ = served
    other = PORT + 1  # a port of its own: the other tests keep theirs exposed
    preview.run(
        sandbox_id, f"python3 raw_app.py {other} >/dev/null 2>&1 &\n" + WAIT_LISTENING.replace(str(PORT), str(other))
    )
    own = preview.expose(sandbox_id, other)
    with _stream(preview, own + "trickle") as response:
        chunks = response.iter_raw()
        next(chunks)
        assert preview.tool("unexpose_port", sandbox_id=sandbox_id, port=other)["ok"]
        _, complete = _read_all(chunks)  # the app never stops: only the proxy can end it
    assert not complete
    assert preview.get(own).status_code == 404


def test_a_response_cut_by_the_server_stopping_is_audited_with_what_it_sent(tmp_path: Path) -> None:
    """A response in flight when the server stops was recorded as status 0 and 0 bytes (its progress lived
    in the call that the shutdown cancelled), though the browser had a 200 and its bytes."""
    with live_preview(tmp_path / "demo") as (preview, _, url), _stream(preview, url + "trickle") as response:
        chunks = response.iter_raw()
        received = b"".join(next(chunks) for _ in range(3))
        preview.server.stop()
    record = _records(preview, url, "trickle", 1)
    assert len(record) == 1
    assert record[0]["status"] == 200
    assert record[0]["bytes"] >= len(received) > 0


def _held_by_the_app(preview: Preview, sandbox_id: str, port: int) -> list[int]:
    """The receive queue of each connection the app on `port` holds open, as the sandbox's kernel shows it."""
    table = preview.run(sandbox_id, "cat /proc/net/tcp /proc/net/tcp6 2>/dev/null")
    queues = []
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 4 and fields[1].endswith(f":{port:04X}") and fields[3] == "01":
            queues.append(int(fields[4].split(":")[1], 16))
    return queues


def test_a_body_the_app_never_reads_leaves_no_socket_holding_it(tmp_path: Path) -> None:
    """Attack (found by attacking previews): an app reads nothing past a request's head. The browser's 16 MiB
    body filled the sockets, the app timed out with a 504, and the server's close then waited for the app to
    take the rest, for ever: 20 such requests held 74 MiB until the sandbox closed. The server's end is now
    reset when the app has not taken everything (the app sees its connection go)."""
    port, preview_port = free_port(), free_port()
    root = tmp_path / "demo"
    config = config_text(root, port, preview_port)
    config.write_text(
        config.read_text().replace(f"preview_max_body_bytes = {MAX_BODY}", "preview_max_body_bytes = 16777216")
    )
    with serve_config(root, config, port) as server:
        live = Preview(server, preview_port)
        created = live.tool("create_sandbox")
        sandbox_id = str(created["detail"]["sandbox_id"])
        assert live.tool(
            "write_file", sandbox_id=sandbox_id, path="raw_app.py", content=(APPS / "raw_app.py").read_text()
        )["ok"]
        live.run(sandbox_id, f"python3 raw_app.py {PORT} >/dev/null 2>&1 &")
        live.run(sandbox_id, WAIT_LISTENING)
        url = live.expose(sandbox_id, PORT)
        cookie = {"cookie": f"{SESSION_COOKIE}={live.session}"}
        with httpx2.Client(timeout=30) as client, contextlib.suppress(httpx2.TransportError):
            # The 504 may come while the body is still on its way: the client may see its send cut instead.
            answered = client.post(url + "sink", content=b"b" * (16 << 20), headers=cookie)
            assert answered.status_code == 504
        deadline = time.monotonic() + 30
        while any(_held_by_the_app(live, sandbox_id, PORT)):
            assert time.monotonic() < deadline, "the server's end still holds the body the app never read"
            time.sleep(0.2)

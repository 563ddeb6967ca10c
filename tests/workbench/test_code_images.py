"""Image results of code contexts under attack, through the real MCP client in real sandboxes: the agent's
code sends images on its own protocol channel, as many and as large as the protocol lets one message be."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import struct
import zlib
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp_types import CallToolResult, ImageContent

from bastion.workbench.code import MAX_CELL_IMAGE_BYTES, MAX_IMAGES
from bastion.workbench.media import MAX_IMAGE_BYTES_IN_FLIGHT, SANDBOX_SHARE_DIVISOR
from tests.helpers import LoopLag, create, sh

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

CONTEXTS = 8
# Every fake fills a cell's image bytes with room for a small PNG only; one fills a sandbox's share of the
# server's budget, four the whole budget.
FAKE_BYTES = MAX_CELL_IMAGE_BYTES - 1024
SANDBOX_SHARE = MAX_IMAGE_BYTES_IN_FLIGHT // SANDBOX_SHARE_DIVISOR
FITTING = SANDBOX_SHARE // FAKE_BYTES
HOLDERS = 4
# What the loop's thread may compute between two ticks. Encoding seven 4 MiB images on it took 0.34 s; now
# ~8 ms, most of it the in-process client's own check of one answer (5.5 MiB of base64), on the same loop.
MAX_LOOP_CPU_S = 0.05


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


# A real 2x2 PNG (zlib and struct only), which must come back byte for byte.
SMALL_PNG = (
    b"\x89PNG\r\n\x1a\n"
    + chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, 8, 0, 0, 0, 0))
    + chunk(b"IDAT", zlib.compress(b"\x00\x10\x20\x00\x30\x40"))
    + chunk(b"IEND", b"")
)


def cell(name: str, fakes: int, barrier: int) -> str:
    """A cell that sends the small PNG, then `fakes` random "PNG"s (only the magic is right) of FAKE_BYTES,
    prints the fakes' SHA-256, then waits (60 s at most) until `barrier` cells have sent theirs, so that
    all hold their images at once."""
    return (
        "import hashlib, os, sys, time\n"
        "kernel = sys.modules['__main__']\ncell = kernel._current['id']\n"
        "header = {'event': 'image', 'id': cell, 'width': 2, 'height': 2}\n"
        f"kernel.emit(header, {SMALL_PNG!r})\n"
        f"fake = b'\\x89PNG\\r\\n\\x1a\\n' + os.urandom({FAKE_BYTES} - 8)\n"
        f"for _ in range({fakes}):\n    kernel.emit(header, fake)\n"
        "print(hashlib.sha256(fake).hexdigest())\n"
        f"open('/tmp/sent-{name}', 'w').close()\n"
        "end = time.monotonic() + 60\n"
        f"while sum(n.startswith('sent-') for n in os.listdir('/tmp')) < {barrier} and time.monotonic() < end:\n"
        "    time.sleep(0.01)\n"
    )


def decoded(raw: CallToolResult) -> tuple[dict[str, Any], list[bytes]]:
    """The result and its images' bytes (decoded by the test, outside the loop's measure)."""
    assert raw.structured_content is not None
    images = [base64.b64decode(block.data) for block in raw.content if isinstance(block, ImageContent)]
    return raw.structured_content, images


async def run_raw(client: Client, sandbox_id: str, code: str, **args: object) -> tuple[dict[str, Any], list[bytes]]:
    return decoded(await client.call_tool("execute_code", {"code": code, "sandbox_id": sandbox_id, **args}))


async def test_contexts_returning_the_most_images_at_once_are_capped_per_cell_and_server_wide(
    client: Client,
) -> None:
    """Attack: 8 contexts of a sandbox each send 8 random 4 MiB "PNG"s (only the magic was checked) at once.
    Every image was read, base64-encoded on the event loop and returned: +493 MiB of server memory per 8
    contexts, and another sandbox's call waited 1.8 s. Invariant: a cell returns at most
    MAX_CELL_IMAGE_BYTES of images, an image past it is dropped with a note; the server holds for one
    sandbox's calls in progress at most its share of MAX_IMAGE_BYTES_IN_FLIGHT, and an image past that is
    dropped with a note saying so; the event loop's thread never computes long (encoding is off it); a real
    small PNG comes back byte for byte, and the budget is whole again once the calls have returned. Does not prove a
    bound on an answer after its tool returned (while the transport sends it: one cell's cap each)."""
    sandbox = await create(client)
    names = [f"c{i}" for i in range(CONTEXTS)]
    for name in names:
        assert (await run_raw(client, sandbox, "1", context=name))[0]["ok"]
    attack = [cell(name, MAX_IMAGES - 1, CONTEXTS) for name in names]
    calls = (
        client.call_tool("execute_code", {"code": code, "sandbox_id": sandbox, "context": name})
        for name, code in zip(names, attack, strict=True)
    )
    with LoopLag() as lag:
        raws = await asyncio.gather(*calls)
    answers = [decoded(raw) for raw in raws]
    assert lag.cpu_worst < MAX_LOOP_CPU_S, f"the loop's thread computed {lag.cpu_worst:.3f} s in one go"
    whole = [images for _, images in answers if len(images) == 2]
    assert len(whole) == FITTING  # the others' fakes did not fit the sandbox's share of the server's budget
    for payload, images in answers:
        assert payload["code"] == "OUTPUT_TRUNCATED", payload
        assert payload["detail"]["truncated"] is True
        assert images[0] == SMALL_PNG
        assert sum(len(image) for image in images) <= MAX_CELL_IMAGE_BYTES
        assert [image["bytes"] for image in payload["detail"]["images"]] == [len(image) for image in images]
        note = payload["detail"]["images_note"]
        if len(images) == 2:
            assert images[1].startswith(b"\x89PNG")
            assert hashlib.sha256(images[1]).hexdigest() == payload["detail"]["stdout"].strip()
            assert note.startswith(f"{MAX_IMAGES - 2} image(s) dropped: a cell returns at most"), note
        else:
            assert note.startswith(f"{MAX_IMAGES - 1} image(s) dropped: this sandbox's calls in progress"), note
    # The budget was given back: one cell alone gets its whole share, and every context lives.
    payload, images = await run_raw(client, sandbox, cell("alone", 1, 1), context=names[-1])
    assert payload["code"] == "OK", payload
    assert payload["detail"]["images_note"] is None
    assert images[0] == SMALL_PNG
    assert len(images) == 2
    assert hashlib.sha256(images[1]).hexdigest() == payload["detail"]["stdout"].strip()
    for name in names:
        payload, _ = await run_raw(client, sandbox, "6 * 7", context=name)
        assert payload["detail"]["value"] == "42", payload


def holder(name: str) -> str:
    """A cell that sends one fake of FAKE_BYTES, says so in /tmp, then waits (60 s at most) for
    /workspace/release: its call, and the image bytes it holds, last until the test lets it go."""
    return (
        "import os, sys, time\n"
        "kernel = sys.modules['__main__']\ncell = kernel._current['id']\n"
        f"fake = b'\\x89PNG\\r\\n\\x1a\\n' + os.urandom({FAKE_BYTES} - 8)\n"
        "kernel.emit({'event': 'image', 'id': cell, 'width': 2, 'height': 2}, fake)\n"
        f"open('/tmp/held-{name}', 'w').close()\n"
        "end = time.monotonic() + 60\n"
        "while not os.path.exists('/workspace/release') and time.monotonic() < end:\n"
        "    time.sleep(0.01)\n"
    )


async def wait_held(client: Client, sandbox_id: str, count: int) -> None:
    """Until `count` holders of the sandbox have sent their image (a condition, under a deadline)."""
    with anyio.fail_after(60):
        while True:
            listing = await sh(client, sandbox_id, "ls /tmp")
            if sum(name.startswith("held-") for name in listing["detail"]["stdout"].split()) >= count:
                return


async def test_one_sandbox_holding_images_in_all_its_contexts_leaves_other_sandboxes_their_share(
    client: Client,
) -> None:
    """Attack (found by review): four contexts of one sandbox each send a 4 MiB image, then sleep; they held
    the server's whole MAX_IMAGE_BYTES_IN_FLIGHT for their cells' timeout, and every other sandbox's images
    were dropped meanwhile. Invariant: a sandbox's calls hold at most its share of the budget (an image past
    it is dropped, with a note saying so), so another sandbox's image comes back whole, byte for byte, while
    they hold theirs; once they return, the budget is whole again and every context lives. Does not prove
    a bound when several sandboxes (of one agent, or of several) each hold their share."""
    attacker, victim = await create(client), await create(client)
    names = [f"h{i}" for i in range(HOLDERS)]
    for name in names:
        assert (await run_raw(client, attacker, "1", context=name))[0]["ok"]
    holders = [
        asyncio.ensure_future(
            client.call_tool("execute_code", {"code": holder(n), "sandbox_id": attacker, "context": n})
        )
        for n in names
    ]
    try:
        await wait_held(client, attacker, HOLDERS)
        payload, images = await run_raw(client, victim, cell("victim", 1, 1))
    finally:
        await sh(client, attacker, "touch release")
        answers = [decoded(raw) for raw in await asyncio.gather(*holders)]
    assert payload["code"] == "OK", payload
    assert payload["detail"]["images_note"] is None
    assert images[0] == SMALL_PNG
    assert len(images) == 2
    assert hashlib.sha256(images[1]).hexdigest() == payload["detail"]["stdout"].strip()
    kept = [images for _, images in answers if images]
    assert len(kept) == FITTING, [p["detail"]["images_note"] for p, _ in answers]
    for held, images in answers:
        if not images:
            assert held["code"] == "OUTPUT_TRUNCATED", held
            assert held["detail"]["images_note"].startswith(
                f"1 image(s) dropped: this sandbox's calls in progress already hold its {SANDBOX_SHARE >> 20} MiB"
            ), held
    # The share was given back: the attacker's sandbox alone gets an image again, and every context lives.
    payload, images = await run_raw(client, attacker, cell("alone", 1, 1), context=names[0])
    assert payload["code"] == "OK", payload
    assert len(images) == 2
    for name in names:
        payload, _ = await run_raw(client, attacker, "6 * 7", context=name)
        assert payload["detail"]["value"] == "42", payload

"""Rich forms of a Python value through the real MCP client, in real sandboxes: markdown and HTML
as text beside the plain repr, SVG and PNG as images, a DataFrame as a bounded markdown table; and
hostile reprs (raising, flooding, looping, the wrong type), which cost the agent's own call only."""

from __future__ import annotations

import base64
import time
from typing import Any

import pytest
from mcp import Client
from mcp_types import ImageContent

from bastion.app import Services
from bastion.workbench.code import MAX_TEXT_CHARS
from tests.helpers import audit_record, call, create

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

RICH = """
class Rich:
    def __repr__(self):
        return "Rich()"
    def _repr_markdown_(self):
        return "**bold** | cell"
    def _repr_html_(self):
        return "<b onclick='x()'>bold</b><script>alert(1)</script>"
Rich()
"""

# A 1x1 PNG made in the cell (zlib and struct only), returned by _repr_png_.
PNG_CELL = """
import struct, zlib
def chunk(kind, body):
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
class Dot:
    def _repr_png_(self):
        header = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
        body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\\0\\0")) + chunk(b"IEND", b"")
        return b"\\x89PNG\\r\\n\\x1a\\n" + body
Dot()
"""


async def run_raw(
    client: Client, sandbox_id: str, code: str, **args: object
) -> tuple[dict[str, Any], list[ImageContent]]:
    raw = await client.call_tool("execute_code", {"code": code, "sandbox_id": sandbox_id, **args})
    assert raw.structured_content is not None
    return raw.structured_content, [block for block in raw.content if isinstance(block, ImageContent)]


async def test_markdown_and_html_come_back_as_text_beside_the_repr(client: Client) -> None:
    sandbox = await create(client)
    result = await call(client, "execute_code", code=RICH, sandbox_id=sandbox)
    assert result["ok"], result
    assert result["detail"]["value"] == "Rich()"
    assert result["detail"]["markdown"] == "**bold** | cell"
    # HTML is returned as the text the object gave, never rendered or run by bastion.
    assert result["detail"]["html"] == "<b onclick='x()'>bold</b><script>alert(1)</script>"
    plain = await call(client, "execute_code", code="41 + 1", sandbox_id=sandbox)
    assert plain["detail"]["markdown"] is None
    assert plain["detail"]["html"] is None


async def test_svg_and_png_reprs_come_back_as_images(client: Client) -> None:
    sandbox = await create(client)
    secret = "AKIA" + "ABCDEFGHIJKLMNOP"
    svg = f"class Pic:\n    def _repr_svg_(self):\n        return '<svg xmlns=\"http://www.w3.org/2000/svg\"><text>{secret}</text></svg>'\nPic()"
    payload, images = await run_raw(client, sandbox, svg)
    assert payload["ok"], payload
    assert [image.mime_type for image in images] == ["image/svg+xml"]
    text = base64.b64decode(images[0].data).decode()
    assert text.startswith("<svg")
    assert secret not in text, "an SVG is the agent's text: redacted like output"
    assert payload["detail"]["images"][0]["mime_type"] == "image/svg+xml"
    payload, images = await run_raw(client, sandbox, PNG_CELL)
    assert payload["ok"], payload
    assert [image.mime_type for image in images] == ["image/png"]
    assert base64.b64decode(images[0].data).startswith(b"\x89PNG")
    assert (payload["detail"]["images"][0]["width"], payload["detail"]["images"][0]["height"]) == (1, 1)


async def test_a_repr_that_raises_leaves_the_plain_value_and_a_note(client: Client) -> None:
    sandbox = await create(client)
    code = (
        "class Bad:\n    def __repr__(self): return 'Bad()'\n"
        "    def _repr_html_(self): raise ValueError('no html')\n"
        "    def _repr_markdown_(self): return 42\n"  # not text: skipped
        "Bad()"
    )
    result = await call(client, "execute_code", code=code, sandbox_id=sandbox)
    assert result["ok"], result
    assert result["detail"]["value"] == "Bad()"
    assert result["detail"]["html"] is None
    assert result["detail"]["markdown"] is None
    assert "_repr_html_ of Bad raised ValueError" in result["detail"]["stderr"]
    broken = await call(client, "execute_code", code="class R:\n    def __repr__(self): 1/0\nR()", sandbox_id=sandbox)
    assert broken["detail"]["error"]["type"] == "ZeroDivisionError"
    assert broken["detail"]["context_state"] == "alive"


async def test_a_repr_of_100mb_is_cut_to_the_text_cap(client: Client) -> None:
    """Invariant: a rich form is bounded by the text cap however much the object returns, and a
    100 MB SVG is dropped whole rather than cut into a broken image. Does not measure memory."""
    sandbox = await create(client)
    code = (
        "class Huge:\n    def __repr__(self): return 'Huge()'\n"
        "    def _repr_html_(self): return '<p>' + 'x' * 100_000_000\n"
        "    def _repr_svg_(self): return '<svg>' + 'y' * 100_000_000\n"
        "Huge()"
    )
    started = time.monotonic()
    payload, images = await run_raw(client, sandbox, code, timeout_s=30)
    assert payload["ok"], payload
    assert payload["detail"]["value"] == "Huge()"
    assert payload["detail"]["html"].startswith("<p>xxx")
    assert len(payload["detail"]["html"]) <= MAX_TEXT_CHARS
    assert images == []
    assert time.monotonic() - started < 30
    after = await call(client, "execute_code", code="1 + 1", sandbox_id=sandbox)
    assert after["detail"]["value"] == "2"


async def test_a_repr_that_loops_is_interrupted_by_the_timeout(client: Client) -> None:
    sandbox = await create(client)
    await call(client, "execute_code", code="kept = 'here'", sandbox_id=sandbox)
    code = "class Loop:\n    def _repr_markdown_(self):\n        while True: pass\nLoop()"
    result = await call(client, "execute_code", code=code, sandbox_id=sandbox, timeout_s=0.5)
    assert result["code"] == "TIMEOUT", result
    assert result["detail"]["context_state"] == "alive"
    assert result["detail"]["error"]["type"] == "KeyboardInterrupt"
    assert (await call(client, "execute_code", code="kept", sandbox_id=sandbox))["detail"]["value"] == "'here'"


async def has_pandas(client: Client, sandbox_id: str) -> bool:
    probe = await call(client, "execute_code", code="import pandas", sandbox_id=sandbox_id, timeout_s=60)
    return probe["detail"]["error"] is None


async def test_a_dataframe_comes_back_as_a_bounded_markdown_table(client: Client) -> None:
    sandbox = await create(client)
    if not await has_pandas(client, sandbox):
        pytest.skip("pandas is not importable in this sandbox (the python-data template is built by `make install`)")
    small = "import pandas as pd\npd.DataFrame({'name': ['a|b', 'c\\nd'], 'n': [1, 2]})"
    result = await call(client, "execute_code", code=small, sandbox_id=sandbox, timeout_s=60)
    assert result["ok"], result
    assert result["detail"]["markdown"].splitlines() == [
        "|  | name | n |",
        "|---|---|---|",
        "| 0 | a\\|b | 1 |",
        "| 1 | c d | 2 |",
    ]
    assert "<table" in result["detail"]["html"]
    assert "name" in result["detail"]["value"]
    big = "pd.DataFrame({f'c{i}': range(1000) for i in range(30)})"
    result = await call(client, "execute_code", code=big, sandbox_id=sandbox, timeout_s=60)
    lines = result["detail"]["markdown"].splitlines()
    assert len(lines) == 2 + 50 + 2
    assert lines[-1] == "(1000 rows x 30 columns; the first 50 x 20 shown)"
    assert lines[0].count("|") == 22


async def test_a_repr_returning_a_hostile_str_subclass_is_copied_not_trusted(client: Client) -> None:
    """Invariant: what a repr returns is copied as plain text while the cell runs; the subclass's own
    len, slicing and encode (the agent's code) never run after it, where no timeout could stop them."""
    sandbox = await create(client)
    code = (
        "class Evil(str):\n"
        "    def __len__(self): raise RuntimeError('len')\n"
        "    def __getitem__(self, key): raise RuntimeError('getitem')\n"
        "    def encode(self, *args, **kwargs):\n        while True: pass\n"
        "class Obj:\n"
        "    def __repr__(self): return Evil('Obj()')\n"
        "    def _repr_html_(self): return Evil('<i>obj</i>')\n"
        "Obj()"
    )
    result = await call(client, "execute_code", code=code, sandbox_id=sandbox, timeout_s=10)
    assert result["ok"], result
    assert result["detail"]["value"] == "Obj()"
    assert result["detail"]["html"] == "<i>obj</i>"
    assert result["detail"]["context_state"] == "alive"


# What a terminal acts on or hides: an OSC 8 link, a title, a screen clear (7-bit and C1), a lone CR, a bidi
# override; and an AWS key split by a colour reset, which only the stripping of escapes makes whole again.
HOSTILE = (
    "\x1b]8;;http://evil.example/\x07link\x1b]8;;\x07 \x1b]0;title\x07\x1b[2J\x9b2J\r\u202e AKIA\x1b[0mABCDEFGHIJKLMNOP"
)
SECRET_TAIL = "ABCDEFGHIJKLMNOP"
RAW_CONTROLS = ("\x1b", "\x07", "\x9b", "\r", "\u202e")


def assert_cleaned(text: str) -> None:
    """No escape, control or bidi character as such, and the split key redacted whole."""
    assert not any(char in text for char in RAW_CONTROLS), ascii(text)
    assert "[REDACTED:aws_access_key_id]" in text, ascii(text)
    assert SECRET_TAIL not in text, ascii(text)


async def test_escapes_and_a_split_secret_in_a_value_its_rich_forms_and_an_error_are_cleaned(
    client: Client, services: Services
) -> None:
    """Attack (found by review): a value's repr, its markdown and HTML, an exception's message and traceback,
    and a JavaScript error carry terminal escapes: stdout was cleaned, these fields only redacted, so an OSC 8
    link, a screen clear and a bidi override reached the client, and an AWS key split by ESC[0m was not
    redacted. Invariant: every text field is cleaned as stdout is (escapes removed, controls shown as text,
    then redacted), and the secret is nowhere in the answer nor in the audit record. Does not prove how a
    client renders the HTML or markdown it gets (as text, never run by bastion)."""
    sandbox = await create(client)
    # Made from its repr in the cell: the traceback's source line is not the one that holds it.
    assert (await call(client, "execute_code", code=f"H = {HOSTILE!r}", sandbox_id=sandbox))["ok"]
    code = (
        "class V:\n"
        "    def __repr__(self): return 'v:' + H\n"
        "    def _repr_html_(self): return '<b>' + H + '</b>'\n"
        "    def _repr_markdown_(self): return 'md ' + H\n"
        "V()"
    )
    shown = await call(client, "execute_code", code=code, sandbox_id=sandbox)
    assert shown["ok"], shown
    for name in ("value", "html", "markdown"):
        assert_cleaned(shown["detail"][name])
    assert shown["detail"]["value"].startswith("v:link ")
    raised = await call(client, "execute_code", code="raise ValueError('err:' + H)", sandbox_id=sandbox)
    error = raised["detail"]["error"]
    assert error["type"] == "ValueError"
    assert_cleaned(error["message"])
    assert_cleaned(error["traceback"])
    await call(client, "execute_code", code=f"globalThis.H = {HOSTILE!r}", sandbox_id=sandbox, language="javascript")
    thrown = await call(
        client, "execute_code", code="throw new Error('js:' + H)", sandbox_id=sandbox, language="javascript"
    )
    if thrown["code"] != "NOT_FOUND":  # node is not installed on every machine
        assert_cleaned(thrown["detail"]["error"]["message"])
        assert_cleaned(thrown["detail"]["error"]["traceback"])
    for answer in (shown, raised, thrown):
        assert SECRET_TAIL not in str(answer)
        assert SECRET_TAIL not in str(audit_record(services.config.audit_path, answer["audit_id"]))
    after = await call(client, "execute_code", code="6 * 7", sandbox_id=sandbox)
    assert after["detail"]["value"] == "42"


async def test_a_secret_split_by_an_escape_across_the_text_cap_is_not_shown(client: Client) -> None:
    """Attack: the code sends, on its own protocol channel, a markdown form past MAX_TEXT_CHARS whose AWS key,
    split by ESC[0m, straddles the cut. Invariant: the field is cut to MAX_TEXT_CHARS after the escapes are
    removed and the text redacted (a margin past the cut is seen), so neither the escape nor any part of
    the key's secret half comes back."""
    sandbox = await create(client)
    before = MAX_TEXT_CHARS - 10
    code = (
        "import sys\nkernel = sys.modules['__main__']\ncell = kernel._current['id']\n"
        f"text = 'x' * {before} + ' AKIA\\x1b[0mABCDEFGHIJKLMNOP ' + 'y' * 5000\n"
        "kernel.emit({'event': 'display', 'id': cell, 'mime': 'text/markdown'}, text.encode())\n"
        "1"
    )
    result = await call(client, "execute_code", code=code, sandbox_id=sandbox)
    assert result["ok"], result
    markdown = result["detail"]["markdown"]
    assert len(markdown) == MAX_TEXT_CHARS
    assert markdown.startswith("x" * before)
    assert markdown.startswith("x" * before + " [REDACTED"), ascii(markdown[before:])
    assert "\x1b" not in markdown
    assert "ABCD" not in markdown

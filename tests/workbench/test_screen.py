"""The terminal's screen (`bastion.workbench.screen.TerminalScreen`) against stock pyte: the sequences it does
its own way for speed leave the text pyte would show, and none of them costs the whole screen cell by cell."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import pyte
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bastion.workbench.screen import MAX_SAVED_CURSORS, Scrollback, TerminalScreen

if TYPE_CHECKING:
    from _typeshed import TraceFunction

# Escape-heavy output: the sequences `TerminalScreen` does its own way (DECALN, erases in and out of colour,
# DECSCNM, DECCOLM, RIS, DECSC) among those that move the cursor, scroll and edit around them.
TOKENS = (
    b"ab",
    b"wxyz ",
    "\u4e2d".encode(),
    b"\r",
    b"\n",
    b"\t",
    b"\b",
    b"\x1b#8",
    b"\x1b[J",
    b"\x1b[1J",
    b"\x1b[2J",
    b"\x1b[3J",
    b"\x1b[K",
    b"\x1b[1K",
    b"\x1b[2K",
    b"\x1b[41m",
    b"\x1b[7m",
    b"\x1b[1;32m",
    b"\x1b[m",
    b"\x1b[?5h",
    b"\x1b[?5l",
    b"\x1b[?3h",
    b"\x1b[?3l",
    b"\x1b[?3;5h",
    b"\x1b[?3;6l",
    b"\x1b[?6h",
    b"\x1b[?6l",
    b"\x1bc",
    b"\x1b7",
    b"\x1b8",
    b"\x1bM",
    b"\x1bD",
    b"\x1bE",
    b"\x1b[2L",
    b"\x1b[M",
    b"\x1b[3@",
    b"\x1b[2P",
    b"\x1b[4X",
    b"\x1b[2;4r",
    b"\x1b[r",
    b"\x1b[4h",
    b"\x1b[4l",
    b"\x1b[3;7H",
    b"\x1b[H",
    b"\x1b[99;99H",
    b"\x1b[2A",
    b"\x1b[5C",
)


def _text(screen: pyte.Screen) -> list[str]:
    """Each row's characters, as the client gets them (pyte's `display` trips on a half-erased wide character)."""
    return ["".join(screen.buffer[y][x].data for x in range(screen.columns)) for y in range(screen.lines)]


def _fed(screen: pyte.Screen, data: bytes, slices: list[int]) -> pyte.Screen:
    stream = pyte.ByteStream(screen)
    at = 0
    for size in slices:
        stream.feed(data[at : at + size])
        at += size
    stream.feed(data[at:])
    return screen


@settings(max_examples=1500)
@given(
    tokens=st.lists(st.sampled_from(TOKENS), max_size=60),
    size=st.tuples(st.integers(10, 40), st.integers(2, 10)),
    slices=st.lists(st.integers(1, 16), max_size=20),
)
def test_screen_shows_what_pyte_shows_on_escape_heavy_output(
    tokens: list[bytes], size: tuple[int, int], slices: list[int]
) -> None:
    """Invariant: on any mix of these sequences, fed in any slices, the screen's text, size and cursor
    are stock pyte's (fed at once). Colours may differ: the client never sees them. Does not cover
    more than MAX_SAVED_CURSORS saved cursors (the oldest are dropped), nor piled combining marks."""
    assert tokens.count(b"\x1b7") <= MAX_SAVED_CURSORS
    data = b"".join(tokens)
    columns, lines = size
    ours = _fed(TerminalScreen(columns, lines, Scrollback(10_000)), data, slices)
    stock = _fed(pyte.Screen(columns, lines), data, [])
    assert (ours.columns, ours.lines) == (stock.columns, stock.lines)
    assert _text(ours) == _text(stock)
    assert (ours.cursor.x, ours.cursor.y) == (stock.cursor.x, stock.cursor.y)
    assert ours.mode == stock.mode


def _python_lines_run(work: Callable[[], None]) -> int:
    """How many lines of Python `work` runs (sys.settrace): its cost, counted the same on any machine."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: object) -> TraceFunction:
        nonlocal count
        count += event == "line"
        return tracer

    sys.settrace(tracer)
    try:
        work()
    finally:
        sys.settrace(None)
    return count


SCREEN_WIDE = {
    "decaln": b"\x1b#8",
    "erase": b"\x1b[2J",
    "erase-below": b"\x1b[H\x1b[J",
    "erase-in-colour": b"\x1b[41m\x1b[2J",
    "reverse-video": b"\x1b[?5h",
    "reverse-video-off": b"\x1b[?5l",
    "132-columns": b"\x1b[?3h",
    "132-columns-off": b"\x1b[?3l",
    "132-columns-in-colour": b"\x1b[44m\x1b[?3h",
}


@pytest.mark.parametrize("sequence", SCREEN_WIDE.values(), ids=SCREEN_WIDE.keys())
def test_screen_wide_sequence_costs_python_work_per_row_not_per_cell(sequence: bytes) -> None:
    """Attack: a flood of a sequence that rewrites every cell of a full 100x250 screen in Python (pyte's
    DECALN and DECSCNM call `_replace` per cell: 27 ms each, 36 s per 4 KiB read on the event loop).
    Invariant: each runs at most 20 lines of Python per row (the cells are handled in C), so a
    FEED_SLICE_BYTES slice of them costs a few ms. Does not bound the C work (0.1 ms a sequence here)."""
    screen = TerminalScreen(250, 100, Scrollback(1 << 20))
    stream = pyte.ByteStream(screen)
    stream.feed(b"\x1b[31;42m" + b"y" * 25_000 + b"\x1b[m\x1b[50;100H")  # every cell written, in colour
    if sequence.endswith(b"l"):
        stream.feed(sequence[:-1] + b"h\x1b#8")  # turned on first, the screen filled again
    assert _python_lines_run(lambda: stream.feed(sequence)) <= 20 * screen.lines


def test_saved_cursor_flood_holds_at_most_max_saved_cursors() -> None:
    """Attack: DECSC (`ESC 7`) over and over. pyte pushed each onto a list of its own, unbounded: 84 MiB
    of the server's memory per MiB of output. Invariant: at most MAX_SAVED_CURSORS are kept (xterm keeps
    one), the newest: DECRC (`ESC 8`) goes back to the last one saved."""
    screen = TerminalScreen(80, 24, Scrollback(10_000))
    stream = pyte.ByteStream(screen)
    stream.feed(b"\x1b7" * 30_000 + b"\x1b[5;9H\x1b7\x1b[H\x1b8")
    assert len(screen.savepoints) <= MAX_SAVED_CURSORS
    assert (screen.cursor.y, screen.cursor.x) == (4, 8)

"""A terminal's screen: the program's output, read from the master on the event loop, rendered by pyte.

What the program prints never reaches the client raw: pyte interprets it into a screen of rows x cols
characters, and the text of that screen and of the lines that scrolled off it is what `Terminals`
sanitizes and redacts. pyte never writes to the program (device status and attribute queries go
unanswered: its `write_process_input` is left a no-op), so nothing reaches the program that the
caller did not send.

pyte is pure Python (about 0.3 MB/s on this machine for a scrolling 80x24 screen): reading is
paced so rendering (pyte's, and what waiting reads spend on each change: `charge`) of all terminals and
code contexts together takes at most a quarter of the event loop's time (`PACE_FACTOR`, the `OUTPUT` timeline). A
program that writes faster waits on its full terminal, as on a slow real one (a flood such as `yes`
holds only the kernel's terminal buffer); `paced` in a read says it happened. pyte and wcwidth are
a twelfth of the server's imports: `Terminals` loads this module at the first terminal.

Some sequences cost pyte the whole screen each (a few bytes rewriting 25,000 cells at 100x250):
`TerminalScreen` does those in C-level dict operations, and pyte gets `FEED_SLICE_BYTES` at a time, at most
`STEP_BUDGET_S` of them per turn of the loop, so one step stays short whatever the program writes.
Colours and other attributes are never shown to the client: where pyte's cost is in keeping them
(DECALN, DECSCNM, a full erase), `TerminalScreen` may set them back to the defaults; its text stays pyte's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import itertools
import logging
import operator
import os
import time
import unicodedata
from collections.abc import Callable
from typing import Any, Final

import pyte

from bastion.safety.errors import Conflict
from bastion.sandbox.processes import PtyProcess, readable
from bastion.workbench.pacing import OUTPUT, PACE_FACTOR, Pacer, new_reader

logger = logging.getLogger("bastion.terminals")

SEND_TIMEOUT_S: Final = 5.0  # for the program to take its input
MATCH_SCROLLED_LINES: Final = 200  # of the lines scrolled off, the newest that wait_for also sees
READ_CHUNK_BYTES: Final = 4096  # per read of the master
# Handed to pyte at once: its costliest sequences, made cheap in `TerminalScreen`, still cost up to about
# 0.15 ms a byte on a 100x250 screen (RIS and DECALN in turn, each row freed and filled again), so a
# slice renders in about 10 ms at most. Slicing costs plain text nothing measurable.
FEED_SLICE_BYTES: Final = 64
STEP_BUDGET_S: Final = 0.005  # slices fed in one turn of the loop; the rest waits for the pacing delay
PACE_FREE_S: Final = 0.0005  # a slot ending under PACE_FACTOR times this from now does not pause reading
# The most one step of one terminal books in the loop's shared `Pacer` (a step renders for at most
# STEP_BUDGET_S and one slice, ~10 ms): what its reads charged past this delays that terminal alone.
MAX_SHARED_SLOT_S: Final = 0.02
# pyte accumulates an escape sequence (an OSC title, CSI digits) with no bound: past this many bytes
# inside one, its parser is replaced and the sequence dropped.
MAX_SEQUENCE_BYTES: Final = 65_536
# pyte appends each combining mark to its cell's text and NFC-normalizes all of it again: without a
# cap, marks piled on one letter cost quadratic time on the event loop. Past this, marks are dropped
# (and a cell that normalization made longer, as U+0344 becomes two marks, is cut to it).
MAX_CELL_CHARS: Final = 32
DECCKM: Final = 1 << 5  # private mode 1, as pyte stores private modes (shifted by 5); pyte.modes lacks it
# pyte keeps every DECSC (ESC 7) on a stack of its own, unbounded: 84 MiB held per MiB of them. xterm
# keeps one; past this many, the oldest is dropped.
MAX_SAVED_CURSORS: Final = 32
_DECSCNM_PARAM: Final = pyte.modes.DECSCNM >> 5  # as `CSI ? 5 h` passes it
_DECCOLM_PARAM: Final = pyte.modes.DECCOLM >> 5


class Scrollback:
    """Text of the lines that scrolled off the top of the screen since the last read, at most `cap` characters."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.lines: collections.deque[str] = collections.deque()
        self.chars = 0
        self.dropped = 0  # lines dropped for room since the last read

    def add(self, line: str) -> None:
        self.lines.append(line)
        self.chars += len(line) + 1
        while self.chars > self.cap and self.lines:
            self.chars -= len(self.lines.popleft()) + 1
            self.dropped += 1

    def take(self) -> tuple[list[str], int]:
        lines, dropped = list(self.lines), self.dropped
        self.lines.clear()
        self.chars = self.dropped = 0
        return lines, dropped


class TerminalScreen(pyte.Screen):
    """A pyte screen that keeps, as text, each line scrolling off its top."""

    def __init__(self, columns: int, lines: int, scrollback: Scrollback) -> None:
        super().__init__(columns, lines)
        self.scrollback = scrollback

    def draw(self, data: str) -> None:
        """pyte's draw, with at most MAX_CELL_CHARS characters in any cell (combining marks dropped past it)."""
        if data.isascii():
            super().draw(data)
            return
        start = i = 0
        while i < len(data):
            if not unicodedata.combining(data[i]):
                i += 1
                continue
            end = i
            while end < len(data) and unicodedata.combining(data[end]):
                end += 1
            super().draw(data[start:i])
            self._combine(data[i:end])
            start = i = end
        super().draw(data[start:])

    def _combine(self, marks: str) -> None:
        """Draw combining `marks` into the cell they join, keeping it within MAX_CELL_CHARS characters
        after pyte's NFC normalization (which may make one mark two, or three)."""
        room = MAX_CELL_CHARS - len(self._mark_target()[2])
        if room <= 0:
            return
        super().draw(marks[:room])
        y, x, text = self._mark_target()  # pyte may have wrapped the cursor first: the same cell, found again
        if len(text) > MAX_CELL_CHARS:
            line = self.buffer[y]
            line[x] = line[x]._replace(data=text[:MAX_CELL_CHARS])

    def _mark_target(self) -> tuple[int, int, str]:
        """Row, column and text of the cell a combining mark drawn now joins (as pyte picks it: the one
        left of the cursor, or the last of the row above); (-1, -1, "") when there is none."""
        x, y = self.cursor.x, self.cursor.y
        if x:
            return y, x - 1, self.buffer[y][x - 1].data
        if y:
            return y - 1, self.columns - 1, self.buffer[y - 1][self.columns - 1].data
        return -1, -1, ""

    def erase_in_display(self, how: int = 0, *args: Any, **kwargs: Any) -> None:
        """pyte's, without its loop over each cell (25,000 at 100x250, 0.9 ms per 4-byte `CSI 2 J`): an
        erased row is emptied (its cells read as its default) or, in other attributes than its default,
        filled from one row of blanks built once, in C. Another `how` is ignored, as xterm does (pyte raises)."""
        if how == 0:
            rows = range(self.cursor.y + 1, self.lines)
        elif how == 1:
            rows = range(self.cursor.y)
        elif how in (2, 3):
            rows = range(self.lines)
        else:
            return
        self.dirty.update(rows)
        attrs = self.cursor.attrs
        blanks: dict[int, pyte.screens.Char] | None = None
        for y in rows:
            line = self.buffer[y]  # made if missing, as pyte does: its delete_lines moves only rows that exist
            line.clear()
            if attrs != line.default:
                blanks = blanks or dict.fromkeys(range(self.columns), attrs)
                line.update(blanks)
        if how in (0, 1):
            self.erase_in_line(how)

    def erase_in_line(self, how: int = 0, private: bool = False) -> None:
        """pyte's, in one C-level update; another `how` is ignored, as xterm does (pyte raises)."""
        if how == 0:
            columns = range(self.cursor.x, self.columns)
        elif how == 1:
            columns = range(self.cursor.x + 1)
        elif how == 2:
            columns = range(self.columns)
        else:
            return
        self.dirty.add(self.cursor.y)
        self.buffer[self.cursor.y].update(dict.fromkeys(columns, self.cursor.attrs))

    def alignment_display(self) -> None:
        """DECALN (`ESC # 8`) fills the screen with E. pyte rewrites each cell with `_replace`, keeping
        its colours: 27 ms per 3 bytes at 100x250. Here one row of E in the default attributes is built
        once and copied into each row in C (0.1 ms)."""
        self.dirty.update(range(self.lines))
        row = dict.fromkeys(range(self.columns), self.default_char._replace(data="E"))
        for y in range(self.lines):
            line = self.buffer[y]
            line.clear()  # into an empty dict, update copies the row's table whole
            line.update(row)

    def set_mode(self, *modes: int, **kwargs: Any) -> None:
        """pyte's, with DECSCNM and DECCOLM done cheaply (`_screen_wide_modes`)."""
        if kwargs.get("private") and (_DECSCNM_PARAM in modes or _DECCOLM_PARAM in modes):
            self._screen_wide_modes(modes, setting=True)
        else:
            super().set_mode(*modes, **kwargs)

    def reset_mode(self, *modes: int, **kwargs: Any) -> None:
        """pyte's, with DECSCNM and DECCOLM done cheaply (`_screen_wide_modes`)."""
        if kwargs.get("private") and (_DECSCNM_PARAM in modes or _DECCOLM_PARAM in modes):
            self._screen_wide_modes(modes, setting=False)
        else:
            super().reset_mode(*modes, **kwargs)

    def _screen_wide_modes(self, modes: tuple[int, ...], *, setting: bool) -> None:
        """Private modes with DECSCNM or DECCOLM among them, in pyte's order and with pyte's text.

        DECSCNM (reverse video): pyte flips `reverse` in every cell with `_replace` (18 s per 4 KiB of
        `CSI ? 5 h` / `CSI ? 5 l` at 100x250); the client never sees it, so only the rows' default
        and the cursor's attributes change. DECCOLM (132 columns) resizes, then erases the screen:
        emptied first, its rows have no columns for the resize to drop one at a time."""
        flags = {mode << 5 for mode in modes}
        if setting:
            self.mode.update(flags)
        else:
            self.mode.difference_update(flags)
        if pyte.modes.DECSCNM in flags:
            self.dirty.update(range(self.lines))
        if pyte.modes.DECCOLM in flags:
            self.buffer.clear()
            if setting:
                self.saved_columns = self.columns
                self.resize(columns=132)
            elif self.columns == 132 and self.saved_columns is not None:
                self.resize(columns=self.saved_columns)
                self.saved_columns = None
            self.erase_in_display(2)
            self.cursor_position()
        others = [mode for mode in modes if mode not in (_DECSCNM_PARAM, _DECCOLM_PARAM)]  # DECOM, DECTCEM
        method = super().set_mode if setting else super().reset_mode
        method(*others, private=True)
        if pyte.modes.DECSCNM in flags:
            default = self.default_char
            for line in self.buffer.values():
                line.default = default
            self.select_graphic_rendition(7 if setting else 27)

    def save_cursor(self) -> None:
        super().save_cursor()
        if len(self.savepoints) > MAX_SAVED_CURSORS:
            del self.savepoints[0]

    def index(self) -> None:
        top, bottom = self.margins or pyte.screens.Margins(0, self.lines - 1)
        if self.cursor.y == bottom and top == 0:
            self.scrollback.add(_line_text(self.buffer[top], self.columns))
        super().index()


def _tolerant(name: str) -> Callable[..., None]:
    """The screen's CSI handler `name`, taking what pyte's parser may pass it: more parameters than it
    has (``CSI 1;2;3 A``), or `private` for a private (``CSI ?``) variant it has none of (xterm's
    modifyOtherKeys, ``CSI > 4;2 m``, which vim sends, is no colour). pyte would raise mid-feed and lose
    the rest of the output; extra parameters are dropped, unsupported private variants ignored."""
    base = getattr(TerminalScreen, name)  # pyte's, or the fix of it above
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    parameters = list(inspect.signature(base).parameters.values())[1:]
    takes_private = any(p.name == "private" or p.kind is p.VAR_KEYWORD for p in parameters)
    unbounded = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    most = len([p for p in parameters if p.kind in kinds and p.name != "private"])

    def method(self: pyte.Screen, *params: int, private: bool = False) -> None:
        kept = params if unbounded else params[:most]
        if not private:
            base(self, *kept)
        elif takes_private:
            base(self, *kept, private=True)

    return method


for _name in set(pyte.Stream.csi.values()):
    setattr(TerminalScreen, _name, _tolerant(_name))


_DATA: Final = operator.attrgetter("data")


def _line_text(line: pyte.screens.StaticDefaultDict[int, pyte.screens.Char], columns: int) -> str:
    # In C: each line scrolling off a 250-column screen goes through here.
    if not line:
        return ""
    return "".join(map(_DATA, map(line.get, range(columns), itertools.repeat(line.default)))).rstrip()


class Terminal:
    """One program on a terminal: its master fd read on the loop into a pyte screen; `group` (its sandbox's or
    workspace's id) is whose share of the `OUTPUT` timeline its reading takes."""

    def __init__(
        self,
        terminal_id: str,
        pty: PtyProcess,
        argv: tuple[str, ...],
        rows: int,
        cols: int,
        scrollback_chars: int,
        *,
        group: str,
    ) -> None:
        self.id = terminal_id
        self._group = group
        self._pace_key = new_reader()
        self.pty = pty
        self.argv = argv  # redacted
        self.used = time.monotonic()
        self.reads = 0  # terminal_read calls waiting on it: in use however long they wait
        self.output_open = True
        self._loop = asyncio.get_running_loop()
        self._pacer = Pacer.of(self._loop, OUTPUT)
        self._screen = TerminalScreen(cols, rows, Scrollback(scrollback_chars))
        self._stream = pyte.ByteStream(self._screen)
        self._in_sequence = 0  # bytes fed since the parser left its ground state
        self._emulator_failed = False
        self._lines = [""] * rows
        self._changed: asyncio.Future[None] = self._loop.create_future()
        self.version = 0  # bumped at each change of what a read shows: a render of it is good until then
        self._pending = b""  # read, not yet fed to pyte
        self._charged = 0.0
        self._resume: asyncio.TimerHandle | None = None
        self._paced = False
        self._write_lock = asyncio.Lock()
        self._closed = False
        self._loop.add_reader(pty.fd, self._on_readable)

    @property
    def rows(self) -> int:
        return int(self._screen.lines)

    @property
    def cols(self) -> int:
        return int(self._screen.columns)

    @property
    def application_keys(self) -> bool:
        return DECCKM in self._screen.mode

    def _on_readable(self) -> None:
        booked, started = self._loop.time(), time.perf_counter()  # the read's own cost is the step's too
        try:
            data = os.read(self.pty.fd, READ_CHUNK_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""  # EIO: no process holds the terminal any more
        if not data:
            self._end_output()
            return
        self._pending = data
        self._render(booked, started)

    def _render(self, booked: float | None = None, started: float | None = None) -> None:
        """Feed what was read to pyte a slice at a time for at most `STEP_BUDGET_S`, then pace: reading
        (or the rest of this read) waits for the end of the slot that this step (from `booked`, loop
        time, and `started`, `time.perf_counter`: now if not given) and what the reads charged take in
        the loop's `Pacer` (alone, `PACE_FACTOR` times their cost)."""
        booked = self._loop.time() if booked is None else booked
        started = time.perf_counter() if started is None else started
        fed = 0
        while fed < len(self._pending):
            self._feed(self._pending[fed : fed + FEED_SLICE_BYTES])
            fed += FEED_SLICE_BYTES
            if time.perf_counter() - started >= STEP_BUDGET_S:
                break
        self._pending = self._pending[fed:]
        spent = time.perf_counter() - started + self._charged
        shared = min(spent, MAX_SHARED_SLOT_S)
        # What the reads charged past that is this terminal's own debt, paid on its own clock: booked in the
        # shared timeline, 10 s of `wait_for` re-matching run up by resizing froze every terminal for 11 s.
        resume_at = max(
            self._pacer.slot(self._pace_key, self._group, booked, shared),
            self._loop.time() + (spent - shared) * PACE_FACTOR,
        )
        self._charged = 0.0
        self._notify()
        if self._pending or resume_at - self._loop.time() > PACE_FREE_S * PACE_FACTOR:
            self._loop.remove_reader(self.pty.fd)
            self._resume = self._loop.call_at(resume_at, self._read_again)

    def charge(self, spent_s: float) -> None:
        """Count `spent_s` of work done on the loop for this terminal's output (rendering it for a
        `wait_for`) in the pacing of its next step, as if pyte had spent it."""
        self._charged += spent_s

    def _feed(self, data: bytes) -> None:
        try:
            self._stream.feed(data)
        except Exception as exc:  # pyte on bytes it does not expect: its parser is gone, so make another
            if not self._emulator_failed:  # once: a program repeating the sequence must not flood the log
                self._emulator_failed = True
                logger.warning(
                    "terminal %s: the emulator failed on the program's output (%r); parser reset", self.id, exc
                )
            self._new_parser()
            return
        # pyte's parser is back in its ground state when it takes plain text again.
        if getattr(self._stream, "_taking_plain_text", True):
            self._in_sequence = 0
            return
        self._in_sequence += len(data)
        if self._in_sequence > MAX_SEQUENCE_BYTES:
            self._new_parser()

    def _new_parser(self) -> None:
        self._stream = pyte.ByteStream(self._screen)
        self._in_sequence = 0

    def _read_again(self) -> None:
        self._resume = None
        if self._closed or not self.output_open:
            return
        # Output waiting already: the program wrote faster than the screen renders, and waited.
        self._paced = self._paced or bool(self._pending) or readable(self.pty.fd)
        if self._pending:
            self._render()
        if self._resume is None:  # the rest of the read rendered, without a pause: read on
            self._loop.add_reader(self.pty.fd, self._on_readable)

    def _end_output(self) -> None:
        self.output_open = False
        self._loop.remove_reader(self.pty.fd)
        self._notify()

    def _notify(self) -> None:
        self.version += 1
        if not self._changed.done():
            self._changed.set_result(None)
        self._changed = self._loop.create_future()

    async def send(self, data: bytes) -> int:
        """Write `data` to the program; return how many bytes it took within `SEND_TIMEOUT_S`.

        Raises:
            Conflict: the terminal is closed.
        """
        self.used = time.monotonic()
        written = 0
        async with self._write_lock:
            try:
                async with asyncio.timeout(SEND_TIMEOUT_S):
                    while written < len(data) and not self._closed:
                        written += await self._write_some(data[written : written + READ_CHUNK_BYTES])
            except TimeoutError:
                pass
            except OSError as exc:  # EIO: the program closed its side
                raise Conflict(f"the terminal's program no longer reads it ({exc.strerror})") from None
        return written

    async def _write_some(self, data: bytes) -> int:
        try:
            return os.write(self.pty.fd, data)
        except BlockingIOError:
            writable: asyncio.Future[None] = self._loop.create_future()
            self._loop.add_writer(self.pty.fd, writable.set_result, None)
            try:
                await writable
            finally:
                self._loop.remove_writer(self.pty.fd)
            return 0

    def resize(self, rows: int, cols: int) -> None:
        """New size: the screen's, and the terminal's (the kernel sends SIGWINCH to its foreground). The same size
        changes nothing (found by review: each resize made a new version for every waiting read to look at)."""
        self.used = time.monotonic()
        if (rows, cols) == (self.rows, self.cols):
            return
        self._screen.resize(rows, cols)
        self._lines = [""] * rows
        self._screen.dirty.update(range(rows))
        with contextlib.suppress(OSError):  # the program closed it: only the screen changes
            self.pty.resize(rows, cols)
        self._notify()

    def screen_text(self) -> str:
        """The screen as text: `rows` lines, trailing spaces cut (rendered again only where it changed)."""
        screen = self._screen
        for y in screen.dirty:
            if y < len(self._lines):
                self._lines[y] = _line_text(screen.buffer[y], screen.columns)
        screen.dirty.clear()
        return "\n".join(self._lines)

    def cursor(self) -> dict[str, int]:
        return {"row": int(self._screen.cursor.y), "col": int(self._screen.cursor.x)}

    def scrolled_tail(self) -> str:
        """The newest scrolled-off lines, for wait_for (not taken)."""
        lines = self._screen.scrollback.lines
        return "\n".join(list(lines)[-MATCH_SCROLLED_LINES:])

    def take_scrolled(self) -> tuple[str, int]:
        """What scrolled off since the last take, and how many lines of it were dropped for room."""
        lines, dropped = self._screen.scrollback.take()
        if lines:
            self.version += 1  # the scrolled tail wait_for sees changed
        return "\n".join(lines), dropped

    def take_paced(self) -> bool:
        paced, self._paced = self._paced, False
        return paced

    async def changed(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` for new output, a resize or the end of output; False on timeout."""
        if not self.output_open:
            return False
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(self._changed)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Stop reading and close the master (the program's end: killed by the owner first)."""
        if self._closed:
            return
        self._closed = True
        if self._resume is not None:
            self._resume.cancel()
        with contextlib.suppress(RuntimeError):  # at server shutdown the loop may be closed already
            self._loop.remove_reader(self.pty.fd)
            self._loop.remove_writer(self.pty.fd)
        os.close(self.pty.fd)
        self.output_open = False
        self._notify()

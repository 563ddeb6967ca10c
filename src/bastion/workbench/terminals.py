"""Interactive terminals of a sandbox: a program on a pseudo-terminal, its screen rendered by pyte.

The pseudo-terminal is opened inside the sandbox (`Sandbox.open_pty`); the host holds its
master end only, read on the event loop. What the program prints never reaches the client
raw: pyte interprets it into a screen of rows x cols characters, and the text of that screen
and of the lines that scrolled off it is sanitized and redacted like command output. pyte
never writes to the program (device status and attribute queries go unanswered: its
`write_process_input` is left a no-op), so nothing reaches the program that the caller did
not send.

pyte is pure Python (about 0.3 MB/s on this machine for a scrolling 80x24 screen): reading is
paced so rendering takes at most a quarter of the event loop's time (`PACE_FACTOR`). A program
that writes faster waits on its full terminal, as on a slow real one (a flood such as `yes`
holds only the kernel's terminal buffer); `paced` in a read says it happened.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import os
import re
import secrets
import select
import time
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import pyte

from bastion.config import TerminalsConfig
from bastion.safety.errors import BastionError, Conflict, InvalidRequest, NotFound, PolicyDenied, ResourceLimit
from bastion.safety.redact import Redactor, sanitize_terminal
from bastion.safety.search import search_pattern
from bastion.sandbox.backend import Sandbox
from bastion.sandbox.processes import PtyProcess

RE2: Any
try:  # google-re2: linear-time matching; without it, wait_for falls back to bounded `re` (`wait_pattern`)
    import re2 as RE2  # type: ignore[import-untyped, import-not-found, no-redef, unused-ignore]
except ImportError:  # pragma: no cover - depends on the environment
    RE2 = None

logger = logging.getLogger("bastion.terminals")

MIN_ROWS: Final = 2
MAX_ROWS: Final = 100  # with MAX_COLS: pyte keeps an object per cell written (~0.2 KiB), and renders in pure Python
MIN_COLS: Final = 10
MAX_COLS: Final = 250
MAX_SEND_BYTES: Final = 65_536  # per terminal_send
SEND_TIMEOUT_S: Final = 5.0  # for the program to take its input
MAX_WAIT_S: Final = 60.0  # terminal_read's timeout_s
DEFAULT_WAIT_S: Final = 10.0  # with wait_for and no timeout_s
MAX_PATTERN_CHARS: Final = 1000
MATCH_SCROLLED_LINES: Final = 200  # of the lines scrolled off, the newest that wait_for also sees
READ_CHUNK_BYTES: Final = 4096  # per read of the master: pyte renders it in about 10 ms at most
PACE_FREE_S: Final = 0.0005  # rendering faster than this does not pace reading
PACE_FACTOR: Final = 3.0  # after rendering for t, reading waits 3t: at most a quarter of the loop
# pyte accumulates an escape sequence (an OSC title, CSI digits) with no bound: past this many bytes
# inside one, its parser is replaced and the sequence dropped.
MAX_SEQUENCE_BYTES: Final = 65_536
# pyte appends each combining mark to its cell's text and NFC-normalizes all of it again: without a
# cap, marks piled on one letter cost quadratic time on the event loop. Past this, marks are dropped.
MAX_CELL_CHARS: Final = 32
TERM: Final = "xterm-256color"
DECCKM: Final = 1 << 5  # private mode 1, as pyte stores private modes (shifted by 5); pyte.modes lacks it

# Special keys by name: xterm's sequences (ctlseqs, "PC-Style Function Keys").
_ARROWS: Final = {"Up": "A", "Down": "B", "Right": "C", "Left": "D", "Home": "H", "End": "F"}
KEYS: Final[Mapping[str, bytes]] = {
    "Enter": b"\r",
    "Tab": b"\t",
    "Backspace": b"\x7f",
    "Escape": b"\x1b",
    "Space": b" ",
    "Insert": b"\x1b[2~",
    "Delete": b"\x1b[3~",
    "PageUp": b"\x1b[5~",
    "PageDown": b"\x1b[6~",
    **{name: b"\x1b[" + code.encode() for name, code in _ARROWS.items()},
    **{f"F{n}": b"\x1bO" + code.encode() for n, code in zip(range(1, 5), "PQRS", strict=True)},
    **{f"F{n}": f"\x1b[{c}~".encode() for n, c in zip(range(5, 13), (15, 17, 18, 19, 20, 21, 23, 24), strict=True)},
    **{f"Ctrl-{chr(64 + n)}": bytes([n]) for n in range(1, 27)},
}
# DECCKM (application cursor keys, set by less, vim, readline's keypad mode): the arrows as SS3.
_APPLICATION_KEYS: Final[Mapping[str, bytes]] = {name: b"\x1bO" + code.encode() for name, code in _ARROWS.items()}


def key_bytes(keys: Sequence[str], *, application: bool) -> bytes:
    """The bytes of `keys`, in order.

    Raises:
        InvalidRequest: a name that is not a known key (the message lists them).
    """
    unknown = [key for key in keys if key not in KEYS]
    if unknown:
        shown = ", ".join(repr(sanitize_terminal(key)[:40]) for key in unknown[:5])
        raise InvalidRequest(f"unknown key {shown}: known keys are {', '.join(KEYS)}")
    table = {**KEYS, **_APPLICATION_KEYS} if application else KEYS
    return b"".join(table[key] for key in keys)


def check_size(rows: int, cols: int) -> None:
    """Raises InvalidRequest for a size outside `MIN_ROWS`..`MAX_ROWS` x `MIN_COLS`..`MAX_COLS`."""
    if not (MIN_ROWS <= rows <= MAX_ROWS and MIN_COLS <= cols <= MAX_COLS):
        raise InvalidRequest(
            f"a terminal of {rows} x {cols}: rows must be {MIN_ROWS}..{MAX_ROWS} and cols {MIN_COLS}..{MAX_COLS}"
        )


class Matcher(Protocol):
    def found_in(self, text: str) -> bool: ...


@dataclass(frozen=True)
class _Re2:
    regex: object

    def found_in(self, text: str) -> bool:
        return bool(self.regex.search(text))  # type: ignore[attr-defined]


@dataclass(frozen=True)
class _ByLine:
    """Python's `re` on bounded lines only (`search_pattern`), where RE2 is not installed."""

    pattern: Matcher

    def found_in(self, text: str) -> bool:
        return any(self.pattern.found_in(line) for line in text.splitlines())


def wait_pattern(pattern: str) -> Matcher:
    """Compile terminal_read's `wait_for`: RE2 (linear time) if installed, else `search_pattern`'s bounded `re`.

    Raises:
        InvalidRequest: empty, too long, or not a valid regular expression.
    """
    if not pattern:
        raise InvalidRequest("wait_for is empty: give a regular expression, e.g. '(?m)^>>>$' for a Python prompt")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise InvalidRequest(f"wait_for is over {MAX_PATTERN_CHARS} characters: wait for a shorter pattern")
    if RE2 is None:
        return _ByLine(search_pattern(pattern, regex=True))
    try:
        return _Re2(RE2.compile(pattern, options=_re2_options()))
    except (re.error, ValueError, TypeError, RE2.error) as exc:
        reason = sanitize_terminal(str(exc))[:200]
        raise InvalidRequest(f"wait_for is not a valid regular expression: {reason}") from None


def _re2_options() -> Any:
    options = RE2.Options()
    options.never_nl = False
    options.max_mem = 8 << 20  # a pattern whose automaton needs more is refused, not run
    return options


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


class _Screen(pyte.Screen):
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
            super().draw(data[i : i + max(0, MAX_CELL_CHARS - self._mark_target_chars())])
            start = i = end
        super().draw(data[start:])

    def _mark_target_chars(self) -> int:
        """Length of the cell a combining mark drawn now joins (as pyte picks it: the one left of the cursor)."""
        x, y = self.cursor.x, self.cursor.y
        if x:
            return len(self.buffer[y][x - 1].data)
        return len(self.buffer[y - 1][self.columns - 1].data) if y else 0

    def erase_in_display(self, how: int = 0, *args: Any, **kwargs: Any) -> None:
        if how in (0, 1, 2, 3):  # pyte raises on another (UnboundLocalError); xterm ignores it
            super().erase_in_display(how, *args, **kwargs)

    def erase_in_line(self, how: int = 0, private: bool = False) -> None:
        if how in (0, 1, 2):
            super().erase_in_line(how, private)

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
    base = getattr(_Screen, name)  # pyte's, or the fix of it above
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
    setattr(_Screen, _name, _tolerant(_name))


def _line_text(line: Mapping[int, pyte.screens.Char], columns: int) -> str:
    return "".join(line[x].data for x in range(columns)).rstrip()


class Terminal:
    """One program on a terminal: its master fd read on the loop into a pyte screen."""

    def __init__(
        self, terminal_id: str, pty: PtyProcess, argv: tuple[str, ...], rows: int, cols: int, scrollback_chars: int
    ) -> None:
        self.id = terminal_id
        self.pty = pty
        self.argv = argv  # redacted
        self.used = time.monotonic()
        self.reads = 0  # terminal_read calls waiting on it: in use however long they wait
        self.output_open = True
        self._loop = asyncio.get_running_loop()
        self._screen = _Screen(cols, rows, Scrollback(scrollback_chars))
        self._stream = pyte.ByteStream(self._screen)
        self._in_sequence = 0  # bytes fed since the parser left its ground state
        self._emulator_failed = False
        self._lines = [""] * rows
        self._changed: asyncio.Future[None] = self._loop.create_future()
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
        try:
            data = os.read(self.pty.fd, READ_CHUNK_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""  # EIO: no process holds the terminal any more
        if not data:
            self._end_output()
            return
        started = time.perf_counter()
        self._feed(data)
        spent = time.perf_counter() - started
        self._notify()
        if spent > PACE_FREE_S:
            self._loop.remove_reader(self.pty.fd)
            self._resume = self._loop.call_later(spent * PACE_FACTOR, self._read_again)

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
        if not self._closed and self.output_open:
            # Output waiting already: the program wrote faster than the screen renders, and waited.
            self._paced = self._paced or bool(select.select([self.pty.fd], [], [], 0)[0])
            self._loop.add_reader(self.pty.fd, self._on_readable)

    def _end_output(self) -> None:
        self.output_open = False
        self._loop.remove_reader(self.pty.fd)
        self._notify()

    def _notify(self) -> None:
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
        """New size: the screen's, and the terminal's (the kernel sends SIGWINCH to its foreground)."""
        self.used = time.monotonic()
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


class Terminals:
    """The terminals of one sandbox (or host workspace), at most `config.max_open` running."""

    def __init__(self, owner: str, redactor: Redactor, sandbox: Sandbox, config: TerminalsConfig) -> None:
        self._owner = owner
        self._redactor = redactor
        self._sandbox = sandbox
        self._config = config
        self._open: dict[str, Terminal] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def has(self, terminal_id: str) -> bool:
        return terminal_id in self._open

    def _get(self, terminal_id: str) -> Terminal:
        terminal = self._open.get(terminal_id)
        if terminal is None:
            raise NotFound(f"no terminal {sanitize_terminal(terminal_id)[:80]!r} in {self._owner}: open_terminal first")
        return terminal

    def _make_room(self) -> None:
        """Forget exited terminals past the cap; refuse when `max_open` are running."""
        cap = self._config.max_open
        if cap == 0:
            raise PolicyDenied(f"terminals are off in {self._owner} (its [terminals] max_open is 0)")
        exited = [t for t in self._open.values() if t.pty.exited]
        while len(self._open) >= cap and exited:
            self._forget(exited.pop(0))
        if len(self._open) >= cap:
            raise ResourceLimit(f"{cap} terminals are open in {self._owner}: close_terminal one first")

    async def open(
        self,
        executable: str,
        argv: tuple[str, ...],
        shown: tuple[str, ...],
        *,
        cwd: str,
        env: Mapping[str, str],
        rows: int,
        cols: int,
    ) -> dict[str, object]:
        """Start `argv` on a new terminal (`shown`: argv redacted); return its first view."""
        check_size(rows, cols)
        self._make_room()
        pty = await self._sandbox.open_pty(executable, argv, cwd=cwd, env=env, rows=rows, cols=cols)
        terminal = Terminal(f"term-{secrets.token_hex(8)}", pty, shown, rows, cols, self._config.scrollback_bytes)
        self._open[terminal.id] = terminal
        self._arm(terminal.id, self._config.idle_close_s)
        return {**self._summary(terminal), "cwd": cwd}

    def _summary(self, terminal: Terminal) -> dict[str, object]:
        return {
            "terminal_id": terminal.id,
            "argv": list(terminal.argv),
            "state": "exited" if terminal.pty.exited else "running",
            "exit_status": terminal.pty.status,
            "rows": terminal.rows,
            "cols": terminal.cols,
        }

    async def send(self, terminal_id: str, text: str, keys: Sequence[str]) -> dict[str, object]:
        """Write `text`, then `keys` in order."""
        terminal = self._get(terminal_id)
        data = text.encode("utf-8", errors="replace") + key_bytes(keys, application=terminal.application_keys)
        if len(data) > MAX_SEND_BYTES:
            raise ResourceLimit(f"{len(data)} bytes to send, over {MAX_SEND_BYTES} per call: send them in parts")
        if not data:
            raise InvalidRequest("nothing to send: give text, keys, or both")
        if terminal.pty.exited or not terminal.output_open:
            ended = "with its sandbox" if terminal.pty.status is None else f"(status {terminal.pty.status})"
            raise Conflict(f"terminal {terminal_id} has ended {ended}: open another")
        if self._sandbox.paused:
            raise Conflict("the sandbox is paused: resume it first")
        written = await terminal.send(data)
        return {"terminal_id": terminal_id, "bytes": len(data), "bytes_written": written}

    async def read(self, terminal_id: str, *, wait_for: str | None, timeout_s: float | None) -> dict[str, object]:
        """The screen and what scrolled off since the last read; with `wait_for`, first wait until it
        matches the screen or the newest scrolled lines (redacted), the program's output ends, or the timeout."""
        terminal = self._get(terminal_id)
        terminal.used = time.monotonic()
        if timeout_s is not None and not 0 <= timeout_s <= MAX_WAIT_S:
            raise InvalidRequest(f"timeout_s must be 0..{MAX_WAIT_S}")
        matched: bool | None = None
        terminal.reads += 1
        try:
            if wait_for is not None:
                matcher = wait_pattern(wait_for)
                matched = await self._wait(terminal, matcher, DEFAULT_WAIT_S if timeout_s is None else timeout_s)
            elif timeout_s:
                await terminal.changed(timeout_s)  # without a pattern: until any new output
        finally:
            terminal.reads -= 1
            terminal.used = time.monotonic()
        scrolled, dropped = terminal.take_scrolled()
        detail = {
            **self._summary(terminal),
            "screen": self._clean(terminal.screen_text()),
            "cursor": terminal.cursor(),
            "scrolled_off": self._clean(scrolled),
            "scrolled_off_dropped_lines": dropped,
            "output_open": terminal.output_open,
            "paced": terminal.take_paced(),
        }
        if matched is not None:
            detail["matched"] = matched
        return detail

    async def _wait(self, terminal: Terminal, matcher: Matcher, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            tail = terminal.scrolled_tail()
            seen = self._clean(f"{tail}\n{terminal.screen_text()}" if tail else terminal.screen_text())
            if matcher.found_in(seen):
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await terminal.changed(remaining):
                return False

    def _clean(self, text: str) -> str:
        return self._redactor.redact_keeping_lines(sanitize_terminal(text))

    def resize(self, terminal_id: str, rows: int, cols: int) -> dict[str, object]:
        check_size(rows, cols)
        terminal = self._get(terminal_id)
        terminal.resize(rows, cols)
        return self._summary(terminal)

    async def close(self, terminal_id: str) -> dict[str, object]:
        """Kill the program and everything it started, then close the terminal."""
        terminal = self._get(terminal_id)
        was_running = not terminal.pty.exited
        await self._sandbox.kill(terminal.pty)
        self._forget(terminal)
        return {**self._summary(terminal), "closed": True, "killed": was_running}

    def _forget(self, terminal: Terminal) -> None:
        self._open.pop(terminal.id, None)
        timer = self._timers.pop(terminal.id, None)
        if timer is not None:
            timer.cancel()
        terminal.close()

    def _arm(self, terminal_id: str, delay_s: float) -> None:
        self._timers[terminal_id] = asyncio.get_running_loop().call_later(delay_s, self._idle_check, terminal_id)

    def _idle_check(self, terminal_id: str) -> None:
        terminal = self._open.get(terminal_id)
        if terminal is None:
            return
        idle = time.monotonic() - terminal.used
        if terminal.reads:  # a terminal_read waits on it: in use (its end counts as a use too)
            self._arm(terminal_id, self._config.idle_close_s)
            return
        if idle < self._config.idle_close_s:
            self._arm(terminal_id, self._config.idle_close_s - idle)
            return
        if self._sandbox.paused:  # its programs cannot be killed while frozen: look again once resumed
            logger.info("%s: terminal %s idle while the sandbox is paused: kept for now", self._owner, terminal_id)
            self._arm(terminal_id, self._config.idle_close_s)
            return
        logger.info("%s: terminal %s idle for %.0f s: closed", self._owner, terminal_id, idle)
        task = asyncio.get_running_loop().create_task(self._close_quietly(terminal_id))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_quietly(self, terminal_id: str) -> None:
        try:
            await self.close(terminal_id)
        except BastionError as exc:  # paused meanwhile, say: tried again later (a closing sandbox forgets it)
            logger.warning("%s: idle terminal %s not closed: %s", self._owner, terminal_id, exc.reason)
            if terminal_id in self._open:
                self._arm(terminal_id, self._config.idle_close_s)
        except Exception:
            logger.exception("%s: idle terminal %s not closed", self._owner, terminal_id)

    def close_all(self) -> None:
        """The sandbox is closing (its end kills every program): close the terminals' master ends."""
        for terminal in list(self._open.values()):
            self._forget(terminal)

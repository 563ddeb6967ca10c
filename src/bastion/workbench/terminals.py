"""Interactive terminals of a sandbox: a program on a pseudo-terminal, its screen rendered by pyte.

The pseudo-terminal is opened inside the sandbox (`Sandbox.open_pty`); the host holds its
master end only, read on the event loop into a screen (`bastion.workbench.screen`). What the
program prints never reaches the client raw: the text of that screen and of the lines that
scrolled off it is sanitized and redacted like command output. Here: the terminals of one
sandbox, their caps and idle close, keys by name, and `wait_for` patterns.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

import anyio

from bastion.config import TerminalsConfig
from bastion.safety.errors import BastionError, Conflict, InvalidRequest, NotFound, PolicyDenied, ResourceLimit
from bastion.safety.redact import Redactor, sanitize_terminal
from bastion.safety.search import search_pattern
from bastion.sandbox.backend import Sandbox
from bastion.workbench.pacing import PACE_FACTOR
from bastion.workbench.workers import INLINE_CLEAN_CHARS, InThread, any_thread

if TYPE_CHECKING:
    from bastion.workbench.screen import Terminal

RE2: Any
try:  # google-re2: linear-time matching; without it, wait_for falls back to bounded `re` (`wait_pattern`)
    import re2 as RE2  # type: ignore[import-untyped, import-not-found, no-redef, unused-ignore]
except ImportError:  # pragma: no cover - depends on the environment
    RE2 = None

logger = logging.getLogger("bastion.terminals")
T = TypeVar("T")

MIN_ROWS: Final = 2
MAX_ROWS: Final = 100  # with MAX_COLS: pyte keeps an object per cell written (~0.2 KiB), and renders in pure Python
MIN_COLS: Final = 10
MAX_COLS: Final = 250
MAX_SEND_BYTES: Final = 65_536  # per terminal_send
MAX_WAIT_S: Final = 60.0  # terminal_read's timeout_s
DEFAULT_WAIT_S: Final = 10.0  # with wait_for and no timeout_s
MAX_PATTERN_CHARS: Final = 1000
INLINE_MATCH_WORK: Final = 64 * 1024
"""A wait_for whose text's length times the pattern's is over this is cleaned and matched in a worker thread
(RE2 lets go of the GIL): RE2's slower matcher costs about that product. Found by review: an 875-character
alternation whose automaton does not fit RE2's DFA cache runs on that matcher, 0.5 to 1.8 s for the 75 KB a
wait looks at (20 to 35 ms for 2 KB); four waiters matching on the loop stalled it 2.4 to 4.9 s. Cleaning that
text (redaction) took the loop 0.1 to 0.2 s more for each new version of the screen."""
# terminal_read calls waiting on one terminal at once: each looks at every change of its screen.
MAX_WAITING_READS: Final = 4
TERM: Final = "xterm-256color"

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


def _timed(work: Callable[[str], T], text: str) -> tuple[T, float]:
    """`work(text)`, and the CPU seconds it took (its thread's: in a worker, the time it waited for a CPU or the
    GIL is not the terminal's to pay)."""
    started = time.thread_time()
    return work(text), time.thread_time() - started


def _retrieved(task: asyncio.Task[tuple[str, float]]) -> None:
    if not task.cancelled():
        task.exception()


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
    options.log_errors = False  # else a match whose automaton outgrows the DFA cache writes a line to stderr, each time
    options.never_nl = False
    options.max_mem = 8 << 20  # a pattern whose automaton needs more is refused, not run
    return options


class Terminals:
    """The terminals of one sandbox (or host workspace), at most `config.max_open` running."""

    def __init__(self, owner: str, redactor: Redactor, sandbox: Sandbox, config: TerminalsConfig) -> None:
        self._owner = owner
        self._redactor = redactor
        self._sandbox = sandbox
        self._config = config
        self._open: dict[str, Terminal] = {}
        self._starting = 0  # opens waiting for their pty (a sleeping sandbox wakes first): they hold a slot
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._closing: set[asyncio.Task[None]] = set()
        # Per terminal: what wait_for looks at, cleaned, and the terminal's version it was made at; or, while it
        # is cleaned (in a thread when long), the task cleaning it, which every waiter on that version awaits.
        self._seen: dict[str, tuple[int, str | asyncio.Task[tuple[str, float]]]] = {}

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
        while len(self._open) + self._starting >= cap and exited:
            self._forget(exited.pop(0))
        if len(self._open) + self._starting >= cap:
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
        # Held while the pty opens (found by review of the same race in background processes: concurrent starts
        # on a sleeping sandbox all passed the check before the first one was added).
        self._starting += 1
        try:
            pty = await self._sandbox.open_pty(executable, argv, cwd=cwd, env=env, rows=rows, cols=cols)
        finally:
            self._starting -= 1
        from bastion.workbench.screen import Terminal  # pyte: loaded at the first terminal, not at every start

        terminal = Terminal(
            f"term-{secrets.token_hex(8)}", pty, shown, rows, cols, self._config.scrollback_bytes, group=self._owner
        )
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

    async def read(
        self,
        terminal_id: str,
        *,
        wait_for: str | None,
        timeout_s: float | None,
        in_thread: InThread = any_thread,
        wait_in_thread: InThread | None = None,
    ) -> dict[str, object]:
        """The screen and what scrolled off since the last read; with `wait_for`, first wait until it
        matches the screen or the newest scrolled lines (redacted), the program's output ends, or the timeout.
        What scrolled off is cleaned by `in_thread` (the calling tool's thread shares) when it is long: found
        by attack, 256 KiB of scrollback (the default; up to 16 MiB) took 100 ms of the event loop. A wait's
        own work goes to `wait_in_thread` (default `in_thread`): the tools bound it to a thread per caller."""
        terminal = self._get(terminal_id)
        terminal.used = time.monotonic()
        if timeout_s is not None and not 0 <= timeout_s <= MAX_WAIT_S:
            raise InvalidRequest(f"timeout_s must be 0..{MAX_WAIT_S}")
        matched: bool | None = None
        if (wait_for is not None or timeout_s) and terminal.reads >= MAX_WAITING_READS:
            raise ResourceLimit(
                f"{MAX_WAITING_READS} terminal_read calls already wait on {terminal_id}: wait for one to return"
            )
        terminal.reads += 1
        try:
            if wait_for is not None:
                matcher = wait_pattern(wait_for)
                wait_s = DEFAULT_WAIT_S if timeout_s is None else timeout_s
                matched = await self._wait(terminal, matcher, len(wait_for), wait_s, wait_in_thread or in_thread)
            elif timeout_s:
                await terminal.changed(timeout_s)  # without a pattern: until any new output
        finally:
            terminal.reads -= 1
            terminal.used = time.monotonic()
        scrolled, dropped = terminal.take_scrolled()
        screen, cursor = terminal.screen_text(), terminal.cursor()
        if len(scrolled) > INLINE_CLEAN_CHARS:
            scrolled = await in_thread(functools.partial(self._clean, scrolled))
        else:
            scrolled = self._clean(scrolled)
        detail = {
            **self._summary(terminal),
            "screen": self._clean(screen),
            "cursor": cursor,
            "scrolled_off": scrolled,
            "scrolled_off_dropped_lines": dropped,
            "output_open": terminal.output_open,
            "paced": terminal.take_paced(),
        }
        if matched is not None:
            detail["matched"] = matched
        return detail

    async def _wait(
        self, terminal: Terminal, matcher: Matcher, weight: int, timeout_s: float, in_thread: InThread
    ) -> bool:
        """Whether `matcher` (of a pattern of `weight` characters) matched before `timeout_s`: past it, a wait
        waiting for a thread gives up at once, one whose match runs when that match ends."""
        deadline = time.monotonic() + timeout_s
        looked_at: str | None = None
        while True:
            version = terminal.version
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                text, cleaning = await self._seen_text(terminal, in_thread)
                found, matching = False, 0.0
                if text != looked_at:  # a resize, say, made a new version of the same text (found by review)
                    look = functools.partial(_timed, matcher.found_in, text)
                    found, matching = await in_thread(look) if len(text) * weight > INLINE_MATCH_WORK else look()
                    looked_at = text
                # Rendering, cleaning and matching for a wait is work per change of the output, like pyte's (in a
                # thread or not): counted in the terminal's pacing, so waiters cannot make its output cost more
                # than its share; and the waiter itself waits three times what it spent before it looks again,
                # as idle output would never pace it (found by review: resizes every 50 ms had waiters re-match
                # 75 KB without end, 1.3 cores).
                terminal.charge(cleaning + matching)
                if found:
                    return True
                await anyio.sleep((cleaning + matching) * PACE_FACTOR)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            # A change while this wait looked (in a thread) or slept is not waited for again: it is looked at now.
            if terminal.version == version and not await terminal.changed(remaining):
                return False

    async def _seen_text(self, terminal: Terminal, in_thread: InThread) -> tuple[str, float]:
        """The newest scrolled lines and the screen, cleaned: what wait_for looks at, and the seconds this call
        spent on it. Made once per version of the terminal, by a task every read waiting on it awaits (cleaned
        in a thread when long: 75 KB took the loop 0.1 to 0.2 s)."""
        version = terminal.version
        seen = self._seen.get(terminal.id)
        if seen is not None and seen[0] == version:
            made = seen[1]
            return (made, 0.0) if isinstance(made, str) else ((await asyncio.shield(made))[0], 0.0)
        started = time.perf_counter()
        tail, screen = terminal.scrolled_tail(), terminal.screen_text()
        raw = f"{tail}\n{screen}" if tail else screen
        rendering = time.perf_counter() - started
        # Kept only for an open terminal: a waiter woken by its close would keep a closed one's text for the
        # sandbox's life (found by review: 22 KB a close).
        is_open = self._open.get(terminal.id) is terminal
        if len(raw) <= INLINE_CLEAN_CHARS:
            text = self._clean(raw)
            if is_open:
                self._seen[terminal.id] = (version, text)
            return text, time.perf_counter() - started
        task = asyncio.get_running_loop().create_task(self._clean_seen(terminal, version, raw, in_thread))
        task.add_done_callback(_retrieved)  # every waiter may have gone: its failure is then not reported twice
        if is_open:
            self._seen[terminal.id] = (version, task)
        text, cleaning = await asyncio.shield(task)
        return text, rendering + cleaning

    async def _clean_seen(self, terminal: Terminal, version: int, raw: str, in_thread: InThread) -> tuple[str, float]:
        text, cleaning = await in_thread(functools.partial(_timed, self._clean, raw))
        seen = self._seen.get(terminal.id)
        if seen is not None and seen[0] == version:  # still this version's, and the terminal still open
            self._seen[terminal.id] = (version, text)
        return text, cleaning

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
        killed = await self._sandbox.kill(terminal.pty)  # what an exited shell left running, too
        self._forget(terminal)
        return {**self._summary(terminal), "closed": True, "killed": killed}

    def _forget(self, terminal: Terminal) -> None:
        self._open.pop(terminal.id, None)
        self._seen.pop(terminal.id, None)
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

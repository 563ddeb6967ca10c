"""Background processes of a sandbox: started by run_command(background=true), read, fed and killed later.

Each has a small pid of the sandbox's own, a ring of raw output per stream, and the cleaned
(decoded, sanitized, redacted) log the client reads from; cleaning happens when it reads.

Processes a command left running (`x &`, nohup, setsid, a daemon) are listed beside them
(`"started_by": "command"`, by `os_pid`, the pid `ps` shows inside) and can be killed by it;
their command lines are the sandbox's to write, so they are cleaned like output.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

from bastion.safety.errors import Conflict, InvalidRequest, NotFound, ResourceLimit
from bastion.safety.output import OutputCleaner
from bastion.safety.redact import Redactor, sanitize_terminal
from bastion.sandbox.backend import Process, Sandbox
from bastion.sandbox.command_groups import Leftover
from bastion.sandbox.processes import OutputLog, RingCapture
from bastion.workbench.workers import INLINE_CLEAN_CHARS, InThread, any_thread

MAX_PROCESSES: Final = 16  # background processes per sandbox, running or exited (the oldest exited go first)
RING_BYTES: Final = 1 << 20  # raw output kept per stream of a background process, while the server has room
LOG_CHARS: Final = 1 << 20  # cleaned output kept per background process, both streams, likewise
SERVER_RING_BYTES: Final = 64 << 20  # raw output kept for all background processes of the server
SERVER_LOG_CHARS: Final = 16 << 20  # cleaned output kept for all of them (a character is up to 4 bytes)
MIN_RING_BYTES: Final = 16 << 10  # a process's share when very many run
MIN_LOG_CHARS: Final = 16 << 10
MAX_INPUT_BYTES: Final = 65_536  # per send_process_input call
INPUT_TIMEOUT_S: Final = 5.0  # for the process to take its input
EXIT_OUTPUT_WAIT_S: Final = 1.0  # after an exit, for the last output to arrive
MAX_LEFTOVERS_LISTED: Final = 100  # processes commands left running, per list_processes
MAX_ARGV_CHARS: Final = 512  # of each such process's command line, as listed


@dataclass
class Background:
    """A background process and the cleaning state of its output."""

    id: int
    process: Process
    argv: tuple[str, ...]  # redacted
    cleaners: tuple[OutputCleaner, OutputCleaner]
    log: OutputLog
    consumed: list[int] = field(default_factory=lambda: [0, 0])  # raw bytes cleaned, per stream
    dropped: list[int] = field(default_factory=lambda: [0, 0])  # raw bytes lost before cleaning
    flushed: list[bool] = field(default_factory=lambda: [False, False])
    cleaning: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while its output is cleaned into the log: two reads must not feed one cleaner at once."""

    @property
    def state(self) -> str:
        return "exited" if self.process.exited else "running"

    def summary(self) -> dict[str, object]:
        out, err = self.process.stdout, self.process.stderr
        return {
            "pid": self.id,
            "started_by": "background",
            "argv": list(self.argv),
            "state": self.state,
            "exit_status": self.process.status,
            "age_s": round(time.monotonic() - self.process.started, 3),
            "stdin_open": self.process.stdin_open,
            "output_bytes": out.total + err.total,
            "unread_bytes": out.total - max(out.start, self.consumed[0]) + err.total - max(err.start, self.consumed[1]),
            "dropped_bytes": self.dropped[0]
            + self.dropped[1]
            + max(0, out.start - self.consumed[0])
            + max(0, err.start - self.consumed[1]),
        }


class OutputShares:
    """The server's room for background processes' output, shared out equally among all of them.

    Each keeps `RING_BYTES` of raw output a stream and `LOG_CHARS` of cleaned log while that fits in
    `SERVER_RING_BYTES` and `SERVER_LOG_CHARS`, and an equal share of them as more run (the oldest output of
    each goes first, as when its own ring is full). Per sandbox alone, 16 processes x 16 sandboxes held up to
    ~1.3 GiB of the server's memory, past the ~300 MiB the systemd unit leaves it beside its sandboxes.
    """

    def __init__(self) -> None:
        self._records: dict[int, Background] = {}

    def join(self, record: Background) -> None:
        self._records[id(record)] = record
        self._share()

    def leave(self, record: Background) -> None:
        if self._records.pop(id(record), None) is not None:
            self._share()

    def shares(self) -> tuple[int, int]:
        """(bytes of ring a stream, characters of log) each process may keep now."""
        count = max(1, len(self._records))
        ring = max(MIN_RING_BYTES, min(RING_BYTES, SERVER_RING_BYTES // (2 * count)))
        return ring, max(MIN_LOG_CHARS, min(LOG_CHARS, SERVER_LOG_CHARS // count))

    def _share(self) -> None:
        ring, log = self.shares()
        for record in self._records.values():
            record.process.stdout.limit(ring)
            record.process.stderr.limit(ring)
            record.log.limit(log)


SHARES: Final = OutputShares()
"""One per server process: every sandbox's background processes share it."""


class BackgroundProcesses:
    """The background processes of one sandbox, by pid, at most `MAX_PROCESSES`."""

    def __init__(self, owner: str, redactor: Redactor, sandbox: Sandbox, max_output_chars: int) -> None:
        self._owner = owner
        self._redactor = redactor
        self._sandbox = sandbox
        self._max_output_chars = max_output_chars
        self._records: dict[int, Background] = {}
        self._starting = 0  # slots `reserved` for starts still awaiting the sandbox
        self._next_id = 1

    @contextlib.contextmanager
    def reserved(self) -> Iterator[dict[str, object]]:
        """Hold a slot of the table while a process starts (`add` it inside): the start awaits the
        sandbox, and concurrent starts counted only the added ones, so 300 got past a table of 16.
        Yields what the start made room by forgetting (empty if nothing), for its answer.

        Raises:
            ResourceLimit: every slot is running or starting.
        """
        forgotten = self._make_room()
        self._starting += 1
        try:
            yield forgotten
        finally:
            self._starting -= 1

    def _make_room(self) -> dict[str, object]:
        """Forget the oldest exited process when the table (with the starts under way) is full; say which, and
        how much of its output was never read (found by attack: it went without a word, its output with it).

        Raises:
            ResourceLimit: all of them are running or starting.
        """
        if len(self._records) + self._starting < MAX_PROCESSES:
            return {}
        exited = [pid for pid, record in self._records.items() if record.process.exited]
        if not exited:
            raise ResourceLimit(f"{MAX_PROCESSES} background processes are running: kill_process one first")
        # Let go of its output too: a child it left running may hold the pipes open for ever.
        dropped = self._records.pop(exited[0])
        SHARES.leave(dropped)
        process = dropped.process
        unread = process.stdout.total + process.stderr.total - sum(dropped.consumed)
        dropped.process.close()
        return {"forgotten": {"pid": dropped.id, "exit_status": process.status, "unread_bytes": unread}}

    def add(self, process: Process, argv: tuple[str, ...]) -> Background:
        """Keep a started process (`argv` already redacted) under the next pid."""
        record = Background(
            id=self._next_id,
            process=process,
            argv=argv,
            cleaners=(OutputCleaner(self._redactor), OutputCleaner(self._redactor)),
            log=OutputLog(LOG_CHARS),
        )
        self._next_id += 1
        self._records[record.id] = record
        SHARES.join(record)
        for capture in (process.stdout, process.stderr):
            if isinstance(capture, RingCapture):  # a VM's streams come from its channel, not a pipe
                capture.pace()
        return record

    def _get(self, pid: int) -> Background:
        record = self._records.get(pid)
        if record is None:
            raise NotFound(f"no background process {pid} in {self._owner}: see list_processes")
        return record

    def summaries(self) -> list[dict[str, object]]:
        return [record.summary() for record in self._records.values()]

    async def read(self, pid: int, *, since: int | None, in_thread: InThread = any_thread) -> dict[str, object]:
        """Cleaned output from offset `since` (default: the oldest kept), at most max_output_bytes characters.
        New output is cleaned by `in_thread` (the calling tool's thread shares) when it is long: found by attack,
        64 KiB of control characters a stream took 115 ms of the event loop a read, and another sandbox's
        `run_command` p99 went from 8 to 730 ms."""
        record = self._get(pid)
        if since is not None and since > record.log.end:
            raise InvalidRequest(f"since={since} is past the end of the output ({record.log.end}): use detail.next")
        if record.process.exited:
            await record.process.wait_output(EXIT_OUTPUT_WAIT_S)
        cap = self._max_output_chars
        async with record.cleaning:
            pieces = _take_raw(record, cap)
            if sum(len(raw) for raw, _ in pieces) <= INLINE_CLEAN_CHARS:
                _clean(record, pieces)
            else:
                cleaning = asyncio.ensure_future(in_thread(functools.partial(_clean, record, pieces)))
                try:
                    await asyncio.shield(cleaning)
                finally:  # a read cancelled meanwhile keeps the lock until the thread is through with the cleaners
                    if not cleaning.done():
                        await asyncio.wait([cleaning])
        start = record.log.start if since is None else since
        first, (stdout, stderr), following = record.log.read(start, cap)
        process = record.process
        unread_raw = process.stdout.total > record.consumed[0] or process.stderr.total > record.consumed[1]
        # Found by attack: a process that exited while a child it left still writes to its pipes said
        # `more: false`, which clients take for the end of its output.
        still_written = process.exited and not (process.stdout.closed and process.stderr.closed)
        summary = record.summary()
        return {
            "pid": pid,
            "state": summary["state"],
            "exit_status": process.status,
            "stdout": stdout,
            "stderr": stderr,
            "since": first,
            "next": following,
            "more": following < record.log.end or unread_raw or still_written,
            "skipped_chars": first - start,
            "dropped_bytes": summary["dropped_bytes"],
        }

    async def send_input(self, pid: int, data: str, *, eof: bool) -> dict[str, object]:
        """Write `data` to the process's stdin; with `eof`, close it afterwards."""
        record = self._get(pid)
        raw = data.encode("utf-8")  # a lone surrogate never gets here: the tool decorator refuses it
        if len(raw) > MAX_INPUT_BYTES:
            raise ResourceLimit(f"data is {len(raw)} bytes, over {MAX_INPUT_BYTES} per call: send it in parts")
        if record.process.exited:
            raise Conflict(f"process {pid} has {_ended(record.process.status)}: it reads no more input")
        if self._sandbox.paused:
            raise Conflict("the sandbox is paused: resume it first")
        written = await record.process.write(raw, timeout_s=INPUT_TIMEOUT_S) if raw else 0
        if eof and written == len(raw):
            record.process.close_stdin()
        return {"pid": pid, "bytes": len(raw), "bytes_written": written, "eof": eof and written == len(raw)}

    async def kill(self, pid: int) -> dict[str, object]:
        """SIGKILL the process and everything it started, also once its first process has exited (a child
        it left may still hold its pipes). `killed`: whether anything of it was running."""
        record = self._get(pid)
        killed = await self._sandbox.kill(record.process)
        return {**record.summary(), "killed": killed}

    def clear(self) -> None:
        for record in self._records.values():
            SHARES.leave(record)
        self._records.clear()

    async def leftovers(self, in_thread: InThread = any_thread) -> list[dict[str, object]]:
        """What commands left running, cleaned: at most `MAX_LEFTOVERS_LISTED`, the lowest pids first. Cleaned by
        `in_thread` (the calling tool's thread shares) when there are many: found by attack, 100 command lines of
        4 KiB of `key=` lines each took 100 ms of the event loop a call."""
        lefts = self._sandbox.leftovers()[:MAX_LEFTOVERS_LISTED]
        if sum(len(arg) for left in lefts for arg in left.argv) <= INLINE_CLEAN_CHARS:
            return [self._shown(left) for left in lefts]
        return await in_thread(functools.partial(self._shown_all, lefts))

    def _shown_all(self, lefts: list[Leftover]) -> list[dict[str, object]]:
        return [self._shown(left) for left in lefts]

    def _shown(self, left: Leftover) -> dict[str, object]:
        argv: list[str] = []
        room = MAX_ARGV_CHARS
        for raw in left.argv:
            if room <= 0:
                argv.append("...")
                break
            arg = self._redactor.redact(sanitize_terminal(raw.decode("utf-8", errors="replace")))[:room]
            argv.append(arg)
            room -= len(arg)
        return {"os_pid": left.pid, "started_by": "command", "argv": argv, "state": "running"}

    async def kill_leftover(self, os_pid: int) -> dict[str, object]:
        """SIGKILL one process a command left running (its pid in the sandbox); only that process."""
        await self._sandbox.kill_leftover(os_pid)
        return {"os_pid": os_pid, "started_by": "command", "killed": True}


def _take_raw(record: Background, budget: int) -> list[tuple[bytes, bool]]:
    """At most `budget` more raw bytes of each stream, and whether it is that stream's last (on the loop: the
    rings are filled there)."""
    process = record.process
    pieces: list[tuple[bytes, bool]] = []
    for stream, capture in enumerate((process.stdout, process.stderr)):
        if record.consumed[stream] < capture.start:
            # The ring dropped bytes nobody had read: they are lost, and so is what the cleaner held.
            record.dropped[stream] += capture.start - record.consumed[stream]
            record.consumed[stream] = capture.start
            record.cleaners[stream].reset()
        _, raw = capture.read(record.consumed[stream], budget)
        record.consumed[stream] += len(raw)
        final = capture.closed and record.consumed[stream] == capture.total and not record.flushed[stream]
        pieces.append((raw, final))
    return pieces


def _clean(record: Background, pieces: list[tuple[bytes, bool]]) -> None:
    """Clean `_take_raw`'s pieces into the log (a held tail stays held)."""
    for stream, (raw, final) in enumerate(pieces):
        if raw or final:
            record.flushed[stream] = final
            record.log.append(stream, record.cleaners[stream].feed(raw, final=final))


def _ended(status: int | None) -> str:
    """How a process ended, for a refusal: no status means it ended with its sandbox (agent gone)."""
    return "ended with its sandbox" if status is None else f"exited (status {status})"

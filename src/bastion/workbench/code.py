"""Code execution in a sandbox: persistent contexts for Python, JavaScript and bash.

A Python context is a kernel (`bastion.sandbox.inside.kernel`) running as a background
process of the sandbox: variables, imports and open files live in it between calls. A
JavaScript or bash context is a driver (`bastion.sandbox.inside.repl`) holding one resident
`node` or `bash`, speaking the same protocol; everything below applies to all three.
What the kernel sends is untrusted (it runs the agent's code, which can write to the
protocol fd): only small headers are parsed (at most MAX_HEADER_BYTES, nothing else is
JSON), payloads are bounded per kind and handled as they arrive, output past the cap is
counted, never cleaned, and every text is cleaned and redacted like command output. A
kernel that breaks the protocol is killed; the call says why. No step costs the event loop
more than one read's worth of work, and all contexts together handle messages for at most a share of the
loop's time (`Pacer`, the `OUTPUT` timeline, terminals' too), so flooding contexts cannot stall other sandboxes.

A timeout first interrupts the code (KeyboardInterrupt inside, the context lives on);
if the code does not stop within a grace period, the kernel is killed and the
context is dead until restarted. A kernel killed, or exited on its own, takes what it
started with it (`CodeContext.kill`, `CodeContext._end_with_kernel`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

import anyio
import anyio.to_thread

from bastion.safety.errors import BastionError, Conflict, InvalidRequest, NotFound, ResourceLimit, Unavailable
from bastion.safety.output import OutputCleaner
from bastion.safety.redact import Redactor, sanitize_terminal
from bastion.sandbox import KERNEL_PATH, REPL_PATH, SANDBOX_PATH, SANDBOX_WORKSPACE
from bastion.sandbox.backend import Process
from bastion.sandbox.processes import RingCapture
from bastion.workbench.media import ImageLease
from bastion.workbench.pacing import OUTPUT, PACE_FACTOR, Pacer, new_reader
from bastion.workbench.workers import InThread, any_thread
from bastion.workbench.workspace import OWN_VENV, SYSTEM_PYTHON, HostWorkspace

logger = logging.getLogger("bastion.code")

Language = Literal["python", "javascript", "bash"]
LANGUAGES: Final[tuple[Language, ...]] = ("python", "javascript", "bash")
RUNTIMES: Final = {"javascript": "node", "bash": "bash"}
NAMES: Final = {"python": "Python", "javascript": "JavaScript", "bash": "bash"}
"""How a message names each language."""
"""The program each language other than Python needs on the sandbox's PATH (the host's /usr)."""
MAX_CONTEXTS: Final = 8
MAX_CODE_BYTES: Final = 1 << 20
# A header is a small JSON object; bulk data (output, images, values) travels as raw payload after it.
# Parsing 4 KiB of the worst JSON (nested lists, many numbers) takes well under a millisecond.
MAX_HEADER_BYTES: Final = 4096
MAX_IMAGE_BYTES: Final = 4 << 20
MAX_IMAGES: Final = 8
MAX_CELL_IMAGE_BYTES: Final = 4 << 20
"""Of all the images of one cell, as their headers declare them and as returned (an SVG grows when redacted).
Eight of 4 MiB each, base64-encoded on the event loop, took half a GiB of server memory per 8 contexts and
stalled other sandboxes for seconds. An image past it is never read: dropped on its header, with a note."""
MAX_SVG_BYTES: Final = 512 << 10
"""An SVG is text, redacted like output: 0.4 s of CPU per MiB of the worst text (secret-shaped
`token: a` lines); eight of 4 MiB held the event loop for 18 s. A plot is tens of KiB; a larger SVG
is dropped (`truncated`), and the rest are redacted in a worker thread (the loop then waits at most
for one regex pass over one SVG, about 0.1 s)."""
MAX_TEXT_CHARS: Final = 65_536  # of a value or an error field, as the client sees it
MAX_TEXT_PAYLOAD_BYTES: Final = 4 * MAX_TEXT_CHARS  # of UTF-8
# What one message may carry, by event; a header with "bytes" over its cap breaks the protocol.
PAYLOAD_CAPS: Final = {
    "stream": 1 << 20,  # the kernel sends what one read of a pipe gave (64 KiB)
    "image": MAX_IMAGE_BYTES,
    "value": MAX_TEXT_PAYLOAD_BYTES,
    "display": MAX_TEXT_PAYLOAD_BYTES,
    "error": MAX_TEXT_PAYLOAD_BYTES,
}
_ERROR_FIELDS: Final = ("type", "message", "traceback")
DISPLAY_TYPES: Final = ("text/markdown", "text/html")
"""Rich forms of a value returned as text (HTML is never rendered by bastion)."""
PNG: Final = "image/png"
SVG: Final = "image/svg+xml"
_EVENTS: Final = frozenset({"ready", "done", *PAYLOAD_CAPS})
_CLEAN_SLACK_BYTES: Final = 256  # an escape sequence or a character split at the cut
# Stream payloads are cleaned in batches of this much: the stream redactor rescans what it holds
# (up to 16 Ki characters) at every feed, so cleaning each of a flood of 1-byte messages on its
# own cost ~2 ms apiece, seconds of event loop per read.
_CLEAN_BATCH_BYTES: Final = 65_536
# Headers handled in one step; the rest of a read waits for the step's slot in the loop's `Pacer` (`OUTPUT` timeline)
# (the pipe is not read meanwhile). 64 KiB of 18-byte headers took 15 ms in one callback; 64 take ~0.3 ms.
MAX_HEADERS_PER_TURN: Final = 64
PACE_FREE_S: Final = 0.0015  # a slot ending within this from now does not pause reading: real output never waits
# The most one step books in the shared timeline (a step may clean a 64 KiB batch of output): what it spent
# past this delays its own context alone, so one costly step does not hold every other context's reading.
MAX_SHARED_SLOT_S: Final = 0.02
_REDACT_MARGIN_CHARS: Final = 1024  # text past a cut kept while redacting, so a secret across it is still seen
CLEANING_THREADS_PER_SANDBOX: Final = 1
"""Worker threads a sandbox's contexts clean their cells' images and texts in, at once (anyio's, under a limiter
of the sandbox's own: never the pool another sandbox's calls wait in). Found by attack: in asyncio's default
executor (6 threads on 2 cores, shared by the whole server) eight sandboxes' SVG redactions held every thread for
seconds, another agent's kill_process waited past its grace period, and its whole sandbox was ended."""
T = TypeVar("T")


START_TIMEOUT_S: Final = 30.0  # a cold interpreter on a busy machine
GRACE_S: Final = 5.0
PROGRESS_EVERY_S: Final = 1.0
LATE_ANSWER_S: Final = 0.05  # at its deadline, how long a cell waits for an answer already sent (a stalled server)
PROGRESS_TAIL_CHARS: Final = 2000
_CONTEXT_NAME_MAX: Final = 32

Progress = Callable[[str], Awaitable[None]]


@dataclass
class Image:
    data: bytes
    mime_type: str
    width: int
    height: int


@dataclass
class CellResult:
    """One execution, cleaned and redacted."""

    stdout: str
    stderr: str
    value: str | None
    """The repr of a last expression (Python) or its inspection (JavaScript)."""
    error: dict[str, str] | None
    images: list[Image]
    truncated: bool
    execution_count: int
    timed_out: bool = False
    context_alive: bool = True
    oom_killed: bool = False
    memory_note: str = ""
    """On an OOM kill: how much of the memory files in /tmp and /dev/shm held."""
    protocol_error: str = ""
    """How the kernel broke the protocol, if it did (it was killed)."""
    markdown: str | None = None
    """The value as markdown: a DataFrame's table, or its `_repr_markdown_`."""
    html: str | None = None
    """The value's `_repr_html_`, as text."""
    exit_status: int | None = None
    """bash: the cell's $?."""
    image_note: str = ""
    """Which images were dropped, and why (the cell's caps, the sandbox's share of the server's budget of images
    in flight, or that budget)."""


@dataclass(frozen=True)
class _Texts:
    """A cell's text fields as the client sees them: cleaned and redacted (`CodeContext._text`)."""

    value: str | None = None
    markdown: str | None = None
    html: str | None = None
    error: dict[str, str] | None = None


PayloadSink = Callable[[bytes | None], None]
"""Takes a message's payload chunk by chunk as it is read, then None once it is complete."""


class ProtocolError(Exception):
    """The kernel broke the protocol; `reason` says how, in one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _parse_header(line: bytes) -> dict[str, Any]:
    """A header, checked: a known event with the fields it needs and a payload within its cap.

    Raises:
        ProtocolError: anything else (RecursionError of a deeply nested line included).
    """
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        raise ProtocolError("a message header is not valid JSON") from None
    if not isinstance(message, dict):
        raise ProtocolError("a message header is not a JSON object")
    event = message.get("event")
    if not isinstance(event, str) or event not in _EVENTS:
        raise ProtocolError(f"unknown event {str(event)[:40]!r}")
    cell_id = message.get("id")
    if event not in ("ready", "stream") and type(cell_id) is not int:
        raise ProtocolError(f"a {event} message without a numeric id")
    cap = PAYLOAD_CAPS.get(event)
    size = message.get("bytes")
    if cap is not None and (type(size) is not int or not 0 <= size <= cap):
        raise ProtocolError(f"a {event} message whose payload is not 0 to {cap} bytes")
    if cap is None and size is not None:
        raise ProtocolError(f"a {event} message with a payload")
    return message


class _ProtocolReader:
    """Splits the kernel's bytes into headers and payloads as they are read, never holding more
    than one header (MAX_HEADER_BYTES) or handing on more than it was fed."""

    def __init__(self, on_header: Callable[[dict[str, Any]], PayloadSink | None], on_broken: Callable[[str], None]):
        self._on_header = on_header
        self._on_broken = on_broken
        self._head = bytearray()
        self._left = 0  # payload bytes still to come
        self._sink: PayloadSink | None = None
        self.broken = False

    def feed(self, data: bytes, pos: int = 0) -> int:
        """Take `data` from `pos` on, up to MAX_HEADERS_PER_TURN headers; return where it stopped
        (len(data) once all is taken, or once the protocol is broken)."""
        headers = 0
        while pos < len(data) and not self.broken:
            if self._left:
                pos = self._take_payload(data, pos)
            elif headers == MAX_HEADERS_PER_TURN:
                return pos
            else:
                pos = self._take_header(data, pos)
                headers += 1
        return len(data)

    def _take_payload(self, data: bytes, pos: int) -> int:
        end = min(len(data), pos + self._left)
        self._left -= end - pos
        if self._sink is not None:
            self._sink(data[pos:end])
            if not self._left:
                self._sink(None)
                self._sink = None
        return end

    def _take_header(self, data: bytes, pos: int) -> int:
        room = MAX_HEADER_BYTES - len(self._head)
        end = data.find(b"\n", pos, pos + room + 1)
        if end < 0:
            if len(data) - pos > room:
                self._break(f"a message header is longer than {MAX_HEADER_BYTES} bytes")
            else:
                self._head += data[pos:]
            return len(data)
        self._head += data[pos:end]
        line = bytes(self._head)
        self._head.clear()
        try:
            message = _parse_header(line)
        except ProtocolError as exc:
            self._break(exc.reason)
            return len(data)
        sink = self._on_header(message)
        self._left = message.get("bytes") or 0
        if sink is not None and self._left:
            self._sink = sink
        elif sink is not None:
            sink(None)
        return end + 1

    def _break(self, reason: str) -> None:
        self.broken = True
        self._head.clear()
        self._on_broken(reason)


_INLINE_TEXT_BYTES: Final = 4096
"""A done cell's text fields up to this many bytes in all are cleaned on the loop (a value like `2`), larger
ones in a worker thread."""


def _text_bytes(value: bytes | None, display: dict[str, bytes], error: dict[str, bytes]) -> int:
    return len(value or b"") + sum(map(len, display.values())) + sum(map(len, error.values()))


class _MessageCapture(RingCapture):
    """The kernel's protocol channel, fed to a `_ProtocolReader` one read at a time; a few KiB are
    kept for diagnosis. Closing it (EOF, or the context killed) calls `on_eof` once.

    Each step (a read, or the part of one that MAX_HEADERS_PER_TURN headers allow) is paced by the
    loop's `Pacer` (`OUTPUT` timeline), from before the read: when its slot ends later than PACE_FREE_S from now,
    the pipe is left unread until then (the kernel waits on a full pipe), and the rest of the read is handled then.
    Booked from `_keep` on, after the read, a flooding context took a third of the loop, not a quarter."""

    def __init__(self, fd: int, reader: _ProtocolReader, on_eof: Callable[[], None], group: str) -> None:
        self._reader = reader
        self._group = group  # its sandbox's id: whose share of the `OUTPUT` timeline its reading takes
        self._pace_key = new_reader()
        self._on_eof = on_eof
        self._rest = b""
        self._rest_at = 0
        self._timer: asyncio.TimerHandle | None = None
        self._read_began = (0.0, 0.0)  # (loop time, perf_counter) at the start of the read being kept
        super().__init__(fd, 4096)
        self._pacer = Pacer.of(self._loop, OUTPUT)

    def _on_readable(self) -> None:
        self._read_began = (self._loop.time(), time.perf_counter())
        super()._on_readable()

    def _keep(self, chunk: bytes) -> None:
        booked, started = self._read_began
        super()._keep(chunk)
        self._step(chunk, 0, booked, started)

    def _step(self, data: bytes, pos: int, booked: float, started: float) -> None:
        """Feed `data` from `pos`, book what it cost, and pause reading until the slot ends if it must."""
        stopped = self._reader.feed(data, pos)
        spent = time.perf_counter() - started
        shared = min(spent, MAX_SHARED_SLOT_S)
        now = self._loop.time()
        resume_at = max(
            self._pacer.slot(self._pace_key, self._group, booked, shared), now + (spent - shared) * PACE_FACTOR
        )
        if self.closed or (stopped == len(data) and resume_at - now <= PACE_FREE_S):
            return
        self._rest, self._rest_at = data, stopped
        self._loop.remove_reader(self.fd)
        self._timer = self._loop.call_at(resume_at, self._resume)

    def _resume(self) -> None:
        self._timer = None
        data, pos = self._rest, self._rest_at
        self._rest, self._rest_at = b"", 0
        if self.closed:
            return
        if pos < len(data):
            self._step(data, pos, self._loop.time(), time.perf_counter())
        if self._timer is None and not self.closed:
            self._loop.add_reader(self.fd, self._on_readable)

    def close(self) -> None:
        was_closed = self.closed
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().close()
        if not was_closed:
            self._on_eof()


def _discard(_chunk: bytes | None) -> None:
    """The sink of a payload nobody waits for (a message of an earlier cell, an image past the count)."""


def _collect(done: Callable[[bytes], None]) -> PayloadSink:
    """A sink that gathers a payload (already bounded by its header's cap) and hands it over whole."""
    parts = bytearray()

    def sink(chunk: bytes | None) -> None:
        if chunk is None:
            done(bytes(parts))
        else:
            parts.extend(chunk)

    return sink


@dataclass
class _Cell:
    id: int
    stdout: OutputCleaner
    stderr: OutputCleaner
    cap: int
    done: asyncio.Future[dict[str, Any]]
    text: list[list[str]] = field(default_factory=lambda: [[], []])
    sizes: list[int] = field(default_factory=lambda: [0, 0])
    raw: list[bytearray] = field(default_factory=lambda: [bytearray(), bytearray()])  # not yet cleaned
    truncated: bool = False
    finished: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    value: bytes | None = None
    display: dict[str, bytes] = field(default_factory=dict)
    error: dict[str, bytes] = field(default_factory=dict)
    images: list[Image] = field(default_factory=list)
    lease: ImageLease | None = None
    """The call's share of the server's image budget; None: no budget but the cell's own caps."""
    image_count: int = 0  # images taken on their headers
    image_bytes: int = 0
    images_over_cap: int = 0
    images_over_budget: int = 0
    images_over_share: int = 0

    def add(self, stream: int, raw: bytes | None) -> None:
        """Gather output to clean in batches of _CLEAN_BATCH_BYTES. Past the cap, bytes only mark
        the result truncated: they are never decoded, cleaned or redacted, so a flood costs a
        count, not a pass over it."""
        if self.finished or not raw:
            return
        if self.sizes[stream] >= self.cap:
            self.truncated = True
            return
        self.raw[stream] += raw
        if len(self.raw[stream]) >= _CLEAN_BATCH_BYTES:
            self._clean(stream)

    def _clean(self, stream: int) -> None:
        """Clean what was gathered of `stream`, as much as fits under the cap."""
        raw = bytes(self.raw[stream])
        self.raw[stream].clear()
        room = self.cap - self.sizes[stream]
        if not raw:
            return
        if room <= 0:
            self.truncated = True
            return
        limit = 4 * room + _CLEAN_SLACK_BYTES  # a character is at most 4 bytes; escapes only shorten text
        cleaner = self.stdout if stream == 0 else self.stderr
        clean = cleaner.feed(raw[:limit])
        over = len(raw) > limit or len(clean) > room
        clean = clean[:room]
        if clean:
            self.text[stream].append(clean)
            self.sizes[stream] += len(clean)
            self.changed.set()
        if over:
            # The rest of this stream is cut: joining text across the gap could complete a secret's prefix.
            self.truncated = True
            self.sizes[stream] = self.cap

    def image_sink(self, size: int, mime_type: str, width: int, height: int) -> PayloadSink:
        """Where an image's payload goes: gathered if the cell takes it (`admit_image`), else dropped unread."""
        if not self.admit_image(size, mime_type):
            return _discard
        parts = bytearray()

        def sink(chunk: bytes | None) -> None:
            if self.done.done():
                parts.clear()  # the call has ended (the kernel died mid-image): nobody takes it
            elif chunk is not None:
                parts.extend(chunk)
            elif mime_type != PNG or parts.startswith(b"\x89PNG\r\n\x1a\n"):
                # Only a PNG by its magic, or an SVG (checked when redacted), goes to the client as an
                # image; the size fields are the kernel's word.
                self.images.append(Image(bytes(parts), mime_type, max(0, width), max(0, height)))

        return sink

    def admit_image(self, size: int, mime_type: str) -> bool:
        """Whether an image whose header declares `size` bytes is taken: within the cell's count and bytes
        (an SVG within MAX_SVG_BYTES), its sandbox's share of the server's budget and that budget. Decided on
        the header, so the payload of one refused is never held; each refusal is counted for the note."""
        if self.done.done():
            return False
        if (
            self.image_count >= MAX_IMAGES
            or self.image_bytes + size > MAX_CELL_IMAGE_BYTES
            or (mime_type == SVG and size > MAX_SVG_BYTES)
        ):
            self.images_over_cap += 1
        elif self.lease is not None and (refused := self.lease.take(size)) is not None:
            if refused == "sandbox":
                self.images_over_share += 1
            else:
                self.images_over_budget += 1
        else:
            self.image_count += 1
            self.image_bytes += size
            return True
        self.truncated = True
        return False

    def image_note(self) -> str:
        """One line on the images dropped, if any."""
        notes = []
        if self.images_over_cap:
            notes.append(
                f"{self.images_over_cap} image(s) dropped: a cell returns at most {MAX_IMAGES} images of "
                f"{MAX_CELL_IMAGE_BYTES >> 20} MiB in all (an SVG at most {MAX_SVG_BYTES >> 10} KiB); "
                "save larger ones to a file and read them from there"
            )
        if self.images_over_share and self.lease is not None:
            notes.append(
                f"{self.images_over_share} image(s) dropped: this sandbox's calls in progress already hold its "
                f"{self.lease.budget.sandbox_limit_bytes >> 20} MiB of images; run the code again once they return"
            )
        if self.images_over_budget and self.lease is not None:
            notes.append(
                f"{self.images_over_budget} image(s) dropped: the server already holds its "
                f"{self.lease.budget.limit_bytes >> 20} MiB of images for calls in progress; run the code again"
            )
        return "; ".join(notes)

    def finish(self) -> tuple[str, str]:
        for stream, cleaner in enumerate((self.stdout, self.stderr)):
            self._clean(stream)
            rest = cleaner.feed(b"", final=True)
            if rest and not self.truncated:
                self.add_clean(stream, rest)
        self.finished = True
        return "".join(self.text[0]), "".join(self.text[1])

    def add_clean(self, stream: int, clean: str) -> None:
        room = self.cap - self.sizes[stream]
        if len(clean) > room:
            clean, self.truncated = clean[: max(room, 0)], True
        self.text[stream].append(clean)
        self.sizes[stream] += len(clean)

    def tail(self) -> str:
        if not self.finished:
            self._clean(0)
            self._clean(1)
        joined = "".join(self.text[0][-8:]) + "".join(self.text[1][-8:])
        return joined[-PROGRESS_TAIL_CHARS:]


class CodeContext:
    """One persistent context in a sandbox: a Python kernel, or a driver of node or bash."""

    def __init__(
        self,
        name: str,
        language: Language,
        workspace: HostWorkspace,
        redactor: Redactor,
        argv: tuple[str, ...],
        *,
        threads: anyio.CapacityLimiter,
    ) -> None:
        self.name = name
        self.language = language
        self._workspace = workspace
        self._redactor = redactor
        self._argv = argv
        self._threads = threads  # its sandbox's share of worker threads (`CLEANING_THREADS_PER_SANDBOX`)
        self._process: Process | None = None
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self._cell: _Cell | None = None
        self._count = 0
        self._unusable = False
        """The kernel is out of step with the server (half a request in its input, `_send`; a cancelled cell that
        could not be stopped, `_stop_cancelled`): listed dead until restarted, though its kill may wait."""
        self._lock = asyncio.Lock()
        self._killing: asyncio.Task[None] | None = None  # held: a task nobody references may vanish
        self._watching: asyncio.Task[None] | None = None  # `_end_with_kernel`'s, held likewise
        self._starting: asyncio.Task[None] | None = None
        self._waiters = 0  # calls waiting for the start
        self._on_failure: Callable[[], None] = lambda: None
        self.broken = ""  # how the kernel broke the protocol, once it has
        self.started = time.monotonic()

    @property
    def alive(self) -> bool:
        return self._process is not None and not self._process.exited and not self._unusable

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def summary(self) -> dict[str, object]:
        return {
            "context": self.name,
            "language": self.language,
            "state": ("busy" if self.busy or self.starting else "idle") if self.alive or self.starting else "dead",
            "execution_count": self._count,
            "age_s": round(time.monotonic() - self.started, 3),
        }

    @property
    def starting(self) -> bool:
        return self._starting is not None and not self._starting.done()

    def begin(self, *, after: CodeContext | None, on_failure: Callable[[], None]) -> None:
        """Start the kernel in a task of the context's own (once `after`, a dead context it replaces, is
        killed): every call waiting for this context shares the one start. `on_failure` runs if the start
        fails, or once every call waiting for it has gone away."""

        async def run() -> None:
            try:
                if after is not None:
                    await after.kill()  # lets go of its pipes, which a child it left may hold
                await self.start()
            except BaseException:
                on_failure()
                raise

        self._on_failure = on_failure
        self._starting = asyncio.get_running_loop().create_task(run())
        # Its error reaches every waiter; if none is left, retrieving it here keeps asyncio from logging it.
        self._starting.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def wait_started(self) -> None:
        """Wait for the start `begin` made. A caller cancelled leaves it to the others; the last one to go
        cancels it, and returns once the kernel is killed (nobody would own it).

        Raises:
            Unavailable: the kernel did not start (or another error of the start, the same for every waiter).
        """
        task = self._starting
        assert task is not None
        self._waiters += 1
        try:
            await asyncio.shield(task)
        finally:
            self._waiters -= 1
            if not self._waiters and not task.done():
                self._on_failure()  # out of the table at once: a call from now on starts a fresh context
                task.cancel()
                await asyncio.wait([task])

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        env = {
            **self._workspace.environment(),
            "MPLBACKEND": "Agg",
            "MPLCONFIGDIR": "/tmp/.matplotlib",  # noqa: S108 - the sandbox's own tmpfs
        }
        self._process = await self._workspace.sandbox.spawn(
            self._argv[0],
            self._argv,
            cwd=SANDBOX_WORKSPACE,
            env=env,
            ring_bytes=16_384,
            stdout=lambda fd: _MessageCapture(
                fd, _ProtocolReader(self._on_header, self._on_broken), self._on_eof, self._workspace.id
            ),
        )
        self._watching = loop.create_task(self._end_with_kernel(self._process))
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await self._ready
        except (TimeoutError, Unavailable) as exc:
            # Unavailable: the kernel exited first (or its sandbox was closed), which is not a timeout.
            ended = exc.reason if isinstance(exc, Unavailable) else "it did not start in time"
            broke = f"it broke the protocol ({self.broken})" if self.broken else ""
            reason = broke or self._stderr_tail() or ended
            await self.kill()
            raise Unavailable(f"the {NAMES[self.language]} context did not start: {reason}") from None
        except BaseException:
            # Cancelled (the server is stopping): the kernel would run on, holding its pipes, until the
            # sandbox closes.
            await asyncio.shield(self.kill())
            raise

    def _stderr_tail(self) -> str:
        if self._process is None:
            return ""
        _, raw = self._process.stderr.read(0, 16_384)
        lines = self._redactor.redact(sanitize_terminal(raw.decode("utf-8", "replace"))).strip().splitlines()
        return lines[-1][:300] if lines else ""

    def _on_header(self, message: dict[str, Any]) -> PayloadSink | None:
        """Act on one checked header; return where its payload goes."""
        event = message["event"]
        if event == "ready":
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(message)
            return None
        cell = self._cell
        if cell is None or message.get("id") != cell.id:
            return _discard  # an earlier cell's, or sent between cells
        if event == "done":
            if not cell.done.done():
                cell.done.set_result(message)
            return None
        if event == "stream":
            stream = 0 if message.get("name") == "stdout" else 1
            return lambda chunk: cell.add(stream, chunk)
        if event == "value":
            return _collect(lambda data: setattr(cell, "value", data))
        if event == "display":
            mime = message.get("mime")
            if mime not in DISPLAY_TYPES:
                return _discard
            return _collect(lambda data: cell.display.__setitem__(str(mime), data))
        if event == "error":
            name = message.get("field")
            return _collect(lambda data: cell.error.__setitem__(str(name), data)) if name in _ERROR_FIELDS else _discard
        mime = message.get("mime", PNG)
        if mime not in (PNG, SVG):
            return _discard
        width, height = message.get("width"), message.get("height")
        size = (width if type(width) is int else 0, height if type(height) is int else 0)
        return cell.image_sink(message["bytes"], str(mime), *size)

    def _on_eof(self) -> None:
        """The kernel exited or was killed: the context is over."""
        self._end({"event": "eof"}, Unavailable("the kernel exited"))

    def _on_broken(self, reason: str) -> None:
        """The kernel broke the protocol (it runs the agent's code): the context is killed, the call says why."""
        if self.broken:
            return
        self.broken = reason
        logger.warning(
            "%s context %r of %s broke the protocol: %s", self.language, self.name, self._workspace.config.id, reason
        )
        self._end({"event": "invalid", "reason": reason}, Unavailable(f"the kernel broke the protocol ({reason})"))
        if self._process is not None:
            self._killing = asyncio.get_running_loop().create_task(self.kill())

    def _end(self, message: dict[str, Any], error: Unavailable) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
        cell = self._cell
        if cell is not None and not cell.done.done():
            cell.done.set_result(message)

    async def execute(
        self,
        code: str,
        *,
        timeout_s: float,
        max_output_chars: int,
        progress: Progress,
        images: ImageLease | None = None,
        in_thread: InThread = any_thread,
    ) -> CellResult:
        if self._lock.locked():
            raise Conflict(f"context {self.name!r} is running other code: wait for it, or restart the context")
        async with self._lock:
            if not self.alive:
                raise Conflict(f"context {self.name!r} is dead: run again with restart=true")
            process = self._process
            assert process is not None
            self._count += 1
            loop = asyncio.get_running_loop()
            cell = _Cell(
                id=self._count,
                stdout=OutputCleaner(self._redactor),
                stderr=OutputCleaner(self._redactor),
                cap=max_output_chars,
                done=loop.create_future(),
                lease=images,
            )
            self._cell = cell
            # A task of its own: a cancel must not cut the request line in half (below).
            send = asyncio.ensure_future(self._send({"op": "exec", "id": cell.id, "code": code}))
            try:
                await asyncio.shield(send)
                return await self._await_cell(cell, timeout_s, progress, in_thread)
            except asyncio.CancelledError:
                # Found by attack: a call cancelled (its client gone, `notifications/cancelled`) left the cell
                # running unseen; the context was listed idle, and the next cell waited behind it until its own
                # time limit. It is interrupted as at its time limit (killed if it does not stop). In a shielded
                # scope: anyio cancels again at each await of a cancelled scope, and a cell slow to stop was then
                # left mid-interrupt, its end unread, and killed with the next cell (found by a full run). Also
                # shielded from a plain asyncio cancel, which an anyio scope does not hold back.
                stop = asyncio.ensure_future(self._stop_cancelled(cell, send))
                with anyio.CancelScope(shield=True):
                    while not stop.done():
                        # Found by review: a second plain cancel cut this wait, and the next cell was sent
                        # while this one was still going in, then killed with it. It is waited for to its end.
                        with contextlib.suppress(asyncio.CancelledError):
                            await asyncio.shield(stop)
                raise
            finally:
                self._cell = None

    async def _stop_cancelled(self, cell: _Cell, send: asyncio.Future[None]) -> None:
        """The request of a cancelled cell goes in whole, then the cell is interrupted.

        Found by reading (left alone, then shown by a test): a cancel while code over the pipe's 64 KiB was
        still going in left half a request line in the kernel's input; the next cell's request completed it,
        the kernel's reader failed on the line and read nothing more, and the next cell waited out its whole
        time limit before the context was killed.
        """
        try:
            await send  # bounded by `GRACE_S`; a request cut short there ends the context (`_send`)
        except (Unavailable, Conflict):
            return
        if not cell.done.done():
            try:
                await self._interrupt(cell)
            except Conflict:  # not stopped, nor killed (the sandbox was paused): nobody would see its end
                self._unusable = True

    async def _send(self, request: dict[str, object]) -> None:
        assert self._process is not None
        data = (json.dumps(request) + "\n").encode()
        written = await self._process.write(data, timeout_s=GRACE_S)
        if written != len(data):
            if written:
                # Half a request line is in its input: it is dead whether or not the kill can run now (found by
                # review: a sandbox paused mid-send refuses it, and the context was listed alive and idle).
                self._unusable = True
                with contextlib.suppress(Conflict):
                    await self.kill()
            raise Unavailable(f"the {NAMES[self.language]} context is not taking input")

    async def _await_cell(self, cell: _Cell, timeout_s: float, progress: Progress, in_thread: InThread) -> CellResult:
        deadline = time.monotonic() + timeout_s
        timed_out = False
        message: dict[str, Any] | None = None
        while message is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                # Found by attack: after a stall of the server past the deadline, the cell's "done" was already
                # in the pipe, unread, and the cell was answered TIMEOUT though it ran (a retry would run it
                # twice). What the loop reads at its next turn counts.
                with anyio.move_on_after(LATE_ANSWER_S):
                    message = await asyncio.shield(cell.done)
                if message is not None:
                    break
                timed_out = True
                message = await self._interrupt(cell)
                break
            cell.changed.clear()
            try:
                async with asyncio.timeout(min(remaining, PROGRESS_EVERY_S)):
                    message = await asyncio.shield(cell.done)
            except TimeoutError:
                # Silent code reports too: a client may reset its request timeout on progress.
                await progress(cell.tail())
        done = message is not None and message.get("event") == "done"
        images: list[Image] = []
        texts = _Texts()
        if done and cell.images:
            # A copy: the kernel may still send images of this cell (dropped: it is done) meanwhile.
            async with self._threads:
                images, cut = await in_thread(functools.partial(self._redacted_images, list(cell.images)))
            cell.images_over_cap += cut
            cell.truncated = cell.truncated or cut > 0
        if done and (cell.value is not None or cell.display or cell.error):
            fields = (cell.value, dict(cell.display), dict(cell.error))
            if _text_bytes(*fields) <= _INLINE_TEXT_BYTES:
                texts = self._texts(*fields)  # `1+1`: microseconds, not a thread's hop
            else:
                # Copies, cleaned in a worker thread: up to six fields of 64 Ki characters, the worst of them
                # (all controls, all secret-shaped) some tens of milliseconds each.
                async with self._threads:
                    texts = await in_thread(functools.partial(self._texts, *fields))
        return self._result(cell, message, timed_out, images, texts)

    async def _interrupt(self, cell: _Cell) -> dict[str, Any] | None:
        """KeyboardInterrupt in the code; if it does not stop within the grace period, kill the kernel."""
        try:
            await self._send({"op": "interrupt"})
            async with asyncio.timeout(GRACE_S):
                return await asyncio.shield(cell.done)
        except (TimeoutError, Unavailable, Conflict):
            await self.kill()
            return None

    def _result(
        self, cell: _Cell, message: dict[str, Any] | None, timed_out: bool, images: list[Image], texts: _Texts
    ) -> CellResult:
        stdout, stderr = cell.finish()
        done = message is not None and message.get("event") == "done"
        broken = message is not None and message.get("event") == "invalid"
        status = message.get("exit_status") if done and message is not None else None
        return CellResult(
            stdout=stdout,
            stderr=stderr,
            value=texts.value,
            error=texts.error,
            images=images,
            markdown=texts.markdown,
            html=texts.html,
            exit_status=status if type(status) is int else None,
            truncated=cell.truncated,
            execution_count=cell.id,
            timed_out=timed_out,
            context_alive=self.alive and done,
            protocol_error=str(message.get("reason", "")) if broken and message is not None else "",
            image_note=cell.image_note(),
        )

    def _redacted_images(self, images: list[Image]) -> tuple[list[Image], int]:
        """The images to return, SVGs redacted, within MAX_CELL_IMAGE_BYTES once redacted; and how many did
        not fit (run in a worker thread: `MAX_SVG_BYTES`)."""
        kept: list[Image] = []
        total = cut = 0
        for image in images:
            redacted = self._redacted(image)
            if redacted is None:
                continue
            if total + len(redacted.data) > MAX_CELL_IMAGE_BYTES:
                cut += 1
                continue
            total += len(redacted.data)
            kept.append(redacted)
        return kept, cut

    def _redacted(self, image: Image) -> Image | None:
        """An SVG is text the agent made: redacted like its output (a secret in it becomes [REDACTED]);
        one that is not UTF-8 or has no <svg> element is no SVG, and is dropped."""
        if image.mime_type != SVG:
            return image
        if b"<svg" not in image.data:
            return None
        try:
            text = image.data.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return Image(self._redactor.redact(text).encode("utf-8"), SVG, image.width, image.height)

    def _texts(self, value: bytes | None, display: dict[str, bytes], error: dict[str, bytes]) -> _Texts:
        """A done cell's value, rich forms and error, each cleaned by `_text` (run in a worker thread)."""
        return _Texts(
            value=None if value is None else self._text(value),
            markdown=self._text(display["text/markdown"]) if "text/markdown" in display else None,
            html=self._text(display["text/html"]) if "text/html" in display else None,
            error={key: self._text(error.get(key, b"")) for key in _ERROR_FIELDS} if error else None,
        )

    def _text(self, raw: bytes) -> str:
        """A value, rich form or error field cleaned as output is: terminal escapes out first (a secret split
        by one, `AKIA<ESC>[0m...`, is whole again), then redacted, then cut to MAX_TEXT_CHARS. Text past
        MAX_TEXT_CHARS + _REDACT_MARGIN_CHARS is never looked at; a tail at that cut that could begin a
        secret is dropped (the stream redactor holds it back and is not flushed)."""
        text = raw.decode("utf-8", "replace")
        stream = self._redactor.stream()
        clean = stream.feed(sanitize_terminal(text[: MAX_TEXT_CHARS + _REDACT_MARGIN_CHARS]))
        if len(text) <= MAX_TEXT_CHARS + _REDACT_MARGIN_CHARS:
            clean += stream.flush()
        return clean[:MAX_TEXT_CHARS]

    async def kill(self) -> None:
        """Kill the kernel and everything it started; a kernel that has exited, what it left running.

        Raises:
            Conflict: the sandbox is paused.
        """
        process = self._process
        if process is None:
            return
        try:
            await self._workspace.sandbox.kill(process)
        finally:
            if process.exited:
                process.close()

    async def _end_with_kernel(self, process: Process) -> None:
        """Once the kernel has exited on its own (`os._exit`, an OOM kill), kill what it left running. Found by
        attack: a child it started in a session of its own lived on until the sandbox closed, a restart of the
        context included. Its pipes stay open: what the kernel sent last may still be on its way."""
        await process.wait_exit()
        try:
            await self._workspace.sandbox.kill(process)
        except BastionError as exc:  # paused, or the kernel refused: a restart or the sandbox's close ends them
            logger.warning(
                "%s context %r of %s: what its kernel left running was not killed: %s",
                self.language,
                self.name,
                self._workspace.config.id,
                exc.reason,
            )


class CodeRunner:
    """The code contexts of one sandbox, by language and name."""

    def __init__(self, workspace: HostWorkspace, redactor: Redactor, *, python_env: str | None) -> None:
        self._workspace = workspace
        self._redactor = redactor
        self._python = f"{python_env}/bin/python" if python_env else SYSTEM_PYTHON
        self._contexts: dict[tuple[Language, str], CodeContext] = {}
        self._threads = anyio.CapacityLimiter(CLEANING_THREADS_PER_SANDBOX)

    def contexts(self) -> list[dict[str, object]]:
        return [context.summary() for context in self._contexts.values()]

    async def run(
        self,
        code: str,
        *,
        language: str,
        context: str,
        restart: bool,
        timeout_s: float | None,
        progress: Progress,
        images: ImageLease | None = None,
        in_thread: InThread = any_thread,
    ) -> CellResult:
        """Run `code` in the named context of `language`, started (or restarted) as needed. Its images take
        their bytes from `images` (the server's budget; None: the cell's own caps only); its images and texts
        are cleaned by `in_thread`, within the sandbox's own share (`CLEANING_THREADS_PER_SANDBOX`).

        Raises:
            InvalidRequest: bad code, context name or timeout; an unknown language.
            NotFound: the language's runtime is not installed.
            PolicyDenied: bash or JavaScript in a sandbox whose template has a command policy.
            Conflict: the sandbox is paused, or the context busy or dead.
        """
        _check_code(code, MAX_CODE_BYTES)
        if self._workspace.sandbox.paused:
            raise Conflict("the sandbox is paused: resume it first")
        ctx = await self._context(_language(language), context, restart)
        config = self._workspace.config
        if images is not None:
            images.bind(self._workspace.id)  # a sandbox holds its share of the server's image budget, no more
        limit = _limit(timeout_s, config.timeout_s)
        sandbox = self._workspace.sandbox
        ooms = sandbox.oom_kills()
        result = await ctx.execute(
            code,
            timeout_s=limit,
            max_output_chars=config.max_output_bytes,
            progress=progress,
            images=images,
            in_thread=in_thread,
        )
        if not result.context_alive and sandbox.oom_kills() > ooms:
            result.oom_killed = True
            result.memory_note = sandbox.memory_note()
        return result

    async def _context(self, language: Language, name: str, restart: bool) -> CodeContext:
        """The named context, started once however many calls ask for it at the same time.

        A context is entered in `_contexts` (and counts against MAX_CONTEXTS) before its kernel starts, and
        the calls that find it starting wait for that one start: overlapping calls started a kernel each,
        past the limit, and all but the last were left running, owned by nobody. A restart finding the
        context starting takes that fresh start as its own.
        """
        if not name or len(name) > _CONTEXT_NAME_MAX or not name.replace("-", "").replace("_", "").isalnum():
            raise InvalidRequest(f"context names are letters, digits, '-' and '_', at most {_CONTEXT_NAME_MAX}")
        key = (language, name)
        existing = self._contexts.get(key)
        if existing is not None and restart and not existing.starting:
            # Out of the table before the await: a call meanwhile starts a fresh one, which this one then uses.
            del self._contexts[key]
            # A busy context too: restart is how an agent gets out of a stuck one. Shielded: a caller that
            # goes away mid-kill would leave a kernel nobody owns.
            await asyncio.shield(existing.kill())
            existing = self._contexts.get(key)
        if existing is None:
            existing = self._reserve(key)
        await existing.wait_started()
        return existing

    def _reserve(self, key: tuple[Language, str]) -> CodeContext:
        """A new context entered under `key` and starting, without awaiting anything before it is entered.

        Raises:
            ResourceLimit: MAX_CONTEXTS are open (starting ones included) and none of them is dead.
        """
        language, name = key
        argv = self._argv(language)
        dead: CodeContext | None = None
        if len(self._contexts) >= MAX_CONTEXTS:
            dead_key = next((k for k, ctx in self._contexts.items() if not ctx.alive and not ctx.starting), None)
            if dead_key is None:
                raise ResourceLimit(f"{MAX_CONTEXTS} contexts are open in this sandbox: restart one instead")
            dead = self._contexts.pop(dead_key)
        created = CodeContext(name, language, self._workspace, self._redactor, argv, threads=self._threads)
        self._contexts[key] = created
        created.begin(after=dead, on_failure=lambda: self._forget(key, created))
        return created

    def _forget(self, key: tuple[Language, str], context: CodeContext) -> None:
        """Take out a context whose start failed (unless a restart has already replaced it)."""
        if self._contexts.get(key) is context:
            del self._contexts[key]

    def _argv(self, language: Language) -> tuple[str, ...]:
        """How a context of `language` starts; bash and JavaScript need a sandbox that allows a shell."""
        if language == "python":
            return (self._python, "-I", KERNEL_PATH, OWN_VENV)
        self._workspace.require_shell(f"{language} code")
        runtime = shutil.which(RUNTIMES[language], path=SANDBOX_PATH)
        if runtime is None:
            raise NotFound(
                f"{language} needs {RUNTIMES[language]}, which is not installed on this server: "
                f"languages available here: {', '.join(available_languages())}"
            )
        return (SYSTEM_PYTHON, "-I", REPL_PATH, language, runtime)


def available_languages() -> list[str]:
    """The languages whose runtime the sandboxes have (Python always)."""
    return [name for name in LANGUAGES if name == "python" or shutil.which(RUNTIMES[name], path=SANDBOX_PATH)]


def _language(language: str) -> Language:
    for name in LANGUAGES:
        if name == language:
            return name
    available = ", ".join(available_languages())
    raise InvalidRequest(f"unknown language {language[:40]!r}: languages available here: {available}")


def _check_code(code: str, cap: int) -> None:
    if "\x00" in code:
        raise InvalidRequest("code contains a NUL character")
    if len(code.encode("utf-8", "surrogatepass")) > cap:
        raise InvalidRequest(f"code is longer than {cap} bytes: write it to a file and run that")


def _limit(asked: float | None, ceiling: float) -> float:
    limit = ceiling if asked is None else min(asked, ceiling)
    if limit <= 0:
        raise InvalidRequest("timeout_s must be positive")
    return limit

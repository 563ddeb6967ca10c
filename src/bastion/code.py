"""Code execution in a sandbox: persistent Python contexts, one-shot bash and node.

A Python context is a kernel (`bastion.sandbox._kernel`) running as a background
process of the sandbox: variables, imports and open files live in it between calls.
What the kernel sends is untrusted (it runs the agent's code): messages are parsed
with a size cap, and every text in them is cleaned and redacted like command output.

A timeout first interrupts the code (KeyboardInterrupt inside, the context lives on);
if the code does not stop within a grace period, the kernel is killed and the
context is dead until restarted.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from bastion.safety.errors import Conflict, InvalidRequest, NotFound, PolicyDenied, ResourceLimit, Unavailable
from bastion.safety.redact import Redactor
from bastion.sandbox._spawn import SANDBOX_PATH, SANDBOX_WORKSPACE
from bastion.sandbox.processes import BackgroundProcess, RingCapture
from bastion.workspaces import CommandOutput, HostWorkspace, OutputCleaner

logger = logging.getLogger("bastion.code")

KERNEL_SOURCE: Final = (Path(__file__).parent / "sandbox" / "_kernel.py").read_text(encoding="utf-8")
SYSTEM_PYTHON: Final = "/usr/bin/python3"
OWN_VENV: Final = f"{SANDBOX_WORKSPACE}/.venv"
MAX_CONTEXTS: Final = 8
MAX_CODE_BYTES: Final = 1 << 20
MAX_ARGV_CODE_BYTES: Final = 100_000  # bash -c / node -e: one argument, under the kernel's 128 KiB
MAX_MESSAGE_BYTES: Final = 32 << 20  # images travel base64 in one line
MAX_IMAGE_BYTES: Final = 8 << 20
START_TIMEOUT_S: Final = 30.0  # a cold interpreter on a busy machine
GRACE_S: Final = 5.0
PROGRESS_EVERY_S: Final = 1.0
PROGRESS_TAIL_CHARS: Final = 2000
_CONTEXT_NAME_MAX: Final = 32
INTERPRETERS: Final = {"bash": ("bash", "-c"), "node": ("node", "-e")}

Progress = Callable[[str], Awaitable[None]]


@dataclass
class Image:
    png: bytes
    width: int
    height: int


@dataclass
class CellResult:
    """One execution, cleaned and redacted."""

    stdout: str
    stderr: str
    value: str | None
    error: dict[str, str] | None
    images: list[Image]
    truncated: bool
    execution_count: int
    timed_out: bool = False
    context_alive: bool = True
    oom_killed: bool = False


class _MessageCapture(RingCapture):
    """The kernel's protocol channel: complete lines go to `on_message`; a few KiB are kept for diagnosis."""

    def __init__(self, fd: int, on_message: Callable[[dict[str, Any] | None], None]) -> None:
        self._line = bytearray()
        self._on_message = on_message
        super().__init__(fd, 4096)

    def _keep(self, chunk: bytes) -> None:
        super()._keep(chunk)
        self._line += chunk
        while True:
            end = self._line.find(b"\n")
            if end < 0:
                break
            line = bytes(self._line[:end])
            del self._line[: end + 1]
            self._on_message(_parse(line))
        if len(self._line) > MAX_MESSAGE_BYTES:
            self._line.clear()
            self._on_message(None)

    def close(self) -> None:
        super().close()
        self._on_message({"event": "eof"})


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        message = json.loads(line)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


@dataclass
class _Cell:
    id: int
    stdout: OutputCleaner
    stderr: OutputCleaner
    cap: int
    done: asyncio.Future[dict[str, Any]]
    text: list[list[str]] = field(default_factory=lambda: [[], []])
    sizes: list[int] = field(default_factory=lambda: [0, 0])
    truncated: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, stream: int, raw: str) -> None:
        cleaner = self.stdout if stream == 0 else self.stderr
        clean = cleaner.feed(raw.encode("utf-8", "replace"))
        room = self.cap - self.sizes[stream]
        if len(clean) > room:
            clean = clean[: max(room, 0)]
            self.truncated = True
        if clean:
            self.text[stream].append(clean)
            self.sizes[stream] += len(clean)
            self.changed.set()

    def finish(self) -> tuple[str, str]:
        for stream, cleaner in enumerate((self.stdout, self.stderr)):
            rest = cleaner.feed(b"", final=True)
            if rest and not self.truncated:
                self.add_clean(stream, rest)
        return "".join(self.text[0]), "".join(self.text[1])

    def add_clean(self, stream: int, clean: str) -> None:
        room = self.cap - self.sizes[stream]
        if len(clean) > room:
            clean, self.truncated = clean[: max(room, 0)], True
        self.text[stream].append(clean)
        self.sizes[stream] += len(clean)

    def tail(self) -> str:
        joined = "".join(self.text[0][-8:]) + "".join(self.text[1][-8:])
        return joined[-PROGRESS_TAIL_CHARS:]


class PythonContext:
    """One persistent Python kernel in a sandbox."""

    def __init__(self, name: str, workspace: HostWorkspace, redactor: Redactor, python: str) -> None:
        self.name = name
        self._workspace = workspace
        self._redactor = redactor
        self._python = python
        self._process: BackgroundProcess | None = None
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self._cell: _Cell | None = None
        self._count = 0
        self._lock = asyncio.Lock()
        self._killing: asyncio.Task[None] | None = None  # held: a task nobody references may vanish
        self.started = time.monotonic()

    @property
    def alive(self) -> bool:
        return self._process is not None and not self._process.exited

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def summary(self) -> dict[str, object]:
        return {
            "context": self.name,
            "state": ("busy" if self.busy else "idle") if self.alive else "dead",
            "execution_count": self._count,
            "age_s": round(time.monotonic() - self.started, 3),
        }

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        env = {
            **self._workspace.environment(),
            "MPLBACKEND": "Agg",
            "MPLCONFIGDIR": "/tmp/.matplotlib",  # noqa: S108 - the sandbox's own tmpfs
        }
        self._process = await self._workspace.sandbox.spawn(
            self._python,
            [self._python, "-I", "-c", KERNEL_SOURCE, OWN_VENV],
            cwd=SANDBOX_WORKSPACE,
            env=env,
            ring_bytes=16_384,
            stdout=lambda fd: _MessageCapture(fd, self._on_message),
        )
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await self._ready
        except (TimeoutError, Unavailable):
            reason = self._stderr_tail() or "it did not start in time"
            await self.kill()
            raise Unavailable(f"the Python context did not start: {reason}") from None

    def _stderr_tail(self) -> str:
        if self._process is None:
            return ""
        _, raw = self._process.stderr.read(0, 16_384)
        lines = self._redactor.redact(raw.decode("utf-8", "replace")).strip().splitlines()
        return lines[-1][:300] if lines else ""

    def _on_message(self, message: dict[str, Any] | None) -> None:
        event = message.get("event") if message is not None else "invalid"
        if event == "ready" and self._ready is not None and not self._ready.done():
            self._ready.set_result(message or {})
            return
        cell = self._cell
        if event in ("eof", "invalid"):
            # The kernel exited, or broke the protocol (it runs the agent's code): the context is over.
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(Unavailable("the kernel exited"))
            if cell is not None and not cell.done.done():
                cell.done.set_result({"event": event})
            if event == "invalid" and self._process is not None:
                self._killing = asyncio.get_running_loop().create_task(self.kill())
            return
        if cell is None or message is None or message.get("id") != cell.id:
            return
        if event == "stream":
            stream = 0 if message.get("name") == "stdout" else 1
            text = message.get("text")
            if isinstance(text, str):
                cell.add(stream, text)
        elif event == "done" and not cell.done.done():
            cell.done.set_result(message)

    async def execute(self, code: str, *, timeout_s: float, max_output_chars: int, progress: Progress) -> CellResult:
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
            )
            self._cell = cell
            try:
                await self._send({"op": "exec", "id": cell.id, "code": code})
                return await self._await_cell(cell, timeout_s, progress)
            finally:
                self._cell = None

    async def _send(self, request: dict[str, object]) -> None:
        assert self._process is not None
        data = (json.dumps(request) + "\n").encode()
        written = await self._process.write(data, timeout_s=GRACE_S)
        if written != len(data):
            raise Unavailable("the Python context is not taking input")

    async def _await_cell(self, cell: _Cell, timeout_s: float, progress: Progress) -> CellResult:
        deadline = time.monotonic() + timeout_s
        timed_out = False
        message: dict[str, Any] | None = None
        while message is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
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
        return self._result(cell, message, timed_out)

    async def _interrupt(self, cell: _Cell) -> dict[str, Any] | None:
        """KeyboardInterrupt in the code; if it does not stop within the grace period, kill the kernel."""
        try:
            await self._send({"op": "interrupt"})
            async with asyncio.timeout(GRACE_S):
                return await asyncio.shield(cell.done)
        except (TimeoutError, Unavailable, Conflict):
            await self.kill()
            return None

    def _result(self, cell: _Cell, message: dict[str, Any] | None, timed_out: bool) -> CellResult:
        stdout, stderr = cell.finish()
        alive = self.alive and message is not None and message.get("event") == "done"
        value = message.get("value") if message else None
        error = message.get("error") if message else None
        return CellResult(
            stdout=stdout,
            stderr=stderr,
            value=self._redactor.redact(value) if isinstance(value, str) else None,
            error=self._clean_error(error),
            images=_images(message.get("images") if message else None),
            truncated=cell.truncated,
            execution_count=cell.id,
            timed_out=timed_out,
            context_alive=alive,
        )

    def _clean_error(self, error: object) -> dict[str, str] | None:
        if not isinstance(error, dict):
            return None
        return {
            key: self._redactor.redact(str(error.get(key, ""))[:65_536]) for key in ("type", "message", "traceback")
        }

    async def kill(self) -> None:
        if self._process is not None and not self._process.exited:
            await self._workspace.sandbox.kill(self._process)
        if self._process is not None:
            self._process.close()


def _images(raw: object) -> list[Image]:
    images: list[Image] = []
    if not isinstance(raw, list):
        return images
    for item in raw[:8]:
        if not isinstance(item, dict) or not isinstance(item.get("png"), str):
            continue
        try:
            data = base64.b64decode(item["png"], validate=True)
        except ValueError:
            continue
        # Only a real PNG goes to the client as an image; the size fields are the kernel's word.
        if len(data) <= MAX_IMAGE_BYTES and data.startswith(b"\x89PNG\r\n\x1a\n"):
            images.append(Image(data, int(item.get("width") or 0), int(item.get("height") or 0)))
    return images


class CodeRunner:
    """The code contexts of one sandbox."""

    def __init__(self, workspace: HostWorkspace, redactor: Redactor, *, python_env: str | None) -> None:
        self._workspace = workspace
        self._redactor = redactor
        self._python = f"{python_env}/bin/python" if python_env else SYSTEM_PYTHON
        self._contexts: dict[str, PythonContext] = {}

    def contexts(self) -> list[dict[str, object]]:
        return [context.summary() for context in self._contexts.values()]

    async def python(
        self, code: str, *, context: str, restart: bool, timeout_s: float | None, progress: Progress
    ) -> CellResult:
        _check_code(code, MAX_CODE_BYTES)
        if self._workspace.sandbox.paused:
            raise Conflict("the sandbox is paused: resume it first")
        ctx = await self._context(context, restart)
        config = self._workspace.config
        limit = _limit(timeout_s, config.timeout_s)
        sandbox = self._workspace.sandbox
        ooms = sandbox.oom_kills()
        result = await ctx.execute(code, timeout_s=limit, max_output_chars=config.max_output_bytes, progress=progress)
        if not result.context_alive and sandbox.oom_kills() > ooms:
            result.oom_killed = True
        return result

    async def _context(self, name: str, restart: bool) -> PythonContext:
        if not name or len(name) > _CONTEXT_NAME_MAX or not name.replace("-", "").replace("_", "").isalnum():
            raise InvalidRequest(f"context names are letters, digits, '-' and '_', at most {_CONTEXT_NAME_MAX}")
        existing = self._contexts.get(name)
        if existing is not None and restart:
            await existing.kill()  # a busy context too: restart is how an agent gets out of a stuck one
            del self._contexts[name]
            existing = None
        if existing is not None:
            return existing
        if len(self._contexts) >= MAX_CONTEXTS:
            dead = [key for key, ctx in self._contexts.items() if not ctx.alive]
            if not dead:
                raise ResourceLimit(f"{MAX_CONTEXTS} contexts are open in this sandbox: restart one instead")
            del self._contexts[dead[0]]
        created = PythonContext(name, self._workspace, self._redactor, self._python)
        await created.start()
        self._contexts[name] = created
        return created

    async def one_shot(self, language: str, code: str, *, timeout_s: float | None) -> CommandOutput:
        """bash or node, run once like a command (needs a sandbox whose policy allows a shell)."""
        program, flag = INTERPRETERS[language]
        _check_code(code, MAX_ARGV_CODE_BYTES)
        if not self._workspace.via_sh:
            raise PolicyDenied("this sandbox's template has a command policy: use run_command")
        executable = shutil.which(program, path=SANDBOX_PATH)
        if executable is None:
            raise NotFound(f"{program} is not installed in this sandbox's template")
        return await self._workspace.run_argv(executable, (program, flag, code), timeout_s=timeout_s)


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

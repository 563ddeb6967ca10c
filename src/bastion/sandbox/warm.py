"""A warm sandbox: one bubblewrap sandbox kept alive, running one command per request.

The host side of the protocol described in `bastion.sandbox._agent`. Output is
read by the host directly from pipes whose write ends were handed to the agent,
so nothing the command prints passes through the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import subprocess  # noqa: TID251 - only the Popen type; _spawn starts it
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from bastion.safety.errors import Unavailable
from bastion.sandbox._spawn import SandboxSpec, start_sandbox

START_TIMEOUT_S: Final = 10.0
KILL_GRACE_S: Final = 5.0
READ_CHUNK_BYTES: Final = 65_536
MAX_MESSAGE_BYTES: Final = 65_536


@dataclass(frozen=True)
class RunOutcome:
    """What one command did. `status` is the exit code, or 128 + signal."""

    status: int | None
    stdout: bytes
    stderr: bytes
    stdout_total: int
    stderr_total: int
    timed_out: bool
    cancelled: bool = False

    @property
    def truncated(self) -> bool:
        return self.stdout_total > len(self.stdout) or self.stderr_total > len(self.stderr)


class _Capture:
    """Reads one pipe to EOF, keeping at most `cap` bytes and counting the rest."""

    def __init__(self, fd: int, cap: int) -> None:
        self.fd = fd
        self.cap = cap
        self.data = bytearray()
        self.total = 0
        self.done = asyncio.get_running_loop().create_future()
        os.set_blocking(fd, False)
        asyncio.get_running_loop().add_reader(fd, self._on_readable)

    def _on_readable(self) -> None:
        try:
            chunk = os.read(self.fd, READ_CHUNK_BYTES)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
            return
        self.total += len(chunk)
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]

    def close(self) -> None:
        if not self.done.done():
            asyncio.get_running_loop().remove_reader(self.fd)
            os.close(self.fd)
            self.done.set_result(None)


class WarmSandbox:
    """One long-lived sandbox; commands in it run concurrently, each in its own PID namespace."""

    def __init__(self, spec: SandboxSpec) -> None:
        self.spec = spec
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._waiters: dict[int, asyncio.Future[int]] = {}
        self._start_lock = asyncio.Lock()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    async def start(self) -> None:
        async with self._start_lock:
            if self.alive:
                return
            await self._start()

    async def _start(self) -> None:
        proc, sock = start_sandbox(self.spec)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                hello = await loop.sock_recv(sock, MAX_MESSAGE_BYTES)
        except TimeoutError:
            hello = b""
        if not hello:
            proc.kill()
            err = (proc.communicate()[1] or b"").decode(errors="replace").strip().splitlines()
            sock.close()
            raise Unavailable("sandbox failed to start: " + (err[-1] if err else "no reason given"))
        self._proc, self._sock = proc, sock
        loop.add_reader(sock.fileno(), self._on_message)

    def _on_message(self) -> None:
        assert self._sock is not None
        try:
            data = self._sock.recv(MAX_MESSAGE_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._on_agent_gone()
            return
        msg = json.loads(data)
        waiter = self._waiters.pop(msg.get("id"), None)
        if waiter is not None and not waiter.done():
            waiter.set_result(int(msg["status"]) if msg.get("event") == "exit" else 127)

    def _on_agent_gone(self) -> None:
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(Unavailable("the sandbox ended while a command was running"))
        self._waiters.clear()
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            if self._proc.stderr is not None:
                self._proc.stderr.close()
            self._proc = None

    async def run(
        self,
        executable: str,
        argv: Sequence[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        timeout_s: float,
        max_output_bytes: int,
    ) -> RunOutcome:
        """Run one command to completion; on timeout or cancellation its whole tree is killed."""
        await self.start()
        assert self._sock is not None
        req_id = next(self._ids)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[int] = loop.create_future()
        self._waiters[req_id] = waiter
        request = {"op": "run", "id": req_id, "exe": executable, "argv": list(argv), "cwd": cwd, "env": dict(env)}
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode()], [out_w, err_w])
        except OSError as exc:
            self._waiters.pop(req_id, None)
            for fd in (out_r, err_r):
                os.close(fd)
            raise Unavailable(f"sandbox agent unreachable: {exc.strerror}") from exc
        finally:
            os.close(out_w)
            os.close(err_w)
        out, err = _Capture(out_r, max_output_bytes), _Capture(err_r, max_output_bytes)
        timed_out = cancelled = False
        status: int | None = None
        try:
            async with asyncio.timeout(timeout_s):
                status = await asyncio.shield(waiter)
                await asyncio.gather(out.done, err.done)
        except TimeoutError:
            timed_out = True
        except asyncio.CancelledError:
            cancelled = True
            self._kill(req_id)
            out.close()
            err.close()
            raise
        finally:
            if timed_out:
                self._kill(req_id)
                status = await self._await_exit(waiter)
                out.close()
                err.close()
        return RunOutcome(status, bytes(out.data), bytes(err.data), out.total, err.total, timed_out, cancelled)

    def _kill(self, req_id: int) -> None:
        if self._sock is None:
            return
        with contextlib.suppress(OSError):
            self._sock.send(json.dumps({"op": "kill", "id": req_id}).encode())

    async def _await_exit(self, waiter: asyncio.Future[int]) -> int | None:
        try:
            async with asyncio.timeout(KILL_GRACE_S):
                return await waiter
        except TimeoutError:
            # The agent did not confirm the kill: end the whole sandbox, which ends every process in it.
            self.close()
            return None

    def close(self) -> None:
        """Kill the sandbox: its PID namespace dies, and with it every process inside."""
        if self._sock is not None:
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._on_agent_gone()

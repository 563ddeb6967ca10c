"""The SSH side of a gateway: one warm asyncssh connection per configured host.

The host key is pinned from config (`host_key`): an unknown or changed key is refused
(FORBIDDEN) before authentication, and no ~/.ssh file (config, known_hosts, agent, keys)
is read. The client asks for no pty, no forwarding and sends no environment; the target's
``restrict`` key option refuses those anyway. Only a `GatewayCommand` (a checked literal)
is ever sent. Output is capped and redacted here whatever the target does.

Sessions: at most `MAX_SESSIONS` on the connection, each counted until the host closes its channel,
not until bastion stops waiting: a call that passed call_timeout_s or was cancelled keeps running on
the host (dispatch.py lets it finish) and keeps its sshd session until then. One caller holds at most
`CALLER_SHARE` of them, running or abandoned. A host whose MaxSessions is lower still refuses some
opens: those are retried for ~3 s, then refused (nothing was sent). The whole of a call (a free slot,
the connection, the action) is bounded by call_timeout_s; one connect answers every call waiting for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Final, NamedTuple

import anyio
import asyncssh
from asyncssh.public_key import get_default_public_key_algs

from bastion.config import GatewayConfig
from bastion.gateway.actions import GatewayCommand
from bastion.safety.errors import BastionError, Forbidden, PolicyDenied, ResourceLimit, Timeout, Unavailable
from bastion.safety.paths import secret_file_problem
from bastion.safety.redact import Redactor, sanitize_terminal

logger = logging.getLogger("bastion.gateway")

EXIT_REFUSED: Final = 126
EXIT_TIMEOUT: Final = 124
REFUSED_PREFIX: Final = "dispatch: refused: "
TIMEOUT_PREFIX: Final = "dispatch: timeout: "
MAX_REASON_CHARS: Final = 300
"""Of a refusal's reason from the host: dispatch's are a line; a hostile host's could be the whole cap."""
_CHUNK: Final = 65536
MAX_SESSIONS: Final = 8
CALLER_SHARE: Final = MAX_SESSIONS // 2
"""Sessions one caller may hold, running or abandoned: a caller whose calls it gave up on (each still
running on the host until its own time limit) cannot take every session from the others."""
LOCAL_CALLER: Final = "local"
FAILURE_STANDS_S: Final = 1.0
"""How long a failed connect answers new calls (they fail at once with its reason) before the next one."""
_REDACT_MARGIN: Final = 4096
# Pauses between tries to open a session the live connection refused (about 3 s in all).
_OPEN_RETRY_PAUSES: Final = (0.02, 0.05, 0.1, 0.2, 0.4, 0.8, 1.5)


@dataclass(frozen=True)
class GatewayOutput:
    exit_status: int
    stdout: str
    stderr: str
    truncated: bool


def _host_key_algs(pinned: asyncssh.SSHKey) -> list[str]:
    """The pinned key's algorithms first, then every other plain-key algorithm.

    Left to itself, asyncssh offers only the pinned key's type, so a host that now has a key of
    another type fails key exchange (UNAVAILABLE). Offering the rest too makes the host present
    that key, which the pin then refuses (FORBIDDEN): a changed key is a changed key, whatever its type.
    """
    algs = [*pinned.sig_algorithms, *get_default_public_key_algs()]
    return list(dict.fromkeys(alg.decode("ascii") for alg in algs))


def _lost_connection(group: ExceptionGroup[Exception]) -> Exception:
    """The first SSH or socket error in the drains' failure, or the group itself if it holds another."""
    leaves: list[Exception] = []
    pending: list[Exception] = [group]
    while pending:
        error = pending.pop()
        if isinstance(error, ExceptionGroup):
            pending.extend(reversed(error.exceptions))
        else:
            leaves.append(error)
    if all(isinstance(leaf, asyncssh.Error | OSError) for leaf in leaves):
        return leaves[0]
    return group


class _Unsent(Exception):
    """A call failed before its session opened: nothing reached the host (carries the error to raise)."""

    def __init__(self, error: BastionError) -> None:
        super().__init__(error.reason)
        self.error = error


def _again(error: BastionError) -> BastionError:
    """A fresh copy of `error`, for each call a shared failure answers (one raise per exception object)."""
    return type(error)(error.reason, detail=error.detail)


@dataclass
class _Attempt:
    """One connect, shared by every call that waits on it."""

    done: anyio.Event = field(default_factory=anyio.Event)
    conn: asyncssh.SSHClientConnection | None = None
    error: BastionError | None = None
    ended: float = 0.0

    def answers_now(self, now: float) -> bool:
        """Still running, connected, or failed recently enough that its failure still stands."""
        if not self.done.is_set():
            return True
        if self.conn is not None:
            return not self.conn.is_closed()
        return now - self.ended < FAILURE_STANDS_S


_SERVER_OPEN_REFUSALS: Final = frozenset(
    {
        asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED,
        asyncssh.OPEN_CONNECT_FAILED,
        asyncssh.OPEN_UNKNOWN_CHANNEL_TYPE,
        asyncssh.OPEN_RESOURCE_SHORTAGE,
    }
)


def _refused_open(exc: BaseException) -> bool:
    """The host refused to open the session: its command was never sent.

    asyncssh also raises ChannelOpenError ("Session request failed", its own OPEN_REQUEST_SESSION_FAILED)
    when the channel opened and the exec request went out but its answer never came (the connection
    closed meanwhile): the command may have run, so that is no refusal (a deploy was sent twice)."""
    return isinstance(exc, asyncssh.ChannelOpenError) and exc.code in _SERVER_OPEN_REFUSALS


class _Answer(NamedTuple):
    """What the host answered: its exit status, the head of each stream (the cap plus the redaction margin),
    whether one was cut, and stderr's last line, read whole however much came before it: dispatch's verdict."""

    status: int
    out: bytes
    err: bytes
    truncated: bool
    last_err_line: bytes


_TAIL_BYTES: Final = 4096
"""Of stderr's end kept apart from its head, for its last line (dispatch's are under 300 bytes; a longer one
is no verdict of dispatch's: the answer is told as it came, exit status and output)."""


def _only_line(answer: _Answer) -> bool:
    """Whether stderr is one whole line and stdout empty, as a refusal is: dispatch refuses before any action
    runs, and follows an action that ran with a line of its own."""
    return not answer.out and answer.err.count(b"\n") == 1 and answer.err == answer.last_err_line + b"\n"


def _last_line(tail: bytes) -> bytes:
    """The last whole line of stderr's `tail` (its newline dropped); empty if the tail holds only part of one."""
    lines = tail.rstrip(b"\n").rsplit(b"\n", 1)
    return lines[-1] if len(lines) > 1 or len(tail) < _TAIL_BYTES else b""


@dataclass
class _Slot:
    """One call's session slot; `process` is set while the host may still hold the session open."""

    process: asyncssh.SSHClientProcess[bytes] | None = None
    opening: bool = False


class _Slots:
    """The sessions bastion holds on a gateway, each counted until the host closes its channel.

    sshd counts a session against MaxSessions until the action's process ends (dispatch.py lets an
    action finish when its client is gone), whatever bastion does: a call bastion stopped waiting for
    (its call_timeout_s, or its client cancelled) keeps its slot until then. One caller holds at most
    `share` slots, running or abandoned, so the other callers always find the rest.
    """

    def __init__(self, gateway: str, total: int, share: int) -> None:
        self.gateway = gateway
        self.total = total
        self.share = share
        self.used = 0
        self.running: dict[str, int] = {}
        self.abandoned: dict[str, int] = {}
        self._freed: anyio.Event | None = None
        self._waiters: set[asyncio.Task[None]] = set()

    @asynccontextmanager
    async def hold(self, caller: str) -> AsyncIterator[_Slot]:
        await self._take(caller)
        slot = _Slot()
        try:
            yield slot
        finally:
            _add(self.running, caller, -1)
            process = slot.process
            if process is None:
                self._free()
            else:
                # Abandoned: close our side; the slot stays taken until the host closes the channel.
                process.close()
                _add(self.abandoned, caller, 1)
                task = asyncio.get_running_loop().create_task(self._release_when_closed(caller, process))
                self._waiters.add(task)
                task.add_done_callback(self._waiters.discard)

    async def _take(self, caller: str) -> None:
        while True:
            abandoned = self.abandoned.get(caller, 0)
            if abandoned >= self.share:
                raise ResourceLimit(
                    f"gateway {self.gateway!r}: {abandoned} of your earlier calls were abandoned (timed out or "
                    f"cancelled) and still run on the host, the most one client may hold ({self.share} of "
                    f"{self.total} sessions): wait for them to end (up to the host's own time limit)"
                )
            if self.used < self.total and self.running.get(caller, 0) + abandoned < self.share:
                self.used += 1
                _add(self.running, caller, 1)
                return
            if self._freed is None:
                self._freed = anyio.Event()
            await self._freed.wait()

    async def _release_when_closed(self, caller: str, process: asyncssh.SSHClientProcess[bytes]) -> None:
        try:
            # Returns once the host answered our close (its action ended) or the connection is gone.
            await process.wait_closed()
        except Exception:  # a task nobody awaits: its failure is only logged
            logger.debug("waiting for an abandoned session to close failed", exc_info=True)
        finally:
            _add(self.abandoned, caller, -1)
            self._free()

    def _free(self) -> None:
        self.used -= 1
        freed, self._freed = self._freed, None
        if freed is not None:
            freed.set()


def _add(counts: dict[str, int], key: str, step: int) -> None:
    value = counts.get(key, 0) + step
    if value:
        counts[key] = value
    else:
        counts.pop(key, None)  # callers come and go: keep only those holding something


class GatewayClient:
    """Sends checked literals to one gateway over a reused SSH connection."""

    def __init__(self, config: GatewayConfig, redactor: Redactor) -> None:
        self.config = config
        self.redactor = redactor
        self._attempt: _Attempt | None = None
        self._connecting: asyncio.Task[None] | None = None
        # Below sshd's default MaxSessions (10) on the one shared connection.
        self._slots = _Slots(config.name, MAX_SESSIONS, CALLER_SHARE)

    async def _connect(self) -> asyncssh.SSHClientConnection:
        cfg = self.config
        if cfg.host_key is None:
            raise Forbidden(f"gateway {cfg.name!r} has no pinned host_key in config: add the target's host key")
        try:
            host_key = asyncssh.import_public_key(cfg.host_key)
        except (asyncssh.KeyImportError, ValueError):
            raise Forbidden(f"gateway {cfg.name!r} host_key cannot be read: fix it in config") from None
        try:
            # As ssh does: a key others may read or swap is refused (a copy would deploy without approval).
            problem = secret_file_problem(str(cfg.key_path), (os.geteuid(), os.getegid()))
            client_key = asyncssh.read_private_key(str(cfg.key_path))
        except (OSError, asyncssh.KeyImportError) as exc:
            raise Unavailable(
                f"gateway {cfg.name!r} key {cfg.key_path} cannot be read: run 'bastion gateway keygen'",
                detail=str(exc),
            ) from None
        if problem is not None:
            raise Forbidden(
                f"gateway {cfg.name!r} key {cfg.key_path} is not the server's alone ({problem}): "
                "chmod 600 it and keep it in a folder only root can write"
            )
        try:
            with anyio.fail_after(cfg.connect_timeout_s):
                return await asyncssh.connect(
                    cfg.host,
                    cfg.port,
                    username=cfg.user,
                    known_hosts=([host_key], [], []),
                    server_host_key_algs=_host_key_algs(host_key),
                    client_keys=[client_key],
                    config=None,
                    agent_path=None,
                    agent_forwarding=False,
                    x11_forwarding=False,
                    preferred_auth="publickey",
                    password=None,
                    kbdint_auth=False,
                    gss_auth=False,
                    connect_timeout=cfg.connect_timeout_s,
                    keepalive_interval=30,
                )
        except asyncssh.HostKeyNotVerifiable as exc:
            raise Forbidden(
                f"gateway {cfg.name!r} presented a host key that is not the pinned one: refused",
                detail=str(exc),
            ) from None
        except asyncssh.PermissionDenied as exc:
            raise Forbidden(
                f"gateway {cfg.name!r} refused bastion's key (check authorized_keys and from=)", detail=str(exc)
            ) from None
        except TimeoutError:
            raise Timeout(f"gateway {cfg.name!r} did not answer within {cfg.connect_timeout_s:g} s") from None
        except (OSError, asyncssh.Error) as exc:
            raise Unavailable(f"gateway {cfg.name!r} cannot be reached", detail=str(exc)) from None

    async def connection(self) -> asyncssh.SSHClientConnection:
        """The warm connection, opened (or reopened) on demand.

        One connect answers every call waiting for it; its failure answers the calls that come within
        `FAILURE_STANDS_S` after it, so calls to a hung host fail together, not one connect_timeout_s each.
        """
        attempt = self._attempt
        if attempt is None or not attempt.answers_now(time.monotonic()):
            attempt = self._attempt = _Attempt()
            # A task of its own: a caller giving up (its deadline, a cancel) does not stop the others' connect.
            self._connecting = asyncio.get_running_loop().create_task(self._connect_for(attempt))
        await attempt.done.wait()
        if attempt.conn is None:
            assert attempt.error is not None
            raise _again(attempt.error)
        return attempt.conn

    async def _connect_for(self, attempt: _Attempt) -> None:
        try:
            attempt.conn = await self._connect()
        except BastionError as exc:
            attempt.error = exc
        except Exception as exc:  # never leave the waiters without an answer
            attempt.error = Unavailable(f"gateway {self.config.name!r} cannot be reached", detail=repr(exc))
        except BaseException:
            attempt.error = Unavailable(f"gateway {self.config.name!r}: the connection attempt was stopped")
            raise
        finally:
            attempt.ended = time.monotonic()
            attempt.done.set()

    async def call(
        self,
        command: GatewayCommand,
        *,
        retry: bool = False,
        caller: str = LOCAL_CALLER,
        before_send: Callable[[], Awaitable[None]] | None = None,
        if_unsent: Callable[[BastionError], Awaitable[None]] | None = None,
    ) -> GatewayOutput:
        """Run one checked literal on the gateway; the target's dispatch decides whether it runs.

        The whole call (a free session slot, the connection, the action) is bounded by call_timeout_s.

        Args:
            command: the checked literal.
            retry: reconnect and send again once if the warm connection was dropped. Only for actions
                that are safe to repeat: a dropped connection may hide a request that already ran.
            caller: who asks (`CallRunner.identity`): one caller holds at most `CALLER_SHARE` sessions.
            before_send: awaited once the slot and the connection are there, just before the session
                opens (an approval is spent here); an error from it ends the call with nothing sent.
            if_unsent: awaited with the error when the call fails after `before_send` and the failure
                proves nothing reached the host (the session was never opened).

        Raises:
            PolicyDenied: dispatch refused it (exit 126).
            Timeout: no answer within call_timeout_s, or dispatch's own timeout.
            ResourceLimit: `caller` has abandoned calls holding its share of the sessions.
            Forbidden / Unavailable: the connection could not be made, or was lost.
        """
        slot = _Slot()
        try:
            with anyio.fail_after(self.config.call_timeout_s):
                async with self._slots.hold(caller) as slot:
                    conn = await self.connection()
                    if before_send is not None:
                        await before_send()
                    answer = await self._send(conn, command.literal, slot, retry=retry)
        except _Unsent as unsent:
            if if_unsent is not None:
                await if_unsent(unsent.error)
            raise unsent.error from None
        except TimeoutError:
            timeout = self._timeout(slot)
            if not slot.opening and if_unsent is not None:
                await if_unsent(timeout)  # no session open was under way: nothing reached the host
            raise timeout from None
        return self._output(answer)

    def _timeout(self, slot: _Slot) -> Timeout:
        limit = f"{self.config.call_timeout_s:g} s"
        if not slot.opening:
            return Timeout(f"gateway {self.config.name!r}: no session or connection within {limit}: nothing was sent")
        return Timeout(
            f"gateway {self.config.name!r} gave no result within {limit}; "
            "the action may still be running there, up to the host's own time limit"
        )

    async def _send(self, conn: asyncssh.SSHClientConnection, literal: str, slot: _Slot, *, retry: bool) -> _Answer:
        try:
            return await self._run(conn, literal, slot)
        except (asyncssh.ChannelOpenError, asyncssh.DisconnectError, OSError) as exc:
            opened = not _refused_open(exc)
            if not opened and not conn.is_closed():
                raise _Unsent(self._refused_session()) from None
            # The connection is gone, and with it every session the host held for it.
            slot.process = None
            self._drop(conn)
            if opened and not retry:
                raise Unavailable(
                    f"gateway {self.config.name!r} dropped the connection; the action may or may not have run",
                    detail=str(exc),
                ) from None
            # The session never opened (so nothing was sent), or the action is safe to repeat.
            return await self._send_again(literal, slot, sent=opened)

    async def _send_again(self, literal: str, slot: _Slot, *, sent: bool) -> _Answer:
        try:
            conn = await self.connection()
        except BastionError as lost:
            raise (lost if sent else _Unsent(lost)) from None
        try:
            return await self._run(conn, literal, slot)
        except (asyncssh.Error, OSError) as again:
            unopened = _refused_open(again)
            if unopened and not conn.is_closed():
                failure: BastionError = self._refused_session()
            else:
                slot.process = None
                self._drop(conn)
                failure = Unavailable(f"gateway {self.config.name!r} failed twice", detail=str(again))
            raise (_Unsent(failure) if unopened and not sent else failure) from None

    def _refused_session(self) -> Unavailable:
        return Unavailable(
            f"gateway {self.config.name!r} refused a new session with {self._slots.used} of bastion's open "
            f"(its sshd's MaxSessions is below {MAX_SESSIONS + 2}, or it is slow to reap ended ones): "
            "nothing was sent; try again when a call ends"
        )

    def _output(self, answer: _Answer) -> GatewayOutput:
        exit_status = answer.status
        stdout, cut_out = self._clean(answer.out)
        stderr, cut_err = self._clean(answer.err)
        truncated = answer.truncated or cut_out or cut_err
        # dispatch's verdict is its last line, as it came (an action's own lines come before it, and redaction
        # or the cap could change which line is last), and a refused request ran nothing, so printed nothing else:
        # found by attack, an action that ran and exited 126 with such a line of its own was told as refused, its
        # output dropped and its approval spent (a second one would run it twice).
        last, _ = self._clean(answer.last_err_line)
        if exit_status == EXIT_REFUSED and _only_line(answer) and last.startswith(REFUSED_PREFIX):
            reason = _shortened(last[len(REFUSED_PREFIX) :])
            raise PolicyDenied(f"gateway {self.config.name!r} refused it: {reason}")
        if exit_status == EXIT_TIMEOUT and last.startswith(TIMEOUT_PREFIX):
            raise Timeout(f"the action ran past the gateway's time limit and was killed: {_shortened(last)}")
        return GatewayOutput(exit_status=exit_status, stdout=stdout, stderr=stderr, truncated=truncated)

    async def _run(self, conn: asyncssh.SSHClientConnection, literal: str, slot: _Slot) -> _Answer:
        # Under the call's deadline, the open too: a hung host (frozen, or a network dropping packets)
        # never confirms the channel.
        slot.opening = True
        process = slot.process = await self._open(conn, literal, slot)
        out, err, truncated, tail = await self._drain(process)
        await process.wait_closed()
        slot.process = None  # the host closed the channel: its session is free again
        status = process.exit_status
        if status is None:
            signal = process.exit_signal
            status = 128 + 9 if signal else 255
        return _Answer(status, out, err, truncated, _last_line(tail))

    async def _drain(self, process: asyncssh.SSHClientProcess[bytes]) -> tuple[bytes, bytes, bool, bytes]:
        """Read both streams to their end, keeping at most the cap (plus the redaction margin) of each, and
        stderr's last `_TAIL_BYTES`: a flood of output must not hide dispatch's verdict after it."""
        cap = self.config.max_output_bytes + _REDACT_MARGIN
        buffers: dict[str, bytearray] = {"out": bytearray(), "err": bytearray()}
        tail = bytearray()
        truncated = False

        async def drain(name: str, stream: asyncssh.SSHReader[bytes]) -> None:
            nonlocal truncated
            while chunk := await stream.read(_CHUNK):
                room = cap - len(buffers[name])
                if len(chunk) > room:
                    truncated = True
                buffers[name] += chunk[: max(room, 0)]
                if name == "err":
                    tail[:] = (tail + chunk)[-_TAIL_BYTES:]

        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(drain, "out", process.stdout)
                tasks.start_soon(drain, "err", process.stderr)
        except ExceptionGroup as group:
            # The connection lost mid-read fails both drains: answer it as the one loss it is.
            raise _lost_connection(group) from None
        return bytes(buffers["out"]), bytes(buffers["err"]), truncated, bytes(tail)

    async def _open(
        self, conn: asyncssh.SSHClientConnection, literal: str, slot: _Slot
    ) -> asyncssh.SSHClientProcess[bytes]:
        """Open the session, waiting out sshd's slow release of finished ones.

        sshd frees a session slot only once it has reaped the session's child, which under load
        lags behind the client seeing the channel closed; until then a new session over
        MaxSessions is refused. A refused open sent nothing, so trying again is always safe.
        """
        for pause in _OPEN_RETRY_PAUSES:
            try:
                return await conn.create_process(literal, encoding=None, request_pty=False, stdin=asyncssh.DEVNULL)
            except asyncssh.ChannelOpenError as exc:
                if conn.is_closed() or not _refused_open(exc):
                    raise
            slot.opening = False  # refused: nothing was sent, and a deadline in the pause says so
            await anyio.sleep(pause)
            slot.opening = True
        return await conn.create_process(literal, encoding=None, request_pty=False, stdin=asyncssh.DEVNULL)

    def _clean(self, data: bytes) -> tuple[str, bool]:
        # Redact, then cut (ARCHITECTURE principle 5): the raw read keeps a margin past the cap so a
        # secret straddling the cap is still recognised whole, then the redacted text is cut.
        text = sanitize_terminal(data.decode("utf-8", errors="replace"))
        return self.redactor.redact_then_truncate(text, self.config.max_output_bytes)

    def _drop(self, conn: asyncssh.SSHClientConnection) -> None:
        """Close `conn`, which failed; it stops being the warm one only if it still is (a call that
        reconnected meanwhile keeps its new connection)."""
        conn.close()
        if self._attempt is not None and self._attempt.conn is conn:
            self._attempt = None

    async def close(self) -> None:
        """Close the warm connection (the server is stopping); the next call connects again."""
        attempt, self._attempt = self._attempt, None
        connecting, self._connecting = self._connecting, None
        if connecting is not None and not connecting.done():
            connecting.cancel()
        if attempt is not None and attempt.conn is not None:
            attempt.conn.close()
            await attempt.conn.wait_closed()


def _shortened(reason: str) -> str:
    return reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS] + "…"

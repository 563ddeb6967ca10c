"""The SSH side of a gateway: one warm asyncssh connection per configured host.

The host key is pinned from config (`host_key`): an unknown or changed key is refused
(FORBIDDEN) before authentication, and no ~/.ssh file (config, known_hosts, agent, keys)
is read. The client asks for no pty, no forwarding and sends no environment; the target's
``restrict`` key option refuses those anyway. Only a `GatewayCommand` (a checked literal)
is ever sent. Output is capped and redacted here whatever the target does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

import anyio
import asyncssh
from asyncssh.public_key import get_default_public_key_algs

from bastion.config import GatewayConfig
from bastion.gateway.actions import GatewayCommand
from bastion.safety.errors import Forbidden, PolicyDenied, Timeout, Unavailable
from bastion.safety.redact import Redactor, sanitize_terminal

logger = logging.getLogger("bastion.gateway")

EXIT_REFUSED: Final = 126
EXIT_TIMEOUT: Final = 124
REFUSED_PREFIX: Final = "dispatch: refused: "
_CHUNK: Final = 65536
MAX_SESSIONS: Final = 8
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


class GatewayClient:
    """Sends checked literals to one gateway over a reused SSH connection."""

    def __init__(self, config: GatewayConfig, redactor: Redactor) -> None:
        self.config = config
        self.redactor = redactor
        self._conn: asyncssh.SSHClientConnection | None = None
        self._lock = anyio.Lock()
        # Below sshd's default MaxSessions (10) on the one shared connection.
        self._sessions = anyio.Semaphore(MAX_SESSIONS)

    async def _connect(self) -> asyncssh.SSHClientConnection:
        cfg = self.config
        if cfg.host_key is None:
            raise Forbidden(f"gateway {cfg.name!r} has no pinned host_key in config: add the target's host key")
        try:
            host_key = asyncssh.import_public_key(cfg.host_key)
        except (asyncssh.KeyImportError, ValueError):
            raise Forbidden(f"gateway {cfg.name!r} host_key cannot be read: fix it in config") from None
        try:
            client_key = asyncssh.read_private_key(str(cfg.key_path))
        except (OSError, asyncssh.KeyImportError) as exc:
            raise Unavailable(
                f"gateway {cfg.name!r} key {cfg.key_path} cannot be read: run 'bastion gateway keygen'",
                detail=str(exc),
            ) from None
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
        """The warm connection, opened (or reopened) on demand."""
        async with self._lock:
            if self._conn is None or self._conn.is_closed():
                self._conn = await self._connect()
            return self._conn

    async def call(self, command: GatewayCommand, *, retry: bool = False) -> GatewayOutput:
        """Run one checked literal on the gateway; the target's dispatch decides whether it runs.

        Args:
            command: the checked literal.
            retry: reconnect and send again once if the warm connection was dropped. Only for actions
                that are safe to repeat: a dropped connection may hide a request that already ran.

        Raises:
            PolicyDenied: dispatch refused it (exit 126).
            Timeout: no answer within call_timeout_s, or dispatch's own timeout.
            Forbidden / Unavailable: the connection could not be made, or was lost.
        """
        async with self._sessions:
            return await self._call(command, retry=retry)

    async def _call(self, command: GatewayCommand, *, retry: bool) -> GatewayOutput:
        conn = await self.connection()
        try:
            exit_status, out, err, truncated = await self._run(conn, command.literal)
        except (asyncssh.ChannelOpenError, asyncssh.DisconnectError, OSError) as exc:
            opened = not isinstance(exc, asyncssh.ChannelOpenError)
            if not opened and not conn.is_closed():
                # The live connection refused one more session (sshd's MaxSessions): keep it for the others.
                raise Unavailable(f"gateway {self.config.name!r} refused a new session: try again") from None
            await self.close()
            if opened and not retry:
                raise Unavailable(
                    f"gateway {self.config.name!r} dropped the connection; the action may or may not have run",
                    detail=str(exc),
                ) from None
            # The session never opened (so nothing was sent), or the action is safe to repeat.
            conn = await self.connection()
            try:
                exit_status, out, err, truncated = await self._run(conn, command.literal)
            except (asyncssh.Error, OSError) as again:
                await self.close()
                raise Unavailable(f"gateway {self.config.name!r} failed twice", detail=str(again)) from None
        stdout, cut_out = self._clean(out)
        stderr, cut_err = self._clean(err)
        truncated = truncated or cut_out or cut_err
        refusals = [line for line in stderr.splitlines() if line.startswith(REFUSED_PREFIX)]
        if exit_status == EXIT_REFUSED and refusals:
            reason = refusals[-1][len(REFUSED_PREFIX) :]
            raise PolicyDenied(f"gateway {self.config.name!r} refused it: {reason}")
        if exit_status == EXIT_TIMEOUT and "dispatch: timeout" in stderr:
            raise Timeout(f"the action ran past the gateway's time limit and was killed: {stderr.strip()[-200:]}")
        return GatewayOutput(exit_status=exit_status, stdout=stdout, stderr=stderr, truncated=truncated)

    async def _run(self, conn: asyncssh.SSHClientConnection, literal: str) -> tuple[int, bytes, bytes, bool]:
        opened: list[asyncssh.SSHClientProcess[bytes]] = []
        try:
            with anyio.fail_after(self.config.call_timeout_s):
                # The open too: a hung host (frozen, or a network dropping packets) never confirms the channel.
                opened.append(await self._open(conn, literal))
                out, err, truncated = await self._drain(opened[0])
                await opened[0].wait_closed()
        except TimeoutError:
            for process in opened:
                process.close()
            raise Timeout(
                f"gateway {self.config.name!r} gave no result within {self.config.call_timeout_s:g} s; "
                "the action may still be running there, up to the host's own time limit"
            ) from None
        status = opened[0].exit_status
        if status is None:
            signal = opened[0].exit_signal
            status = 128 + 9 if signal else 255
        return status, out, err, truncated

    async def _drain(self, process: asyncssh.SSHClientProcess[bytes]) -> tuple[bytes, bytes, bool]:
        """Read both streams to their end, keeping at most the cap (plus the redaction margin) of each."""
        cap = self.config.max_output_bytes + _REDACT_MARGIN
        buffers: dict[str, bytearray] = {"out": bytearray(), "err": bytearray()}
        truncated = False

        async def drain(name: str, stream: asyncssh.SSHReader[bytes]) -> None:
            nonlocal truncated
            while chunk := await stream.read(_CHUNK):
                room = cap - len(buffers[name])
                if len(chunk) > room:
                    truncated = True
                buffers[name] += chunk[: max(room, 0)]

        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(drain, "out", process.stdout)
                tasks.start_soon(drain, "err", process.stderr)
        except ExceptionGroup as group:
            # The connection lost mid-read fails both drains: answer it as the one loss it is.
            raise _lost_connection(group) from None
        return bytes(buffers["out"]), bytes(buffers["err"]), truncated

    async def _open(self, conn: asyncssh.SSHClientConnection, literal: str) -> asyncssh.SSHClientProcess[bytes]:
        """Open the session, waiting out sshd's slow release of finished ones.

        sshd frees a session slot only once it has reaped the session's child, which under load
        lags behind the client seeing the channel closed; until then a new session over
        MaxSessions is refused. A refused open sent nothing, so trying again is always safe.
        """
        for pause in _OPEN_RETRY_PAUSES:
            try:
                return await conn.create_process(literal, encoding=None, request_pty=False, stdin=asyncssh.DEVNULL)
            except asyncssh.ChannelOpenError:
                if conn.is_closed():
                    raise
            await anyio.sleep(pause)
        return await conn.create_process(literal, encoding=None, request_pty=False, stdin=asyncssh.DEVNULL)

    def _clean(self, data: bytes) -> tuple[str, bool]:
        # Redact, then cut (ARCHITECTURE principle 5): the raw read keeps a margin past the cap so a
        # secret straddling the cap is still recognised whole, then the redacted text is cut.
        text = sanitize_terminal(data.decode("utf-8", errors="replace"))
        return self.redactor.redact_then_truncate(text, self.config.max_output_bytes)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            await self._conn.wait_closed()
            self._conn = None

"""Every tool call passes through `CallRunner`: audit, timing, and errors as data.

Order (ARCHITECTURE principle 5): a mutating call first writes a `start` record
and does not run if it cannot (fail-closed); then the operation; then an `end`
record with the result code, before the result is returned. If that end record
cannot be written, a mutating call answers AUDIT_UNAVAILABLE saying that the
operation ran and its end record is missing. A read-only call writes only the
`end` record, and its answer is withheld if that write fails.
The start record, and a read-only call's only record, are on disk (fdatasync)
before the call goes on; a mutating call's end record is in the file before the
answer and on disk one sync later (`AuditLog.append`'s ``durable=False``): the
answer does not wait for a second sync, and every later record waits for it.
Any exception that is not a `BastionError` becomes INTERNAL_ERROR with an
incident id: the traceback goes to the server log, never to the client.
A call cancelled mid-operation (graceful shutdown past its bound, a client
gone) still writes its end record, shielded, with UNAVAILABLE and
`CANCELLED_REASON`, then lets the cancellation go on.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import anyio
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp_types import ImageContent

from bastion.metrics import Metrics
from bastion.safety.audit import AuditLog, Verbatim
from bastion.safety.errors import AuditUnavailable, BastionError
from bastion.safety.results import OperationResult, ResultCode

logger = logging.getLogger("bastion.tools")


@dataclass(frozen=True)
class Outcome:
    """A result, the files the operation wrote or moved (for the audit record, not the client) and any images."""

    result: OperationResult
    files: Sequence[str] = ()
    images: Sequence[ImageContent] = ()


Operation = Callable[[], Awaitable[OperationResult | Outcome]]
CANCELLED_REASON: Final = (
    "cancelled before it finished (the server is stopping, the client went away or its grant was revoked)"
)
UNNAMED: Final = ""
UNKNOWN_TOOL: Final = "(unknown)"
"""The metrics label of a call to a tool this server does not have: a client's name never becomes a label."""
"""The action of a result built inside a tool's body: `CallRunner` sets it to the tool's name."""


class CallRunner:
    """Runs one tool operation under the audit log."""

    def __init__(self, audit: AuditLog, *, caller: str, metrics: Metrics | None = None) -> None:
        self.audit = audit
        self.caller = caller
        self.metrics = metrics
        self.tools: set[str] = set()
        """The registered tools' names (`BastionServer.tool` adds them): only these are metric labels."""
        self._in_flight = 0
        self.requests_in_flight = 0
        """Transport requests being served that may reach this runner (the HTTP app counts its /mcp POSTs).
        A call is alone only if no other is: a request still on its way here is served while a record
        syncs on the worker thread, and joins the next batch."""

    def identity(self) -> str:
        """Who is calling: the transport, and over HTTP the OAuth client the token was issued to."""
        token = get_access_token()
        return f"{self.caller}:{token.client_id}" if token is not None else self.caller

    async def _record(self, record: Mapping[str, object], *, ran: bool = False, durable: bool = True) -> str:
        # Alone, the record is written inline; with company, group commit shares the fdatasync.
        alone = self._in_flight == 1 and self.requests_in_flight <= 1
        return await self.audit.append_async(record, alone=alone, ran=ran, durable=durable)

    async def run(
        self,
        action: str,
        arguments: Mapping[str, object],
        operation: Operation,
        *,
        mutating: bool,
        workspace: str | None = None,
    ) -> OperationResult:
        self._in_flight += 1
        started = time.perf_counter()
        try:
            result = await self._run(action, arguments, operation, mutating=mutating, workspace=workspace)
        finally:
            self._in_flight -= 1
        if self.metrics is not None:
            tool = action if action in self.tools else UNKNOWN_TOOL
            self.metrics.tool_call(tool, result.code.value, time.perf_counter() - started)
        return result

    async def _run(
        self,
        action: str,
        arguments: Mapping[str, object],
        operation: Operation,
        *,
        mutating: bool,
        workspace: str | None,
    ) -> OperationResult:
        started = time.perf_counter()
        call_id = Verbatim(secrets.token_hex(16))
        base: dict[str, object] = {
            "call": call_id,
            "caller": self.identity(),
            "tool": action,
            "workspace": workspace,
            "args": dict(arguments),
        }
        if mutating:
            try:
                await self._record({**base, "event": "start"})
            except AuditUnavailable as exc:
                return self._finish(OperationResult.failure(action, exc.code, exc.reason), started, None)
        try:
            result, files, internal = await self._execute(action, operation)
        except anyio.get_cancelled_exc_class():
            await self._record_cancelled(base, started, mutating=mutating)
            raise
        end: dict[str, object] = {
            **base,
            "event": "end",
            "code": result.code.value,
            "reason": result.reason,
            "duration_ms": round((time.perf_counter() - started) * 1000, 3),
            "files": list(files),
        }
        if internal:
            end["internal"] = internal
        try:
            # A mutating call has acted by now: a failure must say so, never "nothing was done".
            audit_id = await self._record(end, ran=mutating, durable=not mutating)
        except AuditUnavailable as exc:
            return self._finish(OperationResult.failure(action, exc.code, exc.reason), started, None)
        return self._finish(result, started, audit_id)

    async def _record_cancelled(self, base: Mapping[str, object], started: float, *, mutating: bool) -> None:
        """A call cancelled mid-operation (the server stopping, or its client gone) still gets its end
        record: without it the log would show a start and never say how the call ended."""
        end = {
            **base,
            "event": "end",
            "code": ResultCode.UNAVAILABLE.value,
            "reason": CANCELLED_REASON,
            "duration_ms": round((time.perf_counter() - started) * 1000, 3),
            "files": [],
        }
        with anyio.CancelScope(shield=True):
            try:
                await self._record(end, ran=mutating, durable=not mutating)
            except AuditUnavailable as exc:
                logger.error("the end record of a cancelled %s call was not written: %s", base["tool"], exc.reason)

    async def refuse(self, action: str, arguments: Mapping[str, object], error: BastionError) -> OperationResult:
        """Record and return a refusal made before the tool's own code ran (unknown tool, bad arguments)."""

        async def fail() -> OperationResult:
            raise error

        return await self.run(action, arguments, fail, mutating=False)

    async def _execute(self, action: str, operation: Operation) -> tuple[OperationResult, Sequence[str], str | None]:
        try:
            done = await operation()
        except BastionError as exc:
            # The client gets the code and one line; the detail is for the audit log only.
            return OperationResult.failure(action, exc.code, exc.reason), (), exc.detail or None
        except Exception as exc:
            incident = secrets.token_hex(6)
            logger.exception("internal error in %s (incident %s)", action, incident)
            reason = f"internal error (incident {incident}); the server log has the details"
            return (
                OperationResult.failure(action, ResultCode.INTERNAL_ERROR, reason),
                (),
                f"{type(exc).__name__}: {exc}",
            )
        result, files = (done.result, done.files) if isinstance(done, Outcome) else (done, ())
        if result.action != action:  # a body names no action: the runner names it, once
            result = result.model_copy(update={"action": action})
        return result, files, None

    @staticmethod
    def _finish(result: OperationResult, started: float, audit_id: str | None) -> OperationResult:
        duration = round((time.perf_counter() - started) * 1000, 3)
        return result.model_copy(update={"duration_ms": duration, "audit_id": audit_id})

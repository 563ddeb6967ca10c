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

Each caller (`identity`: the transport, and over HTTP the OAuth client) has a budget of audit bytes
(`[audit] caller_bytes_per_s`, `caller_burst_bytes`), charged with what each of its records took in the
file. Found by attack: one HTTP client sending calls to a tool that does not exist, each with three
arguments of 4,096 control characters (6 bytes each once escaped), grew the log by 14.5 MB/s, and a full
state filesystem stops every call of every client (fail-closed). A call first takes the most its records
can take (`RECORD_RESERVE` each) from its caller's budget, and gives back at its end what they did not use:
calls made at once cannot pass the check together before any is charged (found by review: 200 at once
wrote 15 times a 128 KiB burst). A caller whose budget does not hold that is refused (RESOURCE_LIMIT)
before anything runs or is recorded; what it was refused is counted, one ``calls_throttled`` record a
second, so the log grows by a bounded amount however hard a caller tries. The gateway's approval requests,
written before a call reaches the runner, are charged the same way (`record_outside`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import anyio
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp_types import ImageContent

from bastion.config import AuditConfig
from bastion.metrics import Metrics
from bastion.safety.audit import MAX_RECORD_BYTES, AuditLog, Verbatim
from bastion.safety.errors import AuditUnavailable, BastionError
from bastion.safety.rates import ByteRate
from bastion.safety.results import OperationResult, ResultCode
from bastion.safety.span import call_span

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
"""The action of a result built inside a tool's body: `CallRunner` sets it to the tool's name."""
UNKNOWN_TOOL: Final = "(unknown)"
"""The metrics label of a call to a tool this server does not have: a client's name never becomes a label."""
_AUDIT_DEFAULTS: Final = AuditConfig()
"""A caller's audit budget by default (`[audit] caller_bytes_per_s`, 256 KiB: calls of a few hundred bytes each
way, 200 a second, all day, 22 GB a day at most where an unbounded client wrote 52 GB an hour; and
`caller_burst_bytes`, 64 MiB: some 50,000 ordinary calls at once)."""
RECORD_RESERVE: Final = MAX_RECORD_BYTES + 1
"""The most one record takes in the file (its newline included): what a call holds of its caller's budget a record."""
THROTTLE_REPORT_S: Final = 1.0
"""At most one ``calls_throttled`` record a caller this often."""
NO_THREAD: Final = "can't start new thread"
"""`threading.Thread.start`'s RuntimeError when the host (or the server's cgroup) has no thread left."""
NO_THREAD_REASON: Final = (
    "the server cannot start a thread now (the host's or its cgroup's process limit is reached): the call stopped "
    "there; try again once the host has room"
)
MAX_CALLER_BUDGETS: Final = 4096
"""Callers' budgets kept; past it, those full again are forgotten (a full budget is what a new one is)."""


class CallRunner:
    """Runs one tool operation under the audit log."""

    def __init__(
        self,
        audit: AuditLog,
        *,
        caller: str,
        metrics: Metrics | None = None,
        caller_bytes_per_s: int = _AUDIT_DEFAULTS.caller_bytes_per_s,
        caller_burst_bytes: int = _AUDIT_DEFAULTS.caller_burst_bytes,
    ) -> None:
        self.audit = audit
        self.caller = caller
        self.metrics = metrics
        self.caller_bytes_per_s = caller_bytes_per_s
        self.caller_burst_bytes = caller_burst_bytes
        self._budgets: dict[str, ByteRate] = {}
        self._refused: dict[str, int] = {}
        """Callers' calls refused since their last ``calls_throttled`` record (one is pending for each)."""
        self._reports: set[asyncio.Task[None]] = set()
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

    async def _record(
        self, record: Mapping[str, object], budget: ByteRate, *, ran: bool = False, durable: bool = True
    ) -> str:
        # Alone, the record is written inline; with company, group commit shares the fdatasync.
        alone = self._in_flight == 1 and self.requests_in_flight <= 1
        return await self.audit.append_async(record, alone=alone, ran=ran, durable=durable, on_written=budget.owed_s)

    def _budget(self, identity: str) -> ByteRate:
        budget = self._budgets.get(identity)
        if budget is None:
            if len(self._budgets) >= MAX_CALLER_BUDGETS:
                self._budgets = {who: kept for who, kept in self._budgets.items() if not kept.full()}
            budget = self._budgets[identity] = ByteRate(self.caller_bytes_per_s, self.caller_burst_bytes)
        return budget

    async def record_outside(self, record: Mapping[str, object]) -> str | None:
        """Write `record` for the calling client outside a call (the gateway's approval request, asked before
        its call reaches the runner), charged to its budget: None, with nothing written, if the budget does not
        hold it (the call then reaches the runner, which refuses it).

        Raises:
            AuditUnavailable: the record could not be written.
        """
        budget = self._budget(self.identity())
        if budget.hold(RECORD_RESERVE) > 0:
            return None
        try:
            return await self.audit.append_async(record, on_written=budget.owed_s)
        finally:
            budget.give_back(RECORD_RESERVE)

    def _throttled(self, action: str, identity: str, wait_s: float, started: float) -> OperationResult:
        """The answer to a call its caller's budget cannot hold: nothing ran, and it is counted for `_report`."""
        if identity not in self._refused:
            self._refused[identity] = 0
            asyncio.get_running_loop().call_later(THROTTLE_REPORT_S, self._start_report, identity)
        self._refused[identity] += 1
        reason = (
            f"this client's calls wrote more to the audit log than its budget ({self.caller_bytes_per_s} bytes a "
            f"second, {self.caller_burst_bytes} at once): nothing was done; calls are refused for {wait_s:.1f} s"
        )
        return self._finish(OperationResult.failure(action, ResultCode.RESOURCE_LIMIT, reason), started, None)

    def _start_report(self, identity: str) -> None:
        task = asyncio.get_running_loop().create_task(self._report(identity))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _report(self, identity: str) -> None:
        record = {
            "event": "calls_throttled",
            "caller": identity,
            "refused": self._refused.pop(identity, 0),
            "bytes_per_s": self.caller_bytes_per_s,
            "burst_bytes": self.caller_burst_bytes,
        }
        try:
            await self.audit.append_async(record)
        except AuditUnavailable as exc:
            logger.error(
                "%d calls of %s refused by its audit budget, not recorded: %s", record["refused"], identity, exc.reason
            )

    async def run(
        self,
        action: str,
        arguments: Mapping[str, object],
        operation: Operation,
        *,
        mutating: bool,
        workspace: str | None = None,
    ) -> OperationResult:
        started = time.perf_counter()
        identity = self.identity()
        budget = self._budget(identity)
        held = RECORD_RESERVE * (2 if mutating else 1)
        if (wait_s := budget.hold(held)) > 0:
            result = self._throttled(action, identity, wait_s, started)
        else:
            self._in_flight += 1
            try:
                with call_span():  # what the call uses (a sandbox) is in use until it ends
                    result = await self._run(action, arguments, operation, identity, budget, mutating, workspace)
            finally:
                self._in_flight -= 1
                budget.give_back(held)
        if self.metrics is not None:
            tool = action if action in self.tools else UNKNOWN_TOOL
            self.metrics.tool_call(tool, result.code.value, time.perf_counter() - started)
        return result

    async def _run(
        self,
        action: str,
        arguments: Mapping[str, object],
        operation: Operation,
        identity: str,
        budget: ByteRate,
        mutating: bool,
        workspace: str | None,
    ) -> OperationResult:
        started = time.perf_counter()
        call_id = Verbatim(secrets.token_hex(16))
        base: dict[str, object] = {
            "call": call_id,
            "caller": identity,
            "tool": action,
            "workspace": workspace,
            "args": dict(arguments),
        }
        if mutating:
            try:
                await self._record({**base, "event": "start"}, budget)
            except AuditUnavailable as exc:
                return self._finish(OperationResult.failure(action, exc.code, exc.reason), started, None)
        try:
            result, files, internal = await self._execute(action, operation)
        except anyio.get_cancelled_exc_class():
            await self._record_cancelled(base, budget, started, mutating=mutating)
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
            audit_id = await self._record(end, budget, ran=mutating, durable=not mutating)
        except AuditUnavailable as exc:
            return self._finish(OperationResult.failure(action, exc.code, exc.reason), started, None)
        return self._finish(result, started, audit_id)

    async def _record_cancelled(
        self, base: Mapping[str, object], budget: ByteRate, started: float, *, mutating: bool
    ) -> None:
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
                await self._record(end, budget, ran=mutating, durable=not mutating)
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
        except RuntimeError as exc:
            if str(exc) != NO_THREAD:
                return self._internal_error(action, exc)
            # Found by attack (the server's cgroup at its pids limit): a tool's worker thread could not be started,
            # and the client got INTERNAL_ERROR with a traceback in the log.
            return OperationResult.failure(action, ResultCode.UNAVAILABLE, NO_THREAD_REASON), (), NO_THREAD
        except Exception as exc:
            return self._internal_error(action, exc)
        result, files = (done.result, done.files) if isinstance(done, Outcome) else (done, ())
        if result.action != action:  # a body names no action: the runner names it, once
            result = result.model_copy(update={"action": action})
        return result, files, None

    @staticmethod
    def _internal_error(action: str, exc: Exception) -> tuple[OperationResult, Sequence[str], str | None]:
        incident = secrets.token_hex(6)
        logger.error("internal error in %s (incident %s)", action, incident, exc_info=exc)
        reason = f"internal error (incident {incident}); the server log has the details"
        return (
            OperationResult.failure(action, ResultCode.INTERNAL_ERROR, reason),
            (),
            f"{type(exc).__name__}: {exc}",
        )

    @staticmethod
    def _finish(result: OperationResult, started: float, audit_id: str | None) -> OperationResult:
        duration = round((time.perf_counter() - started) * 1000, 3)
        return result.model_copy(update={"duration_ms": duration, "audit_id": audit_id})

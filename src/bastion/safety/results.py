"""Typed results: every tool call ends in one `OperationResult`.

MCP's `isError` is derived from `ok` and nothing else, so a client never has to
guess whether a refusal was an error. A non-zero exit status of a command is
`ok=True` with the status in `detail`: the tool did what it was asked.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Final

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema


class ResultCode(StrEnum):
    """The closed vocabulary a client sees; the audit log has the full story."""

    OK = "OK"
    INVALID_REQUEST = "INVALID_REQUEST"
    POLICY_DENIED = "POLICY_DENIED"
    PATH_ESCAPE = "PATH_ESCAPE"
    NOT_FOUND = "NOT_FOUND"
    CONFLICT = "CONFLICT"
    TIMEOUT = "TIMEOUT"
    OUTPUT_TRUNCATED = "OUTPUT_TRUNCATED"
    RESOURCE_LIMIT = "RESOURCE_LIMIT"
    NEEDS_EXPLICIT_REQUEST = "NEEDS_EXPLICIT_REQUEST"
    NEEDS_APPROVAL = "NEEDS_APPROVAL"
    APPROVAL_DENIED = "APPROVAL_DENIED"
    SANDBOX_NOT_FOUND = "SANDBOX_NOT_FOUND"
    FORBIDDEN = "FORBIDDEN"
    UNAVAILABLE = "UNAVAILABLE"
    AUDIT_UNAVAILABLE = "AUDIT_UNAVAILABLE"
    OPERATION_FAILED = "OPERATION_FAILED"
    INTERNAL_ERROR = "INTERNAL_ERROR"


# Codes whose operation still produced a usable answer: the call did what was asked.
OK_CODES: Final = frozenset({ResultCode.OK, ResultCode.OUTPUT_TRUNCATED})


class OperationResult(BaseModel):
    """What every tool returns.

    Attributes:
        ok: True when the operation did what was asked (possibly with truncated output).
        code: the `ResultCode`.
        action: the tool's action name, e.g. ``run_command``.
        reason: one short line for the client; never a traceback.
        detail: structured, redacted payload (output, exit status, entries...).
        duration_ms: wall time of the call.
        audit_id: the id of the audit record of this call, when one was written.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    ok: bool
    # Inlined in the schema (no $ref): clients validate every result against it.
    code: Annotated[ResultCode, WithJsonSchema({"type": "string", "enum": [code.value for code in ResultCode]})]
    action: str
    reason: str = ""
    detail: dict[str, Any] = Field(default_factory=dict)
    duration_ms: float = 0.0
    audit_id: str | None = None

    @classmethod
    def success(
        cls, action: str, detail: dict[str, Any] | None = None, *, code: ResultCode = ResultCode.OK, reason: str = ""
    ) -> OperationResult:
        if code not in OK_CODES:
            raise ValueError(f"{code} is not a success code")
        return cls(ok=True, code=code, action=action, reason=reason, detail=detail or {})

    @classmethod
    def failure(
        cls, action: str, code: ResultCode, reason: str, detail: dict[str, Any] | None = None
    ) -> OperationResult:
        if code in OK_CODES:
            raise ValueError(f"{code} is a success code")
        return cls(ok=False, code=code, action=action, reason=reason, detail=detail or {})

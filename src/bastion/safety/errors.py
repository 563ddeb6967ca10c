"""The one error tree of bastion. Each subclass is chosen by what the caller must do.

    BastionError (code, reason: short line for the client; detail: for the audit log only)
    ├── InvalidRequest          INVALID_REQUEST   malformed input: fix the request
    ├── PolicyDenied            POLICY_DENIED     a rule refused it: ask a human or do something else
    ├── PathEscape              PATH_ESCAPE       the path leaves the jail
    ├── NotFound                NOT_FOUND
    ├── SandboxNotFound         SANDBOX_NOT_FOUND no such sandbox or workspace id
    ├── Conflict                CONFLICT          the target exists; nothing is overwritten
    ├── ResourceLimit           RESOURCE_LIMIT    a size or count bound was hit
    ├── Forbidden               FORBIDDEN         not this caller's to do (e.g. closing a host workspace)
    ├── Timeout                 TIMEOUT
    ├── Unavailable             UNAVAILABLE       a dependency (bubblewrap, the kernel feature) is missing
    ├── AuditUnavailable        AUDIT_UNAVAILABLE the audit record could not be written: nothing ran
    ├── NeedsApproval           NEEDS_APPROVAL    a human must approve first: present the approval id later
    ├── ApprovalDenied          APPROVAL_DENIED   a human denied it, or the approval expired: it never runs
    └── OperationFailed         OPERATION_FAILED  the OS refused for another reason
    ConfigError (not a BastionError: it stops the server at start-up with one line)

The tool layer turns a BastionError into an `OperationResult`; anything else is an
internal error whose text stays on the server.
"""

from __future__ import annotations

from typing import ClassVar, Final

from bastion.safety.results import ResultCode

MAX_SHOWN_CHARS: Final = 64
"""Of a client's id, name or argument name quoted in a reason (`shown`)."""


def shown(text: str) -> str:
    """A client's id, name or argument name, quoted for a reason and cut to `MAX_SHOWN_CHARS`: a 100,000-character
    sandbox id came back whole, and a million-character argument name made a reason of a million."""
    if len(text) > MAX_SHOWN_CHARS:
        return repr(text[:MAX_SHOWN_CHARS]) + f"... (cut, {len(text)} characters)"
    return repr(text)


class BastionError(Exception):
    """Base of the errors a tool turns into a typed refusal."""

    code: ClassVar[ResultCode] = ResultCode.OPERATION_FAILED

    def __init__(self, reason: str, *, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


class InvalidRequest(BastionError):
    code = ResultCode.INVALID_REQUEST


class PolicyDenied(BastionError):
    code = ResultCode.POLICY_DENIED


class PathEscape(BastionError):
    code = ResultCode.PATH_ESCAPE


class NotFound(BastionError):
    code = ResultCode.NOT_FOUND


class SandboxNotFound(BastionError):
    code = ResultCode.SANDBOX_NOT_FOUND


class Conflict(BastionError):
    code = ResultCode.CONFLICT


class ResourceLimit(BastionError):
    code = ResultCode.RESOURCE_LIMIT


class Forbidden(BastionError):
    code = ResultCode.FORBIDDEN


class Timeout(BastionError):
    code = ResultCode.TIMEOUT


class Unavailable(BastionError):
    code = ResultCode.UNAVAILABLE


class AuditUnavailable(BastionError):
    code = ResultCode.AUDIT_UNAVAILABLE


class NeedsApproval(BastionError):
    code = ResultCode.NEEDS_APPROVAL


class ApprovalDenied(BastionError):
    code = ResultCode.APPROVAL_DENIED


class OperationFailed(BastionError):
    code = ResultCode.OPERATION_FAILED


class ConfigError(Exception):
    """Invalid configuration: the server refuses to start, printing this one line."""

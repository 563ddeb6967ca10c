"""The approval queue: actions that wait for a human before they run.

Public API (stable; the admin pages and the CLI build on it):

    queue = ApprovalQueue(config.db_path, webhook_url=None)
    a = queue.request(action, literal, requested_by, ttl_s)   # -> Approval (state "pending")
    queue.get(a.id); queue.pending(); queue.recent(limit)
    queue.approve(a.id, by)  /  queue.deny(a.id, by, reason)
    await queue.wait(a.id, timeout_s, on_progress)            # -> Approval, when decided or on timeout
    queue.consume(a.id, action, literal)                      # the one use of an approved request
    queue.give_back(a.id)                                     # that use sent nothing: approved again
    await queue.decide_recorded(audit, a.id, "approve", by=..., channel="web")  # audited, then decided

An approval is bound to the exact literal it was asked for (``action`` is the tool,
e.g. ``biscuit_deploy``; ``literal`` the exact string sent, e.g. ``deploy v1.2.3``):
`consume` refuses any other pair, so approving one deploy cannot authorise another.
It is used at most once (``approved`` -> ``used`` in one conditional UPDATE), and a
request not decided and used before ``expires_at`` becomes ``expired``. A denied,
expired or used approval never runs anything.

State lives in SQLite (table ``approvals`` in ``<state_dir>/bastion.db``, WAL), so
``bastion approvals approve`` in another process and the web page see the same queue;
`wait` polls the table, which costs one indexed read per interval.
"""

from __future__ import annotations

import json
import logging
import secrets
import sqlite3
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal, cast

import anyio

from bastion.safety.errors import (
    ApprovalDenied,
    BastionError,
    ConfigError,
    Conflict,
    InvalidRequest,
    NeedsApproval,
    NotFound,
    ResourceLimit,
)

if TYPE_CHECKING:
    from bastion.safety.audit import AuditLog

logger = logging.getLogger("bastion.approvals")

ApprovalState = Literal["pending", "approved", "denied", "expired", "used"]
Decision = Literal["approve", "deny"]
Channel = Literal["web", "cli", "elicitation"]
"""Where a human decided: the admin page, `bastion approvals`, or the agent's client (elicitation)."""
ProgressCallback = Callable[[float, str], Awaitable[None]]
"""Called while waiting with (seconds waited, a one-line message)."""

ID_PREFIX: Final = "ap-"
MAX_LITERAL_CHARS: Final = 4096
MAX_REASON_CHARS: Final = 500
POLL_INTERVAL_S: Final = 0.2
PROGRESS_INTERVAL_S: Final = 1.0
WEBHOOK_TIMEOUT_S: Final = 5.0
MAX_PENDING_PER_REQUESTER: Final = 16
"""Requests one client may have waiting at once: each is a row, a line on the approvals page and a webhook
POST, which a client calling in a loop multiplied without bound."""
KEEP_DECIDED_S: Final = 90 * 86_400
"""How long a decided, used or expired request stays listed (the audit log keeps the calls for good)."""

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS approvals (
    id TEXT PRIMARY KEY,
    action TEXT NOT NULL,
    literal TEXT NOT NULL,
    requested_by TEXT NOT NULL,
    requested_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    state TEXT NOT NULL,
    decided_by TEXT,
    decided_at REAL,
    reason TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS approvals_state ON approvals (state, expires_at);
"""
_COLUMNS: Final = "id, action, literal, requested_by, requested_at, expires_at, state, decided_by, decided_at, reason"


@dataclass(frozen=True)
class Approval:
    """One request for a human decision, as stored."""

    id: str
    action: str
    """The tool that asked, e.g. ``biscuit_deploy``."""
    literal: str
    """The full literal action that will be sent if approved, e.g. ``deploy v1.2.3``."""
    requested_by: str
    requested_at: float
    """Unix seconds."""
    expires_at: float
    state: ApprovalState
    decided_by: str | None = None
    decided_at: float | None = None
    reason: str = ""
    """The denial reason, when denied."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def database_problem(path: Path, exc: OSError | sqlite3.Error) -> str:
    """The one line a start refused by the state database prints (a full state filesystem, a bad file)."""
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"database {path} cannot be opened ({why}): free space on its filesystem, or move the file aside"


def new_approval_id() -> str:
    """A fresh approval id (64 random bits)."""
    return ID_PREFIX + secrets.token_hex(8)


class ApprovalQueue:
    """A persisted queue of actions waiting for a human decision.

    Args:
        db_path: the SQLite file (``config.db_path``); created if missing, mode 0600.
        webhook_url: if set, each new request is POSTed there as JSON (best effort, never blocks).
        clock: seconds since the epoch; tests pass a fake one.
    """

    def __init__(
        self,
        db_path: str | Path,
        *,
        webhook_url: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.db_path = Path(db_path)
        self.webhook_url = webhook_url
        self._clock = clock
        try:
            self.db_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.db_path.touch(mode=0o600, exist_ok=True)
            with self._connect() as db:
                db.execute("PRAGMA journal_mode=WAL")
                db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(database_problem(self.db_path, exc)) from None

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        # One short connection per operation: safe across threads and processes (the CLI, the web page).
        db = sqlite3.connect(self.db_path, timeout=10.0, isolation_level=None)
        try:
            db.execute("PRAGMA busy_timeout=10000")
            yield db
        finally:
            db.close()

    def _expire(self, db: sqlite3.Connection) -> None:
        db.execute(
            "UPDATE approvals SET state='expired' WHERE state IN ('pending', 'approved') AND expires_at <= ?",
            (self._clock(),),
        )

    def _row(self, db: sqlite3.Connection, approval_id: str) -> Approval:
        row = db.execute(f"SELECT {_COLUMNS} FROM approvals WHERE id = ?", (approval_id,)).fetchone()  # noqa: S608
        if row is None:
            raise NotFound(f"no approval {approval_id!r}: list them with 'bastion approvals list'")
        return _approval(row)

    def request(
        self, action: str, literal: str, requested_by: str, ttl_s: float, *, approval_id: str | None = None
    ) -> Approval:
        """Queue a request; it stays pending until approved, denied, or `ttl_s` seconds pass.

        `approval_id` (from `new_approval_id`): the id an audit record already names; a new one if None.

        Raises:
            InvalidRequest: an empty or oversized literal, or a non-positive ttl.
            ResourceLimit: `requested_by` has `MAX_PENDING_PER_REQUESTER` requests waiting already.
        """
        if not literal or len(literal) > MAX_LITERAL_CHARS:
            raise InvalidRequest(f"approval literal must be 1 to {MAX_LITERAL_CHARS} characters")
        if not ttl_s > 0:
            raise InvalidRequest("approval ttl_s must be positive")
        now = self._clock()
        approval = Approval(
            id=approval_id or new_approval_id(),
            action=action,
            literal=literal,
            requested_by=requested_by,
            requested_at=now,
            expires_at=now + ttl_s,
            state="pending",
        )
        with self._connect() as db:
            self._expire(db)
            waiting = db.execute(
                "SELECT count(*) FROM approvals WHERE state = 'pending' AND requested_by = ?", (requested_by,)
            ).fetchone()[0]
            if waiting >= MAX_PENDING_PER_REQUESTER:
                raise ResourceLimit(
                    f"{waiting} approval requests of yours are waiting for a decision: "
                    "wait for them (or their expiry) before asking again"
                )
            db.execute(
                "DELETE FROM approvals WHERE state IN ('denied', 'expired', 'used') AND requested_at < ?",
                (now - KEEP_DECIDED_S,),
            )
            db.execute(
                f"INSERT INTO approvals ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, NULL, NULL, '')",  # noqa: S608
                (
                    approval.id,
                    approval.action,
                    approval.literal,
                    approval.requested_by,
                    approval.requested_at,
                    approval.expires_at,
                    approval.state,
                ),
            )
        self._notify(approval)
        return approval

    def get(self, approval_id: str) -> Approval:
        """The approval as it is now (an overdue one reads as ``expired``). Raises NotFound."""
        with self._connect() as db:
            self._expire(db)
            return self._row(db, approval_id)

    def pending(self) -> list[Approval]:
        """Requests waiting for a decision, oldest first."""
        with self._connect() as db:
            self._expire(db)
            rows = db.execute(
                f"SELECT {_COLUMNS} FROM approvals WHERE state = 'pending' ORDER BY requested_at"  # noqa: S608
            ).fetchall()
        return [_approval(row) for row in rows]

    def recent(self, limit: int = 50) -> list[Approval]:
        """The newest requests in any state, newest first."""
        with self._connect() as db:
            self._expire(db)
            rows = db.execute(
                f"SELECT {_COLUMNS} FROM approvals ORDER BY requested_at DESC LIMIT ?",  # noqa: S608
                (max(1, min(limit, 1000)),),
            ).fetchall()
        return [_approval(row) for row in rows]

    def approve(self, approval_id: str, by: str) -> Approval:
        """Approve a pending request. Raises NotFound, or Conflict if it is no longer pending."""
        return self._decide(approval_id, "approved", by, "")

    def deny(self, approval_id: str, by: str, reason: str = "") -> Approval:
        """Deny a pending request; it will never run. Raises NotFound, or Conflict if no longer pending."""
        return self._decide(approval_id, "denied", by, reason[:MAX_REASON_CHARS])

    def _decide(self, approval_id: str, state: ApprovalState, by: str, reason: str) -> Approval:
        with self._connect() as db:
            self._expire(db)
            changed = db.execute(
                "UPDATE approvals SET state = ?, decided_by = ?, decided_at = ?, reason = ? "
                "WHERE id = ? AND state = 'pending'",
                (state, by, self._clock(), reason, approval_id),
            ).rowcount
            current = self._row(db, approval_id)
        if not changed:
            raise Conflict(f"approval {approval_id} is {current.state}, not pending: it cannot be decided again")
        return current

    def consume(self, approval_id: str, action: str, literal: str) -> Approval:
        """Take the one use of an approved request for exactly this action and literal.

        Returns:
            The approval, now ``used``: the caller may run the literal once.

        Raises:
            NotFound: no such approval.
            InvalidRequest: the approval was asked for another action or literal.
            NeedsApproval: still pending.
            ApprovalDenied: denied, expired, or already used.
        """
        with self._connect() as db:
            self._expire(db)
            current = self._row(db, approval_id)
            if current.action != action or current.literal != literal:
                raise InvalidRequest(
                    f"approval {approval_id} is for {current.action} {current.literal!r}, not this call: "
                    "ask for a new approval"
                )
            changed = db.execute(
                "UPDATE approvals SET state = 'used' WHERE id = ? AND state = 'approved' AND expires_at > ?",
                (approval_id, self._clock()),
            ).rowcount
            if changed:
                return self._row(db, approval_id)
            current = self._row(db, approval_id)
        raise_for_state(current)
        raise ApprovalDenied(f"approval {approval_id} cannot be used")  # unreachable: the row was not approved

    def give_back(self, approval_id: str) -> Approval:
        """Make a ``used`` approval usable again: its use failed before anything reached the host.

        Only the call that spent it may do this, once that failure proves nothing was sent (the
        caller audits it first). One conditional UPDATE, like `consume`: an expired one stays used.

        Raises:
            NotFound: no such approval.
            Conflict: it is not ``used``, or has expired.
        """
        with self._connect() as db:
            changed = db.execute(
                "UPDATE approvals SET state = 'approved' WHERE id = ? AND state = 'used' AND expires_at > ?",
                (approval_id, self._clock()),
            ).rowcount
            current = self._row(db, approval_id)
        if not changed:
            raise Conflict(f"approval {approval_id} is {current.state}: it cannot be given back")
        return current

    async def decide_recorded(
        self,
        audit: AuditLog,
        approval_id: str,
        decision: Decision,
        *,
        by: str,
        channel: Channel,
        reason: str = "",
    ) -> Approval:
        """Approve or deny, with the decision in the audit chain before it is committed.

        The record (``event: admin``, as the dashboard's own actions) names the approval, its tool
        and literal, the decision, who made it and through which channel; an end record says how it went.

        Raises:
            AuditUnavailable: the record could not be written; nothing was decided.
            NotFound / Conflict: as `approve` and `deny`.
        """
        current = self.get(approval_id)
        if current.state != "pending":
            raise Conflict(f"approval {approval_id} is {current.state}, not pending: it cannot be decided again")
        record: dict[str, object] = {
            "event": "admin",
            "tool": f"{decision}_approval",
            "caller": by,
            "channel": channel,
            "approval": current.id,
            "action": current.action,
            "literal": current.literal,
            "requested_by": current.requested_by,
            "decision": decision,
        }
        if decision == "deny":
            record["denial_reason"] = reason[:MAX_REASON_CHARS]
        await audit.append_async({**record, "phase": "start"})
        try:
            decided = self.approve(approval_id, by) if decision == "approve" else self.deny(approval_id, by, reason)
        except BastionError as exc:
            await audit.append_async({**record, "phase": "end", "code": exc.code.value, "refusal": exc.reason})
            raise
        await audit.append_async({**record, "phase": "end", "code": "OK", "state": decided.state}, ran=True)
        return decided

    async def wait(self, approval_id: str, timeout_s: float, on_progress: ProgressCallback | None = None) -> Approval:
        """Wait until the request is decided (or expires), at most `timeout_s` seconds.

        Returns:
            The approval as it is at the end; still ``pending`` if the time ran out.
        """
        started = time.monotonic()
        last_progress = -PROGRESS_INTERVAL_S
        while True:
            current = self.get(approval_id)
            waited = time.monotonic() - started
            if current.state != "pending" or waited >= timeout_s:
                return current
            if on_progress is not None and waited - last_progress >= PROGRESS_INTERVAL_S:
                last_progress = waited
                await on_progress(waited, f"waiting for a human to approve {current.literal!r} ({current.id})")
            await anyio.sleep(min(POLL_INTERVAL_S, max(0.0, timeout_s - waited)))

    def _notify(self, approval: Approval) -> None:
        if not self.webhook_url:
            return
        body = json.dumps({"event": "approval.requested", "approval": approval.to_dict()}).encode()
        url = self.webhook_url
        # A thread so a slow or dead webhook never delays the tool call; failure is logged only.
        threading.Thread(target=_post, args=(url, body), name="approval-webhook", daemon=True).start()


def raise_for_state(approval: Approval) -> None:
    """Raise the error that says why `approval` cannot run now; return if it is approved."""
    if approval.state == "approved":
        return
    if approval.state == "pending":
        raise NeedsApproval(f"approval {approval.id} is still pending: ask the administrator to approve it")
    if approval.state == "denied":
        why = f": {approval.reason}" if approval.reason else ""
        raise ApprovalDenied(f"approval {approval.id} was denied by {approval.decided_by}{why}")
    if approval.state == "expired":
        raise ApprovalDenied(f"approval {approval.id} expired before it was used: ask for a new one")
    raise ApprovalDenied(f"approval {approval.id} was already used: each approval runs once")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def _post(url: str, body: bytes) -> None:
    request = urllib.request.Request(  # noqa: S310 (the scheme is checked in config: http or https only)
        url, data=body, method="POST", headers={"Content-Type": "application/json", "User-Agent": "bastion"}
    )
    try:
        with urllib.request.build_opener(_NoRedirect()).open(request, timeout=WEBHOOK_TIMEOUT_S) as response:
            response.read(1024)
    except Exception as exc:  # any failure: the queue works without the webhook
        logger.warning("approval webhook %s failed: %s", url, exc)


def _approval(row: tuple[object, ...]) -> Approval:
    (id_, action, literal, requested_by, requested_at, expires_at, state, decided_by, decided_at, reason) = row
    return Approval(
        id=str(id_),
        action=str(action),
        literal=str(literal),
        requested_by=str(requested_by),
        requested_at=float(cast(float, requested_at)),
        expires_at=float(cast(float, expires_at)),
        state=cast(ApprovalState, state),
        decided_by=None if decided_by is None else str(decided_by),
        decided_at=None if decided_at is None else float(cast(float, decided_at)),
        reason=str(reason or ""),
    )

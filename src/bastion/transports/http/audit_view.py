"""The audit log as the administrator's pages read it: bounded pages, newest first, and the chain's status.

A page reads at most `SCAN_BYTES` of the current log file backwards from a byte offset (the `before`
cursor of the previous page), whatever the log's size, and keeps at most `PAGE_RECORDS` records that
match the filters; the next page starts where this one stopped. Rotated files (`name.N`) are not paged
here: `bastion audit verify` and any JSONL tool read them. Filter values are checked against the
vocabulary of the log (a tool name, a result code, a sandbox id) and refused otherwise.

The chain's status comes from `bastion.safety.audit.verify_files`, in a worker thread: the rotated files
(which never change) once, then the current file from where they end, at most once per `VERIFY_EVERY_S`
and only when the files changed (inode, size, mtime), and not past `VERIFY_MAX_BYTES` (the page then
says to run `bastion audit verify`). It is a point-in-time check with verify's own limits (a
consistent rewrite of the whole chain is not detected).
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from bastion.safety.audit import ChainHead, chain_files, chain_identities, verify_files
from bastion.safety.errors import InvalidRequest
from bastion.safety.results import ResultCode

PAGE_RECORDS: Final = 50
SCAN_BYTES: Final = 2 << 20
VERIFY_MAX_BYTES: Final = 64 << 20  # one file at the default rotate_bytes: ~1 s
VERIFY_EVERY_S: Final = 30.0
MAX_FILTER_CHARS: Final = 200

Kind = Literal["all", "calls", "egress", "admin"]
KINDS: Final = ("all", "calls", "egress", "admin")
DECISIONS: Final = ("allow", "deny", "error")
_KIND_OF: Final[Mapping[str, Kind]] = {"all": "all", "calls": "calls", "egress": "egress", "admin": "admin"}
_NAME: Final = re.compile(r"[A-Za-z0-9_.:-]{1,100}")
_CODES: Final = frozenset(code.value for code in ResultCode)
_EVENTS: Final[Mapping[str, frozenset[str]]] = {
    "calls": frozenset({"start", "end", "calls_throttled"}),  # calls_throttled: a caller's refusals, counted
    # egress_open: an allowed connection as it is made; its "egress" record comes when it ends, hours later for
    # a tunnel kept open. Without it, a connection open now was on no page but the whole log.
    "egress": frozenset({"egress", "egress_open", "egress_throttled"}),
    "admin": frozenset({"admin"}),
}


def _decision(record: Mapping[str, object]) -> object:
    """A record's egress decision; an `egress_open` record is an allowed connection being made."""
    return "allow" if record.get("event") == "egress_open" else record.get("decision")


@dataclass(frozen=True)
class AuditFilter:
    """What a page shows: every field set must match (caller: a part of it)."""

    kind: Kind = "all"
    tool: str = ""
    caller: str = ""
    sandbox: str = ""
    code: str = ""
    decision: str = ""

    def matches(self, record: Mapping[str, object]) -> bool:
        event = record.get("event")
        if self.kind != "all" and event not in _EVENTS[self.kind]:
            return False
        if self.tool and record.get("tool") != self.tool:
            return False
        if self.code and record.get("code") != self.code:
            return False
        if self.decision and _decision(record) != self.decision:
            return False
        if self.caller and self.caller not in str(record.get("caller", "")):
            return False
        return not self.sandbox or self.sandbox in _sandboxes_of(record)

    def query(self) -> dict[str, str]:
        """The filters set, as query parameters (for the next page's link)."""
        fields: dict[str, str] = {"kind": "" if self.kind == "all" else self.kind, "tool": self.tool}
        fields |= {"caller": self.caller, "sandbox": self.sandbox, "code": self.code, "decision": self.decision}
        return {key: value for key, value in fields.items() if value}


def _sandboxes_of(record: Mapping[str, object]) -> set[str]:
    found = {record.get("sandbox"), record.get("workspace")}
    args = record.get("args")
    if isinstance(args, dict):
        found.add(args.get("sandbox_id"))
    return {value for value in found if isinstance(value, str)}


def parse_filter(params: Mapping[str, str], *, kind: Kind = "all") -> AuditFilter:
    """The filters of a query string, checked.

    Raises:
        InvalidRequest: a value outside the log's vocabulary (one line, naming the parameter).
    """
    chosen = params.get("kind", kind) or kind
    if chosen not in KINDS:
        raise InvalidRequest(f"kind must be one of {', '.join(KINDS)}")
    tool, sandbox = params.get("tool", ""), params.get("sandbox", "")
    for name, value in (("tool", tool), ("sandbox", sandbox)):
        if value and not _NAME.fullmatch(value):
            raise InvalidRequest(f"{name} must be 1 to 100 letters, digits, '_', '.', ':' or '-'")
    code = params.get("code", "")
    if code and code not in _CODES:
        raise InvalidRequest("code must be a result code, e.g. OK or POLICY_DENIED")
    decision = params.get("decision", "")
    if decision and decision not in DECISIONS:
        raise InvalidRequest(f"decision must be one of {', '.join(DECISIONS)}")
    caller = params.get("caller", "")
    if len(caller) > MAX_FILTER_CHARS or not caller.isprintable():
        raise InvalidRequest(f"caller must be printable and at most {MAX_FILTER_CHARS} characters")
    return AuditFilter(_KIND_OF[chosen], tool, caller, sandbox, code, decision)


def refuse_repeated(pairs: Iterable[tuple[str, str]]) -> None:
    """Refuse a query that gives a parameter twice, in one pass (a head of thousands of names stays cheap:
    a `getlist` per name was quadratic, a quarter second on the event loop for a 16 KiB query).

    Raises:
        InvalidRequest: a parameter given twice.
    """
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise InvalidRequest("each filter may be given once")
        seen.add(key)


def parse_cursor(value: str | None) -> int | None:
    """The `before` byte offset of a page link.

    Raises:
        InvalidRequest: not a decimal number of at most 18 digits.
    """
    if not value:
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= 18):
        raise InvalidRequest("before must be a byte offset (digits only)")
    return int(value)


@dataclass(frozen=True)
class AuditRecord:
    """One record as the page shows it; `fields` are the record's own, parsed, unescaped (the template escapes)."""

    offset: int
    fields: dict[str, object]

    def text(self, key: str) -> str:
        value = self.fields.get(key)
        return "" if value is None else value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class AuditPage:
    records: list[AuditRecord]
    next_before: int | None
    """Where the next (older) page starts; None at the start of the file."""
    scanned_bytes: int
    file_bytes: int
    rotated: bool
    """Older rotated files exist (not paged here)."""


def read_page(
    path: Path,
    wanted: AuditFilter,
    *,
    before: int | None = None,
    limit: int = PAGE_RECORDS,
    scan_bytes: int = SCAN_BYTES,
) -> AuditPage:
    """At most `limit` records matching `wanted`, newest first, from at most `scan_bytes` before `before`.

    A line that is not a JSON object (torn, or a cursor in the middle of a line) is skipped, never shown.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return AuditPage([], None, 0, 0, _has_rotated(path))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidRequest(f"audit log {path} is not a regular file")
        end = st.st_size if before is None else min(before, st.st_size)
        start = max(0, end - scan_bytes)
        window = os.pread(fd, end - start, start)
    finally:
        os.close(fd)
    return _page(window, start, wanted, limit, st.st_size, _has_rotated(path))


def _page(window: bytes, start: int, wanted: AuditFilter, limit: int, file_bytes: int, rotated: bool) -> AuditPage:
    lines = window.split(b"\n")
    # The last piece follows the last newline (empty, or a record being written); the first may begin
    # mid-line when the window does not start the file: neither is a whole record.
    first_whole = 0 if start == 0 else 1
    offsets = [start]
    for line in lines[:-1]:
        offsets.append(offsets[-1] + len(line) + 1)
    records: list[AuditRecord] = []
    oldest = offsets[len(lines) - 1]
    for index in range(len(lines) - 2, first_whole - 1, -1):
        if len(records) >= limit:
            break
        oldest = offsets[index]
        parsed = _parse(lines[index])
        if parsed is not None and wanted.matches(parsed):
            records.append(AuditRecord(offsets[index], parsed))
    scanned = offsets[len(lines) - 1] - oldest
    return AuditPage(records, oldest or None, scanned, file_bytes, rotated)


def _parse(raw: bytes) -> dict[str, object] | None:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # an edited log may nest deeper than the writer ever does
        return None
    return value if isinstance(value, dict) else None


def _has_rotated(path: Path) -> bool:
    return os.path.lexists(path.with_name(f"{path.name}.1"))


@dataclass(frozen=True)
class ChainState:
    state: Literal["ok", "broken", "unchecked"]
    message: str
    checked_at: float | None = None


@dataclass
class ChainStatus:
    """`verify`, cached and bounded.

    Rotated files never change: they are verified once, and later checks start from the head they end
    with (re-verified only if one of them changes). The current file is re-verified only when the files
    changed (inode, size, mtime), at most once per `every_s`, and not past `max_bytes` (nor rotated
    files past it in all).
    """

    path: Path
    max_bytes: int = VERIFY_MAX_BYTES
    every_s: float = VERIFY_EVERY_S
    _key: tuple[tuple[str, int, int, int], ...] | None = None
    _state: ChainState | None = None
    _rotated: tuple[tuple[tuple[str, int, int, int], ...], ChainHead] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def check(self) -> ChainState:
        """The chain's status (blocking: call it in a worker thread)."""
        with self._lock:
            key = chain_identities(self.path)
            state = self._state
            if state is not None and (key == self._key or _recent(state, self.every_s)):
                return state
            self._state = self._verify(key)
            if self._state.state == "broken" and chain_identities(self.path) != key:
                key = chain_identities(self.path)  # rotated or appended while verifying: look again once
                self._state = self._verify(key)
            self._key = key
            return self._state

    def _verify(self, key: tuple[tuple[str, int, int, int], ...]) -> ChainState:
        files, missing = chain_files(self.path)
        if missing is not None:
            return _checked("broken", f"BROKEN: {missing.first_error}")
        rotated, current = files[:-1], files[-1]
        head = self._rotated_head(key[:-1] if key else (), rotated)
        if isinstance(head, ChainState):
            return head
        size = key[-1][2] if key and key[-1][0] == self.path.name else 0
        if size > self.max_bytes:
            return ChainState("unchecked", _too_big(size, self.max_bytes))
        report, end = verify_files([current], head, rotated[-1] if rotated else None)
        if not report.ok:
            return _checked("broken", f"BROKEN at {report.file}:{report.line}: {report.first_error}")
        return _checked("ok", f"{end.records} records, chain intact")

    def _rotated_head(self, key: tuple[tuple[str, int, int, int], ...], rotated: list[Path]) -> ChainHead | ChainState:
        """The head after the rotated files (cached while they are unchanged), or why there is none."""
        if not rotated:
            return ChainHead()
        if self._rotated is not None and self._rotated[0] == key:
            return self._rotated[1]
        total = sum(size for _, _, size, _ in key)
        if total > self.max_bytes:
            return ChainState("unchecked", _too_big(total, self.max_bytes))
        report, head = verify_files(rotated, ChainHead())
        if not report.ok:
            return _checked("broken", f"BROKEN at {report.file}:{report.line}: {report.first_error}")
        self._rotated = (key, head)
        return head


def _checked(state: Literal["ok", "broken"], message: str) -> ChainState:
    checked = time.strftime("%H:%M:%SZ", time.gmtime())
    return ChainState(state, f"{message} (checked at {checked})", time.monotonic())


def _too_big(size: int, limit: int) -> str:
    return f"not checked here: {size} bytes to read (over {limit}); run bastion audit verify"


def _recent(state: ChainState, every_s: float) -> bool:
    return state.checked_at is not None and time.monotonic() - state.checked_at < every_s

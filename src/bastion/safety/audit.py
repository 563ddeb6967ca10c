"""The audit log: append-only, hash-chained JSONL, written before anything runs.

What it guarantees:
    * One JSON object per line (JSON escapes newlines, so a value cannot forge a line,
      CWE-117), string values redacted and capped, each line at most `MAX_RECORD_BYTES`.
    * Each record carries ``prev``, the SHA-256 of the previous line's bytes (without the
      newline), and ``seq``, increasing by one; both continue across rotated files.
    * Each record is on disk (fdatasync) before `AuditLog.append` returns. Any write or
      sync error raises `AuditUnavailable` and the caller must not act (fail-closed); a
      partly written line is truncated away, or the log refuses every later record.
    * Except a record appended with ``durable=False`` (the end record of a call whose start
      record is on disk): it is in the file when `append` returns (write(2) is done: a crash
      of this process keeps it), and on disk once the fdatasync that a flusher thread starts
      at once ends; every later record is written after that sync. Only a crash of the host
      within that sync can lose it, leaving its call's start record without its end, as a
      call cut short by a crash does. A failed sync refuses every later record.
    * Before each write (one per group commit) the open file is checked to still be the
      configured path: same device and inode as an ``lstat`` of the path, a regular file,
      ours, one link. A log deleted, renamed, or replaced by another file or a symlink
      while the server runs refuses every record (and logs one error line) until the
      original is back or the server restarts; no record goes to the moved file.
    * `verify` detects an edited, deleted, inserted or reordered record, a torn line,
      and a missing rotated file. A rotated file must be a regular file with one link that
      no group or other user may write, owned by root or the log's own user (the server's, or
      whoever verifies a copy): one another user put beside the log fails it, and `open`
      continues no chain but its own user's (a FIFO there is refused, never waited on).

What it does not guarantee:
    * Someone who can write the file (root, or this user) can rewrite the whole chain
      consistently, or drop records from the end: only the head hash, anchored outside
      this host, would catch that (future work). The last record is only protected once
      a successor links to it.
    * Redaction is best-effort (see `bastion.safety.redact`).
    * The path check is point-in-time: a rename racing the write itself can still take
      that one batch with it.
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeAlias, cast

import anyio

from bastion.executors import started_pool
from bastion.metrics import Metrics
from bastion.safety.errors import AuditUnavailable
from bastion.safety.paths import sync_folder
from bastion.safety.redact import Redactor, escape_hidden
from bastion.safety.reserve import Reserve

JSONValue: TypeAlias = "str | int | float | bool | list[JSONValue] | dict[str, JSONValue] | None"

MAX_ARG_CHARS: Final = 4096  # per string value in a record
MAX_RECORD_BYTES: Final = 65_536  # per line, newline excluded
MAX_KEY_CHARS: Final = 256
MAX_DEPTH: Final = 32
GENESIS: Final = "0" * 64
CHAIN_FIELDS: Final = frozenset({"id", "seq", "ts", "prev"})

_TYPE_AND_SHARED_WRITE: Final = 0o170000 | 0o022  # S_IFMT (the file type bits), and group and other write
_OPEN_FLAGS: Final = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
_TAIL_READ_BYTES: Final = 64 * 1024
_FS_IOC_GETFLAGS: Final = 0x80086601  # _IOR('f', 1, long), include/uapi/linux/fs.h; the kernel copies an int
_FS_IMMUTABLE_FL: Final = 0x10
NOTHING_DONE: Final = "nothing was done"
_KNOWN_KEYS: Final = 4096  # keys remembered by `AuditLog._key`; past it, new keys are cleaned each time
_KNOWN_TEXTS: Final = 4096  # short string values remembered by `AuditLog._text` (cleared when full)
_SHORT_TEXT_CHARS: Final = 128
_SHRINK_PASSES: Final = 8
MAX_CLEANED_CHARS: Final = 4 * MAX_RECORD_BYTES
"""What one record's cleaning redacts at most (strings, and `_ENTRY_COST` per entry): a refused call's raw
arguments are the client's, and 2,000 strings of 4 KiB took seconds of redaction on the event loop before
`_shrink` cut them to the line's size anyway. Past it, the rest is counted, not cleaned."""
_ENTRY_COST: Final = 8
_OVER_BUDGET: Final = "the record is over its size"
_OVER_BUDGET_KEY: Final = "…"
_KEEP_SHORT_CHARS: Final = 128  # strings this short are kept whole by `_shrink`
_REDACTED_CREDENTIAL: Final = "[REDACTED:credential]"
INLINE_SYNC_MAX_S: Final = 0.001
"""A lone record is written on the event loop only while fdatasync takes less than this (a thread hop
costs ~0.1 ms). A slower disk (14 ms measured on a loaded host) would stall every other request for
that long: 32 HTTP clients then got ~70 calls/s, each call "alone" because the others were still
waiting in their sockets while the loop was blocked."""

_log = logging.getLogger("bastion.audit")
_HOP_THREAD: Final = "bastion-audit"


class Verbatim(str):
    """A string the server made itself, such as a call's random id: written as is, not redacted.

    It cannot hold a secret, and each one is new, so redaction's cache never held it: redacting it cost
    ~7 us a call. Client input is never one (JSON decodes to `str`). Longer than `MAX_ARG_CHARS`, it is
    cleaned as any string.
    """

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What `verify` found: ``ok`` and the number of good records, or the first error and where."""

    ok: bool
    records: int
    first_error: str | None = None
    file: str | None = None
    line: int | None = None


_IDS_PER_READ: Final = 64
# A UUID's version 4 and variant bits (RFC 9562 §5.4): the bits each id keeps from the random bytes, and those set.
_ID_KEEP: Final = int.from_bytes(bytes.fromhex("ffffffffffff0fff3fffffffffffffff") * _IDS_PER_READ)
_ID_SET: Final = int.from_bytes(bytes.fromhex("00000000000040008000000000000000") * _IDS_PER_READ)
_ids: Iterator[str] = iter(())


def _record_id() -> str:
    """A random UUID (version 4) as 32 hex digits, as uuid.uuid4().hex.

    Taken from ids made `_IDS_PER_READ` at a time from one read of the kernel's random source: a getrandom(2)
    per record cost ~0.8 us here. Thread-safe as long as the GIL makes `next` on a list iterator atomic (two
    threads finding the pool empty each make their own); a forked child drops the parent's pool.
    """
    global _ids
    made = next(_ids, None)
    if made is None:
        raw = int.from_bytes(os.urandom(16 * _IDS_PER_READ)) & _ID_KEEP | _ID_SET
        text = raw.to_bytes(16 * _IDS_PER_READ).hex()
        _ids = iter([text[at : at + 32] for at in range(32, len(text), 32)])
        made = text[:32]
    return made


def _forget_ids() -> None:
    global _ids
    _ids = iter(())


os.register_at_fork(after_in_child=_forget_ids)


class _RotationDeferred(Exception):
    """A rotation that changed nothing, or moved the full file but could not open the new one yet."""


@dataclass(slots=True)
class _Pending:
    body: dict[str, JSONValue]
    durable: bool = True
    id: str = field(default_factory=_record_id)
    done: bool = False
    error: str | None = None
    size: int = 0
    """The line's bytes in the file, its newline included, once written."""


@dataclass(slots=True, eq=False)
class _AsyncPending:
    pending: _Pending
    event: anyio.Event = field(default_factory=anyio.Event)
    cause: str | None = None
    finished: bool = False
    lead: bool = False


class AuditLog:
    """An append-only, hash-chained, fsynced audit log.

    Args:
        path: the log file; its directory must exist and should be writable only by us.
        redactor: applied to every string in a record (keys included).
        rotate_bytes: a file that would grow past this is renamed ``<name>.<N>``.
        reserve_bytes: kept allocated past the file's end (`reserve.py`): records still have room
            for a while when the state filesystem fills up.
        fail_closed: when False (dangerous, for development only) a record that could not
            be written is logged as a warning to ``bastion.audit`` instead of raising.
        metrics: where each append's latency and each failed record are counted.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        redactor: Redactor,
        rotate_bytes: int = 64 * 1024 * 1024,
        reserve_bytes: int = 0,
        fail_closed: bool = True,
        metrics: Metrics | None = None,
    ) -> None:
        self._path = Path(path)
        self._path_text = str(self._path)  # os.lstat of a Path costs two Python calls (__fspath__, __str__)
        self._metrics = metrics
        self._redactor = redactor
        self._keys: dict[str, tuple[str, bool]] = {}
        """Key -> (cleaned key, whether it names a secret): records repeat the same few keys."""
        self._plain_keys: dict[str, str] = {}
        """The keys of `_keys` that name no secret -> their cleaned form: one lookup for most fields."""
        self._texts: dict[str, str] = {}
        self._rotate_bytes = rotate_bytes
        self._reserve = Reserve(min(reserve_bytes, rotate_bytes))
        self._fail_closed = fail_closed
        self._fd: int | None = None
        self._ident = (0, 0)  # (st_dev, st_ino) of the open file: an fd's inode never changes
        self._euid = -1
        self._offset = 0
        self._prev = GENESIS
        self._seq = 0
        self._broken: str | None = "audit log is not open"
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        """`with self._lock` where nothing waits: `Condition.__enter__` is a Python call around the same lock."""
        self._waiting = 0
        """Threads in `_wait`: a batch's end wakes them, and calls nothing when there are none."""
        self._queue: list[_Pending] = []
        self._writing = False
        # Async group commit: one event loop's waiters, and whether one of them is leading.
        self._async_queue: list[_AsyncPending] = []
        self._async_leading = False
        self._last_sync_s = 0.0
        """How long the last fdatasync took: decides whether a lone async record is written inline."""
        self.syncs = 0
        """fdatasync calls that made records durable so far: records / syncs is what group commit shares."""
        self._owed = False
        """Records were written (``durable=False``) and no fdatasync has covered them yet."""
        self._flusher: threading.Thread | None = None
        self._hop: concurrent.futures.ThreadPoolExecutor | None = None
        """Where `append_async` writes a batch (made at the first one, shut down at `close`)."""
        # The last "the file is not the configured path" problem logged, so a flood of refused calls logs it once.
        self._stale: str | None = None
        self._deferred: str | None = None
        """Why the last rotation could not finish (no fd left...): records are refused and the next batch
        tries again (`_RotationDeferred`); logged once while it stays the same."""
        self._moved_away = False
        """A rotation moved the full file away and the new one is not open (or its name not durable) yet."""

    @property
    def path(self) -> Path:
        return self._path

    def open(self) -> None:
        """Open the log and continue its chain.

        Raises:
            AuditUnavailable: the file cannot be opened, is a symlink or not a regular file,
                has another owner or link, is writable by others, or ends in a torn line.
        """
        with self._cond:
            self._close_fd()
            self._fd = _open_log(self._path, exclusive=False)
            self._euid = os.geteuid()  # what `_open_log` found the file's owner to be
            try:
                st = os.fstat(self._fd)
                size, self._ident = st.st_size, (st.st_dev, st.st_ino)
                self._prev, self._seq = _chain_head(self._path, self._fd, size)
                self._start_threads()
            except BaseException:
                self._close_fd()
                raise
            self._offset = size
            self._broken = self._deferred = None
            self._moved_away = False
            self._reserve.forget()
            self._reserve.top_up(self._fd, size)

    def _start_threads(self) -> None:
        """Start the writer's thread (`_hop`) and the flusher's with the log, `_cond` held (the flusher waits for it
        before it looks at `_flusher`).

        Found by attack (the server's cgroup at its pids limit): started at their first use, a host out of threads
        then broke the log for good (every later call AUDIT_UNAVAILABLE, after the limit was lifted too), or left
        a batch queued in an executor with no thread, written a second later for calls answered as failed.

        Raises:
            AuditUnavailable: a thread cannot be started.
        """
        try:
            if self._hop is None:
                self._hop = started_pool(1, _HOP_THREAD)
            if self._flusher is None:
                flusher = threading.Thread(target=self._flush_forever, name="bastion-audit-flush", daemon=True)
                flusher.start()
                self._flusher = flusher
        except RuntimeError as exc:
            raise AuditUnavailable(
                f"audit log {self._path}: its threads cannot be started ({exc}): the host is out of threads"
            ) from None

    def close(self) -> None:
        """Close the file (after syncing what was written); later appends raise until `open` is called again."""
        with self._cond:
            while self._writing:
                self._wait()
            self._close_fd()
            self._broken = "audit log is not open"
            flusher, self._flusher = self._flusher, None
            hop, self._hop = self._hop, None
            self._cond.notify_all()
        if flusher is not None and flusher is not threading.current_thread():
            flusher.join()
        if hop is not None:
            # Idle (`_writing` is over): its thread ends now, and a batch queued meanwhile finds the log closed.
            hop.shutdown(wait=not threading.current_thread().name.startswith(_HOP_THREAD))

    def append(
        self,
        record: Mapping[str, object],
        *,
        ran: bool = False,
        durable: bool = True,
        on_written: Callable[[int], object] | None = None,
    ) -> str:
        """Write one record durably and return its id.

        String values are redacted and capped at `MAX_ARG_CHARS`; values of keys naming a
        secret (``password``, ``*_TOKEN``...) are replaced whole.

        Args:
            record: the fields to write; the chain fields are added here.
            ran: the record follows an operation that already ran (an ``end`` record): a
                failure then says so, instead of "nothing was done".
            durable: False returns once the record is written, not synced (module docstring):
                only for a record that follows a durable one of the same call.
            on_written: called with the bytes the record took in the file, once it is written (never
                for a record that failed), in the caller's thread: what a caller's budget is charged.

        Raises:
            AuditUnavailable: the record is not on disk; the caller must not act.
            ValueError: the record uses a reserved key (id, seq, ts, prev).
        """
        if self._metrics is None:
            return self._append(record, ran=ran, durable=durable, on_written=on_written)
        started = time.perf_counter()
        try:
            return self._append(record, ran=ran, durable=durable, on_written=on_written)
        finally:
            self._metrics.audit_append(started)

    def _append(
        self, record: Mapping[str, object], *, ran: bool, durable: bool, on_written: Callable[[int], object] | None
    ) -> str:
        pending = self._prepare(record, durable)
        self._commit([pending])
        return self._result(pending, ran=ran, on_written=on_written)

    async def append_async(
        self,
        record: Mapping[str, object],
        *,
        alone: bool = False,
        ran: bool = False,
        durable: bool = True,
        on_written: Callable[[int], object] | None = None,
    ) -> str:
        """`append` off the event loop, with group commit (``ran``, ``durable`` and ``on_written`` as for `append`).

        With ``alone=True`` (the caller knows no other call is in flight), no batch
        being written and a disk whose last fdatasync took under `INLINE_SYNC_MAX_S`, the
        record is written inline: there is nothing to group it with, and a thread hop costs
        more than the fdatasync it would hide. On a slower disk it goes to the thread, so
        requests that have not reached the call runner yet are served meanwhile.

        Records that arrive while a batch is being written form the next batch: one
        worker thread writes it with one fdatasync, then wakes every waiter (records are cleaned
        on the event loop first).
        Use one event loop per `AuditLog`. A caller cancelled once its record is queued gets the
        cancellation after the record is written (or has failed).
        """
        started = time.perf_counter()
        try:
            return await self._append_async(record, alone=alone, ran=ran, durable=durable, on_written=on_written)
        finally:
            if self._metrics is not None:
                self._metrics.audit_append(started)

    async def _append_async(
        self,
        record: Mapping[str, object],
        *,
        alone: bool,
        ran: bool,
        durable: bool,
        on_written: Callable[[int], object] | None,
    ) -> str:
        if alone and not self._async_leading and self._last_sync_s < INLINE_SYNC_MAX_S:
            return self._append(record, ran=ran, durable=durable, on_written=on_written)
        # Cleaned here, on the loop: on the worker, each record's uuid4 (getrandom releases the GIL) made
        # the worker take the GIL back once more, and every such hand-over stalls the loop (convoy effect).
        waiter = _AsyncPending(self._prepare(record, durable))
        self._async_queue.append(waiter)
        if not self._async_leading:
            self._async_leading = waiter.lead = True
        # Shielded: a queued record is written (or fails) before its caller's cancellation goes on, so
        # the caller's call is recorded as far as it went. A caller cancelled while waiting would leave
        # its record queued with nobody to lead it, and a finished leader handing it the lead would leave
        # every later record, so every later call, waiting for ever.
        with anyio.CancelScope(shield=True):
            try:
                while not waiter.lead:
                    await waiter.event.wait()
                    if waiter.finished:
                        break
                if not waiter.finished:
                    await self._lead_async()
            except BaseException:
                if waiter.lead and not waiter.finished:
                    self._pass_lead(exclude=waiter)
                raise
        if waiter.cause is not None:
            self._count_failure()
            raise AuditUnavailable(_failure(waiter.cause, ran=ran))
        return self._result(waiter.pending, ran=ran, on_written=on_written)

    async def _lead_async(self) -> None:
        batch, self._async_queue = self._async_queue, []
        try:
            # A thread of the log's own (`_start_threads`), not anyio's worker pool: its capacity limiter and
            # queue, shared with every other to_thread call, cost 0.07x to 0.18x of HTTP throughput in the SSE era.
            if self._hop is not None:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._hop, self._commit, [waiter.pending for waiter in batch])
        except RuntimeError:  # shut down by a `close` meanwhile: the batch is refused below
            pass
        finally:
            for waiter in batch:
                if not waiter.pending.done:
                    waiter.cause = "audit log unavailable: the write was interrupted"
                waiter.finished = True
                waiter.event.set()
            self._pass_lead(exclude=None)

    def _pass_lead(self, exclude: _AsyncPending | None) -> None:
        for waiter in self._async_queue:
            if waiter is not exclude:
                waiter.lead = True
                waiter.event.set()
                return
        self._async_leading = False

    def _prepare(self, record: Mapping[str, object], durable: bool = True) -> _Pending:
        if not CHAIN_FIELDS.isdisjoint(record):
            reserved = sorted(CHAIN_FIELDS.intersection(record))
            raise ValueError(f"audit record uses reserved keys {reserved}: rename them")
        return _Pending(self._clean_mapping(record, 0, [MAX_CLEANED_CHARS]), durable)

    def _result(self, pending: _Pending, *, ran: bool, on_written: Callable[[int], object] | None = None) -> str:
        if pending.error is None:
            if on_written is not None:
                on_written(pending.size)
            return pending.id
        self._count_failure()
        if self._fail_closed:
            raise AuditUnavailable(_failure(pending.error, ran=ran))
        _log.warning("%s (fail_closed is off: continuing)", pending.error)
        return pending.id

    def _count_failure(self) -> None:
        if self._metrics is not None:
            self._metrics.audit_failure()

    def problem(self) -> str | None:
        """Why a record written now would be refused (broken, closed, moved or replaced), or None.

        Point-in-time: the file can change right after. Takes no lock: a batch being written is not
        waited for (a readiness probe must not queue behind a slow disk).
        """
        broken, fd = self._broken, self._fd
        if broken is not None or fd is None:
            return broken or self._deferred or "audit log is not open"
        return _path_problem(self._path, self._ident)

    # -- cleaning -------------------------------------------------------------

    def _key(self, key: object) -> tuple[str, bool]:
        text = str(key)
        known = self._keys.get(text)
        if known is None:
            known = self._cap(text, MAX_KEY_CHARS), self._redactor.is_sensitive_key(text)
            # Exact strings only: a subclass's own __eq__ and __hash__ could make it another key's entry.
            if len(self._keys) < _KNOWN_KEYS and type(text) is str:
                self._keys[text] = known
                if not known[1]:
                    self._plain_keys[text] = known[0]
        return known

    def _cap(self, text: str, limit: int) -> str:
        kept, cut = self._redactor.redact_then_truncate(text, limit)
        return f"{kept}…[truncated {len(text) - len(kept)} chars]" if cut else kept

    def _text(self, text: str) -> str:
        """A string value redacted and capped; records repeat the same short strings (tool names, paths)."""
        known = self._texts.get(text)
        if known is None:
            known = self._cap(text, MAX_ARG_CHARS)
            if len(text) <= _SHORT_TEXT_CHARS and type(text) is str:  # exact strings only, as in `_key`
                if len(self._texts) >= _KNOWN_TEXTS:
                    self._texts.clear()  # bounded, and holds recent strings rather than the first ones for ever
                self._texts[text] = known
        return known

    def _clean_mapping(self, mapping: Mapping[Any, object], depth: int, budget: list[int]) -> dict[str, JSONValue]:
        # A record is mostly known keys, short strings seen before and numbers: those are handled here, without a
        # call per field (an append costs several times its hot price right after the previous record's sync, so
        # every line here counts). The record's own fields (depth 0: the tool, the caller, the result code) are
        # always cleaned whole; what they hold (a call's arguments) shares the record's budget, kept in `left`
        # and handed over in `budget` around each nested call.
        plain, texts, top = self._plain_keys, self._texts, depth == 0
        cleaned: dict[str, JSONValue] = {}
        renamed: dict[str, int] | None = None
        left = budget[0]
        for key, value in mapping.items():
            left -= _ENTRY_COST
            if left < 0 and not top:
                # Each entry so far added one name to `cleaned`.
                cleaned[_OVER_BUDGET_KEY] = f"[{len(mapping) - len(cleaned)} more entries not recorded: {_OVER_BUDGET}]"
                break
            name = plain.get(key) if type(key) is str else None  # exact strings only, as in `_key`
            if name is None:
                name, secret = self._key(key)
                if name in cleaned:  # two keys alike once capped or redacted: the second value is kept too
                    renamed = renamed if renamed is not None else {}
                    name = _unused_key(name, cleaned, renamed)
                if secret and isinstance(key, str) and value is not None and type(value) is not bool:
                    cleaned[name] = _REDACTED_CREDENTIAL
                    continue
            elif name in cleaned:
                renamed = renamed if renamed is not None else {}
                name = _unused_key(name, cleaned, renamed)
            if type(value) is str:
                # Within the budget here (or a field of the record itself): cleaned whole.
                text = texts.get(value)
                if text is None:
                    text = self._text(value)
                cleaned[name] = text
                left -= len(text)
            elif value is None or type(value) is int or type(value) is bool:
                cleaned[name] = value
            elif type(value) is float:
                cleaned[name] = value if math.isfinite(value) else str(value)  # JSON has no NaN (RFC 8259 §6)
            else:
                budget[0] = left
                if type(value) is list and depth < MAX_DEPTH:  # `_clean`'s answer, one call sooner
                    cleaned[name] = self._clean_items(value, depth + 1, budget)
                else:
                    cleaned[name] = self._clean(value, depth, budget)
                left = budget[0]
        budget[0] = left
        return cleaned

    def _clean(self, value: object, depth: int, budget: list[int]) -> JSONValue:
        # The common cases first, by exact type: `type(x) is T` (which mypy narrows) costs no `cast` call.
        if type(value) is str:
            return self._budgeted_text(value, budget)
        if value is None or type(value) is int or type(value) is bool:
            return value
        if type(value) is float:
            return value if math.isfinite(value) else str(value)
        if type(value) is Verbatim and len(value) <= MAX_ARG_CHARS:
            budget[0] -= len(value)
            return str(value)
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else str(value)
        if depth >= MAX_DEPTH:
            return "[nested too deep]"
        if type(value) is list or type(value) is tuple:  # before `Mapping`, an ABC: isinstance is slow on it
            return self._clean_items(value, depth + 1, budget)
        if isinstance(value, Mapping):
            return self._clean_mapping(value, depth + 1, budget)
        if isinstance(value, list | tuple | set | frozenset):
            return self._clean_items(value, depth + 1, budget)
        if isinstance(value, bytes | bytearray):
            value = bytes(value).decode("utf-8", "backslashreplace")
        return self._budgeted_text(str(value), budget)

    def _clean_items(
        self, values: Sequence[object] | set[object] | frozenset[object], depth: int, budget: list[int]
    ) -> list[JSONValue]:
        """The items of a list, tuple or set at `depth`; short strings seen before without a call, as in
        `_clean_mapping`."""
        texts = self._texts
        items: list[JSONValue] = []
        left = budget[0]
        for item in values:
            left -= _ENTRY_COST
            if left < 0:
                items.append(f"[{len(values) - len(items)} more items not recorded: {_OVER_BUDGET}]")
                break
            if type(item) is str:
                text = texts.get(item)
                if text is None:
                    text = self._text(item)
                items.append(text)
                left -= len(text)
            else:
                budget[0] = left
                items.append(self._clean(item, depth, budget))
                left = budget[0]
        budget[0] = left
        return items

    def _budgeted_text(self, text: str, budget: list[int]) -> str:
        if budget[0] < 0:
            return f"[{len(text)} characters not recorded: {_OVER_BUDGET}]"
        cleaned = self._text(text)
        budget[0] -= len(cleaned)
        return cleaned

    # -- writing --------------------------------------------------------------

    def _commit(self, pendings: list[_Pending]) -> None:
        """Return once every pending record is written and synced, or has failed."""
        with self._lock:
            if self._writing:
                self._queue.extend(pendings)
                while self._writing and not all(p.done for p in pendings):
                    self._wait()
                if all(p.done for p in pendings):
                    return
                batch = self._queue
            else:  # a lone record, as a single writer's always is: no copy of the queue
                batch = self._queue + pendings if self._queue else pendings
            # Leader: everything queued so far shares one write and one sync.
            self._writing = True
            self._queue = []
        try:
            self._write_batch(batch)
        except Exception as exc:
            # Never leave a waiter without an answer.
            self._broken = f"audit log broken: {exc}"
            _log.exception("audit log write failed")
            _finish([p for p in batch if not p.done], self._broken)
        finally:
            with self._lock:
                self._writing = False
                if self._waiting:  # `_wake`, inline
                    self._cond.notify_all()

    def _wait(self) -> None:
        """`_cond.wait()` (the lock held), counted in `_waiting`."""
        self._waiting += 1
        try:
            self._cond.wait()
        finally:
            self._waiting -= 1

    def _wake(self) -> None:
        """Wake every thread in `_wait` (the lock held)."""
        if self._waiting:
            self._cond.notify_all()

    def _write_batch(self, batch: list[_Pending]) -> None:
        todo = batch
        if self._moved_away and self._broken is None:
            try:
                self._open_next(None)
            except _RotationDeferred as exc:
                self._defer(str(exc))
                _finish(todo, self._deferred)
                return
        while todo:
            if self._broken is not None or self._fd is None:
                _finish(todo, self._broken or "audit log is not open")
                return
            moved = self._moved(self._fd)
            if moved is not None:
                _finish(todo, moved)
                return
            lines: list[bytes] = []
            prev, seq, size = self._prev, self._seq, 0
            room = self._rotate_bytes - self._offset  # what this file may still grow by
            sync = False
            for p in todo:
                body = p.body  # the record's own dict (`_prepare`): the chain fields go in, set anew on a retry
                body["id"], body["seq"], body["ts"], body["prev"] = p.id, seq, _now(), prev
                line = _dumps(body)
                if len(line) > MAX_RECORD_BYTES:
                    line = _shrink(body)
                if size + len(line) + 1 > room and self._offset + size > 0:
                    break
                lines.append(line)
                p.size = len(line) + 1
                sync = sync or p.durable
                prev, seq, size = hashlib.sha256(line).hexdigest(), seq + 1, size + len(line) + 1
            if len(lines) == len(todo):
                segment, todo = todo, []
            else:
                segment, todo = todo[: len(lines)], todo[len(lines) :]
            if segment:
                error = self._write(b"\n".join(lines) + b"\n", sync=sync)
                if error is not None:
                    _finish(segment + todo, error)
                    return
                self._prev, self._seq, self._offset = prev, seq, self._offset + size
                for p in segment:
                    p.done = True  # written, with no error
                if self._reserve.size:
                    self._reserve.top_up(self._fd, self._offset)
            if todo:
                try:
                    self._rotate()
                except _RotationDeferred as exc:
                    self._defer(str(exc))
                    _finish(todo, self._deferred)
                    return
                except (OSError, AuditUnavailable) as exc:
                    reason = exc.strerror if isinstance(exc, OSError) else exc.reason
                    self._broken = f"audit log rotation failed: {reason or exc}"
                    _log.error("%s", self._broken)

    def _defer(self, cause: str) -> None:
        """A rotation that could not finish: its records are refused, and the next batch tries again."""
        problem = f"audit log rotation unfinished: {cause}; nothing was lost, and the next record tries again"
        if problem != self._deferred:
            _log.error("%s", problem)
        self._deferred = problem

    def _write(self, data: bytes, *, sync: bool) -> str | None:
        """Write `data`, and sync it (or leave the sync to the flusher); on failure undo it and return the
        error line."""
        fd = self._fd
        assert fd is not None
        try:
            written = os.write(fd, data)
            if written != len(data):
                _write_rest(fd, memoryview(data), written)
            if sync:
                self._sync(fd)
        except OSError as exc:
            message = f"audit log unavailable: {exc.strerror or exc}"
            if exc.errno == errno.EPERM and _immutable(fd):
                message = f"audit log unavailable: {self._path} is immutable (chattr +i): run `chattr -i` on it"
            self._undo(fd)
            return message
        if not sync:
            self._owe()
        return None

    def _sync(self, fd: int) -> None:
        started = time.perf_counter()
        os.fdatasync(fd)  # also makes durable what earlier unsynced writes left (`_owed`)
        self._last_sync_s = time.perf_counter() - started
        self.syncs += 1
        self._owed = False

    def _owe(self) -> None:
        """Records are written but not synced: the flusher (`_start_threads`) syncs them once `_writing` is over
        (called with it held; its end wakes the flusher)."""
        self._owed = True

    def _flush_forever(self) -> None:
        """The flusher: syncs written records as soon as no batch is being written, until `close`."""
        me = threading.current_thread()
        with self._cond:
            while self._flusher is me:
                if not self._owed or self._writing or self._fd is None:
                    self._wait()
                    continue
                self._writing = True
                fd = self._fd
                self._cond.release()
                try:
                    self._flush(fd)
                finally:
                    self._cond.acquire()
                    self._writing = False
                    self._wake()

    def _flush(self, fd: int) -> None:
        try:
            self._sync(fd)
        except OSError as exc:
            # The records are in the file but may never reach the disk: refuse every later one.
            self._owed = False
            self._broken = f"audit log broken: records written could not be synced ({exc.strerror or exc})"
            _log.error("%s: reopen after checking the disk holding %s", self._broken, self._path)

    def _undo(self, fd: int) -> None:
        """Cut a partly written line so the next record links to the last durable one."""
        try:
            if os.fstat(fd).st_size != self._offset:
                os.ftruncate(fd, self._offset)
                os.fsync(fd)
                self._reserve.forget()  # the cut freed what was allocated past the end
        except OSError as exc:
            self._broken = f"audit log broken: a partial record could not be removed ({exc.strerror or exc})"
            _log.error("%s: reopen after repairing %s", self._broken, self._path)

    def _moved(self, fd: int) -> str | None:
        """Why the open file is no longer the configured path (deleted, renamed, replaced), or None.

        Logs the problem once (until it changes), with where the records written so far are.
        """
        if self._stale is None:
            # What `_path_problem` asks, as one test of the common answer: the path names the open file (so a
            # regular file, not a symlink), with one link, ours, and writable by no group or other user. "Ours" is
            # the user that opened it (a geteuid(2) per record cost 0.3 us; the server never changes its uid).
            try:
                lst = os.lstat(self._path_text)
            except OSError:
                pass
            else:
                if (
                    (lst.st_dev, lst.st_ino) == self._ident
                    and lst.st_mode & _TYPE_AND_SHARED_WRITE == stat.S_IFREG
                    and lst.st_nlink == 1
                    and lst.st_uid == self._euid
                ):
                    return None
        problem = _path_problem(self._path, self._ident)
        if problem is not None and problem != self._stale:
            _log.error(
                "%s; records are refused until then (those written so far stay readable at /proc/%d/fd/%d)",
                problem,
                os.getpid(),
                fd,
            )
        elif problem is None and self._stale is not None:
            _log.warning("audit log %s is the open file again: records are accepted", self._path)
        self._stale = problem
        return problem

    def _rotate(self) -> None:
        """Rename the full file `<name>.<N>` and start an empty one. Found by attack: a rotation at the
        process's open-file limit failed opening the folder to sync it, after the move, and broke the log
        until a restart. The folder is opened before anything changes, and a new file that cannot be
        opened yet is opened by a later batch (`_RotationDeferred`)."""
        fd = self._fd
        assert fd is not None
        if self._owed:
            self._sync(fd)  # the rotated file is complete on disk before the new one starts
        try:
            # Listed first, the folder opened next: each needs an fd, one after the other. A listing that
            # failed was taken for an empty folder, and the link then met the first rotated file (found by
            # review: at exactly one free fd, EEXIST broke the log for good).
            index = max(_rotated(self._path, strict=True), default=0) + 1
            folder = os.open(self._path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise _RotationDeferred(exc.strerror or str(exc)) from None
        try:
            rotated = self._path.with_name(f"{self._path.name}.{index}")
            st, lst = os.fstat(fd), os.lstat(self._path)
            if (st.st_dev, st.st_ino) != (lst.st_dev, lst.st_ino):
                raise OSError(errno.ESTALE, f"{self._path} was replaced by another file")
            os.ftruncate(fd, self._offset)  # a rotated file keeps no reserve (its size does not change)
            self._reserve.forget()
            # link() fails with EEXIST, so an existing rotated file is never overwritten.
            os.link(self._path, rotated, follow_symlinks=False)
            os.unlink(self._path)
            self._moved_away = True
            self._close_fd()
            self._open_next(folder)
        finally:
            os.close(folder)

    def _open_next(self, folder: int | None) -> None:
        """Open the new, empty file once the full one has moved away, and make its name durable (through
        `folder` if open already).

        Raises:
            _RotationDeferred: it cannot be opened or its folder synced now (no fd left, no room...).
        """
        if self._fd is None:
            try:
                self._fd = _open_log(self._path, exclusive=True)
            except AuditUnavailable as exc:
                raise _RotationDeferred(exc.reason) from None
            new = os.fstat(self._fd)
            self._ident, self._offset = (new.st_dev, new.st_ino), 0
        try:
            if folder is None:
                sync_folder(self._path.parent)
            else:
                os.fsync(folder)
        except OSError as exc:
            raise _RotationDeferred(f"its folder could not be synced ({exc.strerror or exc})") from None
        self._moved_away = False
        if self._deferred is not None:
            _log.warning("audit log %s: the rotation finished, records are accepted again", self._path)
            self._deferred = None
        self._reserve.top_up(self._fd, 0)

    def _close_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            if self._owed:
                self._flush(fd)
            os.close(fd)


def _write_rest(fd: int, view: memoryview, written: int) -> None:
    """Write what a short write left of `view` (`written` bytes of it are written).

    Raises:
        OSError: a write failed or wrote nothing.
    """
    while True:
        if written <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[written:]
        if not view:
            return
        written = os.write(fd, view)


def _unused_key(name: str, taken: Mapping[str, object], last: dict[str, int]) -> str:
    """`name#2`, `name#3`... the first free one; `last` remembers where each name's count is, so thousands
    of keys alike cost one step each, not a search from #2 each."""
    number = last.get(name, 1) + 1
    while f"{name}#{number}" in taken:
        number += 1
    last[name] = number
    return f"{name}#{number}"


def _failure(cause: str, *, ran: bool) -> str:
    """The one line a caller gets when its record is not on disk."""
    if ran:
        return (
            f"the operation ran, but its end record could not be written ({cause}); "
            "the audit log is unavailable until that is fixed"
        )
    return f"{cause}; {NOTHING_DONE}"


def _immutable(fd: int) -> bool:
    """Whether the file has the immutable attribute (chattr +i): every write then fails with EPERM."""
    flags = array.array("i", [0])
    try:
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags)
    except OSError:  # a filesystem without attributes: not immutable
        return False
    return bool(flags[0] & _FS_IMMUTABLE_FL)


def _path_problem(path: Path, ident: tuple[int, int]) -> str | None:
    """Why the open file (`ident`: its device and inode) is no longer a safe log at `path`, or None.

    One lstat: when it names the open file, its owner, links and mode are the open file's.
    """
    fix = "put the original file back or restart the server"
    try:
        lst = os.lstat(path)
    except FileNotFoundError:
        return f"audit log unavailable: {path} was deleted or renamed while the server ran: {fix}"
    except OSError as exc:
        return f"audit log unavailable: {path} cannot be examined ({exc.strerror or exc}): {fix}"
    if stat.S_ISLNK(lst.st_mode):
        return f"audit log unavailable: {path} was replaced by a symlink while the server ran: {fix}"
    if (lst.st_dev, lst.st_ino) != ident:
        return f"audit log unavailable: {path} was replaced by another file while the server ran: {fix}"
    problem = file_problem(path, lst)
    return None if problem is None else f"audit log unavailable: {problem}"


def _finish(pendings: list[_Pending], error: str | None) -> None:
    for p in pendings:
        p.error = error
        p.done = True


_second: tuple[int, str] = (-1, "")
"""The last second `_now` formatted, and its text: records come many to a second."""
_MILLISECONDS: Final = tuple(f".{ms:03d}Z" for ms in range(1000))  # an f-string with a format spec costs 0.2 us


def _now() -> str:
    """UTC now as 2026-12-04T23:10:00.123Z (ISO 8601, milliseconds)."""
    global _second
    seconds, fraction = divmod(time.time_ns() // 1_000_000, 1000)
    second = _second  # one read: another thread may replace it meanwhile (a tuple, never half-written)
    if second[0] != seconds:
        second = _second = (seconds, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)))
    return second[1] + _MILLISECONDS[fraction]


# One encoder for every record: json.dumps with options builds a new one per call.
_ENCODER: Final = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _no_default(value: object) -> object:
    raise TypeError(f"{type(value).__name__} is not JSON: records are cleaned first")


def _c_encoder() -> Callable[[object, int], Sequence[str]] | None:
    """`_ENCODER`'s C scanner, made once: `JSONEncoder.encode` makes it again at every call (a fifth of
    encoding a record). No circular-reference check (markers None): a cleaned record is a tree of
    fresh dicts and lists. None where the C module is missing."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    encoder = make(None, _no_default, json.encoder.encode_basestring, None, ":", ",", True, False, False)
    return cast(Callable[[object, int], Sequence[str]], encoder)


_C_ENCODER: Final = _c_encoder()


def _dumps(obj: dict[str, JSONValue]) -> bytes:
    text = "".join(_C_ENCODER(obj, 0)) if _C_ENCODER is not None else _ENCODER.encode(obj)
    # An agent's 8-bit CSI or bidi override would act on the terminal of whoever reads the log with cat or jq:
    # written as JSON escapes, the same strings to a reader. A lone surrogate cannot be UTF-8: an escape too.
    if not text.isascii():  # as `escape_hidden` asks first, without the call for most records
        text = escape_hidden(text)
    return text.encode("utf-8", "backslashreplace")


def _shrink(obj: dict[str, JSONValue]) -> bytes:
    """Cut the long strings until the line fits; drop the body as a last resort.

    Each pass cuts every string over `_KEEP_SHORT_CHARS` by the share the line is over, so a few passes (one
    encode each) do it. Halving the longest string alone, one encode per halving, took 256 encodes of a record
    of 2,000 strings (8 MB of arguments to a tool that does not exist): 17 s of a frozen server.
    """
    body = {k: v for k, v in obj.items() if k not in CHAIN_FIELDS}
    chain = {k: v for k, v in obj.items() if k in CHAIN_FIELDS}
    for _ in range(_SHRINK_PASSES):
        line = _dumps({**body, **chain})
        if len(line) <= MAX_RECORD_BYTES:
            return line
        if not _cut_strings(body, MAX_RECORD_BYTES / len(line) * 0.9):
            break
    keys: list[JSONValue] = [*sorted(body)[:64]]
    note: dict[str, JSONValue] = {"record_too_large": True, "keys": keys}
    return _dumps({**note, **chain})


def _cut_strings(value: dict[str, JSONValue], share: float) -> bool:
    """Cut every string of `value` longer than `_KEEP_SHORT_CHARS` to `share` of its length (at least that
    many characters kept), marking the cut; whether any was cut."""
    cut = False
    stack: list[JSONValue] = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, child in node.items():
                if isinstance(child, str):
                    shorter = _cut(child, share)
                    if shorter is not None:
                        node[key], cut = shorter, True
                elif isinstance(child, dict | list):
                    stack.append(child)
        elif isinstance(node, list):
            for index, child in enumerate(node):
                if isinstance(child, str):
                    shorter = _cut(child, share)
                    if shorter is not None:
                        node[index], cut = shorter, True
                elif isinstance(child, dict | list):
                    stack.append(child)
    return cut


def _cut(text: str, share: float) -> str | None:
    keep = max(_KEEP_SHORT_CHARS, int(len(text) * share))
    return f"{text[:keep]}…[truncated {len(text) - keep} chars]" if keep < len(text) else None


def _open_log(path: Path, *, exclusive: bool) -> int:
    flags = _OPEN_FLAGS | os.O_NONBLOCK | (os.O_EXCL if exclusive else 0)
    try:
        # O_NONBLOCK: opening a FIFO must fail at once (ENXIO), not wait for a reader.
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise AuditUnavailable(f"audit log {path} is a symlink: point the config at the real file") from None
        if exc.errno == errno.ENXIO:
            raise AuditUnavailable(f"audit log {path} is not a regular file: use a plain file") from None
        raise AuditUnavailable(f"audit log {path} cannot be opened: {exc.strerror or exc}") from None
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        st = os.fstat(fd)
        problem = file_problem(path, st)
        if problem is not None and st.st_nlink == 2 and stat.S_ISREG(st.st_mode) and _finish_rotation(path, st):
            os.close(fd)
            return _open_log(path, exclusive=True)
        if problem is not None:
            raise AuditUnavailable(problem)
        if not exclusive and st.st_size == 0:
            sync_folder(path.parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_problem(path: Path, st: os.stat_result) -> str | None:
    """Why an existing audit log file is unsafe to append to (not a plain file, not ours...), or None."""
    if not stat.S_ISREG(st.st_mode):
        return f"audit log {path} is not a regular file: use a plain file"
    if st.st_uid != os.geteuid():
        return f"audit log {path} is owned by uid {st.st_uid}, not {os.geteuid()}: chown it or choose another path"
    if st.st_nlink != 1:
        return f"audit log {path} has {st.st_nlink} hard links: remove the other links"
    if st.st_mode & 0o022:
        return f"audit log {path} is writable by group or others: chmod 600 it"
    return None


def open_problem(path: Path) -> str | None:
    """Why `AuditLog.open` would refuse the log at `path` now, or None; reads only (for `bastion doctor`).

    The same checks, the end of the chain included: found by attack (an upgrade after a crash), the doctor
    said "no FAIL" of a log whose last record a crash had torn, which the server then refused to start on.
    """
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return f"audit log {path} is a symlink: point the config at the real file"
        if not stat.S_ISREG(st.st_mode):
            return file_problem(path, st)  # never opened: a FIFO or a device
        # For writing, as the start opens it (found by review: an immutable log passed a read-only open).
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        # Made at start, going on from the newest rotated file (found by review: a crash between a rotation's
        # unlink and the new file's open leaves only that one, and the start judges it).
        try:
            _chain_head(path, -1, 0)
        except AuditUnavailable as exc:
            return exc.reason
        except OSError as exc:
            return f"audit log {path} cannot be examined: {exc.strerror or exc}"
        return None
    except OSError as exc:
        return f"audit log {path} cannot be opened: {exc.strerror or exc}"
    try:
        st = os.fstat(fd)
        problem = file_problem(path, st)
        rotated = _rotated_as(path, st) if problem is not None and st.st_nlink == 2 else None
        if rotated is not None:  # a start finishes that rotation (`_open_log`) and goes on from that file
            problem = chain_file_problem(rotated, st, frozenset({os.geteuid()}), one_link=False)
        if problem is not None:
            return problem
        _chain_head(path, fd, st.st_size)
    except AuditUnavailable as exc:
        return exc.reason
    except OSError as exc:
        return f"audit log {path} cannot be read: {exc.strerror or exc}"
    finally:
        os.close(fd)
    return None


def _rotated_as(path: Path, st: os.stat_result) -> Path | None:
    """The newest rotated file, if the log `st` is also linked there: a crash between a rotation's link() and
    unlink() leaves it so."""
    newest = max(_rotated(path), default=0)
    if not newest or not stat.S_ISREG(st.st_mode):
        return None
    rotated = path.with_name(f"{path.name}.{newest}")
    try:
        rst = os.lstat(rotated)
    except OSError:
        return None
    return rotated if (rst.st_dev, rst.st_ino) == (st.st_dev, st.st_ino) else None


def _finish_rotation(path: Path, st: os.stat_result) -> bool:
    """A crash between link() and unlink() leaves the log also linked as the newest rotated file."""
    if _rotated_as(path, st) is None:
        return False
    try:
        os.unlink(path)
    except OSError as exc:
        raise AuditUnavailable(f"audit log {path} cannot finish a rotation: {exc.strerror or exc}") from None
    return True


def _chain_head(path: Path, fd: int, size: int) -> tuple[str, int]:
    """The hash of the last line and the next seq, from this file or the newest rotated one (which must pass
    `chain_file_problem` as this process's own: it is found by name)."""
    if size == 0:
        newest = max(_rotated(path), default=0)
        if not newest:
            return GENESIS, 0
        rotated = path.with_name(f"{path.name}.{newest}")
        rfd, problem = _open_regular(rotated, frozenset({os.geteuid()}), one_link=True)
        if rfd is None:
            raise AuditUnavailable(problem)
        try:
            rsize = os.fstat(rfd).st_size
            if rsize == 0:
                raise AuditUnavailable(f"rotated audit log {rotated} is empty: run `bastion audit verify {path}`")
            return _chain_head(rotated, rfd, rsize)
        finally:
            os.close(rfd)
    line = _last_line(path, fd, size)
    try:
        seq = json.loads(line)["seq"]
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise TypeError("seq is not an integer")
    except (ValueError, KeyError, TypeError) as exc:
        raise AuditUnavailable(
            f"audit log {path} ends in an unreadable record ({exc}): run `bastion audit verify {path}`"
        ) from None
    return hashlib.sha256(line).hexdigest(), seq + 1


def _last_line(path: Path, fd: int, size: int) -> bytes:
    if os.pread(fd, 1, size - 1) != b"\n":
        raise AuditUnavailable(
            f"audit log {path} ends in a torn record: run `bastion audit verify {path}` and move the file aside"
        )
    chunks: list[bytes] = []
    pos = size - 1
    while pos > 0:
        step = min(_TAIL_READ_BYTES, pos)
        pos -= step
        chunk = os.pread(fd, step, pos)
        nl = chunk.rfind(b"\n")
        if nl != -1:
            chunks.append(chunk[nl + 1 :])
            break
        chunks.append(chunk)
    return b"".join(reversed(chunks))


def _rotated(path: Path, *, strict: bool = False) -> list[int]:
    """Indexes N of the existing ``<name>.N`` files; none if the folder cannot be listed, unless `strict`.

    Raises:
        OSError: with `strict`, the folder cannot be listed.
    """
    prefix = path.name + "."
    try:
        names = os.listdir(path.parent)
    except OSError:
        if strict:
            raise
        return []
    out = []
    for name in names:
        suffix = name[len(prefix) :]
        if name.startswith(prefix) and suffix.isascii() and suffix.isdigit() and not suffix.startswith("0"):
            out.append(int(suffix))
    return sorted(out)


@dataclass(frozen=True, slots=True)
class ChainHead:
    """Where a verified part of the chain ends: the next record's ``prev`` and ``seq``, and the records so far."""

    prev: str = GENESIS
    seq: int = 0
    records: int = 0


_VERIFY_TRIES: Final = 12
_ROTATION_WAIT_S: Final = 0.005
_ROTATION_WAIT_MAX_S: Final = 0.2
"""A rotation's writer may be off the CPU for long on a loaded host: the waits double up to this (1.3 s in
all); with 10 waits of 5 ms a verify beside a rotating server, 1 run in 3 to 10, said the log was missing."""


def chain_files(path: str | os.PathLike[str]) -> tuple[list[Path], VerifyReport | None]:
    """The files of a log in chain order (``name.1``, ``name.2``, ..., ``name``), or a report of the missing one."""
    base = Path(path)
    indexes = _rotated(base)
    for expected, index in enumerate(indexes, 1):
        if index != expected:
            missing = base.with_name(f"{base.name}.{expected}")
            return [], VerifyReport(False, 0, f"rotated file {missing} is missing", str(missing), None)
    return [base.with_name(f"{base.name}.{i}") for i in indexes] + [base], None


def chain_identities(path: str | os.PathLike[str]) -> tuple[tuple[str, int, int, int], ...]:
    """(name, inode, size, mtime) of the rotated files in order, then the log: what a record, a rotation or an
    edit changes."""
    files, _ = chain_files(path)
    out = []
    for file in files:
        try:
            st = os.lstat(file)
        except OSError:
            continue
        out.append((file.name, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def verify(path: str | os.PathLike[str]) -> VerifyReport:
    """Check the chain of a log and its rotated files (``name.1``, ``name.2``, ..., ``name``).

    Detects edited, deleted, inserted or swapped records, torn lines and missing files;
    not a consistent rewrite of the whole chain, nor records cut from the very end. Safe beside a
    running server: the log is held open once its files are listed, so a rotation (which renames
    that very file) cannot put a newer file after the listed ones; a log caught in the middle of a
    rotation, or that looked broken while a record was being appended, is read again (up to
    `_VERIFY_TRIES` times in all). A rotated file must be root's, the verifier's or the log's owner's
    (`chain_file_problem`): a copy of root's log, or a service user's log verified by root, verifies.
    """
    report = VerifyReport(False, 0, f"{path} kept rotating while it was read: run verify again", str(path), None)
    for attempt in range(_VERIFY_TRIES):
        before = chain_identities(path)
        files, missing = chain_files(path)
        if missing is not None:
            return missing
        fd, problem = _open_regular(files[-1])
        if chain_files(path)[0] != files or _mid_rotation(files, fd):
            if fd is not None:
                os.close(fd)
            elif problem:
                report = VerifyReport(False, 0, problem, str(files[-1]), None)
            # A writer in another thread or process ends its rotation.
            time.sleep(min(_ROTATION_WAIT_S * 2**attempt, _ROTATION_WAIT_MAX_S))
            continue
        if fd is None:
            return VerifyReport(False, 0, problem, str(files[-1]), None)
        # A copy of root's log, or the log of the server's own user, is that user's to verify: rotated files
        # of anyone else were put beside it.
        owners = frozenset({0, os.geteuid(), os.fstat(fd).st_uid})
        report = verify_files(files, ChainHead(), last_fd=fd, owners=owners)[0]
        if report.ok or not _changed_under(report, files, before, chain_identities(path)):
            return report
    return _absent_log(report, path)


def _absent_log(report: VerifyReport, path: str | os.PathLike[str]) -> VerifyReport:
    """A log still absent after every try: say what the rotated files before it hold, and the two causes.

    A server whose rotation could not open the new file (no fd left, no room) leaves the log absent until a
    later record opens it, refusing records meanwhile; a deleted log looks the same from its files. Not ok
    either way: the files cannot tell them apart, but the verdict need not leave the rotated files unread.
    """
    files, missing = chain_files(path)
    if missing is not None or len(files) < 2 or os.path.lexists(files[-1]):
        return report
    rotated, _ = verify_files(files[:-1], ChainHead())
    if not rotated.ok:
        return rotated
    why = (
        f"{files[-1]} is absent; the {len(files) - 1} rotated files before it verify ({rotated.records} records). "
        "Either the server's rotation has not finished (its log says 'audit log rotation unfinished', and it "
        "refuses records until the new file opens) or the log was deleted"
    )
    return VerifyReport(False, rotated.records, why, str(files[-1]), None)


def _changed_under(
    report: VerifyReport,
    files: list[Path],
    before: tuple[tuple[str, int, int, int], ...],
    after: tuple[tuple[str, int, int, int], ...],
) -> bool:
    """Whether the file `report` found broken may have changed while it was read: the log itself (a record
    being appended), or a rotated file (renamed or replaced). A break in a rotated file that stayed as it was
    is final: reading the whole chain again would only take as long again."""
    if report.file == str(files[-1]):
        return after != before
    rotated = len(before) - 1
    return after[:rotated] != before[:rotated]


def _mid_rotation(files: list[Path], fd: int | None) -> bool:
    """Whether the log is between its rotation's link and its new file: absent, or still the last rotated file."""
    if len(files) < 2:
        return False
    if fd is None:
        # Absent when opened, whether or not its new file is there now: the new file may have come between the
        # open and a look now (a verify beside a server rotating fast reported that moment as broken).
        return True
    try:
        last = os.lstat(files[-2])
    except OSError:
        return True
    current = os.fstat(fd)
    return (current.st_dev, current.st_ino) == (last.st_dev, last.st_ino)


def verify_files(
    files: list[Path],
    head: ChainHead,
    previous_file: Path | None = None,
    *,
    last_fd: int | None = None,
    owners: frozenset[int] | None = None,
) -> tuple[VerifyReport, ChainHead]:
    """Check `files` in order as the continuation of a chain verified up to `head` (ending in `previous_file`).
    `last_fd`: the last file, already open (it is closed here). Each file opened here must pass
    `chain_file_problem` for `owners` (by default root and this process's user).

    Returns the report and the head after the last good record.
    """
    prev, seq, records = head.prev, head.seq, head.records
    trusted = owners if owners is not None else frozenset({0, os.geteuid()})
    for index, file in enumerate(files):
        opened = last_fd is not None and index == len(files) - 1
        fd, problem = (last_fd, "") if opened else _open_regular(file, trusted)
        if fd is None:
            return VerifyReport(False, records, problem, str(file), None), ChainHead(prev, seq, records)
        with os.fdopen(fd, "rb") as f:
            for number, raw in enumerate(f, 1):
                error = _check_line(raw, number, prev, seq, previous_file)
                if error is not None:
                    report = VerifyReport(False, records, f"line {number}: {error}", str(file), number)
                    return report, ChainHead(prev, seq, records)
                prev, seq, records = hashlib.sha256(raw[:-1]).hexdigest(), seq + 1, records + 1
        previous_file = file
    return VerifyReport(True, records), ChainHead(prev, seq, records)


def _open_regular(
    file: Path, owners: frozenset[int] | None = None, *, one_link: bool = False
) -> tuple[int | None, str]:
    """A read-only fd on `file` if it is a regular file (never a symlink, a FIFO never waited on), or why not.

    `owners`, `one_link`: judge it as a file of the chain another user must not have made (`chain_file_problem`).
    """
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None, f"{file} is a symlink: the files of an audit log never are"
        return None, f"cannot open {file}: {exc.strerror or exc}"
    st = os.fstat(fd)
    if owners is not None:
        problem = chain_file_problem(file, st, owners, one_link=one_link)
    else:  # before fdopen, which raises on a folder
        problem = None if stat.S_ISREG(st.st_mode) else f"{file} is not a regular file"
    if problem is not None:
        os.close(fd)
        return None, problem
    return fd, ""


def chain_file_problem(file: Path, st: os.stat_result, owners: frozenset[int], *, one_link: bool) -> str | None:
    """Why `file` is not a file of the chain as the server leaves one, or None: a regular file owned by one of
    `owners`, that no group or other user may write, and with `one_link`, with one link (what `file_problem`
    asks of the log; `verify` does not ask it, so a backup made with hard links, as rsnapshot makes them,
    verifies).

    Why: the rotated files are found by name, so whoever can add a name to the log's folder (a sticky one)
    could put a FIFO there (the start hung opening it) or a chain forged from genesis that `verify` passed
    and the server continued. Never "chown it": a file someone else made is evidence, not the log.
    """
    if not stat.S_ISREG(st.st_mode):
        why = "is not a regular file"
    elif st.st_uid not in owners:
        why = f"is owned by uid {st.st_uid}, not {' or '.join(str(uid) for uid in sorted(owners))}"
    elif one_link and st.st_nlink != 1:
        why = f"has {st.st_nlink} hard links"
    elif st.st_mode & 0o022:
        why = "is writable by group or others"
    else:
        return None
    return f"{file} {why} (the server never leaves one so): move it out of the log's folder and find who made it"


def _check_line(raw: bytes, number: int, prev: str, seq: int, previous_file: Path | None) -> str | None:
    if not raw.endswith(b"\n"):
        return "torn record: the last line has no newline (write interrupted or file truncated)"
    try:
        obj = json.loads(raw[:-1])
    except ValueError as exc:
        return f"not valid JSON ({exc})"
    if not isinstance(obj, dict):
        return "not a JSON object"
    if not isinstance(obj.get("prev"), str) or not isinstance(obj.get("id"), str):
        return "missing prev or id field"
    if obj["prev"] != prev:
        if number > 1:
            where = f"line {number - 1}"
        elif previous_file is not None:
            where = f"the last line of {previous_file}"
        else:
            return "prev is not the genesis hash (earlier records or rotated files are missing)"
        return f"prev hash does not match {where} (record edited, deleted or reordered)"
    got = obj.get("seq")
    if not isinstance(got, int) or isinstance(got, bool) or got != seq:
        return f"seq {got!r} where {seq} was expected (records deleted or reordered)"
    return None

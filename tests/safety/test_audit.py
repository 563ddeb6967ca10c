"""The audit log: chain, verification, fail-closed writes (corpus entries A103, A104)."""

from __future__ import annotations

import datetime
import enum
import errno
import functools
import json
import logging
import math
import os
import resource
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import cast

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bastion.safety import audit as audit_mod
from bastion.safety.audit import GENESIS, MAX_ARG_CHARS, MAX_RECORD_BYTES, AuditLog, Verbatim, VerifyReport, verify
from bastion.safety.errors import AuditUnavailable
from bastion.safety.redact import Redactor, escape_hidden
from tests.helpers import least_cpu_s

A104_INPUT = 'ls\n{"decision":"allowed","command":"rm -rf /"}'
AWS_KEY_ID = "AKIAIOSFODNN7EXAMPLE"


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    return tmp_path / "audit.jsonl"


@pytest.fixture
def log(log_path: Path) -> Iterator[AuditLog]:
    audit = AuditLog(log_path, redactor=Redactor())
    audit.open()
    yield audit
    audit.close()


def _write(log: AuditLog, n: int) -> list[str]:
    return [log.append({"action": "run_command", "command": f"echo {i}", "n": i}) for i in range(n)]


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def test_chain_verifies_over_many_records(log: AuditLog, log_path: Path) -> None:
    ids = _write(log, 300)
    report = verify(log_path)
    assert report.ok, report.first_error
    assert report.records == 300
    first, last = json.loads(_lines(log_path)[0]), json.loads(_lines(log_path)[-1])
    assert first["prev"] == GENESIS
    assert first["seq"] == 0
    assert last["seq"] == 299
    assert last["id"] == ids[-1]
    assert len(set(ids)) == 300
    assert first["ts"].endswith("Z")


def test_reopen_continues_the_chain(log: AuditLog, log_path: Path) -> None:
    _write(log, 3)
    log.close()
    log.open()
    _write(log, 3)
    assert verify(log_path) == audit_mod.VerifyReport(True, 6)


def test_verify_detects_an_edited_record(log: AuditLog, log_path: Path) -> None:
    _write(log, 10)
    lines = _lines(log_path)
    lines[5] = lines[5].replace(b"echo 5", b"echo X")
    log_path.write_bytes(b"".join(lines))
    report = verify(log_path)
    assert not report.ok
    assert report.line == 7
    assert report.first_error == "line 7: prev hash does not match line 6 (record edited, deleted or reordered)"


def test_verify_detects_a_deleted_record(log: AuditLog, log_path: Path) -> None:
    _write(log, 10)
    lines = _lines(log_path)
    del lines[4]
    log_path.write_bytes(b"".join(lines))
    report = verify(log_path)
    assert not report.ok
    assert report.line == 5
    assert report.records == 4


def test_verify_detects_swapped_records(log: AuditLog, log_path: Path) -> None:
    _write(log, 10)
    lines = _lines(log_path)
    lines[3], lines[4] = lines[4], lines[3]
    log_path.write_bytes(b"".join(lines))
    report = verify(log_path)
    assert not report.ok
    assert report.line == 4


def test_verify_detects_a_truncated_last_line(log: AuditLog, log_path: Path) -> None:
    _write(log, 10)
    data = log_path.read_bytes()
    log_path.write_bytes(data[:-20])
    report = verify(log_path)
    assert not report.ok
    assert report.line == 10
    assert report.first_error is not None
    assert "torn record" in report.first_error


def test_verify_missing_file_is_an_error(tmp_path: Path) -> None:
    report = verify(tmp_path / "nope.jsonl")
    assert not report.ok
    assert report.first_error is not None
    assert "No such file" in report.first_error


def test_open_refuses_a_log_ending_in_a_torn_record(log: AuditLog, log_path: Path) -> None:
    _write(log, 2)
    log.close()
    with log_path.open("ab") as f:
        f.write(b'{"half":')
    with pytest.raises(AuditUnavailable, match="torn record"):
        log.open()


def test_rotation_keeps_the_chain_across_files(log_path: Path) -> None:
    log = AuditLog(log_path, redactor=Redactor(), rotate_bytes=4000)
    log.open()
    _write(log, 60)
    log.close()
    rotated = sorted(p.name for p in log_path.parent.iterdir() if p.name != log_path.name)
    assert len(rotated) >= 2
    assert rotated[:2] == ["audit.jsonl.1", "audit.jsonl.2"]
    assert all(p.stat().st_size <= 4000 for p in log_path.parent.iterdir())
    report = verify(log_path)
    assert report.ok, report.first_error
    assert report.records == 60
    first_of_current = json.loads(_lines(log_path)[0])
    assert first_of_current["prev"] != GENESIS


def test_verify_detects_a_missing_rotated_file(log_path: Path) -> None:
    log = AuditLog(log_path, redactor=Redactor(), rotate_bytes=2000)
    log.open()
    _write(log, 40)
    log.close()
    log_path.with_name("audit.jsonl.2").unlink()
    report = verify(log_path)
    assert not report.ok
    assert report.first_error is not None
    assert "audit.jsonl.2 is missing" in report.first_error


def test_open_finishes_an_interrupted_rotation(log: AuditLog, log_path: Path) -> None:
    """A crash between link() and unlink() leaves two names; open completes the rotation."""
    _write(log, 3)
    log.close()
    os.link(log_path, log_path.with_name("audit.jsonl.1"))
    log.open()
    _write(log, 2)
    assert verify(log_path) == audit_mod.VerifyReport(True, 5)


def test_a104_newline_in_command_cannot_forge_a_record(log: AuditLog, log_path: Path) -> None:
    """A104 (CWE-117): the forged JSON stays inside one string of one line."""
    log.append({"action": "run_command", "decision": "denied", "command": A104_INPUT})
    lines = _lines(log_path)
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["decision"] == "denied"
    assert record["command"] == A104_INPUT


def test_unicode_line_separators_do_not_split_records(log: AuditLog, log_path: Path) -> None:
    log.append({"command": "a\u2028b\u2029c\x85d\re\udcff"})
    log.append({"command": "next"})
    report = verify(log_path)
    assert report.ok, report.first_error
    assert report.records == 2


def test_record_values_are_redacted_and_capped(log: AuditLog, log_path: Path) -> None:
    log.append(
        {
            "command": f"echo {AWS_KEY_ID}",
            "env": {"GITHUB_TOKEN": "plainvalue123", "HOME": "/root"},
            "argv": ["x" * (MAX_ARG_CHARS + 10)],
            "nested": {"deep": [{"k": f"password=hunter22 {AWS_KEY_ID}"}]},
        }
    )
    raw = log_path.read_text()
    assert AWS_KEY_ID not in raw
    assert "plainvalue123" not in raw
    assert "hunter22" not in raw
    record = json.loads(raw)
    assert record["env"] == {"GITHUB_TOKEN": "[REDACTED:credential]", "HOME": "/root"}
    assert record["argv"][0] == "x" * MAX_ARG_CHARS + "…[truncated 10 chars]"


def test_a_verbatim_string_is_written_as_is_and_the_same_text_as_a_plain_string_is_redacted(
    log: AuditLog, log_path: Path
) -> None:
    """Only the server makes a `Verbatim` (a call's id); a client's string with the same text is still
    redacted, and a `Verbatim` too long for a value is capped as any string."""
    secretish = f"password=hunter22 {AWS_KEY_ID}"
    log.append({"made": Verbatim(secretish), "sent": secretish, "long": Verbatim("v" * (MAX_ARG_CHARS + 5))})
    record = json.loads(log_path.read_text())
    assert record["made"] == secretish
    assert "hunter22" not in record["sent"]
    assert AWS_KEY_ID not in record["sent"]
    assert record["long"] == "v" * MAX_ARG_CHARS + "…[truncated 5 chars]"


def _cleaned_as_before(log: AuditLog, key: object, value: object, depth: int) -> object:
    """The record cleaning before it was flattened for speed (2026-12-05): the oracle for what it must still do."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(key, str) and log._key(key)[1]:
        return "[REDACTED:credential]"
    if type(value) is str:
        return log._cap(value, MAX_ARG_CHARS)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth >= audit_mod.MAX_DEPTH:
        return "[nested too deep]"
    if isinstance(value, Mapping):
        return {log._key(k)[0]: _cleaned_as_before(log, k, v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_cleaned_as_before(log, None, v, depth + 1) for v in value]
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("utf-8", "backslashreplace")
    return log._cap(str(value), MAX_ARG_CHARS)


class Color(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


_KEYS = st.sampled_from(["command", "password", "GITHUB_TOKEN", "env", "path", "api_key", 7, ("a", 1)])
_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=40)
    | st.sampled_from([f"echo {AWS_KEY_ID}", "password=hunter22", "x" * (MAX_ARG_CHARS + 3), Color.RED, Level.HIGH])
    | st.binary(max_size=20)
)
_VALUES = st.recursive(
    _LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=30,
)


@given(st.dictionaries(_KEYS, _VALUES, max_size=6))
@settings(max_examples=300)
def test_record_cleaning_is_what_it_was(record: dict[object, object]) -> None:
    log = AuditLog("/nonexistent/audit.jsonl", redactor=Redactor())
    for _ in range(2):  # the second time from the caches
        expected = {log._key(k)[0]: _cleaned_as_before(log, k, v, 0) for k, v in record.items()}
        # Keys that are not strings on purpose: tool details are built at run time.
        assert log._prepare(cast(Mapping[str, object], record)).body == expected


@given(st.dictionaries(_KEYS, _VALUES, max_size=6))
@settings(max_examples=300)
def test_record_encoding_is_what_the_json_encoder_writes(record: dict[object, object]) -> None:
    """`_dumps` calls the C scanner made once; its bytes are those of `json.JSONEncoder.encode` with the hidden
    characters escaped, and they read back as the same record."""
    log = AuditLog("/nonexistent/audit.jsonl", redactor=Redactor())
    body = log._prepare(cast(Mapping[str, object], record)).body
    chained = {**body, "id": "0" * 32, "seq": 7, "ts": "2026-12-05T16:00:00.000Z", "prev": audit_mod.GENESIS}
    standard = audit_mod._ENCODER.encode(chained)
    assert audit_mod._dumps(chained) == escape_hidden(standard).encode("utf-8", "backslashreplace")
    assert json.loads(audit_mod._dumps(chained)) == json.loads(standard.encode("utf-8", "backslashreplace"))


class _EqualsEverything(str):
    """A string that claims to equal every other, hashing as "ls" does."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return hash("ls")


class _Shifty:
    def __str__(self) -> str:
        return _EqualsEverything("something else entirely")


def test_a_str_subclass_never_stands_in_for_another_value_or_key(log: AuditLog) -> None:
    """Found by an attack review: `str(value)` may be a subclass with its own equality; the caches of
    short values and keys keep exact strings only, so it cannot become the entry of "ls"."""
    log._prepare({"tool": _Shifty(), _Shifty(): 1})  # type: ignore[dict-item]
    assert log._prepare({"tool": "ls", "ls": 2}).body == {"tool": "ls", "ls": 2}


def test_record_cleaning_of_deep_nesting_stops_at_the_limit(log: AuditLog) -> None:
    deep: object = "bottom"
    for _ in range(audit_mod.MAX_DEPTH + 5):
        deep = {"next": [deep]}
    body = log._prepare({"deep": deep}).body
    assert json.dumps(body).count("[nested too deep]") == 1
    assert body == {"deep": _cleaned_as_before(log, "deep", deep, 0)}


def test_timestamps_are_utc_milliseconds_of_now() -> None:
    for _ in range(3):
        before = time.time()
        stamp = audit_mod._now()
        after = time.time()
        parsed = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.UTC)
        assert math.floor(before * 1000) / 1000 <= parsed.timestamp() <= after
        assert len(stamp) == len("2026-12-05T12:00:00.000Z")


def test_oversized_record_is_shrunk_to_the_line_limit(log: AuditLog, log_path: Path) -> None:
    log.append({f"arg{i}": "y" * MAX_ARG_CHARS for i in range(40)})
    log.append({"next": 1})
    lines = _lines(log_path)
    assert len(lines[0]) - 1 <= MAX_RECORD_BYTES
    assert "truncated" in json.loads(lines[0])["arg0"]
    assert verify(log_path).ok


def test_reserved_keys_are_refused(log: AuditLog) -> None:
    with pytest.raises(ValueError, match="reserved"):
        log.append({"prev": GENESIS})


def test_log_path_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    """O_NOFOLLOW: a symlink planted at the log path is not followed, not even to a fresh file."""
    target = tmp_path / "elsewhere"
    link = tmp_path / "audit.jsonl"
    link.symlink_to(target)
    log = AuditLog(link, redactor=Redactor())
    with pytest.raises(AuditUnavailable, match="is a symlink"):
        log.open()
    assert not target.exists()


def test_log_path_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "audit.jsonl"
    os.mkfifo(fifo)
    log = AuditLog(fifo, redactor=Redactor())
    with pytest.raises(AuditUnavailable, match="not a regular file"):
        log.open()


def test_log_with_a_second_hard_link_is_refused(log: AuditLog, log_path: Path) -> None:
    _write(log, 1)
    log.close()
    os.link(log_path, log_path.with_name("copy"))
    with pytest.raises(AuditUnavailable, match="hard links"):
        log.open()


def test_append_before_open_is_refused(log_path: Path) -> None:
    with pytest.raises(AuditUnavailable, match="not open"):
        AuditLog(log_path, redactor=Redactor()).append({"a": 1})


def test_group_commit_8_writers_x_200(log_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    syncs = 0
    real = os.fdatasync

    def counting(fd: int) -> None:
        nonlocal syncs
        syncs += 1
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counting)
    log = AuditLog(log_path, redactor=Redactor())
    log.open()

    async def writer(w: int) -> None:
        for i in range(200):
            await log.append_async({"writer": w, "i": i})

    async def main() -> None:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for w in range(8):
                    tg.start_soon(writer, w)

    anyio.run(main)
    log.close()
    report = verify(log_path)
    assert report.ok, report.first_error
    assert report.records == 1600
    assert syncs <= 1600


def test_slow_disk_sync_never_blocks_the_event_loop(log_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone record is written inline (no thread hop) only while fdatasync is fast: once a sync took
    longer than INLINE_SYNC_MAX_S, the next lone record is synced in a worker thread and other tasks
    (other HTTP requests) run meanwhile. Does not prove anything about the disk's own latency."""
    real = os.fdatasync

    def slow_disk(fd: int) -> None:
        real(fd)
        time.sleep(audit_mod.INLINE_SYNC_MAX_S * 5)  # a disk slower than the inline bound

    monkeypatch.setattr(os, "fdatasync", slow_disk)
    log = AuditLog(log_path, redactor=Redactor())
    log.open()
    events: list[str] = []

    async def other_request() -> None:
        events.append("other task ran")

    async def one_append() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(other_request)
            await log.append_async({"i": len(events)}, alone=True)
            events.append("appended")

    async def main() -> None:
        with anyio.fail_after(10):
            await one_append()  # fast so far as the log knows: inline, the other task waits
            await one_append()  # the last sync was slow: off the loop, the other task runs first

    anyio.run(main)
    log.close()
    assert events == ["appended", "other task ran", "other task ran", "appended"]
    assert verify(log_path) == audit_mod.VerifyReport(True, 2)


def test_async_bad_record_fails_alone(log: AuditLog, log_path: Path) -> None:
    results: list[object] = []

    async def one(record: dict[str, object]) -> None:
        try:
            results.append(await log.append_async(record))
        except ValueError as exc:
            results.append(exc)

    async def main() -> None:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for i in range(5):
                    record: dict[str, object] = {"seq": 1} if i == 2 else {"i": i}
                    tg.start_soon(one, record)

    anyio.run(main)
    assert sum(isinstance(r, ValueError) for r in results) == 1
    assert verify(log_path) == audit_mod.VerifyReport(True, 4)


def _wait_for(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_group_commit_waiters_share_one_sync(log: AuditLog, log_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records queued while a sync runs are written together and covered by one later sync."""
    gate = threading.Event()
    entered = threading.Event()
    syncs = 0
    real = os.fdatasync

    def slow(fd: int) -> None:
        nonlocal syncs
        syncs += 1
        if syncs == 1:
            entered.set()
            assert gate.wait(10)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow)
    threads = [threading.Thread(target=log.append, args=({"i": i},)) for i in range(6)]
    threads[0].start()
    assert entered.wait(10)
    for t in threads[1:]:
        t.start()
    _wait_for(lambda: len(log._queue) == 5)
    gate.set()
    for t in threads:
        t.join(10)
    assert syncs == 2
    assert log.syncs == 2  # what bench_audit reports as records per sync
    assert verify(log_path) == audit_mod.VerifyReport(True, 6)


def test_a_record_that_need_not_be_durable_is_written_at_once_and_synced_by_the_flusher(
    log: AuditLog, log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`durable=False` (a call's end record) returns once the line is in the file; the flusher's sync
    follows, and a durable record arriving meanwhile is written after that sync, never before it."""
    _write(log, 1)
    gate, entered = threading.Event(), threading.Event()
    real = os.fdatasync

    def held(fd: int) -> None:
        entered.set()
        assert gate.wait(10)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", held)
    syncs = log.syncs
    end_id = log.append({"event": "end", "n": 1}, ran=True, durable=False)
    assert json.loads(_lines(log_path)[-1])["id"] == end_id  # in the file while its sync is held
    assert entered.wait(10)
    durable = threading.Thread(target=log.append, args=({"event": "start", "n": 2},))
    durable.start()
    _wait_for(lambda: len(log._queue) == 1)  # waits behind the flusher's sync
    assert len(_lines(log_path)) == 2
    gate.set()
    durable.join(10)
    assert log.syncs == syncs + 2
    assert verify(log_path) == audit_mod.VerifyReport(True, 3)


def test_a_failed_flush_refuses_every_later_record_until_reopened(
    log: AuditLog, log_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _write(log, 1)
    monkeypatch.setattr(os, "fdatasync", _fail(errno.EIO))
    log.append({"event": "end"}, ran=True, durable=False)  # written: the sync fails after it returns
    _wait_for(lambda: log.problem() is not None)
    with pytest.raises(AuditUnavailable, match="records written could not be synced"):
        log.append({"event": "start"})
    assert "could not be synced (Input/output error)" in caplog.text
    monkeypatch.undo()
    assert verify(log_path) == audit_mod.VerifyReport(True, 2)
    log.open()
    _write(log, 1)
    assert verify(log_path) == audit_mod.VerifyReport(True, 3)


def test_close_syncs_what_was_written_and_ends_the_flusher(log_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = AuditLog(log_path, redactor=Redactor())
    log.open()
    synced = threading.Event()
    real = os.fdatasync
    gate = threading.Event()

    def held(fd: int) -> None:
        assert gate.wait(10)
        real(fd)
        synced.set()

    monkeypatch.setattr(os, "fdatasync", held)
    log.append({"event": "end"}, ran=True, durable=False)
    flusher = log._flusher
    assert flusher is not None
    assert flusher.is_alive()
    closing = threading.Thread(target=log.close)
    closing.start()
    gate.set()
    closing.join(10)
    assert synced.is_set()
    assert not flusher.is_alive()
    assert verify(log_path) == audit_mod.VerifyReport(True, 1)


def _fail(err: int) -> Callable[..., int]:
    def failing(*args: object) -> int:
        raise OSError(err, os.strerror(err))

    return failing


def test_write_error_fails_closed_and_keeps_the_chain(
    log: AuditLog, log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(log, 2)
    monkeypatch.setattr(os, "write", _fail(errno.EIO))
    with pytest.raises(AuditUnavailable, match=r"^audit log unavailable: Input/output error; nothing was done$"):
        log.append({"command": "rm -rf /tmp/x"})
    monkeypatch.undo()
    _write(log, 2)
    assert verify(log_path) == audit_mod.VerifyReport(True, 4)


def test_partial_write_is_truncated_back(log: AuditLog, log_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(log, 2)
    real = os.write
    calls = 0

    def half(fd: int, data: bytes) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            return real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half)
    with pytest.raises(AuditUnavailable, match="No space left on device"):
        log.append({"command": "x"})
    monkeypatch.undo()
    assert verify(log_path) == audit_mod.VerifyReport(True, 2)
    _write(log, 1)
    assert verify(log_path) == audit_mod.VerifyReport(True, 3)


def test_fsync_error_fails_closed(log: AuditLog, log_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(log, 1)
    monkeypatch.setattr(os, "fdatasync", _fail(errno.EIO))
    with pytest.raises(AuditUnavailable):
        log.append({"command": "x"})
    monkeypatch.undo()
    assert verify(log_path) == audit_mod.VerifyReport(True, 1)


def test_unremovable_partial_line_breaks_the_log_until_reopened(
    log: AuditLog, log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(log, 1)
    real = os.write

    def half(fd: int, data: bytes) -> int:
        real(fd, bytes(data[:10]))
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "write", half)
    monkeypatch.setattr(os, "ftruncate", _fail(errno.EROFS))
    with pytest.raises(AuditUnavailable):
        log.append({"command": "x"})
    monkeypatch.undo()
    with pytest.raises(AuditUnavailable, match="broken"):
        log.append({"command": "y"})
    log.close()
    with pytest.raises(AuditUnavailable, match="torn record"):
        log.open()


def test_fail_open_mode_warns_and_returns_an_id(
    log_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    log = AuditLog(log_path, redactor=Redactor(), fail_closed=False)
    log.open()
    monkeypatch.setattr(os, "write", _fail(errno.ENOSPC))
    with caplog.at_level(logging.WARNING, logger="bastion.audit"):
        record_id = log.append({"command": "x"})
    assert len(record_id) == 32
    assert "No space left on device" in caplog.text
    log.close()


# --- real filesystem faults (root only) ---------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)], check=True)


def _fill(write: Callable[[bytes], object], size: int) -> None:
    while True:
        write(b"\0" * size)


def _umount(where: Path) -> None:
    if subprocess.run(["umount", str(where)], check=False).returncode != 0:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.root
@needs_root
def test_a103_read_only_filesystem_fails_closed(tmp_path: Path) -> None:
    """A103: on a read-only filesystem the log cannot be opened and nothing can be appended.

    Linux refuses to remount read-only while a file is open for writing (EBUSY), so the
    log is closed first; the in-flight write error path is covered by the EIO/ENOSPC tests.
    """
    mnt = tmp_path / "mnt"
    _mount_tmpfs(mnt, "1m")
    path = mnt / "audit.jsonl"
    log = AuditLog(path, redactor=Redactor())
    try:
        log.open()
        _write(log, 3)
        log.close()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with pytest.raises(AuditUnavailable, match="Read-only file system"):
            log.open()
        with pytest.raises(AuditUnavailable):
            log.append({"command": "ls"})
        assert verify(path) == audit_mod.VerifyReport(True, 3)
    finally:
        log.close()
        _umount(mnt)


@pytest.mark.root
@needs_root
def test_a103_full_filesystem_fails_closed_without_a_partial_line(tmp_path: Path) -> None:
    """A103: ENOSPC mid-record raises AuditUnavailable and the partial line is cut away."""
    mnt = tmp_path / "mnt"
    _mount_tmpfs(mnt, "64k")
    path = mnt / "audit.jsonl"
    log = AuditLog(path, redactor=Redactor())
    try:
        log.open()
        _write(log, 1)
        with (mnt / "fill").open("wb", buffering=0) as f:
            for size in (4096, 1):
                with pytest.raises(OSError, match="No space left on device"):
                    _fill(f.write, size)
        written = 1
        with pytest.raises(AuditUnavailable, match="No space left on device"):  # noqa: PT012
            for _ in range(100):
                log.append({"command": "x" * 300})
                written += 1
        assert verify(path) == audit_mod.VerifyReport(True, written)
        assert path.read_bytes().endswith(b"\n")
    finally:
        log.close()
        _umount(mnt)


def test_alone_append_async_writes_inline_and_chains(
    log: AuditLog, log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller alone writes on its own thread (no hop), and the chain is the same as any other write.

    Inline is for a disk whose syncs are fast; this host's may not be, so any sync counts as fast here
    (test_slow_disk_sync_never_blocks_the_event_loop covers the slow case)."""
    monkeypatch.setattr(audit_mod, "INLINE_SYNC_MAX_S", math.inf)
    threads: set[int] = set()
    real = os.fdatasync

    def record_thread(fd: int) -> None:
        threads.add(threading.get_ident())
        real(fd)

    monkeypatch.setattr(os, "fdatasync", record_thread)

    async def main() -> int:
        for i in range(5):
            await log.append_async({"i": i}, alone=True)
        return threading.get_ident()

    loop_thread = anyio.run(main)
    assert threads == {loop_thread}
    assert verify(log_path) == audit_mod.VerifyReport(True, 5)


# --- the live file moved under the writer (issue 13, finding 4) -----------------------------


def _audit_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "bastion.audit" and r.levelno >= logging.ERROR]


def test_audit_file_unlinked_under_the_writer_fails_closed(
    log: AuditLog, log_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Invariant: after an unlink of the live file no append succeeds, none reaches the deleted
    inode, no new file appears at the path, and one error line (not one per record) says so."""
    _write(log, 2)
    assert log._fd is not None
    proc_path = Path(f"/proc/self/fd/{log._fd}")
    log_path.unlink()
    with caplog.at_level(logging.ERROR, logger="bastion.audit"):
        for _ in range(3):
            with pytest.raises(AuditUnavailable, match=r"was deleted or renamed while the server ran: .*restart"):
                log.append({"command": "touch x"})
    held = proc_path.read_bytes()
    assert len(held.splitlines()) == 2
    assert not log_path.exists()
    (errors,) = _audit_errors(caplog)
    assert "was deleted or renamed" in errors


def test_audit_file_renamed_under_group_commit_fails_every_waiter(
    log: AuditLog, log_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Invariant: records of concurrent writers (group commit, one check per batch) are all refused
    once the live file is renamed: none lands in the renamed file, which still verifies; putting
    it back lets records through again, chained to the last one written."""
    _write(log, 3)
    moved = log_path.with_name("moved.jsonl")
    log_path.rename(moved)
    outcomes: list[object] = []

    async def writer(w: int) -> None:
        for i in range(20):
            try:
                outcomes.append(await log.append_async({"writer": w, "i": i}))
            except AuditUnavailable as exc:
                outcomes.append(exc)

    async def main() -> None:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for w in range(8):
                    tg.start_soon(writer, w)

    with caplog.at_level(logging.ERROR, logger="bastion.audit"):
        anyio.run(main)
    assert len(outcomes) == 160
    assert all(isinstance(o, AuditUnavailable) for o in outcomes)
    assert verify(moved) == audit_mod.VerifyReport(True, 3)
    assert len(_audit_errors(caplog)) == 1
    moved.rename(log_path)
    _write(log, 2)
    assert verify(log_path) == audit_mod.VerifyReport(True, 5)


def test_audit_symlink_swapped_in_under_the_writer_fails_closed(
    log: AuditLog, log_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Invariant: a symlink put where the live file was is refused at the next append (not at
    rotation), nothing is written through it, and the error line names the symlink."""
    _write(log, 1)
    aside = tmp_path / "aside.jsonl"
    target = tmp_path / "target"
    target.write_bytes(b"")
    log_path.rename(aside)
    log_path.symlink_to(target)
    with (
        caplog.at_level(logging.ERROR, logger="bastion.audit"),
        pytest.raises(AuditUnavailable, match="was replaced by a symlink"),
    ):
        log.append({"command": "x"})
    assert target.read_bytes() == b""
    assert verify(aside) == audit_mod.VerifyReport(True, 1)
    assert "replaced by a symlink" in _audit_errors(caplog)[0]


def test_audit_file_given_a_second_link_under_the_writer_fails_closed(log: AuditLog, log_path: Path) -> None:
    """Invariant: the checks made at open (one link, our owner, mode) hold at every append too:
    a hard link made to the live file (a copy the writer would keep feeding) stops the records."""
    _write(log, 1)
    os.link(log_path, log_path.with_name("copy.jsonl"))
    with pytest.raises(AuditUnavailable, match="has 2 hard links"):
        log.append({"command": "x"})
    os.unlink(log_path.with_name("copy.jsonl"))
    _write(log, 1)
    assert verify(log_path) == audit_mod.VerifyReport(True, 2)


def test_audit_file_made_group_writable_or_given_away_under_the_writer_fails_closed(
    log: AuditLog, log_path: Path
) -> None:
    """Invariant: the per-batch check (one test of the common answer since issue 19) still refuses a live file
    another user may write or that another user owns, and takes records again once it is put right. Does not
    prove the owner check follows a change of the server's own uid: the server never makes one."""
    _write(log, 1)
    log_path.chmod(0o620)
    with pytest.raises(AuditUnavailable, match="writable by group or others"):
        log.append({"command": "x"})
    log_path.chmod(0o600)
    _write(log, 1)
    if os.geteuid() == 0:
        os.chown(log_path, 4242, -1)
        with pytest.raises(AuditUnavailable, match="owned by uid 4242"):
            log.append({"command": "x"})
        os.chown(log_path, 0, -1)
        _write(log, 1)
    assert verify(log_path).ok


def test_record_ids_are_uuid4_and_a_forked_child_never_repeats_its_parents(log: AuditLog) -> None:
    """Invariant: ids are made many at a time from one read of the kernel's random source (a getrandom per
    record cost ~0.8 us); each is a version-4 UUID, and a child forked while the pool is full makes its own
    rather than the parent's next ones."""
    ids = [log.append({"n": n}) for n in range(3)]
    assert all(uuid.UUID(hex=i).version == 4 and uuid.UUID(hex=i).variant == uuid.RFC_4122 for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, then out without running the parent's cleanup
        try:
            os.write(write, "".join(audit_mod._record_id() for _ in range(8)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        child = pipe.read().decode()
    os.waitpid(pid, 0)
    parent = {audit_mod._record_id() for _ in range(8)}
    assert len(child) == 8 * 32
    assert not parent & {child[at : at + 32] for at in range(0, len(child), 32)}


def test_audit_end_record_failure_says_the_operation_ran(log: AuditLog, log_path: Path) -> None:
    """Invariant: a record written after acting (``ran=True``) that fails says the operation ran
    and its end record is missing, never "nothing was done"; before acting, it says nothing was done."""
    _write(log, 1)
    log_path.unlink()
    with pytest.raises(AuditUnavailable) as before:
        log.append({"event": "start"})
    with pytest.raises(AuditUnavailable) as after:
        log.append({"event": "end"}, ran=True)
    with pytest.raises(AuditUnavailable) as after_async:
        anyio.run(lambda: log.append_async({"event": "end"}, ran=True))
    assert before.value.reason.endswith("; nothing was done")
    for caught in (after, after_async):
        reason = caught.value.reason
        assert reason.startswith("the operation ran, but its end record could not be written (audit log unavailable: ")
        assert reason.endswith("); the audit log is unavailable until that is fixed")
        assert "nothing was done" not in reason


@pytest.mark.skipif(os.geteuid() != 0, reason="chattr +i needs CAP_LINUX_IMMUTABLE")
def test_immutable_log_refuses_with_the_fix_then_accepts_again(log: AuditLog, log_path: Path) -> None:
    """Invariant: a log made immutable (chattr +i) under the open writer refuses each record with a
    line naming the attribute and the fix, and accepts records again once it is cleared, chain intact."""
    _write(log, 2)
    subprocess.run(["chattr", "+i", str(log_path)], check=True)
    try:
        with pytest.raises(AuditUnavailable, match=r"is immutable \(chattr \+i\): run `chattr -i` on it; nothing"):
            log.append({"action": "run_command"})
    finally:
        subprocess.run(["chattr", "-i", str(log_path)], check=True)
    _write(log, 1)
    report = verify(log_path)
    assert (report.ok, report.records) == (True, 3)


def test_a_record_cancelled_in_the_queue_is_written_and_later_records_are_not_stuck(
    log: AuditLog, log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found when a SIGTERM cut calls over stdio: a record waiting behind a batch being synced was
    cancelled (its call cut); the batch's leader then handed the lead to it, nobody took it, and every
    later record waited for ever, so the server answered nothing more. A queued record's caller now
    gets its cancellation once the record is written: it leads when its turn comes."""
    gate = threading.Event()
    entered = threading.Event()
    real = os.fdatasync

    def slow(fd: int) -> None:
        if not entered.is_set():
            entered.set()
            assert gate.wait(10)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow)

    async def cut_call(cut: anyio.CancelScope, done: anyio.Event) -> None:
        with cut:
            await log.append_async({"i": "cut"})
        done.set()

    async def main() -> None:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(log.append_async, {"i": "leader"})
                await anyio.to_thread.run_sync(entered.wait, 10)  # the leader's batch is being synced
                cut, cut_done = anyio.CancelScope(), anyio.Event()
                tg.start_soon(cut_call, cut, cut_done)
                tg.start_soon(log.append_async, {"i": "after"})
                while len(log._async_queue) < 2:
                    await anyio.sleep(0)
                cut.cancel()
                for _ in range(10):
                    await anyio.sleep(0)
                assert not cut_done.is_set()  # cancelled, it waits for its record all the same
                gate.set()
                await cut_done.wait()

    anyio.run(main)
    assert [json.loads(line)["i"] for line in log_path.read_text().splitlines()] == ["leader", "cut", "after"]
    log.append({"i": "later"})  # the log still takes records
    assert verify(log_path) == audit_mod.VerifyReport(True, 4)


def test_a_record_of_thousands_of_long_strings_costs_what_one_line_holds(log: AuditLog, log_path: Path) -> None:
    """Attack (found by review): a call of a tool that does not exist, with 2,000 strings of 4 KiB as its
    arguments (8 MB): the refusal's record redacted all of them, then `_shrink` encoded the record 256 times
    halving one string each: 17 s of a frozen server over stdio. The cleaning now stops at what the line could
    hold (the rest is counted), and `_shrink` cuts every long string at once: 4 times the strings, about the
    same cost; the record's own fields are whole and the chain verifies."""

    def record(count: int) -> dict[str, object]:
        strings = [f"{i:05d}" + "v" * (MAX_ARG_CHARS - 5) for i in range(count)]
        return {"event": "end", "tool": "nope", "args": {"zz": strings}, "code": "INVALID_REQUEST"}

    small, large = record(500), record(2_000)
    ratio = least_cpu_s(lambda: log.append(large)) / max(least_cpu_s(lambda: log.append(small)), 1e-6)
    assert ratio < 2, f"4 times the strings cost {ratio:.1f} times as much"
    last = json.loads(_lines(log_path)[-1])
    assert (last["tool"], last["code"]) == ("nope", "INVALID_REQUEST")
    assert len(_lines(log_path)[-1]) - 1 <= MAX_RECORD_BYTES
    assert "not recorded" in json.dumps(last["args"])
    assert verify(log_path).ok


def test_an_agents_8bit_csi_osc52_and_bidi_override_reach_the_log_file_only_as_escapes(
    log: AuditLog, log_path: Path
) -> None:
    """Attack (found by attack): a refused run_command's raw arguments went into the record as raw UTF-8 C1
    controls (8-bit CSI to move the cursor and erase a line, OSC 52 to write the clipboard) and bidi
    overrides, which `cat` or `jq` pass to the administrator's terminal. They are JSON escapes now: the
    record reads back the same, the chain verifies, and no byte of them is in the file."""
    command = "ls\u009b1A\u009b2K\u009d52;c;cm0gLXJmIH4K\u009c \u202etxt.exe\u200b \U000e0041 é 中"
    log.append({"action": "run_command", "command": command})
    raw = log_path.read_bytes()
    assert "\u202e".encode() not in raw
    assert not any(b"\xc2" + bytes([c]) in raw for c in range(0x80, 0xA0))
    assert "\U000e0041".encode() not in raw
    assert "é 中".encode() in raw, "other text stays as it is"
    assert json.loads(_lines(log_path)[-1])["command"] == command
    assert verify(log_path).ok


def test_hidden_ranges_are_this_pythons_unicode_controls_and_format_characters() -> None:
    """The table `escape_hidden` uses is Unicode's Cc, Cf, Zl and Zp past ASCII, checked against unicodedata."""
    import unicodedata

    from bastion.safety.redact import HIDDEN_RANGES

    listed = {code for low, high in HIDDEN_RANGES for code in range(low, high + 1)}
    hidden = (0x80, 0x110000)
    assert listed == {code for code in range(*hidden) if unicodedata.category(chr(code)) in ("Cc", "Cf", "Zl", "Zp")}, (
        f"Unicode {unicodedata.unidata_version} changed: update HIDDEN_RANGES"
    )


def test_verify_beside_a_server_that_rotates_never_calls_an_intact_chain_broken(log_path: Path) -> None:
    """Attack (found by attack): an agent pushing records until the log rotated made `bastion audit verify`,
    run beside the server as the docs allow, report BROKEN about 5 times in 72: it listed the files, then the
    log became `name.N+1` and a new `name` began before it was read. A chain that changed while it was read
    is read again."""
    log = AuditLog(log_path, redactor=Redactor(), rotate_bytes=4096)
    log.open()
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            log.append({"action": "run_command", "command": "x" * 300})

    def rotations() -> int:
        return len(list(log_path.parent.glob("audit.jsonl.*")))

    thread = threading.Thread(target=writer)
    thread.start()
    reports: list[VerifyReport] = []
    try:
        _wait_for(lambda: rotations() >= 2)
        while rotations() < 40 and len(reports) < 2000:
            reports.append(verify(log_path))
    finally:
        stop.set()
        thread.join()
        log.close()
    assert rotations() >= 40, "it rotated all along"
    assert [r.first_error for r in reports if not r.ok] == []
    assert verify(log_path).ok


def _bytes_read() -> int:
    """What this process has read so far (rchar: every read(2), cached or not)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"])


def test_verify_beside_a_busy_server_reads_a_broken_rotated_file_once(log_path: Path) -> None:
    """Found by review: on a live server the log changes at every record, so a break in a rotated file (which
    never changes) was read again from the first file up to ten times: minutes for a log of gigabytes. Only
    a break where something changed is read again."""
    log = AuditLog(log_path, redactor=Redactor(), rotate_bytes=4096)
    log.open()
    for i in range(3000):  # not synced one by one: only the chain matters here
        log.append({"action": "run_command", "command": f"echo {i}"}, durable=False)
    rotated = sorted(log_path.parent.glob("audit.jsonl.*"), key=lambda p: int(p.suffix[1:]))
    lines = rotated[-1].read_bytes().splitlines(keepends=True)
    lines[0] = lines[0].replace(b"echo", b"ECHO", 1)
    rotated[-1].write_bytes(b"".join(lines))
    size = sum(p.stat().st_size for p in [*rotated, log_path])
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            log.append({"action": "run_command", "command": "x" * 300})

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        _wait_for(lambda: log_path.stat().st_size > 0)
        before = _bytes_read()
        report = verify(log_path)
        read = _bytes_read() - before
    finally:
        stop.set()
        thread.join()
        log.close()
    assert not report.ok
    assert report.file == str(rotated[-1]), report
    assert read < 2 * size, f"read {read} bytes of a {size}-byte chain"


def test_argument_names_alike_in_their_first_256_characters_keep_both_values(log: AuditLog, log_path: Path) -> None:
    """Attack (repro_misc.py part C): two argument names that differ past the 256 characters a key keeps,
    of the same length, were one key once capped: the record kept the second value only, the first (say, the
    harmful one) lost. Invariant: both values are in the record, the second under `<key>#2`; thousands of
    names alike cost one step each (a search from #2 for each would be quadratic)."""
    first, second = "k" * 256 + "a" * 44, "k" * 256 + "b" * 44
    log.append({"args": {first: "rm -rf /", second: "harmless"}})
    many = {"k" * 256 + f"{n:08d}": n for n in range(5_000)}
    log.append({"args": many})
    records = [json.loads(line) for line in _lines(log_path)]
    values = records[0]["args"]
    assert sorted(values.values()) == ["harmless", "rm -rf /"]
    assert [key for key in values if key.endswith("#2")], values
    assert len(records) == 2  # written (cut to the line's size as any record too large)
    assert verify(log_path).ok


def _fill_fds() -> list[int]:
    """Open /dev/null until the process has no fd left (EMFILE); the caller closes them."""
    fillers: list[int] = []
    while True:
        try:
            fillers.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            if exc.errno != errno.EMFILE:
                raise
            return fillers


def _append_until_refused(log: AuditLog, accepted: list[str]) -> AuditUnavailable:
    """Append records until one is refused (within 100); the accepted ones' ids go to `accepted`."""
    for n in range(100):
        try:
            accepted.append(log.append({"action": "run_command", "n": n}))
        except AuditUnavailable as exc:
            return exc
    raise AssertionError("100 records accepted: no rotation was refused")


def test_a_rotation_at_the_open_file_limit_refuses_then_recovers_when_fds_return(
    log_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by attack: a rotation needs fds (the folder, the new file); one that met the process's open-file
    limit (an agent's pipes can fill it) broke the log for good, refusing every call until a restart. It is
    refused while no fd is left, and the next record after fds return rotates and is accepted."""
    log = AuditLog(log_path, redactor=Redactor(), rotate_bytes=2000)
    log.open()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    accepted = _write(log, 5)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 32, hard))
    fillers = _fill_fds()
    try:
        # The records that fit are written; the one to rotate is refused.
        assert "rotation unfinished: Too many open files" in _append_until_refused(log, accepted).reason
        with pytest.raises(AuditUnavailable, match="rotation unfinished"):
            log.append({"action": "refused again"})
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    accepted.extend(_write(log, 40))
    log.close()
    assert log_path.with_name("audit.jsonl.1").exists()
    report = verify(log_path)
    assert report.ok, report.first_error
    ids = [json.loads(line)["id"] for path in sorted(log_path.parent.iterdir()) for line in _lines(path)]
    assert set(accepted) <= set(ids)  # nothing accepted was lost
    assert sum("rotation unfinished" in r.getMessage() for r in caplog.records) == 1  # logged once
    assert any("rotation finished" in r.getMessage() for r in caplog.records)


def test_a_rotation_that_cannot_open_its_new_file_opens_it_at_the_next_record(
    log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by attack (the same limit, later in a rotation): once the full file has moved away, a new file
    that cannot be opened yet (another thread took the fd the old one freed) refuses records, and the next
    record opens it and continues the chain; nothing was lost."""
    log = AuditLog(log_path, redactor=Redactor(), rotate_bytes=2000)
    log.open()
    opened = audit_mod._open_log
    failures = [1]

    def no_fd_once(path: Path, *, exclusive: bool) -> int:
        if failures[0]:
            failures[0] -= 1
            raise AuditUnavailable(f"audit log {path} cannot be opened: Too many open files")
        return opened(path, exclusive=exclusive)

    monkeypatch.setattr(audit_mod, "_open_log", no_fd_once)
    accepted: list[str] = []
    refused = _append_until_refused(log, accepted).reason
    assert "rotation unfinished: audit log" in refused
    assert "Too many open files" in refused
    assert not log_path.exists()  # moved to audit.jsonl.1, the new one not made yet
    assert log.problem() is not None
    accepted.extend(_write(log, 10))
    assert log.problem() is None
    log.close()
    report = verify(log_path)
    assert report.ok, report.first_error
    ids = [json.loads(line)["id"] for path in sorted(log_path.parent.iterdir()) for line in _lines(path)]
    assert set(accepted) <= set(ids)


def test_verify_during_an_unfinished_rotation_reads_the_rotated_files_and_names_both_causes(
    log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left alone last session: while a rotation waits for its new file (no fd left), `bastion audit verify`
    said only "cannot open audit.jsonl". It still fails (a deleted log looks the same from its files), but it
    reads the rotated files, counts their records and names both causes."""
    log = AuditLog(log_path, redactor=Redactor(), rotate_bytes=2000)
    log.open()
    opened = audit_mod._open_log

    def no_fd(path: Path, *, exclusive: bool) -> int:
        raise AuditUnavailable(f"audit log {path} cannot be opened: Too many open files")

    monkeypatch.setattr(audit_mod, "_open_log", no_fd)
    accepted: list[str] = []
    _append_until_refused(log, accepted)
    assert not log_path.exists()
    report = verify(log_path)
    assert not report.ok
    assert report.records == len(accepted) == len(_lines(log_path.with_name("audit.jsonl.1")))
    assert report.first_error is not None
    assert "rotation has not finished" in report.first_error
    assert "deleted" in report.first_error
    monkeypatch.setattr(audit_mod, "_open_log", opened)
    _write(log, 3)
    log.close()
    assert verify(log_path).ok


def test_verify_of_a_deleted_log_with_a_broken_rotated_file_reports_the_break(log_path: Path) -> None:
    """The absent log's report never hides a break in the rotated files before it."""
    log = AuditLog(log_path, redactor=Redactor(), rotate_bytes=2000)
    log.open()
    _write(log, 40)
    log.close()
    first = log_path.with_name("audit.jsonl.1")
    lines = _lines(first)
    first.write_bytes(b"".join(lines[:1] + lines[2:]))
    log_path.unlink()
    report = verify(log_path)
    assert not report.ok
    assert report.file == str(first)
    assert report.first_error is not None
    assert "line 2" in report.first_error


def test_a_rotation_with_exactly_one_fd_left_finishes(log_path: Path) -> None:
    """Found by review: with one fd left, the rotation's folder took it, listing the rotated files then
    failed and was taken for none, and the link met `audit.jsonl.1` (EEXIST): the log was broken for good.
    The folder is listed first and opened next, one fd after the other, and the rotation finishes."""
    log = AuditLog(log_path, redactor=Redactor(), rotate_bytes=2000)
    log.open()
    accepted: list[str] = []
    while not log_path.with_name("audit.jsonl.2").exists():  # two rotations made normally
        accepted.append(log.append({"action": "run_command", "n": len(accepted)}))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 32, hard))
    fillers = _fill_fds()
    os.close(fillers.pop())  # exactly one fd free
    try:
        while not log_path.with_name("audit.jsonl.3").exists():
            accepted.append(log.append({"action": "run_command", "n": len(accepted)}))
        accepted.append(log.append({"action": "after the rotation"}))
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert log.problem() is None
    log.close()
    report = verify(log_path)
    assert report.ok, report.first_error
    files, _ = audit_mod.chain_files(log_path)
    ids = [json.loads(line)["id"] for path in files for line in _lines(path)]
    assert ids == accepted  # every record accepted, in order, and nothing else


@pytest.mark.parametrize("alone", [True, False], ids=["inline", "batched"])
def test_on_written_gets_the_bytes_each_record_took_in_the_file(log: AuditLog, log_path: Path, alone: bool) -> None:
    """What a caller's audit budget is charged (`CallRunner`): each record's own line, escapes and newline
    included, for records written together in one batch as for one written alone; nothing for one refused."""
    sizes: list[int] = []

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            for text in ("a", "\x01" * 100, "é" * 50):
                tasks.start_soon(functools.partial(log.append_async, {"v": text}, alone=alone, on_written=sizes.append))
        with pytest.raises(ValueError, match="reserved keys"):
            await log.append_async({"seq": 1}, on_written=sizes.append)

    anyio.run(main)
    lines = log_path.read_bytes().splitlines(keepends=True)
    assert sorted(sizes) == sorted(map(len, lines))
    assert sum(sizes) == log_path.stat().st_size

"""The audit log as the dashboard reads it (`bastion.transports.http.audit_view`), on real logs.

What this proves: pages come newest first and the `before` cursor walks the whole file with no record
missed or shown twice; each filter keeps exactly its records; hostile filter values are refused with
one line; a page reads at most `SCAN_BYTES` however large the log; a torn line or a cursor in the
middle of a line is skipped, never shown; the chain's status is cached by the files' size and mtime,
re-checked when they change, and not computed past its byte cap. What it does not prove: the pages'
HTML (tests/transports/http/test_dashboard.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bastion.safety.audit import AuditLog
from bastion.safety.errors import InvalidRequest
from bastion.safety.redact import Redactor
from bastion.transports.http.audit_view import (
    SCAN_BYTES,
    AuditFilter,
    ChainStatus,
    parse_cursor,
    parse_filter,
    read_page,
    refuse_repeated,
)


def write_log(path: Path, count: int) -> None:
    """`count` tool-call end records from a real AuditLog: tools t0..t2, codes OK/NOT_FOUND, sandboxes sb-0/1."""
    log = AuditLog(path, redactor=Redactor())
    log.open()
    try:
        for n in range(count):
            log.append(
                {
                    "event": "end",
                    "tool": f"t{n % 3}",
                    "caller": f"http:client-{n % 2}",
                    "workspace": f"sb-{n % 2}",
                    "code": "OK" if n % 4 else "NOT_FOUND",
                    "n": n,
                }
            )
        log.append({"event": "egress", "sandbox": "sb-9", "decision": "deny", "domain": "evil.example", "n": count})
    finally:
        log.close()


@pytest.fixture(scope="module")
def log_230(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """230 tool-call records, an egress record and a connection being made, written once for the module."""
    path = tmp_path_factory.mktemp("audit") / "audit.jsonl"
    write_log(path, 230)
    log = AuditLog(path, redactor=Redactor())
    log.open()
    log.append({"event": "egress_open", "sandbox": "sb-8", "domain": "tunnel.example", "n": 231})
    log.close()
    return path


def walk(path: Path, wanted: AuditFilter, **kwargs: int) -> list[int]:
    """Every page, following the cursor: the records' `n`, in the order shown."""
    shown: list[int] = []
    before: int | None = None
    while True:
        page = read_page(path, wanted, before=before, **kwargs)
        shown += [int(str(r.fields["n"])) for r in page.records]
        if page.next_before is None:
            return shown
        before = page.next_before


def test_pages_are_newest_first_and_the_cursor_misses_nothing(log_230: Path) -> None:
    path = log_230
    assert walk(path, AuditFilter(), limit=50) == list(range(231, -1, -1))
    # A small scan window stops pages early (fewer than `limit`); the cursor still covers everything.
    assert walk(path, AuditFilter(), limit=50, scan_bytes=1000) == list(range(231, -1, -1))


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"tool": "t1"}, [n for n in range(230) if n % 3 == 1]),
        ({"code": "NOT_FOUND"}, [n for n in range(230) if n % 4 == 0]),
        ({"caller": "client-1"}, [n for n in range(230) if n % 2 == 1]),
        ({"sandbox": "sb-0", "tool": "t2"}, [n for n in range(230) if n % 2 == 0 and n % 3 == 2]),
        # An open tunnel (egress_open, its end not yet recorded) is on the egress page, as allowed: it was on
        # no page but the whole log until it closed, hours later for one kept open (attack).
        ({"kind": "egress"}, [230, 231]),
        ({"kind": "egress", "decision": "deny", "sandbox": "sb-9"}, [230]),
        ({"kind": "egress", "decision": "allow", "sandbox": "sb-8"}, [231]),
        ({"kind": "admin"}, []),
    ],
)
def test_each_filter_keeps_exactly_its_records(log_230: Path, params: dict[str, str], expected: list[int]) -> None:
    assert walk(log_230, parse_filter(params)) == expected[::-1]


HOSTILE_FILTERS = [
    {"tool": "<script>alert(1)</script>"},
    {"tool": "x" * 101},
    {"sandbox": "../../etc/passwd"},
    {"sandbox": "sb-1\nforged"},
    {"code": "<b>OK</b>"},
    {"code": "ok"},
    {"kind": "everything"},
    {"decision": "allow' OR 1=1"},
    {"caller": "a\u202eb"},
    {"caller": "x" * 201},
    {"caller": "line\nbreak"},
]


@pytest.mark.parametrize("params", HOSTILE_FILTERS)
def test_hostile_filter_values_are_refused_with_one_line(params: dict[str, str]) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_filter(params)
    assert "\n" not in refused.value.reason


@pytest.mark.parametrize("cursor", ["-1", "1e9", "0x10", "9" * 19, "１２", " 12"])
def test_hostile_cursors_are_refused(cursor: str) -> None:
    with pytest.raises(InvalidRequest):
        parse_cursor(cursor)


def test_a_page_reads_a_bounded_window_of_a_huge_log(tmp_path: Path) -> None:
    """A 24 MiB log (no match anywhere): one page reads SCAN_BYTES, not the file."""
    path = tmp_path / "audit.jsonl"
    line = json.dumps({"event": "end", "tool": "filler", "pad": "x" * 200}).encode() + b"\n"
    with path.open("wb") as f:
        f.write(line * (24 * 1024 * 1024 // len(line)))
    page = read_page(path, parse_filter({"tool": "never"}))
    assert page.records == []
    assert page.scanned_bytes <= SCAN_BYTES
    assert page.file_bytes > 10 * SCAN_BYTES
    assert page.next_before is not None
    assert page.next_before >= page.file_bytes - SCAN_BYTES


def test_a_torn_line_and_a_cursor_inside_a_line_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    write_log(path, 3)
    whole = path.read_bytes()
    with path.open("ab") as f:
        f.write(b'{"event":"end","n":99')  # a record being written: no newline yet
    assert [r.fields["n"] for r in read_page(path, AuditFilter()).records] == [3, 2, 1, 0]
    middle = whole.index(b"\n") + 10  # inside the second line
    shown = [r.fields["n"] for r in read_page(path, AuditFilter(), before=middle).records]
    assert shown == [0]


def test_an_edited_line_nested_too_deep_is_skipped_not_raised(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    write_log(path, 2)
    with path.open("ab") as f:
        f.write(b'{"a":' * 200_000 + b"1" + b"}" * 200_000 + b"\n")
    assert [r.fields["n"] for r in read_page(path, AuditFilter()).records] == [2, 1, 0]


def test_chain_status_is_cached_until_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    write_log(path, 20)
    status = ChainStatus(path, every_s=0.0)
    first = status.check()
    assert first.state == "ok"
    assert "21 records" in first.message
    assert status.check() is first  # same files: the cached answer
    lines = path.read_bytes().split(b"\n")
    lines[5] = lines[5].replace(b'"n":5', b'"n":6')
    path.write_bytes(b"\n".join(lines))
    assert status.check().state == "broken"


def test_chain_status_follows_the_chain_across_rotated_files(tmp_path: Path) -> None:
    """Rotated files are verified once and then trusted while unchanged; an edit to one is still seen."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, redactor=Redactor(), rotate_bytes=4096)
    log.open()
    try:
        for n in range(60):
            log.append({"event": "end", "tool": "t", "n": n})
    finally:
        log.close()
    assert path.with_name("audit.jsonl.2").exists()
    status = ChainStatus(path, every_s=0.0)
    assert status.check().state == "ok"
    assert "60 records" in status.check().message
    first = path.with_name("audit.jsonl.1")
    first.write_bytes(first.read_bytes().replace(b'"n":3', b'"n":4'))
    broken = status.check()
    assert broken.state == "broken"
    assert "audit.jsonl.1" in broken.message
    first.unlink()
    assert "is missing" in status.check().message


def test_chain_status_is_not_computed_past_its_cap(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    write_log(path, 20)
    state = ChainStatus(path, max_bytes=1000).check()
    assert state.state == "unchecked"
    assert "bastion audit verify" in state.message


def test_a_query_of_thousands_of_parameter_names_is_checked_in_one_pass() -> None:
    # The administrator's browser can be sent (a link, a preview page's navigation) to a URL of the
    # longest head with a distinct name per parameter: the check must not be quadratic on the event loop.
    pairs = [(f"{i:x}", "") for i in range(50_000)]
    started = time.perf_counter()
    refuse_repeated(pairs)
    assert time.perf_counter() - started < 1.0
    with pytest.raises(InvalidRequest, match="each filter may be given once"):
        refuse_repeated([*pairs, ("tool", "a"), ("tool", "b")])

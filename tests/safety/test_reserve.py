"""The audit log's reserve: space allocated past its end, so a full state filesystem does not stop calls at once.

Real files: an ext4 or tmpfs temp folder for the allocation checks, and a 2 MiB tmpfs (root) filled by a
filler file for the attack. What this proves: the reserve is allocated without changing the file's size,
rotated files give theirs back, and with the filesystem full records keep landing in the reserve, then
are refused (fail-closed, typed), and are accepted again once space returns, with the chain intact. What
it does not prove: how the server's tools answer (tests/load/test_fault_full_disk.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.safety.audit import AuditLog, verify
from bastion.safety.errors import AuditUnavailable
from bastion.safety.redact import Redactor
from tests.helpers import fill, tmpfs

RESERVE = 256 * 1024


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_the_reserve_is_allocated_past_the_end_without_changing_the_size(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, redactor=Redactor(), reserve_bytes=RESERVE)
    log.open()
    try:
        assert path.stat().st_size == 0
        assert allocated(path) >= RESERVE
        for n in range(500):
            log.append({"event": "call", "n": n})
        size = path.stat().st_size
        assert allocated(path) - size >= RESERVE // 2
    finally:
        log.close()
    assert verify(path).ok


def test_rotated_files_keep_no_reserve(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, redactor=Redactor(), rotate_bytes=16384, reserve_bytes=RESERVE)
    log.open()
    try:
        for n in range(300):
            log.append({"event": "call", "n": n})
    finally:
        log.close()
    rotated = sorted(tmp_path.glob("audit.jsonl.*"))
    assert rotated
    for file in rotated:
        assert allocated(file) <= file.stat().st_size + 4096
    assert verify(path).ok


@pytest.fixture
def small_state(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with tmpfs(tmp_path / "state", "2m") as mountpoint:
        yield mountpoint


def append_until_refused(log: AuditLog) -> tuple[int, AuditUnavailable]:
    """How many records were written before the first refusal, and that refusal."""
    written = 0
    try:
        while written < 100_000:
            log.append({"event": "call", "tool": "run_command", "n": written, "pad": "x" * 200})
            written += 1
    except AuditUnavailable as exc:
        return written, exc
    raise AssertionError("the log never refused a record on a full filesystem")


@pytest.mark.root
def test_a_sandbox_filling_the_state_filesystem_leaves_audited_calls_the_reserve_then_they_fail_closed(
    small_state: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Attack: an agent fills its disk image, a sparse file on the state filesystem, until that is full.
    Invariant: records keep landing in the log's reserve (the administrator is warned once), then are
    refused with AUDIT_UNAVAILABLE (never unrecorded), and are accepted again once space returns; the
    chain verifies and no torn line is left."""
    path = small_state / "audit.jsonl"
    log = AuditLog(path, redactor=Redactor(), reserve_bytes=RESERVE)
    log.open()
    try:
        filler = fill(small_state)
        with caplog.at_level(logging.WARNING, logger="bastion.audit"):
            written, refusal = append_until_refused(log)
        assert "audit log unavailable" in refusal.reason
        assert written * 250 > RESERVE // 2  # the reserve carried the records past the full filesystem
        reserve_warnings = [r for r in caplog.records if "reserve not topped up" in r.getMessage()]
        assert len(reserve_warnings) == 1
        filler.unlink()
        log.append({"event": "call", "tool": "run_command", "n": "after"})
        assert allocated(path) - path.stat().st_size >= RESERVE // 2  # the reserve is back
    finally:
        log.close()
    report = verify(path)
    assert report.ok
    assert report.records == written + 1

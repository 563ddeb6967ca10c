"""Audit log throughput against a bare write+fdatasync loop, on the repository's disk.

The audit log makes each record durable with fdatasync, so the baseline is the same: one write
and one fdatasync per line of the same length. The disk is shared and noisy (its syncs are
bimodal here: 0.2 ms, or several ms while other tests sync), so both run in alternating blocks
of BLOCK records, the first of each pair flipping every round, and every record is timed: the
rates over all blocks and the ratio of the per-record medians are reported. Then WRITERS
concurrent writers through `append_async`: the rate against the bare loop, and records per
fdatasync (group commit).

Run: .venv/bin/python bench/bench_audit.py [records]
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

from bastion.safety.audit import AuditLog
from bastion.safety.redact import Redactor

REPO = Path(__file__).resolve().parent.parent
WRITERS = 8
BLOCK = 25
TARGET_RATIO = 0.8
RECORD: dict[str, object] = {
    "action": "run_command",
    "decision": "allowed",
    "argv": ["git", "status", "--porcelain"],
    "cwd": "/workspace/project",
    "exit_status": 0,
    "duration_ms": 12.5,
    "output": "M src/app.py\n?? notes.txt\n" * 2,
}


def bare_block(fd: int, line: bytes, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        os.write(fd, line)
        os.fdatasync(fd)
        times.append(time.perf_counter() - start)
    return times


def audit_block(log: AuditLog, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        log.append(RECORD)
        times.append(time.perf_counter() - start)
    return times


def single_writer(directory: Path, n: int) -> tuple[list[float], list[float], int]:
    """Alternating blocks: (bare seconds per record, audit seconds per record, audit line bytes)."""
    log = AuditLog(directory / "single.jsonl", redactor=Redactor())
    log.open()
    log.append(RECORD)
    line_bytes = (directory / "single.jsonl").stat().st_size
    line = b"x" * (line_bytes - 1) + b"\n"
    fd = os.open(directory / "bare.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    bare: list[float] = []
    audit: list[float] = []
    try:
        for turn in range(max(1, n // BLOCK)):
            # Each goes first in every other round: on a shared disk, the first of a pair is often the faster.
            if turn % 2:
                audit += audit_block(log, BLOCK)
                bare += bare_block(fd, line, BLOCK)
            else:
                bare += bare_block(fd, line, BLOCK)
                audit += audit_block(log, BLOCK)
    finally:
        os.close(fd)
        log.close()
    return bare, audit, line_bytes


def concurrent_writers(directory: Path, n: int) -> tuple[float, float]:
    """(records/s, records per fdatasync) with WRITERS tasks appending at once."""
    log = AuditLog(directory / "group.jsonl", redactor=Redactor())
    log.open()
    per_writer = n // WRITERS

    async def writer() -> None:
        for _ in range(per_writer):
            await log.append_async(RECORD)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(WRITERS):
                tg.start_soon(writer)

    try:
        start = time.perf_counter()
        anyio.run(main)
        rate = per_writer * WRITERS / (time.perf_counter() - start)
        return rate, per_writer * WRITERS / max(1, log.syncs)
    finally:
        log.close()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    directory = Path(tempfile.mkdtemp(prefix=".bench-audit-", dir=REPO / "bench"))
    try:
        bare, audit, line_bytes = single_writer(directory, n)
        group, per_sync = concurrent_writers(directory, n)
    finally:
        shutil.rmtree(directory)
    bare_rate, audit_rate = len(bare) / sum(bare), len(audit) / sum(audit)
    ratio = audit_rate / bare_rate
    median_ratio = statistics.median(bare) / statistics.median(audit)
    print(f"{len(bare) // BLOCK} alternating blocks of {BLOCK} records, {line_bytes}-byte lines, on {REPO}")
    print(f"{'case':<40}{'records/s':>12}{'vs bare':>10}")
    print(f"{'bare os.write + os.fdatasync loop':<40}{bare_rate:>12,.0f}{1:>9.2f}x")
    print(f"{'AuditLog.append, 1 writer':<40}{audit_rate:>12,.0f}{ratio:>9.2f}x")
    print(f"{f'AuditLog.append_async, {WRITERS} writers':<40}{group:>12,.0f}{group / bare_rate:>9.2f}x")
    print(
        f"1 writer, per-record p50: bare {statistics.median(bare) * 1000:.3f} ms, "
        f"audit {statistics.median(audit) * 1000:.3f} ms ({median_ratio:.2f}x)"
    )
    print(f"{WRITERS} writers: {per_sync:.1f} records per fdatasync (group commit)")
    verdict = "met" if ratio >= TARGET_RATIO else "MISSED"
    print(f"target: AuditLog.append >= {TARGET_RATIO}x the bare loop from one writer: {verdict}")
    sys.exit(0 if ratio >= TARGET_RATIO else 1)


if __name__ == "__main__":
    main()

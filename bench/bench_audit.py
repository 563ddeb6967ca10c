"""Audit log throughput against a bare write+fsync loop, on the repository's disk.

Run: .venv/bin/python bench/bench_audit.py [records]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import anyio

from bastion.safety.audit import AuditLog
from bastion.safety.redact import Redactor

REPO = Path(__file__).resolve().parent.parent
WRITERS = 8
TARGET_RATE = 2_500
RECORD: dict[str, object] = {
    "action": "run_command",
    "decision": "allowed",
    "argv": ["git", "status", "--porcelain"],
    "cwd": "/workspace/project",
    "exit_status": 0,
    "duration_ms": 12.5,
    "output": "M src/app.py\n?? notes.txt\n" * 2,
}


def bare_fsync(directory: Path, n: int) -> float:
    path = directory / "bare.jsonl"
    line = b"x" * 299 + b"\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        start = time.perf_counter()
        for _ in range(n):
            os.write(fd, line)
            os.fsync(fd)
        return n / (time.perf_counter() - start)
    finally:
        os.close(fd)


def single_writer(directory: Path, n: int) -> tuple[float, int]:
    log = AuditLog(directory / "single.jsonl", redactor=Redactor())
    log.open()
    try:
        start = time.perf_counter()
        for _ in range(n):
            log.append(RECORD)
        rate = n / (time.perf_counter() - start)
    finally:
        log.close()
    return rate, (directory / "single.jsonl").stat().st_size // n


def concurrent_writers(directory: Path, n: int) -> float:
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
        return per_writer * WRITERS / (time.perf_counter() - start)
    finally:
        log.close()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    directory = Path(tempfile.mkdtemp(prefix=".bench-audit-", dir=REPO / "bench"))
    try:
        bare = bare_fsync(directory, n)
        single, line_bytes = single_writer(directory, n)
        group = concurrent_writers(directory, n)
    finally:
        shutil.rmtree(directory)
    print(f"{n} records each, ~{line_bytes}-byte audit lines, on {REPO}")
    print(f"{'case':<36}{'records/s':>12}{'vs bare':>10}")
    for name, rate in (
        ("bare os.write + os.fsync loop", bare),
        ("AuditLog.append, 1 writer", single),
        (f"AuditLog.append_async, {WRITERS} writers", group),
    ):
        print(f"{name:<36}{rate:>12,.0f}{rate / bare:>9.2f}x")
    verdict = "met" if single >= TARGET_RATE else "MISSED"
    print(f"target: AuditLog.append >= {TARGET_RATE:,} records/s from one writer: {verdict}")
    sys.exit(0 if single >= TARGET_RATE else 1)


if __name__ == "__main__":
    main()

"""A huge audit log does not make the administrator's pages slow or unbounded (live server, no sandboxes).

What this proves: with a 72 MiB valid chain as the current log, /admin/audit reads one bounded window
(at most `SCAN_BYTES`) and shows at most `PAGE_RECORDS` records, a filter matching nothing reads no more,
the "Older records" link continues from where the page stopped, and the overview does not verify the
chain on a page load (it says to run `bastion audit verify`). What it does not prove: a log on a slow
disk, or rotated files (the pages read the current file only).
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.safety.audit import GENESIS
from bastion.transports.http.audit_view import PAGE_RECORDS, SCAN_BYTES
from bastion.transports.http.password import write_hash

from .live import PASSWORD, Browser, LiveServer, free_port, serve_config, write_config

LOG_BYTES = 72 << 20  # over VERIFY_MAX_BYTES: 36 scan windows


def write_chain(path: Path, size: int) -> int:
    """A valid hash chain of tool-call records, about `size` bytes; returns the record count."""
    prev, seq, written = GENESIS, 0, 0
    pad = "x" * 300
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        while written < size:
            line = (
                f'{{"caller":"http:bulk","code":"OK","event":"end","id":"{seq:032x}","pad":"{pad}",'
                f'"prev":"{prev}","seq":{seq},"tool":"read_file","ts":"2026-12-04T00:00:00.000Z"}}'
            ).encode()
            f.write(line + b"\n")
            prev, seq, written = hashlib.sha256(line).hexdigest(), seq + 1, written + len(line) + 1
    return seq


@pytest.fixture(scope="module")
def huge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("huge") / "demo"
    port = free_port()
    config = write_config(root, port)
    config.write_text(config.read_text().replace("rotate_bytes = 67108864", f"rotate_bytes = {1 << 30}"))
    write_hash(root / "state" / "admin-password.argon2", PASSWORD)
    write_chain(root / "state" / "audit.jsonl", LOG_BYTES)
    with serve_config(root, config, port) as server:
        yield server


@pytest.fixture
def admin(huge: LiveServer) -> Iterator[Browser]:
    browser = Browser(huge)
    browser.login(browser.open("/admin/login"))
    yield browser
    browser.close()


def rows(page: str) -> int:
    return len(re.findall(r"<tr><td data-label=\"Time\"", page))


def test_an_audit_page_of_a_huge_log_reads_one_bounded_window(admin: Browser) -> None:
    started = time.monotonic()
    first = admin.open("/admin/audit")
    elapsed = time.monotonic() - started
    assert first.status_code == 200
    assert rows(first.text) == PAGE_RECORDS
    scanned = re.search(r"this page read ([\d.]+ \w+) of ([\d.]+ \w+)", first.text)
    assert scanned is not None
    assert scanned.group(2).endswith("MiB")
    assert float(scanned.group(2).split()[0]) >= 72
    assert elapsed < 5.0  # generous: the page takes ~0.1 s; a full parse of the log would take seconds
    older = re.search(r'href="(/admin/audit\?before=\d+)"', first.text)
    assert older is not None
    second = admin.open(older.group(1))
    assert second.status_code == 200
    assert rows(second.text) == PAGE_RECORDS
    seqs = [re.findall(r'data-label="Seq">(\d+)<', page.text) for page in (first, second)]
    assert int(seqs[0][-1]) == int(seqs[1][0]) + 1  # the second page continues exactly where the first stopped


def test_a_filter_matching_nothing_reads_no_more_than_one_window(admin: Browser) -> None:
    page = admin.open("/admin/audit?tool=never_called")
    assert page.status_code == 200
    assert rows(page.text) == 0
    scanned = re.search(r"this page read ([\d.]+) (\w+) of", page.text)
    assert scanned is not None
    amount = float(scanned.group(1)) * {"B": 1, "KiB": 1024, "MiB": 1 << 20}[scanned.group(2)]
    assert amount <= SCAN_BYTES
    assert "Older records" in page.text


def test_the_overview_does_not_verify_a_huge_chain_on_a_page_load(admin: Browser) -> None:
    page = admin.open("/admin")
    assert page.status_code == 200
    assert "unchecked" in page.text
    assert "bastion audit verify" in page.text

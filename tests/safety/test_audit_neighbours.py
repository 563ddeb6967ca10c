"""The audit log's rotated files against another local user (uid 65534) who may add names to its folder.

The log is found by name, and so are its rotated files (``audit.jsonl.N``): `AuditLog.open` continues the
chain of the newest one, and `verify` reads them all. In a sticky folder others may write (/tmp), another
user can add the names that are missing. Before, a FIFO planted as the newest hung the root server's start
for good (it waited for a writer), and a chain they forged from genesis was continued by root's records and
passed `bastion audit verify`. The server now refuses such a folder at start (tests/test_serve_audit_folder.py);
these tests take the log itself, with no folder check in front, as the last line.

What this does not prove: anything about a folder only root can write (root may write any chain it likes:
see the module docstring of `bastion.safety.audit`), nor about a rotated file of root's that root edited.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.safety.audit import GENESIS, AuditLog, VerifyReport, verify
from bastion.safety.errors import AuditUnavailable
from bastion.safety.redact import Redactor
from tests.helpers import sticky_folder

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root"),
]

NOBODY = 65534
SERVICE_USER = 12345  # a non-root server's own user, as `bastion install-service` makes one
OPEN_DEADLINE_S = 10.0


def as_nobody(*argv: str, stdin: bytes | None = None) -> None:
    """Run `argv` as uid 65534 with no groups, as the attacker did (setpriv)."""
    setpriv = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]
    subprocess.run([*setpriv, *argv], input=stdin, capture_output=True, timeout=30, check=True)


@pytest.fixture
def sticky() -> Iterator[Path]:
    with sticky_folder() as folder:
        yield folder


def forged_chain(count: int) -> bytes:
    """`count` records chained from genesis, as anyone can write them (the hash chain has no key)."""
    prev, lines = GENESIS, []
    for seq in range(count):
        body = {"id": "f" * 32, "seq": seq, "ts": "2026-01-01T00:00:00.000Z", "prev": prev, "event": "forged"}
        line = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        lines.append(line)
        prev = hashlib.sha256(line).hexdigest()
    return b"\n".join(lines) + b"\n"


def continued(chain: bytes, count: int) -> bytes:
    """`count` more records continuing `chain`: what root's server appended before the fix."""
    lines = chain.splitlines()
    prev, seq = hashlib.sha256(lines[-1]).hexdigest(), len(lines)
    out = []
    for offset in range(count):
        body = {"id": "a" * 32, "seq": seq + offset, "ts": "2026-01-02T00:00:00.000Z", "prev": prev, "tool": "t"}
        line = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        out.append(line)
        prev = hashlib.sha256(line).hexdigest()
    return b"\n".join(out) + b"\n"


def rotated_log(path: Path, records: int = 40) -> AuditLog:
    """A closed log of root's at `path` that rotated at least twice."""
    log = AuditLog(path, redactor=Redactor(), rotate_bytes=2000)
    log.open()
    for n in range(records):
        log.append({"tool": "run_command", "n": n})
    log.close()
    assert path.with_name(f"{path.name}.2").exists()
    return log


def open_within_deadline(log: AuditLog, fifo: Path) -> BaseException | None:
    """`log.open()` in a thread; what it raised, or None. One still waiting after the deadline (on `fifo`) is
    released by opening the FIFO for writing, so the test fails instead of hanging."""
    raised: list[BaseException] = []

    def opening() -> None:
        try:
            log.open()
        except BaseException as exc:  # reported to the test
            raised.append(exc)

    thread = threading.Thread(target=opening)
    thread.start()
    thread.join(OPEN_DEADLINE_S)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a reader waits: this open succeeds at once
        thread.join()
        log.close()
        pytest.fail(f"AuditLog.open waited on the FIFO {fifo} for {OPEN_DEADLINE_S} s")
    return raised[0] if raised else None


def test_a_fifo_a_neighbour_plants_as_the_newest_rotated_log_is_refused_not_waited_on(sticky: Path) -> None:
    """Attack: root's log just rotated (no new file yet), and uid 65534 adds the next ``audit.jsonl.N`` as a
    FIFO in the sticky folder. Invariant: `open` refuses at once naming the FIFO (never waits for a writer), writes
    no record, and root's rotated files are as they were; `verify` names the FIFO too."""
    path = sticky / "audit.jsonl"
    rotated_log(path)
    newest = max(int(p.name.rsplit(".", 1)[1]) for p in sticky.glob("audit.jsonl.*"))
    path.rename(path.with_name(f"audit.jsonl.{newest + 1}"))  # as a rotation leaves it: no live file yet
    before = {p.name: p.read_bytes() for p in sticky.iterdir()}
    fifo = path.with_name(f"audit.jsonl.{newest + 2}")
    as_nobody("mkfifo", "-m", "644", str(fifo))

    log = AuditLog(path, redactor=Redactor())
    raised = open_within_deadline(log, fifo)

    assert isinstance(raised, AuditUnavailable), raised
    assert raised.reason.startswith(f"{fifo} is not a regular file (the server never leaves one so)")
    with pytest.raises(AuditUnavailable, match="not open"):
        log.append({"tool": "after the refusal"})
    assert path.read_bytes() == b""  # made by open, 0600 root's, and nothing written to it
    assert {p.name: p.read_bytes() for p in sticky.iterdir() if p not in (fifo, path)} == before
    report = verify(path)
    assert (report.ok, report.file) == (False, str(fifo))


def test_a_chain_a_neighbour_forged_from_genesis_is_neither_continued_nor_verified(sticky: Path) -> None:
    """Attack: uid 65534 writes ``audit.jsonl.1`` in the sticky folder, two records chained from genesis
    ("approved-by-admin"), before root's server first starts there. Invariant: root's `open` refuses naming the
    file and its owner, and writes nothing; and a log that continued such a chain (as the server did before)
    fails `verify` at the forged file, whose chain is intact: its owner, not its hashes, gives it away."""
    path = sticky / "audit.jsonl"
    forged = sticky / "audit.jsonl.1"
    chain = forged_chain(2)
    as_nobody("sh", "-c", f"umask 022; cat > {forged}", stdin=chain)

    log = AuditLog(path, redactor=Redactor())
    with pytest.raises(AuditUnavailable) as caught:
        log.open()

    assert caught.value.reason == (
        f"{forged} is owned by uid {NOBODY}, not 0 (the server never leaves one so): move it out of the log's "
        "folder and find who made it"
    )
    assert path.read_bytes() == b""
    assert forged.read_bytes() == chain
    # What the root server wrote there before: its records after the forged ones, its file its own.
    path.write_bytes(continued(chain, 3))
    report = verify(path)
    assert report == VerifyReport(
        False,
        0,
        f"{forged} is owned by uid {NOBODY}, not 0 (the server never leaves one so): move it out of the log's "
        "folder and find who made it",
        str(forged),
        None,
    )


@pytest.mark.parametrize("plant", ["owner", "hard-link", "group-writable"])
def test_verify_fails_on_a_rotated_file_the_server_would_not_leave(tmp_path: Path, plant: str) -> None:
    """Invariant: a rotated file of another owner, or that its group may write, fails `verify`, named, though
    every hash in it still links; the log refuses to continue from it, nor from one with a second link."""
    path = tmp_path / "audit.jsonl"
    rotated_log(path)
    newest = max(int(p.name.rsplit(".", 1)[1]) for p in tmp_path.glob("audit.jsonl.*"))
    target = path.with_name(f"audit.jsonl.{newest}")
    if plant == "owner":
        os.chown(target, SERVICE_USER, SERVICE_USER)
        said = f"is owned by uid {SERVICE_USER}, not 0"
    elif plant == "hard-link":
        os.link(target, tmp_path / "elsewhere")
        said = "has 2 hard links"
    else:
        target.chmod(0o620)
        said = "is writable by group or others"
    report = verify(path)
    if plant == "hard-link":  # a backup made with hard links (rsnapshot) verifies; the server goes on from none
        assert report.ok, report
    else:
        assert (report.ok, report.file, report.line) == (False, str(target), None)
        assert report.first_error is not None
        assert report.first_error.startswith(f"{target} {said} (the server never leaves one so)")
    path.unlink()  # the live file gone: open continues from the newest rotated one
    with pytest.raises(AuditUnavailable, match=f"^{target} {said} "):
        AuditLog(path, redactor=Redactor()).open()


def test_verify_of_a_copy_of_roots_log_and_of_a_service_users_log_still_passes(tmp_path: Path) -> None:
    """Not a refusal: `verify` of a copy of root's log (``cp -p``), and of a log whose files are all a service
    user's (root verifying the log of a server that runs as `bastion`), passes; so does the dashboard's view
    of the server's own files. Only a rotated file of someone else fails."""
    path = tmp_path / "log" / "audit.jsonl"
    path.parent.mkdir()
    rotated_log(path)
    assert verify(path).ok

    copy = tmp_path / "copy"
    shutil.copytree(path.parent, copy)
    assert verify(copy / "audit.jsonl") == verify(path)

    for file in path.parent.iterdir():
        os.chown(file, SERVICE_USER, SERVICE_USER)
    assert verify(path) == verify(copy / "audit.jsonl")

    os.chown(copy / "audit.jsonl.1", SERVICE_USER, SERVICE_USER)  # beside root's own files: not the log's owner
    report = verify(copy / "audit.jsonl")
    assert (report.ok, report.file) == (False, str(copy / "audit.jsonl.1"))

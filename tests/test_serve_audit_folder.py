"""`bastion serve` refuses an audit log's folder that another local user may write, even a sticky one.

The state folder's check let a root-owned sticky folder pass (others cannot rename what is root's in it), and
a custom `[audit] path` there (/tmp, /var/tmp) was served. But the log trusts its rotated files by name, and
in a sticky folder uid 65534 could still add the names that are missing: ``audit.jsonl.1`` as a FIFO hung
root's `serve` for good (waiting for a writer), and as a chain forged from genesis it was continued by root's
records and passed `bastion audit verify`. The folder is now judged as a venv's ``bin`` is
(`folder_changeable_by`); the log itself refuses such files too (tests/safety/test_audit_neighbours.py).

What this does not prove: anything about who may write a folder through means the check does not read (see
tests/attacks/test_neighbour_attacks.py, which covers a folder the neighbour owns).
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.config import load_config
from tests.helpers import BASTION, demo_config_at, refused_stdio_start, sticky_folder

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user, against a root server"),
]

NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
START_DEADLINE_S = 60.0
FORGED = b'{"event":"gateway_call deploy approved-by-admin","id":"ffff","prev":"' + b"0" * 64 + b'","seq":0}\n'


@pytest.fixture
def sticky() -> Iterator[Path]:
    with sticky_folder() as folder:
        yield folder


def plant(planted: Path, kind: str) -> None:
    """What uid 65534 puts at `planted`: a FIFO, or a record chained from genesis."""
    if kind == "fifo":
        subprocess.run([*NOBODY, "mkfifo", "-m", "644", str(planted)], check=True, timeout=30)
    else:
        shell = [*NOBODY, "sh", "-c", f"umask 022; cat > {planted}"]
        subprocess.run(shell, input=FORGED, check=True, timeout=30)


def serve_stdio(config: Path, fifo: Path) -> subprocess.CompletedProcess[str]:
    """`bastion serve --stdio` with no client (stdin at its end): it must stop by itself. One still waiting on
    `fifo` after the deadline is released (a writer opens it) and stopped, and the test fails."""
    args = [str(BASTION), "serve", "--config", str(config), "--stdio"]
    with subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            out, err = process.communicate(timeout=START_DEADLINE_S)
        except subprocess.TimeoutExpired:
            if stat.S_ISFIFO(os.lstat(fifo).st_mode):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            process.send_signal(signal.SIGINT)  # a clean stop, even mid-start: its mounts are undone
            process.communicate(timeout=30)
            pytest.fail(f"bastion serve hung at start for {START_DEADLINE_S} s (waiting on {fifo}?)")
    return subprocess.CompletedProcess(args, process.returncode, out, err)


@pytest.mark.parametrize("kind", ["fifo", "forged"])
def test_a_neighbour_who_plants_a_rotated_log_in_a_sticky_audit_folder_is_refused_at_start(
    tmp_path: Path, sticky: Path, kind: str
) -> None:
    """Attack (/tmp/hS/audit_sticky.py): `[audit] path` in a root-owned sticky folder; uid 65534 adds
    ``audit.jsonl.1`` there (a FIFO, or a forged chain) before root's server starts. Invariant: `serve` exits 78
    at once with one line naming the folder and who may write it; it makes no log there and nothing in its
    state folder, and the planted file is left as it was (evidence)."""
    config = demo_config_at(tmp_path / "demo")
    text = config.read_text().replace("[audit]\n", f'[audit]\npath = "{sticky / "audit.jsonl"}"\n', 1)
    config.write_text(text)
    planted = sticky / "audit.jsonl.1"
    plant(planted, kind)
    before = os.lstat(planted)

    result = serve_stdio(config, planted)

    assert result.returncode == 78, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"bastion: the audit log's folder {sticky} could be replaced by any user: they may write {sticky}: make "
        "it and every folder above it root's and not writable by others (chown, chmod go-w), or choose another "
        "[audit] path"
    ]
    assert list(sticky.iterdir()) == [planted]
    after = os.lstat(planted)
    assert (after.st_ino, after.st_mode, after.st_uid, after.st_size) == (
        before.st_ino,
        before.st_mode,
        before.st_uid,
        before.st_size,
    )
    if kind == "forged":
        assert planted.read_bytes() == FORGED
    assert list(load_config(config).state_dir.iterdir()) == []


def test_an_audit_folder_not_made_yet_in_a_sticky_folder_is_refused_before_anyone_can_make_it(
    tmp_path: Path, sticky: Path
) -> None:
    """Attack (found reviewing the folder check): `[audit] path` names a folder not made yet in a sticky
    folder. It was judged by the sticky folder above it, which passed, and the log was then opened there by
    name: another user who made the folder in between would hold root's log folder. A missing audit folder
    is refused at once (the server makes none but its state folder), and nothing is made."""
    config = demo_config_at(tmp_path / "demo")
    folder = sticky / "new"
    text = config.read_text().replace("[audit]\n", f'[audit]\npath = "{folder / "audit.jsonl"}"\n', 1)
    config.write_text(text)
    assert refused_stdio_start(config) == (
        f"bastion: the audit log's folder {folder} does not exist: make it (not writable by others) or choose "
        "another [audit] path"
    )
    assert list(sticky.iterdir()) == []

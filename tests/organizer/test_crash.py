"""kill -9 in the middle of apply_plan: the next start leaves every file in exactly one place.

What this proves: for an apply_plan of 200 moves killed with SIGKILL at 50 random points
(before, during and after the journal's begin record, between any two renames, during the
end record, with torn journal writes, and during a recovery that is itself killed), the next
start's recovery leaves the multiset of file contents unchanged, nothing outside the inbox,
and either the tree as it was with nothing to undo, or the whole plan applied and undoable,
with undo restoring the exact tree.

The 50 points are counted events inside the forked child, so each lands exactly between two
steps that matter; `test_apply_killed_from_outside_recovers` adds kills sent by the parent
to a separate interpreter after a random delay, landing wherever the child happens to be
(inside an fsync, a mkdir, the re-check), with the same invariants.

What it does not prove: durability across a power cut (the kill stops the process, not the
kernel, so page-cache state survives), or crashes of other actions than apply (they share
the same transaction code).
"""

from __future__ import annotations

import os
import random
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bastion.config import InboxConfig
from bastion.organizer import Organizer
from bastion.organizer.folder import Folder
from bastion.organizer.journal import Journal
from bastion.safety.errors import ConfigError

from .trees import Tree, snapshot

FILES = 200
EXTENSIONS = ("pdf", "jpg", "mp3", "mp4", "zip", "py", "csv", "txt")
# Events seen by the child: 1 begin record + 200 renames + 1 end record.
EVENTS = FILES + 2


def _fill(inbox: Path) -> None:
    for index in range(FILES):
        name = f"file {index:03d}.{EXTENSIONS[index % len(EXTENSIONS)]}"
        (inbox / name).write_bytes(f"content of file {index}\n".encode())


def _filled(tmp_path: Path) -> tuple[Path, Path, Path, Tree, InboxConfig]:
    """An inbox of `FILES` files beside an empty state folder and an empty folder outside: the inbox, the state
    folder, the outside one, the inbox's tree, and its config."""
    inbox, state, outside = tmp_path / "inbox", tmp_path / "state", tmp_path / "outside"
    for folder in (inbox, state, outside):
        folder.mkdir()
    _fill(inbox)
    return inbox, state, outside, snapshot(inbox), InboxConfig(id="inbox", path=inbox, max_plan_moves=FILES)


def _die_at(event: int, torn: bool) -> None:
    """In the child: SIGKILL ourselves at the `event`-th journal write or rename."""
    seen = [0]
    original_rename: Callable[..., None] = Folder.rename
    original_append: Callable[[Journal, bytes], None] = Journal._append

    def tick() -> None:
        seen[0] += 1
        if seen[0] == event:
            os.kill(os.getpid(), signal.SIGKILL)

    def rename(self: Folder, *args: Any, **kwargs: Any) -> None:
        tick()
        original_rename(self, *args, **kwargs)

    def append(self: Journal, data: bytes) -> None:
        if torn and seen[0] + 1 == event:
            os.write(self._fd, data[: len(data) // 2])  # a write cut short by the kill
        tick()
        original_append(self, data)

    Folder.rename = rename  # type: ignore[method-assign]
    Journal._append = append  # type: ignore[method-assign]


def _in_child(work: Callable[[], None]) -> None:
    pid = os.fork()
    if pid == 0:
        try:
            work()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) or os.WEXITSTATUS(status) == 0, status


def _apply(config: InboxConfig, state: Path, event: int, torn: bool) -> Callable[[], None]:
    def work() -> None:
        organizer = Organizer(config, state)
        organizer.open()
        plan = organizer.plan()
        assert len(plan["moves"]) == FILES
        _die_at(event, torn)
        organizer.apply(plan["plan_id"])

    return work


def _recover_and_die(config: InboxConfig, state: Path, event: int) -> Callable[[], None]:
    def work() -> None:
        _die_at(event, torn=False)
        Organizer(config, state).open()

    return work


def _points() -> list[tuple[int, bool, int | None]]:
    """50 (event, torn write, kill recovery at rename n) triples, random but reproducible."""
    rng = random.Random(7)
    points: list[tuple[int, bool, int | None]] = [(1, True, None), (EVENTS, True, None), (EVENTS, False, None)]
    while len(points) < 50:
        event = rng.randint(1, EVENTS)
        torn = rng.random() < 0.1
        again = rng.randint(1, 100) if rng.random() < 0.2 else None
        points.append((event, torn, again))
    return points


@pytest.mark.parametrize(("event", "torn", "kill_recovery"), _points())
def test_apply_killed_at_random_point_recovers(
    tmp_path: Path, event: int, torn: bool, kill_recovery: int | None
) -> None:
    inbox, state, outside, original, config = _filled(tmp_path)

    _in_child(_apply(config, state, event, torn))
    if kill_recovery is not None:
        _in_child(_recover_and_die(config, state, kill_recovery))

    _check_recovered(config, state, inbox, outside, original)


def _check_recovered(config: InboxConfig, state: Path, inbox: Path, outside: Path, original: Tree) -> None:
    """Start as the next server would; every file is in exactly one place and the history agrees."""
    organizer = Organizer(config, state)
    organizer.open()
    try:
        after = snapshot(inbox)
        files_after = sorted(data for kind, data in after.values() if kind == "file")
        assert files_after == sorted(data for _, data in original.values()), "a file was lost or duplicated"
        assert list(outside.iterdir()) == []
        assert organizer.journal.path.parent.is_relative_to(state)
        assert organizer.history.undone == []
        if organizer.history.done:
            # The end record made it: the whole plan is applied and undoes as one action.
            assert len(organizer.history.done) == 1
            assert len(organizer.history.done[0].moves) == FILES
            assert all(kind == "dir" or "/" in path for path, (kind, _) in after.items())
            organizer.undo()
            assert snapshot(inbox) == original
        else:
            assert after == original, "a rolled-back apply left the tree changed"
    finally:
        organizer.close()
    # A second start finds nothing left to do.
    again = Organizer(config, state)
    assert again.open() is None
    again.close()


@pytest.mark.parametrize("event", [2, 3, 50, 150, EVENTS - 1, EVENTS])
def test_undo_killed_at_random_point_recovers(tmp_path: Path, event: int) -> None:
    """An interrupted undo of a whole plan is rolled back: the plan stays applied and undoable
    as one action, the folders the undo had removed are back, and a later undo restores the tree.

    The kill lands after the begin record (event 2: before the first rename) and up to the end
    record (EVENTS: all renames done and the emptied folders removed)."""
    inbox, state = tmp_path / "inbox", tmp_path / "state"
    for folder in (inbox, state):
        folder.mkdir()
    _fill(inbox)
    original: Tree = snapshot(inbox)
    config = InboxConfig(id="inbox", path=inbox, max_plan_moves=FILES)
    organizer = Organizer(config, state)
    organizer.open()
    organizer.apply(organizer.plan()["plan_id"])
    organizer.close()
    applied = snapshot(inbox)

    def work() -> None:
        child = Organizer(config, state)
        child.open()
        _die_at(event, torn=False)
        child.undo()

    _in_child(work)
    organizer = Organizer(config, state)
    assert organizer.open() is not None, "the kill left no interrupted undo to roll back"
    try:
        assert snapshot(inbox) == applied
        assert [len(a.moves) for a in organizer.history.done] == [FILES]
        assert organizer.history.undone == []
        organizer.undo()
        assert snapshot(inbox) == original
    finally:
        organizer.close()


_CHILD = """
import sys
from pathlib import Path
from bastion.config import InboxConfig
from bastion.organizer import Organizer

config = InboxConfig(id="inbox", path=Path(sys.argv[1]), max_plan_moves=int(sys.argv[3]))
organizer = Organizer(config, Path(sys.argv[2]))
organizer.open()
plan_id = organizer.plan()["plan_id"]
print("ready", flush=True)
organizer.apply(plan_id)
print("applied", flush=True)
"""
# Upper bound of the random delay between the child's "ready" and the SIGKILL; an apply of 200
# moves takes about 10-40 ms here, so most kills land inside it and some before or after.
KILL_WINDOW_S = 0.03


@pytest.mark.parametrize("seed", range(10))
def test_apply_killed_from_outside_recovers(tmp_path: Path, seed: int) -> None:
    inbox, state, outside, original, config = _filled(tmp_path)
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(inbox), str(state), str(FILES)],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == b"ready\n"
        time.sleep(random.Random(seed).uniform(0, KILL_WINDOW_S))  # the random kill point, not a wait
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()
    _check_recovered(config, state, inbox, outside, original)


def _open_past_a_size_limit(config: InboxConfig, state: Path, reason: Path) -> Callable[[], None]:
    """In a child: the next start, where no file may grow (RLIMIT_FSIZE: its writes fail as on a full
    filesystem, EFBIG for ENOSPC); the refusal's reason written to `reason`."""

    def work() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing
        reason.touch()
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
        organizer = Organizer(config, state)
        try:
            organizer.open()
        except ConfigError as exc:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            reason.write_text(str(exc))

    return work


def test_restart_that_cannot_write_its_journal_refuses_in_one_line_and_loses_nothing(tmp_path: Path) -> None:
    """Found by attack: apply_plan killed part-way, then a restart on a full state filesystem: the rollback's
    end record could not be written and the server died with a traceback (an OSError from the journal). It
    now refuses with one line saying what to do; the files are back where they were, and the start after
    space returns finishes the recovery."""
    inbox, state, outside, original, config = _filled(tmp_path)
    _in_child(_apply(config, state, 30, torn=False))
    reason = tmp_path / "reason.txt"
    _in_child(_open_past_a_size_limit(config, state, reason))
    assert reason.read_text().startswith("inbox 'inbox': its journal ")
    assert "(File too large): free space on the state filesystem and start again" in reason.read_text()
    assert snapshot(inbox) == original  # the moves were put back before the write that failed
    _check_recovered(config, state, inbox, outside, original)

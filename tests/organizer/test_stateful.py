"""A hypothesis state machine: random trees, random sequences of list, plan, apply, move, undo, redo.

Invariants checked after every step: the multiset of file contents is conserved (every file
has unique content, so nothing was overwritten or lost and nothing was duplicated); nothing
outside the inbox changed and nothing left it; a refused call changed nothing; planning
changed nothing; undo restores the exact tree that the action started from, and redo the
exact tree it produced, unless someone else changed the folder in between. Moves name both
random paths and entries that exist (files, folders, symbolic links); a server restart keeps
the undo history and turns every earlier plan into a NOT_FOUND refusal that moves nothing.

What it does not prove: behaviour under concurrent outside changes during a call (the
crash and race tests cover parts of that), or on other file systems than the test's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from bastion.config import InboxConfig
from bastion.organizer import Organizer
from bastion.safety.errors import BastionError, NotFound

from .trees import Tree, snapshot

STEMS = ("a", "b c", "résumé", "日本語", ".hidden", "x\x1by", "setup", "Documents", "dir two", "z")
EXTENSIONS = ("", ".pdf", ".jpg", ".mp3", ".exe", ".tar.gz", ".txt", ".PNG")
FOLDERS = (".", "Documents", "Images", "sub", "sub/deeper", "dir two", "Archives")
# Symbolic links to a folder outside the inbox, to a file, to a folder inside, and dangling.
LINK_TARGETS = ("outside", "a.pdf", "../sub", "missing/none")

names = st.builds(lambda stem, ext: stem + ext, st.sampled_from(STEMS), st.sampled_from(EXTENSIONS))
folders = st.sampled_from(FOLDERS)


class OrganizerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.base = Path(tempfile.mkdtemp(prefix="organizer-sm-"))
        self.inbox = self.base / "inbox"
        self.outside = self.base / "outside"
        self.state = self.base / "state"
        for folder in (self.inbox, self.outside, self.state):
            folder.mkdir()
        (self.outside / "secret.txt").write_bytes(b"outside")
        self.counter = 0
        self.expected: list[bytes] = []
        self.plans: list[str] = []
        self.stale_plans: list[str] = []
        self.before_done: list[Tree | None] = []
        self.before_undone: list[Tree | None] = []
        self.organizer: Organizer | None = None

    def _content(self) -> bytes:
        self.counter += 1
        return f"unique content {self.counter}".encode()

    def _add_file(self, folder: str, name: str) -> None:
        where = self.inbox / folder
        where.mkdir(parents=True, exist_ok=True)
        path = where / name
        if os.path.lexists(path):
            return
        data = self._content()
        path.write_bytes(data)
        self.expected.append(data)

    @initialize(
        files=st.lists(st.tuples(folders, names), min_size=1, max_size=15),
        links=st.lists(st.tuples(folders, names, st.sampled_from(LINK_TARGETS)), max_size=4),
    )
    def build_tree(self, files: list[tuple[str, str]], links: list[tuple[str, str, str]]) -> None:
        for folder, name in files:
            if not (self.inbox / folder).is_file():
                self._add_file(folder, name)
        for folder, name, target in links:
            where = self.inbox / folder
            if where.is_dir() and not where.is_symlink() and not os.path.lexists(where / name):
                os.symlink(self.outside if target == "outside" else target, where / name)
        self.outside_before = snapshot(self.outside)
        self.organizer = Organizer(InboxConfig(id="inbox", path=self.inbox), self.state)
        self.organizer.open()

    @property
    def org(self) -> Organizer:
        assert self.organizer is not None
        return self.organizer

    def _call(self, work: str, *args: str) -> bool:
        """Run one organizer call; True when it moved something."""
        before = snapshot(self.inbox)
        try:
            detail = getattr(self.org, work)(*args)
        except BastionError:
            assert snapshot(self.inbox) == before, f"a refused {work} changed the tree"
            return False
        return bool(detail["moved"])

    def _did(self, before: Tree) -> None:
        self.before_done.append(before)
        self.before_undone.clear()

    @rule(subdir=folders)
    def list_files(self, subdir: str) -> None:
        before = snapshot(self.inbox)
        with contextlib.suppress(BastionError):
            self.org.list_files(subdir)
        assert snapshot(self.inbox) == before

    @rule()
    def plan(self) -> None:
        before = snapshot(self.inbox)
        self.plans.append(self.org.plan()["plan_id"])
        assert snapshot(self.inbox) == before, "planning changed the tree"

    @precondition(lambda self: self.plans)
    @rule(data=st.data())
    def apply(self, data: st.DataObject) -> None:
        plan_id = data.draw(st.sampled_from(self.plans))
        self.plans.remove(plan_id)
        before = snapshot(self.inbox)
        if self._call("apply", plan_id):
            self._did(before)

    @rule()
    def plan_apply_undo(self) -> None:
        before = snapshot(self.inbox)
        plan_id = self.org.plan()["plan_id"]
        if self._call("apply", plan_id):
            self._did(before)
            after = snapshot(self.inbox)
            assert self._call("undo"), "undo right after apply was refused"
            assert snapshot(self.inbox) == before, "undo after apply did not restore the exact tree"
            self.before_done.pop()
            self.before_undone.append(after)

    @rule(src_folder=folders, src=names, dst_folder=folders, dst=names)
    def move(self, src_folder: str, src: str, dst_folder: str, dst: str) -> None:
        before = snapshot(self.inbox)
        if self._call("move", f"{src_folder}/{src}", f"{dst_folder}/{dst}"):
            self._did(before)

    @rule(data=st.data(), dst_folder=folders, dst=names)
    def move_existing(self, data: st.DataObject, dst_folder: str, dst: str) -> None:
        before = snapshot(self.inbox)
        src = data.draw(st.sampled_from(sorted(before)))
        if self._call("move", src, f"{dst_folder}/{dst}"):
            self._did(before)
            assert before[src] == snapshot(self.inbox)[os.path.normpath(f"{dst_folder}/{dst}")]
            assert before[src][0] != "link", "a symbolic link was moved"

    @rule()
    def restart(self) -> None:
        """A server restart: the history survives in the journal, plans do not."""
        before = snapshot(self.inbox)
        self.org.close()
        self.organizer = Organizer(self.org.config, self.state)
        assert self.organizer.open() is None, "a clean stop left something to recover"
        assert snapshot(self.inbox) == before
        self.stale_plans += self.plans
        self.plans = []

    @precondition(lambda self: self.stale_plans)
    @rule(data=st.data())
    def apply_stale_plan(self, data: st.DataObject) -> None:
        plan_id = data.draw(st.sampled_from(self.stale_plans))
        before = snapshot(self.inbox)
        with pytest.raises(NotFound, match=r"server restarted|already used"):
            self.org.apply(plan_id)
        assert snapshot(self.inbox) == before

    @rule()
    def undo(self) -> None:
        before = snapshot(self.inbox)
        if self._call("undo"):
            expected = self.before_done.pop()
            if expected is not None:
                assert snapshot(self.inbox) == expected, "undo did not restore the tree before the action"
            self.before_undone.append(before)

    @rule()
    def redo(self) -> None:
        before = snapshot(self.inbox)
        if self._call("redo"):
            expected = self.before_undone.pop()
            if expected is not None:
                assert snapshot(self.inbox) == expected, "redo did not restore the tree before the undo"
            self.before_done.append(before)

    @rule()
    def undo_then_redo(self) -> None:
        before = snapshot(self.inbox)
        if not self._call("undo"):
            return
        expected = self.before_done.pop()
        undone = snapshot(self.inbox)
        if expected is not None:
            assert undone == expected, "undo did not restore the tree before the action"
        assert self._call("redo"), "redo right after undo was refused"
        assert snapshot(self.inbox) == before, "redo did not restore the tree the undo started from"
        self.before_done.append(undone)

    @rule(folder=folders, name=names)
    def someone_else_adds_a_file(self, folder: str, name: str) -> None:
        if (self.inbox / folder).exists() and not (self.inbox / folder).is_dir():
            return
        if (self.inbox / folder).is_symlink():
            return
        self._add_file(folder, name)
        # The trees remembered for undo no longer describe the folder exactly.
        self.before_done = [None] * len(self.before_done)
        self.before_undone = [None] * len(self.before_undone)

    @invariant()
    def contents_conserved_and_nothing_left(self) -> None:
        if self.organizer is None:
            return
        files = sorted(data for kind, data in snapshot(self.inbox).values() if kind == "file")
        assert files == sorted(self.expected), "a file was lost, duplicated or overwritten"
        assert snapshot(self.outside) == self.outside_before, "something outside the inbox changed"

    def teardown(self) -> None:
        if self.organizer is not None:
            self.organizer.close()
        shutil.rmtree(self.base, ignore_errors=True)


OrganizerMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_organizer_state_machine = OrganizerMachine.TestCase

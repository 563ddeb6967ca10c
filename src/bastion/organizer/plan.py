"""The planner: which top-level entries of an inbox go to which category folder.

Planning changes nothing, not even the category folders: it reads the folder and returns a
`Plan`, which records for every move the inode, size and mtime it saw, so apply can refuse a
plan whose files changed since.
"""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass
from typing import Any, Final

from bastion.organizer.folder import Folder
from bastion.organizer.rules import Hit, Rules, display_name, entry_kind
from bastion.safety.errors import BastionError

MAX_LISTED: Final = 1000
"""Skipped and uncategorized entries a plan lists, each; the rest are counted."""


@dataclass(frozen=True, slots=True)
class PlannedMove:
    src: str
    dst: str
    dev: int
    ino: int
    size: int
    mtime_ns: int


@dataclass(frozen=True, slots=True)
class Plan:
    plan_id: str
    moves: tuple[PlannedMove, ...]


@dataclass(frozen=True, slots=True)
class Assessment:
    """What the planner thinks of one top-level entry."""

    name: str
    info: os.stat_result
    category: str | None
    dst: str | None = None
    hit: Hit | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        kind = entry_kind(self.info.st_mode)
        entry: dict[str, Any] = {
            "name": display_name(self.name),
            "kind": kind,
            "size": self.info.st_size if kind == "file" else 0,
            "category": self.category,
            "would_move": self.dst is not None,
        }
        if self.dst is not None:
            entry["destination"] = self.dst
        elif self.hit is not None:
            entry.update(self.hit.as_dict())
        else:
            entry["reason"] = self.note
        return entry


class _Targets:
    """The state of each category folder, looked up once per plan."""

    def __init__(self, folder: Folder, rules: Rules) -> None:
        self._folder = folder
        self._rules = rules
        self._fds: dict[str, int | None] = {}
        self._hits: dict[str, Hit] = {}

    def occupied(self, category: str, name: str) -> Hit | None:
        if category not in self._fds:
            self._look(category)
        hit = self._hits.get(category)
        if hit is not None:
            return hit
        fd = self._fds[category]
        if fd is not None and self._folder.lstat_at(fd, name) is not None:
            return self._rules.protection_hit("occupied_destination", f"'{category}/{display_name(name)}' exists")
        return None

    def _look(self, category: str) -> None:
        info = self._folder.lstat(category)
        self._fds[category] = None
        if info is None:
            return
        if stat.S_ISLNK(info.st_mode):
            self._hits[category] = self._rules.protection_hit(
                "outside_folder", f"the category folder '{category}' is a symbolic link"
            )
        elif not stat.S_ISDIR(info.st_mode):
            self._hits[category] = self._rules.protection_hit(
                "occupied_destination", f"'{category}' exists and is not a folder"
            )
        elif (who := self._folder.foreign(category, info)) is not None:
            # Its files would be theirs to delete or replace (`Inbox._refuse_foreign`).
            self._hits[category] = self._rules.protection_hit(
                "outside_folder", f"the category folder '{category}' is {who}"
            )
        else:
            try:
                self._fds[category] = self._folder.open_dir(category)
            except BastionError as exc:
                self._hits[category] = self._rules.protection_hit("outside_folder", exc.reason)

    def close(self) -> None:
        for fd in self._fds.values():
            if fd is not None:
                os.close(fd)
        self._fds.clear()


def assess(folder: Folder, rules: Rules) -> list[Assessment]:
    """Judge every top-level entry of the folder: where it would go, or which rule keeps it."""
    targets = _Targets(folder, rules)
    out: list[Assessment] = []
    try:
        for name, info in folder.scan("."):
            out.append(_assess_one(name, info, rules, targets))
    finally:
        targets.close()
    return out


def _assess_one(name: str, info: os.stat_result, rules: Rules, targets: _Targets) -> Assessment:
    if name in rules.categories and stat.S_ISDIR(info.st_mode):
        return Assessment(name, info, name, note="a category folder")
    hit = rules.check(name, info.st_mode, protection_only=False)
    category = rules.category_of(name)
    if hit is not None:
        # Shown for a file a rule keeps (e.g. an unsafe name), so the entry says where it would go.
        return Assessment(name, info, category if stat.S_ISREG(info.st_mode) else None, hit=hit)
    if category is None:
        return Assessment(name, info, None, note="no category for this file's extension")
    hit = targets.occupied(category, name)
    if hit is not None:
        return Assessment(name, info, category, hit=hit)
    return Assessment(name, info, category, dst=f"{category}/{name}")


def make_plan(assessed: list[Assessment], max_moves: int) -> tuple[Plan, dict[str, Any]]:
    """A plan of at most `max_moves` moves, and its description for the client."""
    moving = [a for a in assessed if a.dst is not None]
    chosen = moving[:max_moves]
    moves = tuple(
        PlannedMove(a.name, a.dst, a.info.st_dev, a.info.st_ino, a.info.st_size, a.info.st_mtime_ns)
        for a in chosen
        if a.dst is not None
    )
    plan = Plan(plan_id="plan-" + secrets.token_hex(8), moves=moves)
    kept = [a for a in assessed if a.hit is not None]
    unmatched = [a for a in assessed if a.dst is None and a.hit is None and a.category is None]
    detail: dict[str, Any] = {
        "plan_id": plan.plan_id,
        "moves": [{"src": m.src, "dst": m.dst, "size": m.size} for m in moves],
        # At most MAX_LISTED of each, and how many more: 99,000 long names were a 25 MB answer.
        "skipped": [{"path": display_name(a.name), **a.hit.as_dict()} for a in kept[:MAX_LISTED] if a.hit],
        "uncategorized": [display_name(a.name) for a in unmatched[:MAX_LISTED]],
        "left_out": len(moving) - len(chosen),
    }
    if len(kept) > MAX_LISTED:
        detail["skipped_not_listed"] = len(kept) - MAX_LISTED
    if len(unmatched) > MAX_LISTED:
        detail["uncategorized_not_listed"] = len(unmatched) - MAX_LISTED
    return plan, detail

"""One inbox's organizer: list, plan, apply, move, undo and redo, serialized and journaled.

Every change goes through `Mover.run` as one transaction; the history of undoable actions is
the replay of the journal (see `bastion.organizer.journal`). Before a transaction starts,
every file it will move is checked against what was recorded (inode, and for a plan size and
mtime too) and every destination against being occupied; any difference refuses the whole
action and nothing moves.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from bastion.config import InboxConfig
from bastion.organizer.folder import Dirs, Folder, split
from bastion.organizer.journal import COMPACT_BYTES, Action, History, Journal, Kind, Move, Txn
from bastion.organizer.mover import JournalUnwritable, Mover
from bastion.organizer.plan import Plan, assess, make_plan
from bastion.organizer.rules import Hit, Rules, display_name, entry_kind
from bastion.safety.errors import (
    BastionError,
    ConfigError,
    Conflict,
    InvalidRequest,
    NotFound,
    PathEscape,
    PolicyDenied,
    ResourceLimit,
    Unavailable,
)
from bastion.safety.results import ResultCode

logger = logging.getLogger("bastion.organizer")

# Plans live in memory only: the newest MAX_PLANS per inbox, and none survives a restart (a
# plan is a snapshot of inodes, sizes and mtimes, so planning again is what a restart calls for).
MAX_PLANS: Final = 16
# Plan ids spent (applied or refused) that are still told apart from unknown ones.
MAX_SPENT_PLANS: Final = 256
MAX_LIST_ENTRIES: Final = 10_000
MAX_MOVE_DEPTH: Final = 64
"""Folders deep a moved entry or its destination may be: each folder on a path is looked at from the inbox
(950 levels took 10.7 s a move, 12.9 s its undo, and a 910 KB answer)."""
_PLAN_ID: Final = re.compile(r"plan-[0-9a-f]{16}")
_ERRORS: Final[dict[ResultCode, type[BastionError]]] = {
    ResultCode.POLICY_DENIED: PolicyDenied,
    ResultCode.INVALID_REQUEST: InvalidRequest,
    ResultCode.PATH_ESCAPE: PathEscape,
    ResultCode.CONFLICT: Conflict,
}


def _refuse(hit: Hit, what: str) -> BastionError:
    error = _ERRORS.get(hit.code, PolicyDenied)
    return error(f"{what} is {hit.reason} (rule '{hit.rule}'): the organizer never moves it", detail=hit.rule)


def journal_path(state_dir: Path, inbox_id: str) -> Path:
    return state_dir / "organizer" / inbox_id / "journal.jsonl"


class Organizer:
    """The organizer of one configured inbox. Thread-safe: every method holds one lock."""

    def __init__(self, config: InboxConfig, state_dir: Path) -> None:
        self.id = config.id
        self.config = config
        self.rules = Rules(config)
        self.folder = Folder(config.path)
        self.journal = Journal(journal_path(state_dir, config.id))
        self._mover = Mover(self.folder, self.journal)
        self._lock = threading.Lock()
        self._plans: OrderedDict[str, Plan] = OrderedDict()
        self._spent: OrderedDict[str, None] = OrderedDict()
        self.history = History()
        self._next_txn = 1
        self._compacted = 0
        """The journal's size after its last compaction (`_compact_if_large`)."""
        self._broken: str | None = None
        self._replaced: str | None = None  # the last "folder replaced" line logged

    def open(self, rolling_back: Callable[[str], None] | None = None) -> str | None:
        """Read the journal and roll back a transaction a crash left unfinished.

        `rolling_back` is told what is about to be rolled back, before any file moves (the start's audit
        record: a crash during the rollback still leaves it); it may raise to stop the start.

        Returns:
            A one-line message when something was recovered, else None.

        Raises:
            ConfigError: the journal is damaged, held by another server, or cannot be written.
        """
        try:
            return self._open(rolling_back)
        except OSError as exc:
            # Found by attack: a restart on a full state filesystem died with a traceback. The moves were put
            # back before the write that failed, and the journal still holds the crash's transaction.
            raise ConfigError(
                f"inbox {self.id!r}: its journal {self.journal.path} could not be written "
                f"({os.strerror(exc.errno) if exc.errno else exc}): free space on the state filesystem and start "
                "again; the next start finishes rolling back what a crash left unfinished"
            ) from None

    def _open(self, rolling_back: Callable[[str], None] | None) -> str | None:
        with self._lock:
            replay = self.journal.open()
            message = None
            if replay.pending is not None:
                pending = replay.pending
                if rolling_back is not None:
                    rolling_back(
                        f"inbox {self.id!r}: rolling back an interrupted {pending.kind} of {len(pending.moves)} moves"
                    )
                kept = self._mover.recover(pending)
                replay.history.finish(pending, kept)
                message = (
                    f"inbox {self.id!r}: rolled back an interrupted {pending.kind} of {len(pending.moves)} moves"
                    + (f" ({len(kept)} could not be put back and stay undoable)" if kept else "")
                )
            self.history, self._next_txn = replay.history, replay.next_txn
            if self.journal.size() > COMPACT_BYTES:
                self.journal.compact(self.history, self._next_txn)
            self._compacted = self.journal.size()
            return message

    def close(self) -> None:
        with self._lock:
            self.journal.close()
            self.folder.close()

    def _check_folder(self) -> None:
        """Every call first checks the inbox is still the folder held open (`Folder.check_root`); logged once."""
        try:
            self.folder.check_root()
        except Unavailable as exc:
            if exc.reason != self._replaced:
                logger.error("inbox %s: %s", self.id, exc.reason)
            self._replaced = exc.reason
            raise
        self._replaced = None

    # -- read-only ---------------------------------------------------------------

    def list_files(self, subdir: str = ".") -> dict[str, Any]:
        with self._lock:
            self._check_folder()
            rel = self.folder.relative(subdir)
            if rel == ".":
                entries = [a.as_dict() for a in assess(self.folder, self.rules)]
            else:
                entries = [self._nested_entry(name, info.st_mode, info.st_size) for name, info in self.folder.scan(rel)]
            truncated = len(entries) > MAX_LIST_ENTRIES
            return {
                "inbox": self.id,
                "path": rel,
                "entries": entries[:MAX_LIST_ENTRIES],
                "truncated": truncated,
                "can_undo": bool(self.history.done),
                "can_redo": bool(self.history.undone),
            }

    def _nested_entry(self, name: str, mode: int, size: int) -> dict[str, Any]:
        kind = entry_kind(mode)
        entry: dict[str, Any] = {
            "name": display_name(name),
            "kind": kind,
            "size": size if kind == "file" else 0,
            "category": self.rules.category_of(name) if kind == "file" else None,
            "would_move": False,
        }
        hit = self.rules.check(name, mode, protection_only=True)
        if hit is not None:
            entry.update(hit.as_dict())
        else:
            entry["reason"] = "only the top level of the inbox is organized"
        return entry

    def plan(self) -> dict[str, Any]:
        with self._lock:
            self._check_folder()
            plan, detail = make_plan(assess(self.folder, self.rules), self.config.max_plan_moves)
            self._plans[plan.plan_id] = plan
            while len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)
            return {"inbox": self.id, **detail}

    # -- changes -----------------------------------------------------------------

    def apply(self, plan_id: str) -> dict[str, Any]:
        with self._lock:
            self._check_folder()
            plan = self._take_plan(plan_id)
            if not plan.moves:
                return {"inbox": self.id, "plan_id": plan_id, "action_id": None, "moved": 0, "moves": []}
            changed: list[str] = []
            with Dirs(self.folder) as dirs:
                for planned in plan.moves:
                    parent, name = split(planned.src)
                    info = self.folder.lstat_at(dirs.get(parent), name)
                    seen = None if info is None else (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
                    if seen != (planned.dev, planned.ino, planned.size, planned.mtime_ns):
                        changed.append(planned.src)
                if changed:
                    raise Conflict(
                        f"{len(changed)} of the plan's {len(plan.moves)} files changed, moved or vanished since it "
                        f"was made (first: '{changed[0]}'): nothing was moved; make a new plan"
                    )
                mkdirs = self._check_destinations(dirs, [p.dst for p in plan.moves])
            moves = tuple(Move(p.src, p.dst, p.dev, p.ino) for p in plan.moves)
            action = self._run("apply", moves, mkdirs=mkdirs, plan_id=plan_id)
            detail = self._done(action, moves, mkdirs)
            return {"plan_id": plan_id, **detail}

    def move(self, src: str, dest: str) -> dict[str, Any]:
        with self._lock:
            self._check_folder()
            if dest.endswith("/"):
                raise InvalidRequest(f"dest is the full target path, with the name: e.g. '{dest}{split(src)[1]}'")
            rel_src, rel_dst = self.folder.relative(src), self.folder.relative(dest)
            if "." in (rel_src, rel_dst):
                raise InvalidRequest("the inbox itself cannot be moved or replaced: name a file inside it")
            if rel_dst == rel_src or rel_dst.startswith(rel_src + "/"):
                raise InvalidRequest(f"'{rel_dst}' is '{rel_src}' or inside it: choose another destination")
            info = self.folder.lstat(rel_src)
            if info is None:
                raise NotFound(f"'{rel_src}' does not exist: check the name with list_files")
            hit = self.rules.check(split(rel_src)[1], info.st_mode, protection_only=True)
            if hit is not None:
                raise _refuse(hit, f"'{rel_src}'")
            self._check_names(rel_src)
            self._check_names(rel_dst)
            with Dirs(self.folder) as dirs:
                mkdirs = self._check_destinations(dirs, [rel_dst])
            moves = (Move(rel_src, rel_dst, info.st_dev, info.st_ino),)
            action = self._run("move", moves, mkdirs=mkdirs)
            return self._done(action, moves, mkdirs)

    def undo(self) -> dict[str, Any]:
        with self._lock:
            self._check_folder()
            if not self.history.done:
                raise NotFound("there is nothing to undo")
            action = self.history.done[-1]
            moves = tuple(m.reverse() for m in reversed(action.moves))
            mkdirs = self._check_moves(moves, "undone")
            self._run("undo", moves, mkdirs=mkdirs, rmdirs=action.created, action_id=action.id)
            return {
                "inbox": self.id,
                "undone": _action_id(action),
                "moved": len(moves),
                "moves": [{"src": m.src, "dst": m.dst} for m in moves],
                "files_touched": _touched(moves),
                "can_undo": bool(self.history.done),
                "can_redo": bool(self.history.undone),
            }

    def redo(self) -> dict[str, Any]:
        with self._lock:
            self._check_folder()
            if not self.history.undone:
                raise NotFound("there is nothing to redo")
            action = self.history.undone[-1]
            mkdirs = self._check_moves(action.moves, "redone")
            self._run("redo", action.moves, mkdirs=mkdirs, action_id=action.id)
            return {
                "inbox": self.id,
                "redone": _action_id(action),
                "moved": len(action.moves),
                "moves": [{"src": m.src, "dst": m.dst} for m in action.moves],
                "files_touched": _touched(action.moves),
                "can_undo": bool(self.history.done),
                "can_redo": bool(self.history.undone),
            }

    # -- helpers -----------------------------------------------------------------

    def _take_plan(self, plan_id: str) -> Plan:
        """Remove and return a plan (single use, even when apply then refuses it), or say why there is none."""
        if _PLAN_ID.fullmatch(plan_id) is None:
            raise InvalidRequest("plan_id is not a plan id (plan-<16 hex digits>): pass one from plan_organize")
        plan = self._plans.pop(plan_id, None)
        if plan is not None:
            self._spent[plan_id] = None
            while len(self._spent) > MAX_SPENT_PLANS:
                self._spent.popitem(last=False)
            return plan
        applied = next((a for a in reversed(self.history.done + self.history.undone) if a.plan_id == plan_id), None)
        if plan_id in self._spent or applied is not None:
            used = f" as {_action_id(applied)}" if applied is not None else ""
            raise NotFound(f"plan {plan_id} was already used{used}: plans are single use; plan again")
        raise NotFound(
            f"plan {plan_id} expired or the server restarted (plans live in memory only, the newest {MAX_PLANS} "
            "per inbox): plan again with plan_organize"
        )

    def _check_names(self, path: str) -> None:
        """Protection rules by name bind every component, e.g. no move into or out of .git/hooks; a path
        deeper than `MAX_MOVE_DEPTH` is refused (its folders are looked at one walk each from the inbox)."""
        parts = path.split("/")
        if len(parts) > MAX_MOVE_DEPTH:
            raise InvalidRequest(
                f"'{display_name(path)[:200]}' is {len(parts)} folders deep: the organizer moves entries at most "
                f"{MAX_MOVE_DEPTH} deep; move it by other means"
            )
        for part in parts:
            hit = self.rules.check_name(part)
            if hit is not None:
                raise _refuse(hit, f"'{display_name(part)}' in '{display_name(path)}'")

    def _check_recorded(self, move: Move) -> None:
        """The protection rules undo and redo enforce on a move from the history, as move_file does.

        The history is the journal in the state folder, outside every inbox, but it is replayed
        with the rules in force now: a path must still be a plain path inside the inbox, and a
        name the current config protects is not moved back or forth.
        """
        for path in (move.src, move.dst):
            if path == "." or self.folder.relative(path) != path:
                raise PathEscape(
                    f"the history names '{display_name(path)}', which is not a plain path inside the inbox: "
                    "nothing was moved"
                )
            self._check_names(path)

    def _check_moves(self, moves: tuple[Move, ...], verb: str) -> tuple[str, ...]:
        """Every move passes the protection rules; every source is still the same inode; every
        destination is free. Returns the folders to create."""
        with Dirs(self.folder) as dirs:
            for move in moves:
                self._check_recorded(move)
                parent, name = split(move.src)
                try:
                    info = self.folder.lstat_at(dirs.get(parent), name)
                except NotFound:
                    info = None
                if info is None or (info.st_dev, info.st_ino) != (move.dev, move.ino):
                    raise Conflict(
                        f"'{move.src}' was moved, renamed or replaced since: nothing was {verb}; "
                        "move it back by hand with move_file first"
                    )
                hit = self.rules.check(name, info.st_mode, protection_only=True)
                if hit is not None:
                    raise _refuse(hit, f"'{display_name(move.src)}'")
            return self._check_destinations(dirs, [m.dst for m in moves])

    def _check_destinations(self, dirs: Dirs, destinations: list[str]) -> tuple[str, ...]:
        """Refuse an occupied destination or a parent that is a link; return the missing parents in order."""
        missing: list[str] = []
        looked: dict[str, bool] = {".": True}
        for dst in destinations:
            parent, name = split(dst)
            if not self._parent_exists(parent, looked, missing):
                continue
            if self.folder.lstat_at(dirs.get(parent), name) is not None:
                hit = self.rules.protection_hit("occupied_destination", f"'{dst}' exists")
                raise Conflict(f"'{dst}' already exists: nothing is overwritten and nothing was moved", detail=hit.rule)
        return tuple(missing)

    def _parent_exists(self, rel: str, looked: dict[str, bool], missing: list[str]) -> bool:
        """Whether folder `rel` exists (as a real folder); missing ones are added to `missing`, top first.
        Without recursion: 1,500 nested folders raised RecursionError, and undo stayed stuck behind it."""
        chain: list[str] = []
        while rel not in looked:
            chain.append(rel)
            rel = split(rel)[0]
        exists = looked[rel]
        for folder in reversed(chain):
            exists = exists and self._is_folder(folder)
            if not exists:
                missing.append(folder)
            looked[folder] = exists
        return exists

    def _is_folder(self, rel: str) -> bool:
        info = self.folder.lstat(rel)
        if info is None:
            return False
        if stat.S_ISLNK(info.st_mode):
            hit = self.rules.protection_hit("outside_folder", f"'{rel}' is a symbolic link")
            raise PathEscape(
                f"the destination folder '{rel}' is a symbolic link: the organizer never follows links; "
                "nothing was moved",
                detail=hit.rule,
            )
        if not stat.S_ISDIR(info.st_mode):
            raise Conflict(f"'{rel}' exists and is not a folder: nothing was moved")
        self._refuse_foreign(rel, info)
        return True

    def _refuse_foreign(self, rel: str, info: os.stat_result) -> None:
        """A destination folder someone else owns or may write: a file moved there is theirs to delete or
        replace (a user who could not touch it in the inbox made `Documents` 0777 for it to be moved into)."""
        who = self.folder.foreign(rel, info)
        if who is not None:
            hit = self.rules.protection_hit("outside_folder", f"'{rel}' is {who}")
            raise PathEscape(
                f"the destination folder '{display_name(rel)}' is {who}, not only the inbox owner's: a file moved "
                "there could be deleted or replaced by them; nothing was moved",
                detail=hit.rule,
            )

    def _run(
        self,
        kind: Kind,
        moves: tuple[Move, ...],
        *,
        mkdirs: tuple[str, ...] = (),
        rmdirs: tuple[str, ...] = (),
        plan_id: str | None = None,
        action_id: int | None = None,
    ) -> Action:
        if len(moves) > 10_000:
            raise ResourceLimit("an action may move at most 10000 entries")
        number = self._next_txn
        self._next_txn += 1
        txn = Txn(
            txn=number,
            kind=kind,
            action=action_id if action_id is not None else number,
            moves=moves,
            mkdirs=mkdirs,
            rmdirs=rmdirs,
            plan_id=plan_id,
        )
        if self._broken is not None:
            raise Unavailable(f"{self._broken}: restart the server to recover the inbox")
        try:
            applied, error = self._mover.run(txn)
        except JournalUnwritable as exc:
            self._broken = exc.reason
            raise
        self.history.finish(txn, applied)
        self._compact_if_large()
        if error is not None:
            raise error
        if kind in ("apply", "move"):
            return self.history.done[-1]
        return Action(txn.action, "move", moves)

    def _compact_if_large(self) -> None:
        """Rewrite the journal as its history once it is large: moves and undos in a loop grew it until the
        next start (the history itself is capped). A failure leaves the journal as it was, still valid."""
        # Twice what the last compaction left, at least: a history itself over the threshold (1,000 actions of
        # long paths) was otherwise rewritten, synced and read back at every action (0.2 to 0.5 s each).
        if self.journal.size() <= max(COMPACT_BYTES, 2 * self._compacted):
            return
        try:
            self.journal.compact(self.history, self._next_txn)
            self._compacted = self.journal.size()
        except (OSError, ConfigError) as exc:
            if self.journal.is_open:  # the old journal stands, whole
                logger.warning("inbox %s: journal not compacted (%s); the next start compacts it", self.id, exc)
            else:
                self._broken = f"inbox {self.id}: its journal could not be reopened after compaction ({exc})"
                logger.error("%s", self._broken)

    def _done(self, action: Action, moves: tuple[Move, ...], mkdirs: tuple[str, ...]) -> dict[str, Any]:
        return {
            "inbox": self.id,
            "action_id": _action_id(action),
            "moved": len(moves),
            "moves": [{"src": m.src, "dst": m.dst} for m in moves],
            "created_folders": list(mkdirs),
            "files_touched": _touched(moves),
            "can_undo": True,
            "can_redo": False,
        }


def _action_id(action: Action) -> str:
    return f"action-{action.id}"


def _touched(moves: tuple[Move, ...]) -> list[str]:
    return [path for move in moves for path in (move.src, move.dst)]

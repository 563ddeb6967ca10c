"""The organizer's write-ahead journal and the undo history it records.

One append-only file per inbox, ``<state_dir>/organizer/<inbox>/journal.jsonl``, never inside
the inbox. Each line is ``CRC32 JSON``. Every change to the inbox is one transaction:

    begin  {txn, kind, action, moves: [[src, dst, dev, ino], ...], mkdirs, rmdirs}   fsync'd
    ...    the folders are created and the files renamed, in order
    end    {txn, applied: "all" | [indices of the moves in effect]}                fsync'd

The begin record is on disk before the first rename, and names every move with the inode it
moves, so after a crash at any point the file system itself says which moves happened: the
inode is at its destination or at its source (renameat2 is atomic, and moves nothing else).
Recovery rolls an unfinished transaction back and writes its end record. The undo history is
not stored separately: it is the replay of the finished transactions, so it cannot disagree
with the journal. A torn last line (a kill during a write) is cut off; a damaged line anywhere
else stops the start-up, because the history after it could not be trusted.
"""

from __future__ import annotations

import fcntl
import json
import os
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Literal

from bastion.safety.errors import ConfigError
from bastion.safety.paths import sync_folder

Kind = Literal["apply", "move", "undo", "redo"]
# Older actions than this many can no longer be undone; the journal is compacted at start-up.
HISTORY_LIMIT: Final = 1000
COMPACT_BYTES: Final = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Move:
    """One rename: `src` to `dst` (folder-relative), of the inode (`dev`, `ino`)."""

    src: str
    dst: str
    dev: int
    ino: int

    def reverse(self) -> Move:
        return Move(self.dst, self.src, self.dev, self.ino)

    def as_list(self) -> list[object]:
        return [self.src, self.dst, self.dev, self.ino]


@dataclass(frozen=True, slots=True)
class Action:
    """A unit of undo: a whole plan, or one move_file. `created`: folders its last run made."""

    id: int
    kind: Literal["apply", "move"]
    moves: tuple[Move, ...]
    created: tuple[str, ...] = ()
    plan_id: str | None = None

    def subset(self, indices: list[int]) -> Action:
        return replace(self, moves=tuple(self.moves[i] for i in indices))

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "moves": [m.as_list() for m in self.moves],
            "created": list(self.created),
            "plan_id": self.plan_id,
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> Action:
        return Action(
            id=int(data["id"]),
            kind=data["kind"],
            moves=tuple(_move(m) for m in data["moves"]),
            created=tuple(_path(p) for p in data["created"]),
            plan_id=data.get("plan_id"),
        )


@dataclass(frozen=True, slots=True)
class Txn:
    """A begin record: what a transaction is about to do."""

    txn: int
    kind: Kind
    action: int
    moves: tuple[Move, ...]
    mkdirs: tuple[str, ...] = ()
    rmdirs: tuple[str, ...] = ()
    plan_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "t": "begin",
            "txn": self.txn,
            "kind": self.kind,
            "action": self.action,
            "moves": [m.as_list() for m in self.moves],
            "mkdirs": list(self.mkdirs),
            "rmdirs": list(self.rmdirs),
            "plan_id": self.plan_id,
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> Txn:
        return Txn(
            txn=int(data["txn"]),
            kind=data["kind"],
            action=int(data["action"]),
            moves=tuple(_move(m) for m in data["moves"]),
            mkdirs=tuple(_path(p) for p in data["mkdirs"]),
            rmdirs=tuple(_path(p) for p in data["rmdirs"]),
            plan_id=data.get("plan_id"),
        )


def _move(raw: list[Any]) -> Move:
    src, dst, dev, ino = raw
    return Move(_path(src), _path(dst), int(dev), int(ino))


def _path(raw: object) -> str:
    """A folder-relative path as the organizer writes them: plain components, no ``..``, not absolute."""
    if not isinstance(raw, str) or any(part in ("", ".", "..") or "\0" in part for part in raw.split("/")):
        raise ValueError(f"not a plain folder-relative path: {raw!r}")
    return raw


@dataclass
class History:
    """The undo and redo stacks, rebuilt by replaying finished transactions."""

    done: list[Action] = field(default_factory=list)
    undone: list[Action] = field(default_factory=list)

    def finish(self, txn: Txn, applied: list[int]) -> None:
        """Record a finished transaction; `applied`: indices of its moves in effect after it."""
        if not applied:
            return
        if txn.kind in ("apply", "move"):
            kind: Literal["apply", "move"] = "apply" if txn.kind == "apply" else "move"
            action = Action(txn.action, kind, txn.moves, txn.mkdirs, txn.plan_id).subset(applied)
            self.done.append(action)
            self.undone.clear()
            del self.done[:-HISTORY_LIMIT]
            return
        source, target = (self.done, self.undone) if txn.kind == "undo" else (self.undone, self.done)
        if not source or source[-1].id != txn.action:
            return  # the journal and this replay disagree: keep the stacks as they are
        action = source.pop()
        # Undo reverses the action's moves back to front: map its indices to the action's.
        count = len(action.moves)
        moved = sorted(count - 1 - i for i in applied) if txn.kind == "undo" else sorted(applied)
        done = set(moved)  # once: a set per index made this quadratic (10,000 moves: 1.8 s)
        kept = [i for i in range(count) if i not in done]
        created = txn.mkdirs if txn.kind == "redo" else action.created
        target.append(replace(action.subset(moved), created=created))
        if kept:
            source.append(action.subset(kept))

    def to_json(self) -> dict[str, Any]:
        return {"done": [a.to_json() for a in self.done], "undone": [a.to_json() for a in self.undone]}


def _line(record: dict[str, Any]) -> bytes:
    body = json.dumps(record, ensure_ascii=True, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _parse(line: bytes) -> dict[str, Any] | None:
    if len(line) < 10 or line[8:9] != b" " or not line.endswith(b"\n"):
        return None
    body = line[9:-1]
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        record = json.loads(body)
    except (ValueError, RecursionError):  # nested past the recursion limit: damaged as any other line
        return None
    return record if isinstance(record, dict) else None


@dataclass
class Replay:
    """What the journal holds: the history, the next txn number, and an unfinished begin, if any."""

    history: History
    next_txn: int
    pending: Txn | None


class Journal:
    """The append-only, fsync'd journal of one inbox, locked against a second server."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1

    def open(self) -> Replay:
        """Open (creating it), lock, read and replay the journal; cut off a torn last line.

        Raises:
            ConfigError: the journal is damaged before its last line, or another server holds it.
        """
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        new = not self.path.exists()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        if new:
            sync_folder(self.path.parent)  # the journal's own name must survive a power cut too
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"organizer journal {self.path} is in use by another bastion: stop it first") from None
        self._fd = fd
        with open(fd, "rb", closefd=False) as handle:
            lines = handle.read().splitlines(keepends=True)
        replay = Replay(History(), 1, None)
        good = 0
        for number, line in enumerate(lines, 1):
            record = _parse(line)
            if record is None and number == len(lines):
                break  # a write cut short by a crash: nothing acted on it
            try:
                if record is None:
                    raise ValueError("bad checksum or JSON")
                self._replay(replay, record)
            except (ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
                # IndexError: a move index past its transaction's; RecursionError: JSON nested 100,000 deep.
                self.close()
                raise ConfigError(
                    f"organizer journal {self.path} is damaged at line {number}: move it aside to start afresh "
                    "(the undo history is then lost)"
                ) from exc
            good += len(line)
        if good != sum(len(line) for line in lines):
            os.ftruncate(fd, good)
            os.fsync(fd)
        return replay

    @staticmethod
    def _replay(replay: Replay, record: dict[str, Any]) -> None:
        kind = record.get("t")
        if kind == "history":
            replay.history = History(
                [Action.from_json(a) for a in record["done"]], [Action.from_json(a) for a in record["undone"]]
            )
            replay.next_txn = max(replay.next_txn, int(record["next"]))
        elif kind == "begin":
            txn = Txn.from_json(record)
            if replay.pending is not None:
                # Cannot happen: a server whose journal write failed takes no more changes.
                raise ValueError(f"transaction {txn.txn} began while {replay.pending.txn} was unfinished")
            replay.pending = txn
            replay.next_txn = max(replay.next_txn, txn.txn + 1)
        elif kind == "end" and replay.pending is not None and replay.pending.txn == record["txn"]:
            raw = record["applied"]
            applied = list(range(len(replay.pending.moves))) if raw == "all" else _indices(raw, replay.pending)
            replay.history.finish(replay.pending, applied)
            replay.pending = None

    def begin(self, txn: Txn) -> None:
        """Write and fsync the begin record: after this returns, the moves may start."""
        self._append(_line(txn.to_json()))

    def end(self, txn: Txn, applied: list[int]) -> None:
        raw: str | list[int] = "all" if len(applied) == len(txn.moves) else applied
        self._append(_line({"t": "end", "txn": txn.txn, "applied": raw}))

    def _append(self, data: bytes) -> None:
        if self._fd < 0:
            raise ValueError("the journal is not open")
        _write_all(self._fd, data)
        os.fdatasync(self._fd)

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    @property
    def is_open(self) -> bool:
        return self._fd >= 0

    def compact(self, history: History, next_txn: int) -> None:
        """Replace the journal by one history record (temp file, fsync, rename, fsync the folder)."""
        temp = self.path.with_name(self.path.name + ".new")
        record = {"t": "history", "next": next_txn, **history.to_json()}
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            _write_all(fd, _line(record))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, self.path)
        sync_folder(self.path.parent)
        self.close()
        self.open()

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def _indices(raw: object, txn: Txn) -> list[int]:
    """The move indices of an `end` record: distinct integers within the transaction (ValueError otherwise)."""
    if not isinstance(raw, list) or not all(type(i) is int and 0 <= i < len(txn.moves) for i in raw):
        raise ValueError(f"applied {str(raw)[:80]} is not a list of move indices of transaction {txn.txn}")
    if len(set(raw)) != len(raw):
        raise ValueError(f"applied names a move of transaction {txn.txn} twice")
    return list(raw)

"""The journal: torn last lines, damage, and the history it replays."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from bastion.organizer.journal import History, Journal, Move, Txn
from bastion.safety.errors import ConfigError


def _txn(number: int, kind: str = "move", action: int | None = None, moves: int = 2) -> Txn:
    return Txn(
        txn=number,
        kind=kind,  # type: ignore[arg-type]
        action=action if action is not None else number,
        moves=tuple(Move(f"s{i}", f"d{i}", 1, 100 + i) for i in range(moves)),
    )


def test_torn_last_line_is_cut_off(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path)
    journal.open()
    journal.begin(_txn(1))
    journal.end(_txn(1), [0, 1])
    journal.close()
    good = path.read_bytes()
    path.write_bytes(good + b'1234abcd {"t":"begin","txn":2,"ki')
    replay = Journal(path).open()
    assert replay.pending is None
    assert [a.id for a in replay.history.done] == [1]
    assert path.read_bytes() == good


def test_damage_before_the_last_line_stops_start_up(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path)
    journal.open()
    journal.begin(_txn(1))
    journal.end(_txn(1), [0, 1])
    journal.close()
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0].replace(b"s0", b"s9") + lines[1])
    with pytest.raises(ConfigError, match="damaged at line 1"):
        Journal(path).open()


def test_unfinished_begin_is_pending(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.jsonl")
    journal.open()
    journal.begin(_txn(1))
    journal.close()
    replay = Journal(tmp_path / "journal.jsonl").open()
    assert replay.pending is not None
    assert replay.pending.txn == 1
    assert replay.next_txn == 2


def test_history_replay_of_partial_undo_splits_the_action() -> None:
    """A transaction that ended part-way keeps the history true to the files: what stayed
    moved is still undoable, what was moved back is redoable."""
    history = History()
    history.finish(_txn(1, "apply", moves=3), [0, 1, 2])
    undo = Txn(txn=2, kind="undo", action=1, moves=tuple(m.reverse() for m in reversed(history.done[0].moves)))
    history.finish(undo, [0])  # only the last move (index 2 of the action) was put back
    assert [m.src for m in history.done[0].moves] == ["s0", "s1"]
    assert [m.src for m in history.undone[0].moves] == ["s2"]
    history.finish(_txn(3, "move", moves=1), [0])
    assert history.undone == []


def test_compaction_keeps_the_history(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path)
    journal.open()
    history = History()
    for number in range(1, 4):
        txn = _txn(number)
        journal.begin(txn)
        journal.end(txn, [0, 1])
        history.finish(txn, [0, 1])
    journal.compact(history, 4)
    journal.close()
    assert len(path.read_bytes().splitlines()) == 1
    replay = Journal(path).open()
    assert replay.history == history
    assert replay.next_txn == 4


def _signed(record: dict[str, object] | bytes) -> bytes:
    """A journal line with a valid checksum: what a forger who can write the state folder would write."""
    body = record if isinstance(record, bytes) else json.dumps(record, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


BEGIN = {
    "t": "begin",
    "txn": 1,
    "kind": "apply",
    "action": 1,
    "moves": [["a.pdf", "Documents/a.pdf", 1, 2]],
    "mkdirs": [],
    "rmdirs": [],
    "plan_id": None,
}


@pytest.mark.parametrize(
    "lines",
    [
        [_signed(BEGIN), _signed({"t": "end", "txn": 1, "applied": [5]})],
        [_signed(BEGIN), _signed({"t": "end", "txn": 1, "applied": [-1]})],
        [_signed(BEGIN), _signed({"t": "end", "txn": 1, "applied": "0"})],
        [_signed(BEGIN), _signed({"t": "end", "txn": 1, "applied": [0, 0]})],
        [_signed(b"[" * 100_000 + b"]" * 100_000), _signed({"t": "x"})],
    ],
    ids=["index past the moves", "negative index", "a string", "an index twice", "JSON nested 100,000 deep"],
)
def test_forged_lines_with_valid_checksums_are_a_damaged_journal(tmp_path: Path, lines: list[bytes]) -> None:
    """Attack (found by review): lines whose checksums are right but whose content is not (an index past the
    transaction's moves, JSON nested past the recursion limit) raised IndexError or RecursionError out of the
    server's start, not the journal's "damaged" refusal; a negative index was replayed as the last move."""
    path = tmp_path / "journal.jsonl"
    path.write_bytes(b"".join(lines) + _signed({"t": "x"}))
    with pytest.raises(ConfigError, match="damaged at line"):
        Journal(path).open()

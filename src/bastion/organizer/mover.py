"""Runs one journaled transaction of moves, and rolls back an unfinished one after a crash.

The order is the write-ahead rule: the begin record (every move, with the inode it moves) is
fsync'd before the first folder is created or the first file renamed; the folders touched are
fsync'd before the end record is written. If a move fails, the moves already made are undone
in reverse order, so a failed transaction leaves the inbox as it found it.
"""

from __future__ import annotations

import logging

from bastion.organizer.folder import Dirs, Folder, split
from bastion.organizer.journal import Journal, Txn
from bastion.safety.errors import BastionError, Conflict, Unavailable

logger = logging.getLogger("bastion.organizer")


class JournalUnwritable(Unavailable):
    """The journal could not be written: the organizer takes no more changes until a restart."""


class Mover:
    def __init__(self, folder: Folder, journal: Journal) -> None:
        self._folder = folder
        self._journal = journal

    def run(self, txn: Txn) -> tuple[list[int], Exception | None]:
        """Journal and carry out `txn`.

        Returns:
            The indices of the moves in effect afterwards (all, or after a failure those that
            could not be put back), and the error that stopped it, if any.
        """
        try:
            self._journal.begin(txn)
        except OSError as exc:
            # Nothing has moved; a torn begin record is cut off at the next start.
            raise JournalUnwritable(f"the organizer journal cannot be written ({exc.strerror})") from exc
        applied: list[int] = []
        with Dirs(self._folder) as dirs:
            try:
                self._forward(txn, dirs, applied)
            except Exception as exc:
                kept = self._revert(txn, applied, dirs)
                self._sync(dirs)
                self._end(txn, kept)
                return kept, exc
        self._end(txn, applied)
        return applied, None

    def _end(self, txn: Txn, applied: list[int]) -> None:
        try:
            self._journal.end(txn, applied)
        except OSError as exc:
            # The begin record stands without its end: the next start rolls the action back.
            raise JournalUnwritable(
                f"the organizer journal cannot be written ({exc.strerror}); the next start rolls this action back"
            ) from exc

    def _forward(self, txn: Txn, dirs: Dirs, applied: list[int]) -> None:
        folder = self._folder
        for rel in txn.mkdirs:
            dirs.get(rel, create=True)
        for index, move in enumerate(txn.moves):
            src_parent, src_name = split(move.src)
            dst_parent, dst_name = split(move.dst)
            src_fd, dst_fd = dirs.get(src_parent), dirs.get(dst_parent)
            folder.rename(src_fd, src_name, dst_fd, dst_name, src=move.src, dst=move.dst)
            info = folder.lstat_at(dst_fd, dst_name)
            if info is None or (info.st_dev, info.st_ino) != (move.dev, move.ino):
                # Something else was put at the source after the check: give it back its name.
                try:
                    folder.rename(dst_fd, dst_name, src_fd, src_name, src=move.dst, dst=move.src)
                except BastionError:
                    logger.warning("could not put back '%s' swapped in for a planned file", move.src)
                raise Conflict(f"'{move.src}' was replaced while the moves ran: nothing was moved; list again")
            applied.append(index)
        for rel in sorted(txn.rmdirs, key=lambda r: -r.count("/")):
            dirs.get(split(rel)[0])
            dirs.forget(rel)
            self._folder.rmdir_if_empty(rel)
        dirs.sync()

    def _revert(self, txn: Txn, applied: list[int], dirs: Dirs) -> list[int]:
        """Undo the moves in `applied`, back to front; return those that could not be undone."""
        kept = list(applied)
        for rel in sorted(txn.rmdirs, key=lambda r: r.count("/")):
            try:
                dirs.get(rel, create=True)
            except BastionError as exc:
                logger.warning("rollback could not re-create folder '%s': %s", rel, exc.reason)
        for index in reversed(applied):
            move = txn.moves[index]
            src_parent, src_name = split(move.src)
            dst_parent, dst_name = split(move.dst)
            try:
                src_fd = dirs.get(src_parent, create=True)
                dst_fd = dirs.get(dst_parent)
                self._folder.rename(dst_fd, dst_name, src_fd, src_name, src=move.dst, dst=move.src)
            except BastionError as exc:
                logger.warning("rollback left '%s' at '%s': %s", move.src, move.dst, exc.reason)
                continue
            kept.remove(index)
        for rel in sorted(txn.mkdirs, key=lambda r: -r.count("/")):
            dirs.forget(rel)
            try:
                dirs.get(split(rel)[0])
            except BastionError:
                continue
            self._folder.rmdir_if_empty(rel)
        return kept

    @staticmethod
    def _sync(dirs: Dirs) -> None:
        try:
            dirs.sync()
        except OSError as exc:
            logger.warning("could not fsync the folders after a rollback: %s", exc)

    def recover(self, txn: Txn) -> list[int]:
        """Roll back a transaction a crash left unfinished; return the moves left in effect.

        Which moves happened is read from the file system: a move happened if its inode is at
        its destination. Running this twice (a crash during recovery) gives the same result.
        """
        applied: list[int] = []
        for index, move in enumerate(txn.moves):
            try:
                info = self._folder.lstat(move.dst)
            except BastionError:
                # Cannot tell (a folder on the way its owner cannot search): taken as done, so it is put
                # back if it can be, and kept in the history as in effect if not, never dropped from it.
                applied.append(index)
                continue
            if info is not None and (info.st_dev, info.st_ino) == (move.dev, move.ino):
                applied.append(index)
        with Dirs(self._folder) as dirs:
            kept = self._revert(txn, applied, dirs)
            self._sync(dirs)
        self._journal.end(txn, kept)
        return kept

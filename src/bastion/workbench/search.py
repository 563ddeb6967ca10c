"""search_files: content and name matches beneath a folder of a workspace, through its jail.

Host-side, in sandboxes too: the jail's walk never follows a symlink and reads each file
like read_file does (secret-file rules, regular files only, hard links refused), so a
link planted by a sandbox reaches nothing outside; searching inside the sandbox would
instead see what its commands see (the host's read-only /usr, /etc) and put the secret-file
rules in a place the agent controls. Matching runs on the redacted text, as read_file
would show it, so a pattern cannot probe a secret character by character.
"""

from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass, field
from typing import Final

from bastion.safety.errors import BastionError, InvalidRequest
from bastion.safety.paths import Jail, WalkEntry
from bastion.safety.redact import Redactor, sanitize_name, sanitize_terminal
from bastion.safety.search import SEARCH_BUDGET_S, SearchPattern

DEFAULT_SEARCH_RESULTS: Final = 100
MAX_SEARCH_RESULTS: Final = 1000
MAX_SEARCH_FILE_BYTES: Final = 1_048_576  # larger files are skipped
MAX_SEARCH_SCAN_BYTES: Final = 64 * 1_048_576  # in all, per search
MAX_SHOWN_LINE_CHARS: Final = 300
MAX_GLOB_CHARS: Final = 256
_BINARY_PROBE_BYTES: Final = 8192
PRUNED_FOLDERS: Final = frozenset({".git", ".venv", "node_modules", "__pycache__"})
"""Not entered unless the search starts inside one: tools' own state, large and rarely what is sought."""


@dataclass
class _Tally:
    """What one search found and skipped, and why it stopped early."""

    matches: list[dict[str, object]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    scanned_files: int = 0
    scanned_bytes: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: {"binary": 0, "too_large": 0, "unreadable": 0})
    stopped: str = ""


def search_tree(
    jail: Jail,
    redactor: Redactor,
    pattern: SearchPattern,
    *,
    path: str,
    glob: str | None,
    max_results: int,
) -> dict[str, object]:
    """Search names and contents beneath `path` (or the one file it names) for `pattern`.

    Raises:
        BastionError: for `path` itself (PathEscape, PolicyDenied, NotFound, InvalidRequest).
    """
    if not 1 <= max_results <= MAX_SEARCH_RESULTS:
        raise InvalidRequest(f"max_results must be between 1 and {MAX_SEARCH_RESULTS}")
    if glob is not None and (not glob or len(glob) > MAX_GLOB_CHARS):
        raise InvalidRequest(f"glob must be 1 to {MAX_GLOB_CHARS} characters, e.g. '*.py'")
    deadline = time.monotonic() + SEARCH_BUDGET_S  # the walk counts too
    entries, cut = _entries(jail, path, deadline)
    tally = _Tally()
    for entry in entries:
        if glob is not None and not _globbed(entry.path, glob):
            continue
        if time.monotonic() > deadline:
            tally.stopped = "time"
            break
        _search_entry(jail, redactor, pattern, entry, tally, max_results, deadline)
        if tally.stopped:
            break
    if cut and not tally.stopped:
        tally.stopped = "time" if time.monotonic() > deadline else "entries"
    return {
        "pattern": pattern.text,
        "regex": pattern.regex is not None,
        "matches": tally.matches,
        "name_matches": tally.names,
        "files_searched": tally.scanned_files,
        "skipped": tally.skipped,
        "truncated": bool(tally.stopped),
        **({"truncated_by": _STOPPED[tally.stopped]} if tally.stopped else {}),
    }


_STOPPED: Final = {
    "results": "max_results was reached: narrow the search (path, glob) or raise max_results",
    "bytes": f"over {MAX_SEARCH_SCAN_BYTES // 1_048_576} MiB were searched: narrow the search with path or glob",
    "time": f"the search took over {SEARCH_BUDGET_S:g} s: narrow it with path or glob, or simplify the regex",
    "entries": "the folder has too many entries: narrow the search with path",
}


def _entries(jail: Jail, path: str, deadline: float) -> tuple[tuple[WalkEntry, ...], bool]:
    try:
        return jail.walk(path, prune=PRUNED_FOLDERS, deadline=deadline)
    except InvalidRequest:
        pass  # not a folder: the one file it names (through a link too); its own errors are the caller's
    read = jail.read(path, length=0)
    return (WalkEntry(path=read.path, kind="file", size=read.size),), False


def _globbed(path: str, glob: str) -> bool:
    # A glob with a '/' is matched against the whole relative path ('*' crosses folders), else the name.
    return fnmatch.fnmatchcase(path if "/" in glob else path.rpartition("/")[2], glob)


def _search_entry(
    jail: Jail,
    redactor: Redactor,
    pattern: SearchPattern,
    entry: WalkEntry,
    tally: _Tally,
    max_results: int,
    deadline: float,
) -> None:
    name = redactor.redact(sanitize_name(entry.path.rpartition("/")[2]))
    if pattern.found_in(name):
        if _full(tally, max_results):
            return
        tally.names.append(redactor.redact(sanitize_name(entry.path)))
    if entry.kind != "file":
        return
    if entry.size > MAX_SEARCH_FILE_BYTES:
        tally.skipped["too_large"] += 1
        return
    if tally.scanned_bytes + entry.size > MAX_SEARCH_SCAN_BYTES:
        tally.stopped = "bytes"
        return
    text = _text_of(jail, entry, tally)
    if text is None:
        return
    tally.scanned_files += 1
    shown_path = redactor.redact(sanitize_name(entry.path))
    # Cleaned before redaction (an escape sequence inside a token must not hide it); both keep the line breaks.
    lines = redactor.redact_keeping_lines(sanitize_terminal(text)).split("\n")
    for number, line in enumerate(lines, start=1):
        if time.monotonic() > deadline:
            tally.stopped = "time"
            return
        if pattern.found_in(line):
            if _full(tally, max_results):
                return
            tally.matches.append({"path": shown_path, "line": number, "text": line[:MAX_SHOWN_LINE_CHARS]})


def _full(tally: _Tally, max_results: int) -> bool:
    if len(tally.matches) + len(tally.names) >= max_results:
        tally.stopped = "results"
        return True
    return False


def _text_of(jail: Jail, entry: WalkEntry, tally: _Tally) -> str | None:
    """The file's text through the jail, or None (counted) when it is binary or cannot be read now."""
    try:
        data = jail.read(entry.path, length=MAX_SEARCH_FILE_BYTES).data
    except BastionError:
        tally.skipped["unreadable"] += 1
        return None
    tally.scanned_bytes += len(data)
    if b"\0" in data[:_BINARY_PROBE_BYTES]:
        tally.skipped["binary"] += 1
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        tally.skipped["binary"] += 1
        return None

"""edit_file: exact-string replacement in a text file of a workspace, through its jail.

The file is read and replaced by the jail (`Jail.read`, `Jail.replace`): the same path rules,
secret-file rules and size caps as read_file and write_file, and the new content lands
atomically (a new file renamed over the old, keeping its mode). The diff shown is made from
the old and new text each redacted whole, so a secret shows in it no more than in read_file.
`old` only matches outside the secrets redaction would hide, and the answer is the same whether
or not a guess is inside one: else edit_file(dry_run) would be an oracle that probes a secret
character by character. The size of the result is known before it is built (replace_all of a
short `old` by a long `new` could otherwise ask for terabytes).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator
from typing import Final

from bastion.safety.errors import InvalidRequest, NotFound, ResourceLimit
from bastion.safety.paths import MAX_READ_BYTES, MAX_WRITE_BYTES, Jail
from bastion.safety.redact import Redactor, sanitize_name, sanitize_terminal

MAX_DIFF_CHARS: Final = 64 * 1024
MAX_EDIT_BYTES: Final = MAX_READ_BYTES
MAX_DIFF_PAIRS: Final = 1_000_000
"""Line pairs difflib may compare between the texts' common first and last lines. Its matcher takes time
quadratic in them (a line inserted between every two of 12,000 took 33 s of CPU, a 1 MiB file would take
an hour); a larger change is shown as one hunk: its old lines, then its new ones."""
DIFF_CONTEXT: Final = 3


def edit_text(
    jail: Jail, redactor: Redactor, path: str, old: str, new: str, *, replace_all: bool, dry_run: bool
) -> dict[str, object]:
    """Replace `old` by `new` in the file at `path`; return a unified diff of the change.

    Raises:
        InvalidRequest: `old` is empty, equal to `new`, or occurs more than once without
            `replace_all`; the file is not UTF-8 text.
        NotFound: the file, or `old` in it.
        ResourceLimit: the file is over `MAX_EDIT_BYTES`.
        Conflict: the file changed between the read and the write.
    """
    if not old:
        raise InvalidRequest("old is empty: give the exact text to replace (read_file shows it)")
    if old == new:
        raise InvalidRequest("old and new are the same: nothing would change")
    for name, value in (("old", old), ("new", new)):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # JSON can carry a lone surrogate ("\ud800"), which no file holds
            raise InvalidRequest(f"{name} has a lone surrogate character, which is not text: remove it") from None
    # A link to a file of the workspace is edited at its target and stays a link (as an editor does).
    read = jail.read(jail.real_path(path), length=MAX_EDIT_BYTES)
    shown = redactor.redact(sanitize_name(read.path))  # the real path: names a sandbox chose
    if not read.eof:
        raise ResourceLimit(
            f"{shown} is {read.size} bytes, over the {MAX_EDIT_BYTES} byte limit of edit_file: use write_file"
        )
    try:
        text = read.data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest(f"{shown} is not UTF-8 text: edit_file edits text; use upload_file") from None
    starts = _occurrences(text, old, redactor.secret_spans(text))
    count = len(starts)
    if count == 0:
        raise NotFound(
            f"old was not found in {shown}: copy the exact text from read_file (spaces, tabs and line ends count; "
            "text inside a [REDACTED:...] secret never matches)"
        )
    if count > 1 and not replace_all:
        raise InvalidRequest(
            f"old occurs {count} times in {shown}: include more surrounding text to make it unique, "
            "or pass replace_all=true"
        )
    chosen = starts if replace_all else starts[:1]
    size = len(read.data) + len(chosen) * (len(new.encode("utf-8")) - len(old.encode("utf-8")))
    if size > MAX_WRITE_BYTES:
        raise ResourceLimit(f"the edited file would be {size} bytes, over the {MAX_WRITE_BYTES} byte limit")
    changed = _spliced(text, old, new, chosen)
    data = changed.encode("utf-8")
    if not dry_run:
        jail.replace(read.path, data, version=read.version)
    diff, cut = _diff(redactor, shown, text, changed)
    return {
        "path": shown,
        "replacements": len(chosen),
        "dry_run": dry_run,
        "written": not dry_run,
        "bytes": len(data),
        "diff": diff,
        "diff_truncated": cut,
    }


def _occurrences(text: str, old: str, secrets: list[tuple[int, int]]) -> list[int]:
    """Where `old` starts in `text`, left to right without overlap, each wholly outside every secret span.

    Each stretch between secrets is searched on its own, so whether an occurrence is found never
    depends on what a secret holds.
    """
    starts: list[int] = []
    bounds = [0, *(edge for span in secrets for edge in span), len(text)]
    for begin, end in zip(bounds[::2], bounds[1::2], strict=True):
        at = text.find(old, begin, end)
        while at >= 0:
            starts.append(at)
            at = text.find(old, at + len(old), end)
    return starts


def _spliced(text: str, old: str, new: str, starts: list[int]) -> str:
    parts: list[str] = []
    pos = 0
    for at in starts:
        parts.extend((text[pos:at], new))
        pos = at + len(old)
    parts.append(text[pos:])
    return "".join(parts)


def _diff(redactor: Redactor, path: str, before: str, after: str) -> tuple[str, bool]:
    """A unified diff of the redacted texts, cleaned for display and capped."""
    old_lines = redactor.redact(sanitize_terminal(before)).splitlines(keepends=True)
    new_lines = redactor.redact(sanitize_terminal(after)).splitlines(keepends=True)
    head = _common_head(old_lines, new_lines)
    tail = _common_head(old_lines[head:][::-1], new_lines[head:][::-1])
    if (len(old_lines) - head - tail) * (len(new_lines) - head - tail) <= MAX_DIFF_PAIRS:
        lines: Iterable[str] = difflib.unified_diff(
            old_lines, new_lines, fromfile=f"a/{path}", tofile=f"b/{path}", n=DIFF_CONTEXT
        )
    else:
        lines = _one_hunk(old_lines, new_lines, head, tail, path)
    parts: list[str] = []
    size = 0
    for line in lines:
        parts.append(line if line.endswith("\n") else line + "\n")
        size += len(parts[-1])
        if size > MAX_DIFF_CHARS:
            return "".join(parts)[:MAX_DIFF_CHARS], True
    return "".join(parts), False


def _common_head(a: list[str], b: list[str]) -> int:
    """How many first lines `a` and `b` share."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def _one_hunk(old: list[str], new: list[str], head: int, tail: int, path: str) -> Iterator[str]:
    """The unified diff of a change that spans lines `head` to `tail` from the end, as one hunk with context.

    Written by hand: difflib formats only what its own (quadratic) matcher found.
    """
    start = max(0, head - DIFF_CONTEXT)
    context_after = min(tail, DIFF_CONTEXT)
    old_stop, new_stop = len(old) - tail + context_after, len(new) - tail + context_after
    yield f"--- a/{path}\n"
    yield f"+++ b/{path}\n"
    yield f"@@ -{_unified_range(start, old_stop)} +{_unified_range(start, new_stop)} @@\n"
    yield from (" " + line for line in old[start:head])
    yield from ("-" + line for line in old[head : len(old) - tail])
    yield from ("+" + line for line in new[head : len(new) - tail])
    yield from (" " + line for line in old[len(old) - tail : old_stop])


def _unified_range(start: int, stop: int) -> str:
    """A hunk's line range as unified diffs write it (difflib's own rule: "N" for one line, "N-1,0" for none)."""
    length = stop - start
    if length == 1:
        return str(start + 1)
    return f"{start if length == 0 else start + 1},{length}"

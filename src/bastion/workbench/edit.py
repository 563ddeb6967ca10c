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
from typing import Final

from bastion.safety.errors import InvalidRequest, NotFound, ResourceLimit
from bastion.safety.paths import MAX_READ_BYTES, MAX_WRITE_BYTES, Jail
from bastion.safety.redact import Redactor, sanitize_name, sanitize_terminal

MAX_DIFF_CHARS: Final = 64 * 1024
MAX_EDIT_BYTES: Final = MAX_READ_BYTES


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
    lines = difflib.unified_diff(old_lines, new_lines, fromfile=f"a/{path}", tofile=f"b/{path}")
    text = "".join(line if line.endswith("\n") else line + "\n" for line in lines)
    if len(text) <= MAX_DIFF_CHARS:
        return text, False
    return text[:MAX_DIFF_CHARS], True

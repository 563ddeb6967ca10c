"""Search patterns a caller gives `search_files`: literal, or a regex bounded before it runs.

Python's `re` backtracks, holds the GIL for a whole match and cannot be interrupted from
another thread, so a pattern like ``(a+)+$`` would stall the whole server. This is a
best-effort bound, not a proof: a regex is refused when it has the shapes that backtrack
exponentially (a group holding a quantifier or an alternation and repeated by anything but
``?``, a backreference, a lookaround), more than `MAX_REGEX_UNBOUNDED` unbounded quantifiers,
or more than `MAX_REGEX_QUANTIFIERS` in all; and it is only run on the first `MAX_REGEX_LINE_CHARS`
characters of a line. Measured here: three unbounded ``.*`` on a 256-character line take
about 0.25 s, the worst that passes; the caller's time budget (`SEARCH_BUDGET_S`) bounds
a whole search, checked between lines. A literal pattern is a plain substring test (linear).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, final

from bastion.safety.errors import InvalidRequest

MAX_PATTERN_CHARS: Final = 256
MAX_REGEX_UNBOUNDED: Final = 3
MAX_REGEX_QUANTIFIERS: Final = 8
MAX_REGEX_LINE_CHARS: Final = 256
SEARCH_BUDGET_S: Final = 5.0
# {m,n} with n above this counts as unbounded: it backtracks like '*' on lines this short.
_BOUNDED_REPEAT_MAX: Final = 16
_REPEAT: Final = re.compile(r"\{(\d*)(,?)(\d*)\}")


@final
@dataclass(frozen=True, slots=True)
class SearchPattern:
    """A pattern that passed `search_pattern`; only that function makes one."""

    text: str
    regex: re.Pattern[str] | None

    def found_in(self, line: str) -> bool:
        """Whether the pattern occurs in `line` (a regex: in its first `MAX_REGEX_LINE_CHARS` characters)."""
        if self.regex is None:
            return self.text in line
        return self.regex.search(line[:MAX_REGEX_LINE_CHARS]) is not None


def search_pattern(pattern: str, *, regex: bool) -> SearchPattern:
    """Check a search pattern and compile it.

    Raises:
        InvalidRequest: empty, too long, not a valid regex, or a regex shape refused above.
    """
    if not pattern:
        raise InvalidRequest("the pattern is empty: give the text to search for")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise InvalidRequest(f"the pattern is over {MAX_PATTERN_CHARS} characters: search for a shorter one")
    if "\n" in pattern or "\r" in pattern:
        raise InvalidRequest("the pattern has a line break: search_files matches within one line")
    if not regex:
        return SearchPattern(pattern, None)
    problem = _risky_shape(pattern)
    if problem is not None:
        raise InvalidRequest(f"the regex {problem}, which can take exponential time: simplify it or search literally")
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise InvalidRequest(f"the regex does not compile ({exc}): fix it, or pass regex=false") from None
    return SearchPattern(pattern, compiled)


def _risky_shape(pattern: str) -> str | None:
    """Why the regex's shape is refused, or None; a lexical scan over escapes, classes and groups."""
    groups: list[bool] = []  # per open group: whether it holds a quantifier or '|'
    risky_group = False  # the group that just closed holds one
    unbounded = total = 0
    i = 0
    while i < len(pattern):
        char = pattern[i]
        after_group, risky_group = risky_group, False
        if char == "\\":
            nxt = pattern[i + 1 : i + 2]
            if (nxt.isdigit() and nxt != "0") or nxt == "g":
                return "has a backreference"
            i += 2
        elif char == "[":
            i = _class_end(pattern, i)
        elif char == "(":
            i, opens = _group_start(pattern, i)
            if i < 0:
                return "has a lookaround, backreference or conditional"
            if opens:
                groups.append(False)
        elif char == ")":
            risky_group = groups.pop() if groups else False
            if risky_group and groups:
                groups[-1] = True  # ((a+)b)* repeats the inner quantifier too
            i += 1
        elif char in "*+?" or (char == "{" and _REPEAT.match(pattern, i)):
            if after_group and char != "?":  # (a+)? runs its group at most once
                return "repeats a group that holds a quantifier or '|'"
            total += 1
            unbounded += char in "*+" or _unbounded_repeat(pattern, i)
            if groups:
                groups[-1] = True
            i = _quantifier_end(pattern, i)
        else:
            if char == "|" and groups:
                groups[-1] = True
            i += 1
    if unbounded > MAX_REGEX_UNBOUNDED:
        return f"has {unbounded} unbounded quantifiers (the limit is {MAX_REGEX_UNBOUNDED})"
    if total > MAX_REGEX_QUANTIFIERS:
        return f"has {total} quantifiers (the limit is {MAX_REGEX_QUANTIFIERS})"
    return None


def _group_start(pattern: str, i: int) -> tuple[int, bool]:
    """Where the group opening at `i` starts its content, and whether it opens a group at all
    (``(?i)`` and ``(?#...)`` do not); (-1, False) for lookarounds, backreferences, conditionals."""
    if pattern[i + 1 : i + 2] != "?":
        return i + 1, True
    rest = pattern[i + 2 :]
    if rest.startswith(("=", "!", "<=", "<!", "P=", "(")):
        return -1, False
    if rest.startswith((":", ">")):
        return i + 3, True
    if rest.startswith(("P<", "<")):
        close = pattern.find(">", i)
        return (len(pattern), True) if close < 0 else (close + 1, True)
    if rest.startswith("#"):
        close = pattern.find(")", i)
        return (len(pattern), False) if close < 0 else (close + 1, False)
    j = i + 2
    while j < len(pattern) and (pattern[j].isalpha() or pattern[j] == "-"):
        j += 1
    if pattern[j : j + 1] == ":":
        return j + 1, True
    return j + 1, False  # inline flags: (?i)


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class opening at `i` (']' first in it is literal)."""
    j = i + 1
    if pattern[j : j + 1] == "^":
        j += 1
    if pattern[j : j + 1] == "]":
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


def _unbounded_repeat(pattern: str, i: int) -> bool:
    match = _REPEAT.match(pattern, i)
    if match is None:
        return False
    low, comma, high = match.groups()
    if not comma:
        return int(low or 0) > _BOUNDED_REPEAT_MAX
    return not high or int(high) > _BOUNDED_REPEAT_MAX


def _quantifier_end(pattern: str, i: int) -> int:
    """The index after the quantifier at `i` and its lazy or possessive suffix."""
    match = _REPEAT.match(pattern, i) if pattern[i] == "{" else None
    j = match.end() if match is not None else i + 1
    if pattern[j : j + 1] in ("?", "+"):
        j += 1
    return j

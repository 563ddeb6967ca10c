"""Search patterns a caller gives `search_files`: literal, or a regex run by a linear-time engine.

Python's `re` backtracks and holds the GIL for a whole match, so a pattern like ``(a+)+$``
would stall every client of the server; no shape heuristic bounds it (an accepted regex
measured 0.25 s per line). Regexes therefore run on RE2 (`google-re2`): it builds an
automaton instead of backtracking, so a match costs at most (line length) x (pattern size),
and it releases the GIL while it matches. What RE2 cannot do in linear time it does not do:
backreferences, lookarounds, atomic groups, possessive quantifiers and conditionals are
refused with an InvalidRequest that names the construct.

The caps stay, because linear is not free: a pattern is at most `MAX_PATTERN_CHARS`
characters and its compiled program and automaton cache at most `_MAX_PROGRAM_BYTES`
(bounds the pattern size factor, and the memory a caller can make the server keep: the
`re2` module caches its last 128 compiled regexes, so 128 MiB; at RE2's default 8 MiB,
128 patterns built for large automata kept 180 MiB and could keep 1 GiB), a regex sees the
first `MAX_REGEX_LINE_CHARS` characters of a line (bounds the other factor: the heaviest
pattern found, ``(.*a){1000}z``, takes ~150 ms on one such line), and the caller's time
budget `SEARCH_BUDGET_S` bounds a whole search. A literal pattern is a plain
substring test on the whole line (linear).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Protocol, final

import re2  # type: ignore[import-untyped]  # google-re2 ships no type information

from bastion.safety.errors import InvalidRequest

MAX_PATTERN_CHARS: Final = 256
MAX_REGEX_LINE_CHARS: Final = 4096
SEARCH_BUDGET_S: Final = 5.0
_MAX_PROGRAM_BYTES: Final = 1_048_576  # RE2's max_mem (its default is 8 MiB)

# What RE2 says it does not support, and how to name it to the caller.
_UNSUPPORTED_OPERATORS: Final = (
    ("(?=", "a lookahead '(?=...)'"),
    ("(?!", "a negative lookahead '(?!...)'"),
    ("(?<=", "a lookbehind '(?<=...)'"),
    ("(?<!", "a negative lookbehind '(?<!...)'"),
    ("(?P=", "a backreference '(?P=name)'"),
    ("(?>", "an atomic group '(?>...)'"),
    ("(?(", "a conditional '(?(...)...)'"),
)
_BACKREFERENCE: Final = re.compile(r"invalid escape sequence: \\([1-9]|g)")


class _Regex(Protocol):
    def search(self, text: str) -> object | None: ...


@final
@dataclass(frozen=True, slots=True)
class SearchPattern:
    """A pattern that passed `search_pattern`; only that function makes one."""

    text: str
    regex: _Regex | None

    def found_in(self, line: str) -> bool:
        """Whether the pattern occurs in `line` (a regex: in its first `MAX_REGEX_LINE_CHARS` characters)."""
        if self.regex is None:
            return self.text in line
        # RE2 takes UTF-8: a lone surrogate (a file name that is not UTF-8) is matched as U+FFFD.
        head = line[:MAX_REGEX_LINE_CHARS].encode("utf-8", "replace").decode("utf-8")
        return self.regex.search(head) is not None


def search_pattern(pattern: str, *, regex: bool) -> SearchPattern:
    """Check a search pattern and compile it.

    Raises:
        InvalidRequest: empty, too long, not a valid regex, or a construct RE2 does not support.
    """
    if not pattern:
        raise InvalidRequest("the pattern is empty: give the text to search for")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise InvalidRequest(f"the pattern is over {MAX_PATTERN_CHARS} characters: search for a shorter one")
    if "\n" in pattern or "\r" in pattern:
        raise InvalidRequest("the pattern has a line break: search_files matches within one line")
    if not regex:
        return SearchPattern(pattern, None)
    return SearchPattern(pattern, _compiled(pattern))


def _compiled(pattern: str) -> _Regex:
    options = re2.Options()
    options.log_errors = False  # RE2 would write every refused pattern to the server's stderr
    options.never_capture = True  # only whether it matches counts
    options.max_mem = _MAX_PROGRAM_BYTES
    try:
        compiled: _Regex = re2.compile(pattern, options)
    except UnicodeEncodeError:  # RE2 takes UTF-8; JSON can carry a lone surrogate ("\ud800")
        raise InvalidRequest("the regex has a lone surrogate character, which is not text: remove it") from None
    except re2.error as exc:
        raise InvalidRequest(_refusal(pattern, _message(exc))) from None
    return compiled


def _message(exc: BaseException) -> str:
    raw = exc.args[0] if exc.args else ""
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def _refusal(pattern: str, message: str) -> str:
    """The caller-facing reason RE2 refused `pattern`, naming an unsupported construct when it is one."""
    construct = None
    if "invalid perl operator" in message:
        construct = next((name for prefix, name in _UNSUPPORTED_OPERATORS if prefix in pattern), None)
    elif _BACKREFERENCE.search(message):
        construct = "a backreference ('\\1', '\\g<1>')"
    elif "bad repetition operator: " in message and any(q in pattern for q in ("++", "*+", "?+", "}+")):
        construct = "a possessive quantifier ('a++')"
    if construct is not None:
        return (
            f"the regex uses {construct}, which the linear-time regex engine (RE2) does not support: "
            "rewrite it without, or search literally (regex=false)"
        )
    if "pattern too large" in message:
        return "the regex is too large once compiled (too many or too large repeats): simplify it"
    return f"the regex does not compile ({message}): fix it, or pass regex=false"

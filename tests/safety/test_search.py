"""The search pattern check: literal by default, regexes run by RE2 (linear time).

What this proves: the classic catastrophic-backtracking patterns complete on long lines with
the right answer; constructs RE2 cannot run are refused by name; everyday regexes pass. What it
does not prove: timings (bench/bench_search.py); the tool-level caps are tests/tools/test_search_edit.py's.
"""

from __future__ import annotations

import pytest

from bastion.safety.errors import InvalidRequest
from bastion.safety.search import MAX_PATTERN_CHARS, MAX_REGEX_LINE_CHARS, search_pattern

# The classic catastrophic-backtracking patterns, each with a long line it matches and one it does not.
CATASTROPHIC = [
    ("(a+)+$", "a" * 4000, "a" * 4000 + "!"),
    ("(a|a)*b", "a" * 4000 + "b", "a" * 4000),
    ("(.*a){20}", "a" * 4000, "b" * 4000),
    ("(a*)*b", "a" * 4000 + "b", "a" * 4000),
    ("(x|xx)+y", "x" * 4000 + "y", "x" * 4000),
    (r"(\w+\s?)+$", "word " * 800 + "w", "word " * 800 + "!"),
    (".*.*.*.*x", "y" * 4000 + "x", "y" * 4000),
]
UNSUPPORTED = [
    (r"(\d)\1", "backreference"),
    ("(?P<x>a)(?P=x)", "backreference"),
    (r"(a)\g<1>", "backreference"),
    ("(?=a+)a", "lookahead"),
    ("(?!a)b", "negative lookahead"),
    ("(?<=x)y", "lookbehind"),
    ("(?<!x)y", "negative lookbehind"),
    ("(?>a+)b", "atomic group"),
    ("a++b", "possessive quantifier"),
    ("(?(1)a|b)", "conditional"),
]
EVERYDAY = [
    r"def \w+\(.*\)",
    r"\d+\.\d+\.\d+",
    r"^import (os|sys)$",
    r"(?i)todo:.*",
    r"class [A-Z]\w*(\(.*\))?:",
    r"[(]+x",
    r"(?:ab)*c",
    r"(?P<name>\w+)=",
    r"\bfoo\b",
    r"x{2,10}",
    "(a+)+$",
    ".*.*.*.*x",
]


@pytest.mark.parametrize(("pattern", "hit", "miss"), CATASTROPHIC)
def test_catastrophic_regexes_answer_right_on_long_lines(pattern: str, hit: str, miss: str) -> None:
    """Invariant: the patterns that make a backtracking engine run for ages complete on 4000-character
    lines and answer correctly (RE2 is linear; bench/bench_search.py has the figures)."""
    checked = search_pattern(pattern, regex=True)
    assert checked.found_in(hit)
    assert not checked.found_in(miss)


@pytest.mark.parametrize(("pattern", "construct"), UNSUPPORTED)
def test_regex_constructs_without_a_linear_algorithm_are_refused_by_name(pattern: str, construct: str) -> None:
    """Invariant: backreferences, lookarounds, atomic groups, possessive quantifiers and conditionals
    are InvalidRequest naming the construct, so the caller knows what to rewrite."""
    with pytest.raises(InvalidRequest, match=f"uses an? {construct}.*RE2"):
        search_pattern(pattern, regex=True)


@pytest.mark.parametrize("pattern", EVERYDAY)
def test_everyday_regexes_pass(pattern: str) -> None:
    assert search_pattern(pattern, regex=True).regex is not None


def test_a_regex_too_large_once_compiled_is_refused() -> None:
    """Attack: a short pattern that expands to a huge program ('{1000}' nested) is refused, not built."""
    with pytest.raises(InvalidRequest):
        search_pattern(r"(?i)(.*\pL){1000}", regex=True)
    with pytest.raises(InvalidRequest):
        search_pattern("((a{1000}){1000})", regex=True)


def test_a_lone_surrogate_in_a_regex_is_invalid_not_a_crash() -> None:
    """Attack: JSON can carry "\\ud800"; RE2 takes UTF-8, so it is an InvalidRequest, not a traceback."""
    with pytest.raises(InvalidRequest, match="surrogate"):
        search_pattern("a\ud800", regex=True)


def test_a_regex_matches_a_name_that_is_not_utf8() -> None:
    """Attack: a file name with undecodable bytes (a lone surrogate in Python) is matched, not a crash."""
    assert search_pattern("x.y", regex=True).found_in("\udcffx.y")


def test_literal_patterns_are_never_regexes() -> None:
    """Invariant: regex=false takes the text as is, '(a+)+$' included (a substring test is linear)."""
    literal = search_pattern("(a+)+$", regex=False)
    assert literal.regex is None
    assert literal.found_in("x = '(a+)+$'")
    assert not literal.found_in("aaaa")


@pytest.mark.parametrize(
    ("pattern", "regex"),
    [("", False), ("a" * (MAX_PATTERN_CHARS + 1), False), ("a\nb", False), ("[", True), ("(", True)],
)
def test_empty_long_multiline_and_broken_patterns_are_invalid(pattern: str, regex: bool) -> None:
    with pytest.raises(InvalidRequest):
        search_pattern(pattern, regex=regex)


def test_regex_only_sees_the_start_of_a_long_line() -> None:
    """Invariant: a regex runs on at most MAX_REGEX_LINE_CHARS characters of a line (the cost bound)."""
    pattern = search_pattern("needle", regex=True)
    assert pattern.found_in("x" * (MAX_REGEX_LINE_CHARS - 6) + "needle")
    assert not pattern.found_in("x" * MAX_REGEX_LINE_CHARS + "needle")

"""The search pattern check: literal by default, regexes refused in the shapes that backtrack without end.

What this proves: each refused shape is refused before `re` ever runs it, and common everyday
regexes pass. What it does not prove: that every accepted regex is fast (the bound is
best-effort, see bastion.safety.search); the tool-level caps are tests/tools/test_search_edit.py's.
"""

from __future__ import annotations

import pytest

from bastion.safety.errors import InvalidRequest
from bastion.safety.search import MAX_PATTERN_CHARS, MAX_REGEX_LINE_CHARS, search_pattern

CATASTROPHIC = [
    "(a+)+$",
    "(a*)*b",
    "(a|aa)*c",
    "(x|xx)+y",
    r"(\w+\s?)+$",
    "((a+)b)*",
    "(?:a{2,}){2,}",
    "(.*a){12}",
    r"(\d)\1",
    "(?P<x>a)(?P=x)",
    r"(a)\g<1>",
    "(?=a+)a",
    "(?<!x)y",
    "(?(1)a|b)",
    ".*.*.*.*x",
    "a?" * 9 + "a" * 9,
    "x{1,100}y{1,100}z{1,100}w{1,100}",
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
]


@pytest.mark.parametrize("pattern", CATASTROPHIC)
def test_catastrophic_regex_shapes_are_refused_before_they_run(pattern: str) -> None:
    """Invariant: nested or alternated repeats, backreferences, lookarounds and too many quantifiers are refused."""
    with pytest.raises(InvalidRequest, match="exponential time"):
        search_pattern(pattern, regex=True)


@pytest.mark.parametrize("pattern", EVERYDAY)
def test_everyday_regexes_pass(pattern: str) -> None:
    assert search_pattern(pattern, regex=True).regex is not None


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

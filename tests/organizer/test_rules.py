"""Categories and skip rules: config validation, derivation of the protection set, and matching."""

from __future__ import annotations

import fnmatch
import stat
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from bastion.config import DEFAULT_SKIP_RULES, InboxConfig, SkipRule
from bastion.organizer.rules import Rules, display_name
from bastion.safety.paths import name_problem
from bastion.safety.redact import INVISIBLE_CODEPOINTS

MODES = (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR)


def _config(**kwargs: object) -> InboxConfig:
    return InboxConfig(id="inbox", path=Path("/nonexistent"), **kwargs)


def test_layer_is_required() -> None:
    with pytest.raises(ValidationError, match="layer"):
        SkipRule(id="x", names=("*.iso",))  # type: ignore[call-arg]


def test_protection_set_is_filtered_from_the_whole_rule_set() -> None:
    extra = SkipRule(id="secrets", layer="protection", names=("*.kdbx",), reason="a password store")
    rules = Rules(_config(skip=(*DEFAULT_SKIP_RULES, extra)))
    assert rules.protection == tuple(rule for rule in rules.rules if rule.layer == "protection")
    assert extra in rules.protection
    assert rules.check("vault.kdbx", stat.S_IFREG, protection_only=True) is not None


def test_protection_kinds_cannot_be_dropped_or_demoted() -> None:
    without = tuple(rule for rule in DEFAULT_SKIP_RULES if rule.kind != "symlink")
    with pytest.raises(ValidationError, match="symlink"):
        _config(skip=without)
    demoted = tuple(
        rule.model_copy(update={"layer": "restraint"}) if rule.kind == "symlink" else rule
        for rule in DEFAULT_SKIP_RULES
    )
    with pytest.raises(ValidationError, match="symlink"):
        _config(skip=demoted)


@pytest.mark.parametrize(
    "categories",
    [
        {"Docs": ("pdf",), "Other": ("pdf",)},
        {"../up": ("pdf",)},
        {".hidden": ("pdf",)},
        {"Docs": (".pdf",)},
        {"Docs": ("PDF",)},
        {"a/b": ("pdf",)},
    ],
)
def test_bad_categories_are_refused(categories: dict[str, tuple[str, ...]]) -> None:
    with pytest.raises(ValidationError):
        _config(categories=categories)


def test_longest_extension_wins_and_case_is_ignored() -> None:
    rules = Rules(_config())
    assert rules.category_of("backup.tar.gz") == "Archives"
    assert rules.category_of("PHOTO.JPEG") == "Images"
    assert rules.category_of("noext") is None
    assert rules.category_of(".pdf") is None


def _reference(rules: Rules, name: str, mode: int, protection_only: bool) -> str | None:
    """The rule set read literally: the first rule, in order, that matches."""
    for rule in rules.protection if protection_only else rules.rules:
        kind = rule.kind
        if (
            (kind == "symlink" and stat.S_ISLNK(mode))
            or (kind == "folder" and stat.S_ISDIR(mode))
            or (kind == "special_file" and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)))
            or (kind == "unsafe_name" and name_problem(name) is not None)
            or any(fnmatch.fnmatch(name.lower(), pattern.lower()) for pattern in rule.names)
        ):
            return rule.id
    return None


@given(
    name=st.one_of(
        st.text(min_size=1, max_size=80).filter(lambda n: "/" not in n and n not in (".", "..")),
        st.sampled_from(["setup.EXE", ".git", "Thumbs.db", "a.part", "x\x1b.pdf", "é" * 70, "a\\b", ".env"]),
    ),
    mode=st.sampled_from(MODES),
    protection_only=st.booleans(),
)
def test_check_agrees_with_the_rules_read_literally(name: str, mode: int, protection_only: bool) -> None:
    rules = Rules(_config())
    hit = rules.check(name, mode, protection_only=protection_only)
    assert (hit.rule if hit else None) == _reference(rules, name, mode, protection_only)


@given(st.text(max_size=40))
def test_display_name_is_printable(name: str) -> None:
    shown = display_name(name)
    assert not any(unicodedata.category(char) in ("Cc", "Cf", "Cs", "Zl", "Zp") for char in shown)
    shown.encode("utf-8")
    # Printable but invisible (fillers, variation selectors: found by hypothesis, U+E0100) is escaped too.
    if name.isprintable() and "\\" not in name and not any(ord(char) in INVISIBLE_CODEPOINTS for char in name):
        assert shown == name

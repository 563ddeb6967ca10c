"""What the organizer moves where, and what it leaves alone.

The rule set is the inbox's `skip` list from the config, whole. Protection rules bind every
organizer tool; restraint rules bind only the planner. `Rules.protection` is derived by
filtering that one list, so a rule can never be in force for the planner and forgotten by
move_file.
"""

from __future__ import annotations

import fnmatch
import re
import stat
import unicodedata
from dataclasses import dataclass
from typing import Final

from bastion.config import InboxConfig, SkipKind, SkipRule
from bastion.safety.paths import name_problem
from bastion.safety.results import ResultCode

# The code a refusal by a protection rule of each kind carries; pattern rules are POLICY_DENIED.
_KIND_CODES: Final[dict[str, ResultCode]] = {
    "symlink": ResultCode.POLICY_DENIED,
    "special_file": ResultCode.POLICY_DENIED,
    "unsafe_name": ResultCode.INVALID_REQUEST,
    "outside_folder": ResultCode.PATH_ESCAPE,
    "occupied_destination": ResultCode.CONFLICT,
    "folder": ResultCode.POLICY_DENIED,
}
_ESCAPED_CATEGORIES: Final = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def display_name(name: str) -> str:
    """A name safe to show: control and invisible characters, and undecodable bytes, escaped."""
    out: list[str] = []
    for char in name:
        point = ord(char)
        if 0xDC80 <= point <= 0xDCFF:  # os.fsdecode's surrogateescape for an undecodable byte
            out.append(f"\\x{point - 0xDC00:02x}")
        elif char == "\\" or unicodedata.category(char) in _ESCAPED_CATEGORIES:
            out.append("\\\\" if char == "\\" else f"\\u{point:04x}")
        else:
            out.append(char)
    return "".join(out)


def entry_kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "special"


@dataclass(frozen=True, slots=True)
class Hit:
    """A skip rule that matched an entry, as reported to the client."""

    rule: str
    layer: str
    code: ResultCode
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"rule": self.rule, "layer": self.layer, "code": self.code.value, "reason": self.reason}


def _hit(rule: SkipRule, reason: str = "") -> Hit:
    if rule.layer == "restraint":
        code = ResultCode.NEEDS_EXPLICIT_REQUEST
    else:
        code = _KIND_CODES[rule.kind] if rule.kind is not None else ResultCode.POLICY_DENIED
    return Hit(rule=rule.id, layer=rule.layer, code=code, reason=reason or rule.reason)


class Rules:
    """Categories by extension plus the skip rules of one inbox."""

    def __init__(self, config: InboxConfig) -> None:
        self.categories: tuple[str, ...] = tuple(config.categories)
        self._by_ext = {ext: folder for folder, exts in config.categories.items() for ext in exts}
        self._longest = max((ext.count(".") + 1 for ext in self._by_ext), default=1)
        # Protection first: when both layers match, the stronger one is what gets reported.
        ordered = sorted(config.skip, key=lambda rule: rule.layer != "protection")
        self.rules: tuple[SkipRule, ...] = tuple(ordered)
        self.protection: tuple[SkipRule, ...] = tuple(rule for rule in self.rules if rule.layer == "protection")
        self._patterns = {
            rule.id: re.compile("|".join(fnmatch.translate(name) for name in rule.names), re.IGNORECASE)
            for rule in self.rules
            if rule.names
        }
        self._by_kind = {rule.kind: rule for rule in self.protection if rule.kind is not None}
        # One regex per rule list: alternation tries the rules in order, so the first group to
        # match is the first rule (by order) whose names match.
        self._all_names = _combined(self.rules)
        self._protection_names = _combined(self.protection)

    def category_of(self, name: str) -> str | None:
        """The category folder for a file name (longest extension first: "tar.gz" before "gz")."""
        parts = name.lower().split(".")
        if len(parts) < 2 or not parts[0]:
            return None
        for count in range(min(self._longest, len(parts) - 1), 0, -1):
            folder = self._by_ext.get(".".join(parts[-count:]))
            if folder is not None:
                return folder
        return None

    def check(self, name: str, mode: int, *, protection_only: bool) -> Hit | None:
        """The first skip rule matching an entry (its own name and lstat mode), or None."""
        rules = self.protection if protection_only else self.rules
        combined = self._protection_names if protection_only else self._all_names
        found = combined.match(name) if combined is not None else None
        by_name = _rule_index(found.lastgroup) if found is not None and found.lastgroup else len(rules)
        unsafe: bool | None = None
        for index, rule in enumerate(rules[:by_name]):
            kind = rule.kind
            if kind == "unsafe_name":
                if unsafe is None:
                    unsafe = _unsafe(name)
                if unsafe:
                    return _hit(rule)
            elif kind is not None and _kind_matches(kind, mode):
                return _hit(rule)
            del index
        return _hit(rules[by_name]) if by_name < len(rules) else None

    def check_name(self, name: str) -> Hit | None:
        """Protection rules that judge a name alone (a destination name that does not exist yet)."""
        for rule in self.protection:
            if rule.kind == "unsafe_name" and name_problem(name) is not None:
                return _hit(rule)
            pattern = self._patterns.get(rule.id)
            if pattern is not None and pattern.match(name):
                return _hit(rule)
        return None

    def protection_hit(self, kind: SkipKind, reason: str) -> Hit:
        """The protection rule of a built-in kind (occupied destination, outside the folder)."""
        return _hit(self._by_kind[kind], reason)


def _combined(rules: tuple[SkipRule, ...]) -> re.Pattern[str] | None:
    parts = [
        f"(?P<r{index}>{'|'.join(fnmatch.translate(name) for name in rule.names)})"
        for index, rule in enumerate(rules)
        if rule.names
    ]
    return re.compile("|".join(parts), re.IGNORECASE) if parts else None


def _rule_index(group: str) -> int:
    return int(group[1:])


def _unsafe(name: str) -> bool:
    # Fast path for the common name: printable (no control, format, separator or surrogate
    # characters), no backslash, short enough to be under 255 bytes; else the jail's rule decides.
    if name.isprintable() and "\\" not in name and len(name) <= 63:
        return False
    return name_problem(name) is not None


def _kind_matches(kind: str, mode: int) -> bool:
    if kind == "symlink":
        return stat.S_ISLNK(mode)
    if kind == "special_file":
        return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode))
    if kind == "folder":
        return stat.S_ISDIR(mode)
    return False

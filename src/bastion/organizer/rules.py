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
from dataclasses import dataclass
from typing import Final

from bastion.config import InboxConfig, SkipKind, SkipRule
from bastion.safety.paths import name_problem
from bastion.safety.redact import sanitize_name
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


display_name = sanitize_name
"""A name safe to show (`bastion.safety.redact.sanitize_name`)."""


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
        # Per rule list: one regex of every name pattern (group r<i> is rule i), the first rule
        # index matching each kind of entry, and the index of the unsafe-name rule; `check` takes
        # the smallest index that matches, so the order of the rules decides, in O(1) per entry.
        self._tables = {flag: _table(self.protection if flag else self.rules) for flag in (False, True)}

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
        """The first skip rule (in rule order) matching an entry: its own name and lstat mode; or None."""
        rules, combined, by_kind, unsafe_at = self._tables[protection_only]
        first = by_kind[_mode_class(mode)]
        if combined is not None:
            found = combined.match(name)
            if found is not None:
                first = min(first, _first_group(found))
        if unsafe_at < first and _unsafe(name):
            first = unsafe_at
        return _hit(rules[first]) if first < len(rules) else None

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


def _first_group(found: re.Match[str]) -> int:
    # fnmatch.translate adds groups of its own (named g0, g1...); ours are r<index>.
    return min(int(k[1:]) for k, v in found.groupdict().items() if v is not None and k.startswith("r"))


def _unsafe(name: str) -> bool:
    # Fast path for the common name: printable (no control, format, separator or surrogate
    # characters), no backslash, short enough to be under 255 bytes; else the jail's rule decides.
    if name.isprintable() and "\\" not in name and len(name) <= 63:
        return False
    return name_problem(name) is not None


_CLASS_KINDS: Final[dict[str, str]] = {"symlink": "symlink", "special": "special_file", "folder": "folder"}
_Table = tuple[tuple[SkipRule, ...], re.Pattern[str] | None, dict[str, int], int]


def _mode_class(mode: int) -> str:
    return entry_kind(mode)


def _table(rules: tuple[SkipRule, ...]) -> _Table:
    never = len(rules)
    by_kind = {}
    for entry_class in ("file", "folder", "symlink", "special"):
        wanted = _CLASS_KINDS.get(entry_class)
        by_kind[entry_class] = next((i for i, r in enumerate(rules) if wanted and r.kind == wanted), never)
    unsafe_at = next((i for i, r in enumerate(rules) if r.kind == "unsafe_name"), never)
    return rules, _combined(rules), by_kind, unsafe_at

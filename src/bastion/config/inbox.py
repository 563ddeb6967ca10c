"""`[[inbox]]`: the file organizer's folders, its default categories and its skip rules.

Private: import these names from `bastion.config`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Final, Literal

from pydantic import Field, field_validator

from bastion.config.base import ID_PATTERN, Model
from bastion.safety.paths import name_problem

# The organizer's default categories: folder name -> file extensions (lower case, no leading dot).
DEFAULT_CATEGORIES: Final[dict[str, tuple[str, ...]]] = {
    "Documents": ("pdf", "doc", "docx", "odt", "rtf", "txt", "md", "tex", "pages", "epub", "mobi"),
    "Spreadsheets": ("xls", "xlsx", "ods", "csv", "tsv", "numbers"),
    "Presentations": ("ppt", "pptx", "odp", "key"),
    "Images": ("jpg", "jpeg", "png", "gif", "webp", "bmp", "tif", "tiff", "svg", "heic", "heif", "raw", "ico"),
    "Audio": ("mp3", "wav", "flac", "aac", "ogg", "oga", "m4a", "opus", "wma", "aiff", "mid"),
    "Video": ("mp4", "mkv", "mov", "avi", "webm", "wmv", "m4v", "mpg", "mpeg", "flv"),
    "Archives": ("zip", "tar", "gz", "tgz", "bz2", "xz", "zst", "7z", "rar", "tar.gz", "tar.bz2", "tar.xz", "iso"),
    "Code": (
        "py", "js", "ts", "jsx", "tsx", "java", "c", "h", "cpp", "hpp", "cs", "go", "rs", "rb", "php", "sh",
        "json", "yaml", "yml", "toml", "xml", "html", "css", "sql", "ipynb",
    ),
    "Fonts": ("ttf", "otf", "woff", "woff2"),
}  # fmt: skip

SkipKind = Literal["symlink", "special_file", "unsafe_name", "outside_folder", "occupied_destination", "folder"]
# Checks every organizer tool must make: a skip rule of one of these kinds must have layer "protection".
PROTECTION_KINDS: Final[frozenset[str]] = frozenset(
    {"symlink", "special_file", "unsafe_name", "outside_folder", "occupied_destination"}
)


class SkipRule(Model):
    """One reason the organizer leaves an entry where it is.

    `layer` has no default: "protection" rules bind every organizer tool (a move naming such a
    file is refused); "restraint" rules bind only the planner, and a person may still move the
    file on purpose with move_file (the plan reports it as NEEDS_EXPLICIT_REQUEST).
    """

    id: Annotated[str, Field(pattern=ID_PATTERN)]
    layer: Literal["protection", "restraint"]
    kind: SkipKind | None = None
    """A built-in check; or None for a rule by `names` only."""
    names: tuple[str, ...] = ()
    """Name patterns (fnmatch, case-insensitive) matched against the entry's own name."""
    reason: str = ""

    @field_validator("names")
    @classmethod
    def _check_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        for name in names:
            if not name or "/" in name:
                raise ValueError(f"skip pattern {name!r} must be a non-empty name without '/'")
        return names


DEFAULT_SKIP_RULES: Final[tuple[SkipRule, ...]] = (
    SkipRule(id="symlinks", layer="protection", kind="symlink", reason="a symbolic link"),
    SkipRule(id="special-files", layer="protection", kind="special_file", reason="a device, pipe or socket"),
    SkipRule(id="unsafe-names", layer="protection", kind="unsafe_name", reason="an unsafe name (control characters)"),
    SkipRule(id="outside", layer="protection", kind="outside_folder", reason="a path that leaves the folder"),
    SkipRule(id="occupied", layer="protection", kind="occupied_destination", reason="an occupied destination"),
    # Matched against every component of a move's paths: no planting of git hooks.
    SkipRule(id="vcs", layer="protection", names=(".git", ".hg", ".svn"), reason="version-control internals"),
    SkipRule(id="folders", layer="restraint", kind="folder", reason="a folder"),
    SkipRule(id="dotfiles", layer="restraint", names=(".*",), reason="a hidden file"),
    SkipRule(
        id="installers",
        layer="restraint",
        names=("*.exe", "*.msi", "*.msix", "*.dmg", "*.pkg", "*.deb", "*.rpm", "*.appimage", "*.apk", "*.snap"),
        reason="an installer",
    ),
    SkipRule(id="app-bundles", layer="restraint", names=("*.app",), reason="an application bundle"),
    SkipRule(
        id="system-files",
        layer="restraint",
        names=("desktop.ini", "thumbs.db", "ehthumbs.db", "$recycle.bin", "system volume information"),
        reason="a system file",
    ),
    SkipRule(
        id="partial-downloads",
        layer="restraint",
        names=("*.part", "*.crdownload", "*.download", "*.partial", "*.opdownload"),
        reason="a download in progress",
    ),
)
_CATEGORY_EXT: Final = re.compile(r"^[a-z0-9][a-z0-9_+-]*(\.[a-z0-9][a-z0-9_+-]*)*$")


class InboxConfig(Model):
    id: Annotated[str, Field(pattern=ID_PATTERN)]
    path: Path
    categories: dict[str, tuple[str, ...]] = Field(default_factory=lambda: dict(DEFAULT_CATEGORIES))
    """Folder name -> extensions (lower case, no dot; "tar.gz" matches before "gz")."""
    max_plan_moves: Annotated[int, Field(ge=1, le=10_000)] = 500
    skip: tuple[SkipRule, ...] = DEFAULT_SKIP_RULES
    """The whole rule set; it must keep one protection rule of each built-in protection kind."""

    @field_validator("categories")
    @classmethod
    def _check_categories(cls, categories: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        seen: dict[str, str] = {}
        for folder, extensions in categories.items():
            if name_problem(folder) is not None or folder.startswith(".") or folder.strip() != folder:
                raise ValueError(f"category folder {folder!r} must be a plain visible folder name")
            for ext in extensions:
                if not _CATEGORY_EXT.fullmatch(ext):
                    raise ValueError(f"extension {ext!r} of {folder!r} must be lower case without a leading dot")
                if ext in seen:
                    raise ValueError(f"extension {ext!r} is in both {seen[ext]!r} and {folder!r}: keep one")
                seen[ext] = folder
        return categories

    @field_validator("skip")
    @classmethod
    def _check_skip(cls, rules: tuple[SkipRule, ...]) -> tuple[SkipRule, ...]:
        ids = [rule.id for rule in rules]
        if len(set(ids)) != len(ids):
            raise ValueError("two skip rules share an id: give each a unique id")
        for kind in sorted(PROTECTION_KINDS):
            layers = {rule.layer for rule in rules if rule.kind == kind}
            if layers != {"protection"}:
                raise ValueError(f"the skip rules must keep a rule of kind {kind!r} with layer 'protection'")
        for rule in rules:
            if rule.kind is None and not rule.names:
                raise ValueError(f"skip rule {rule.id!r} has neither kind nor names: say what it matches")
        return rules

"""The package-requirement grammar: what install_package accepts is a name and a version, nothing else.

pip and npm read a requirement as much more than a package (a URL, a path, a VCS link, an
option, an archive file in the current folder); the grammar here accepts only the plain forms,
so the installer can only fetch a named package from the registry.
"""

from __future__ import annotations

import re
from typing import Final, Literal

from bastion.safety.errors import InvalidRequest

Manager = Literal["pip", "npm"]
MAX_REQUIREMENT_CHARS: Final = 200

_NAME: Final = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_EXTRAS: Final = rf"\[\s*{_NAME}(?:\s*,\s*{_NAME})*\s*\]"
_VERSION: Final = r"[A-Za-z0-9][A-Za-z0-9.*+!_-]*"
_CLAUSE: Final = rf"(?:===|==|!=|<=|>=|~=|<|>)\s*{_VERSION}"
PIP_REQUIREMENT: Final = re.compile(rf"{_NAME}\s*(?:{_EXTRAS})?\s*(?:{_CLAUSE}(?:\s*,\s*{_CLAUSE})*)?")
_NPM_NAME: Final = r"[a-z0-9][a-z0-9._-]*"
# The range never starts with "." (npm reads "x@.." as the folder "..").
NPM_SPEC: Final = re.compile(rf"(?:@{_NPM_NAME}/)?{_NPM_NAME}(?:@[0-9A-Za-z^~<>=*][0-9A-Za-z.^~<>=*|+_-]*)?")
# pip and npm take a requirement ending like an archive for a file in the current folder
# (pip: "x.whl", "x==1.zip"; npm: "x.tgz", "x@1.tar"), found or not: a path in disguise.
ARCHIVE_SUFFIX: Final = re.compile(r"\.(?:whl|zip|tgz|tbz|txz|tlz|tar(?:\.gz|\.bz2|\.xz|\.lz|\.lzma)?)$", re.IGNORECASE)
_TRAILING_EXTRAS: Final = re.compile(r"\[[^\]]*\]$")


def check_requirement(text: str, manager: Manager) -> str:
    """The requirement, stripped, if it is only a requirement.

    Raises:
        InvalidRequest: an option, URL, path, VCS link, marker or anything else.
    """
    requirement = text.strip()
    if not requirement or len(requirement) > MAX_REQUIREMENT_CHARS:
        raise InvalidRequest(f"give one package requirement of 1 to {MAX_REQUIREMENT_CHARS} characters")
    if requirement.startswith("-"):
        raise InvalidRequest("options are not accepted: give a package name, e.g. 'requests' or 'requests>=2.31'")
    grammar = PIP_REQUIREMENT if manager == "pip" else NPM_SPEC
    if grammar.fullmatch(requirement) is None:
        example = "'requests', 'requests[socks]>=2.31,<3'" if manager == "pip" else "'lodash', '@types/node@^20'"
        raise InvalidRequest(
            f"{requirement[:60]!r} is not a plain {manager} requirement: URLs, paths, VCS links, options and "
            f"markers are refused; use a name with an optional version, e.g. {example}"
        )
    if ARCHIVE_SUFFIX.search(requirement) or ARCHIVE_SUFFIX.search(_TRAILING_EXTRAS.sub("", requirement).rstrip()):
        raise InvalidRequest(
            f"{requirement[:60]!r} ends like an archive file name, which {manager} would install from a path: "
            "give the package's name and version instead"
        )
    return requirement

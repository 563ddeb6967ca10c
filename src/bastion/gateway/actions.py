"""The literal action string bastion sends to a gateway, checked before anything leaves.

The real boundary is the target's dispatch.py; this is the same check done early, so a
malformed request is refused with INVALID_REQUEST without touching the host, and the
approval a human sees is exactly the text that will be sent. The rules match dispatch's:
printable ASCII, words separated by one space, at most 256 characters, each argument of
the shape ``[A-Za-z0-9_][A-Za-z0-9._:@+=,/-]*`` (so never an option, never whitespace)
and matching its configured pattern in full.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from bastion.config import GatewayActionConfig
from bastion.safety.errors import InvalidRequest

MAX_COMMAND_CHARS: Final = 256
MAX_ARG_CHARS: Final = 128
ARG_SHAPE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:@+=,/-]*")


@dataclass(frozen=True)
class GatewayCommand:
    """Proof that a literal passed the checks; only `build_command` makes one."""

    action: str
    literal: str


def build_command(action: GatewayActionConfig, arguments: Mapping[str, str]) -> GatewayCommand:
    """Check `arguments` against the action's patterns and build the literal, e.g. ``deploy biscuit v1.2.3``.

    Raises:
        InvalidRequest: a missing, extra or malformed argument, or a literal over 256 characters.
    """
    expected = [arg.name for arg in action.args]
    extra = sorted(set(arguments) - set(expected))
    if extra:
        raise InvalidRequest(f"{action.name} takes no argument {extra[0]!r}")
    words = [action.name]
    for arg in action.args:
        value = arguments.get(arg.name)
        if value is None:
            raise InvalidRequest(f"{action.name} needs the argument {arg.name!r}")
        if len(value) > MAX_ARG_CHARS or not ARG_SHAPE.fullmatch(value):
            raise InvalidRequest(
                f"argument {arg.name} must be letters, digits and ._:@+=,/- (not starting with - or .), "
                f"at most {MAX_ARG_CHARS} characters"
            )
        if not re.fullmatch(arg.pattern, value):
            raise InvalidRequest(f"argument {arg.name} does not match its pattern {arg.pattern!r}")
        words.append(value)
    literal = " ".join(words)
    if len(literal) > MAX_COMMAND_CHARS:
        raise InvalidRequest(f"the action string is longer than {MAX_COMMAND_CHARS} characters")
    return GatewayCommand(action=action.name, literal=literal)

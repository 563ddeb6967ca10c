"""What every tool argument must be before a tool sees it: finite numbers and real text.

The tool decorator (`bastion.tools.audited`) applies `require_sound` to each argument a client gives.
JSON parsers take `NaN`, `Infinity` and `1e400`: a NaN `timeout_s` passed every `<=` check and became an
event-loop timer, which NaN left out of order (other clients' time limits ran late, SIGINT was not heard).
The 2026-07-28 era's parser takes "\\ud800", which no file, command line or environment holds: a sandbox env
value with one made every later command of that sandbox fail to start.
"""

from __future__ import annotations

import math
import re
from typing import Final

from pydantic import BaseModel

from bastion.safety.errors import InvalidRequest

__all__ = ["require_sound"]

_SURROGATE: Final = re.compile("[\ud800-\udfff]")


def require_sound(name: str, value: object) -> None:
    """Refuse NaN and Infinity, and lone surrogates, anywhere in an argument (keys of a mapping included).

    Raises:
        InvalidRequest: naming the argument (`name`, or `name.field` inside a model).
    """
    if isinstance(value, str):
        if not value.isascii() and _SURROGATE.search(value):  # isascii is O(1): most strings stop there
            raise InvalidRequest(f"{name} has a lone surrogate character, which is not text: remove it")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRequest(f"{name} must be a finite number: NaN and Infinity are refused")
    elif isinstance(value, BaseModel):
        for field, inner in value:
            require_sound(f"{name}.{field}", inner)
    elif isinstance(value, list | tuple):
        for inner in value:
            require_sound(name, inner)
    elif isinstance(value, dict):
        for key, inner in value.items():
            require_sound(name, key)
            require_sound(name, inner)

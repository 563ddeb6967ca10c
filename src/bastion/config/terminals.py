"""`[terminals]` of a workspace or of sandboxes: caps on the interactive terminals of each."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from bastion.config.base import Model


class TerminalsConfig(Model):
    """Caps per sandbox (or host workspace): open terminals, scrollback kept between reads, idle close."""

    max_open: Annotated[int, Field(ge=0, le=64)] = 4
    """Terminals open at once in one sandbox; 0 turns terminals off there."""
    scrollback_bytes: Annotated[int, Field(ge=1024, le=16 * 1024 * 1024)] = 256 * 1024
    """Text of the lines that scrolled off the screen since the last terminal_read; older lines are dropped."""
    idle_close_s: Annotated[float, Field(gt=0, le=7 * 86_400)] = 1800.0
    """A terminal nobody sent to, read or resized for this long is closed and its programs killed."""

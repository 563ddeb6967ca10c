"""Images returned as MCP image content: a file tool's (the type told by the magic bytes, never the name),
and the server-wide budget of image bytes that code calls hold."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Literal

from bastion.safety.paths import MAX_READ_BYTES

MAX_IMAGE_BYTES: Final = MAX_READ_BYTES
_IMAGE_TYPES: Final = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


@dataclass(frozen=True)
class Image:
    """An image file read by `HostWorkspace.read_image`: its bytes and the type its magic bytes say."""

    path: str
    mime_type: str
    data: bytes


def image_type(data: bytes) -> str | None:
    """The MIME type of a PNG, JPEG, GIF or WebP image, told by its first bytes; None for anything else."""
    for signature, mime in _IMAGE_TYPES:
        if data.startswith(signature):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


MAX_IMAGE_BYTES_IN_FLIGHT: Final = 16 << 20
"""Image bytes the server holds for the code calls in progress, all sandboxes together: four cells' worth
(`bastion.workbench.code.MAX_CELL_IMAGE_BYTES`). 32 contexts each returning 32 MiB of images took 1.4 GiB of
server memory and stalled every other sandbox for seconds."""
SANDBOX_SHARE_DIVISOR: Final = 4
"""The calls of one sandbox hold at most 1/4 of the budget (one cell's worth): four contexts of one sandbox,
each sending a 4 MiB image and then sleeping, held all of it for their cells' timeout, and every other
sandbox's images were dropped meanwhile."""


class ImageBudget:
    """The image bytes held by calls in progress, server-wide; a call takes its share through a lease.

    What it bounds: an image counts, at the size its header declares, from the moment its header is read
    (before its bytes are) until the tool call that asked for it returns; the calls of one sandbox together
    hold at most `sandbox_limit_bytes`, so one sandbox cannot take what others need. It does not count the
    answer after that, while the transport sends it (a slow client's answers queue in the MCP SDK); each
    call's own cap bounds that. Used on the event loop only (no lock).
    """

    def __init__(self, limit_bytes: int = MAX_IMAGE_BYTES_IN_FLIGHT) -> None:
        self.limit_bytes = limit_bytes
        self.sandbox_limit_bytes = limit_bytes // SANDBOX_SHARE_DIVISOR
        self.held_bytes = 0
        self._held_by: dict[str, int] = {}  # by sandbox id; an entry goes when its sandbox holds nothing

    def held_by(self, owner: str) -> int:
        """The bytes the calls of sandbox `owner` hold."""
        return self._held_by.get(owner, 0)

    @contextlib.contextmanager
    def lease(self) -> Iterator[ImageLease]:
        """A share for one call, given back whole when the block ends (an error or a cancellation too)."""
        lease = ImageLease(self)
        try:
            yield lease
        finally:
            lease.close()

    def _charge(self, owner: str, size: int) -> None:
        self.held_bytes += size
        held = self._held_by.get(owner, 0) + size
        if held:
            self._held_by[owner] = held
        else:
            self._held_by.pop(owner, None)


ImageRefusal = Literal["sandbox", "server", "ended"]
"""Why a lease took nothing: its sandbox holds its share, the server holds its whole budget, or the call ended."""


class ImageLease:
    """One call's share of an `ImageBudget`, charged to the sandbox the call runs in (`bind`)."""

    def __init__(self, budget: ImageBudget) -> None:
        self.budget = budget
        self.owner = ""  # the sandbox; "" until bound (then only the server's budget bounds the call)
        self.taken_bytes = 0
        self.closed = False

    def bind(self, owner: str) -> None:
        """Charge this call's images to sandbox `owner` (the code runner binds it, before the first image)."""
        assert not self.taken_bytes, "bound after taking: its bytes would go back to another sandbox"
        self.owner = owner

    def take(self, size: int) -> ImageRefusal | None:
        """Hold `size` bytes more; or, holding nothing, say why not (`ImageRefusal`)."""
        budget = self.budget
        if self.closed:
            return "ended"
        if self.owner and budget.held_by(self.owner) + size > budget.sandbox_limit_bytes:
            return "sandbox"
        if budget.held_bytes + size > budget.limit_bytes:
            return "server"
        budget._charge(self.owner, size)
        self.taken_bytes += size
        return None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.budget._charge(self.owner, -self.taken_bytes)

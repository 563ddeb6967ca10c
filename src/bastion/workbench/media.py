"""Images a file tool returns as MCP image content: the type told by the magic bytes, never the name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

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

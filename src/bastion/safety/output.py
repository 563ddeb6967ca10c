"""Output cleaning: what a command prints reaches the client decoded, without terminal escapes, redacted.

`clean_output` cleans a whole capture; `OutputCleaner` cleans a stream chunk by chunk as
`clean_output` would clean the whole (background processes, a code context's output).
"""

from __future__ import annotations

import codecs
import re
from typing import Final

from bastion.safety.redact import STRING_BODY_CHAR, Redactor, StreamRedactor, sanitize_terminal

# An escape sequence (or CR of a CRLF) still open at the end of a chunk: held until more arrives,
# so the chunks are sanitized as the whole would be. Bounded: a longer tail is not held.
UNFINISHED_ESCAPE: Final = re.compile(
    r"(?:\x1b\[[0-?]*[ -/]*|\x1b[ -/]*|\x9b[0-?]*[ -/]*"
    rf"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f]){STRING_BODY_CHAR}*\x1b?|\r)\Z"
)
ESCAPE_HOLD_CHARS: Final = 4096


def clean_output(redactor: Redactor, raw: bytes, *, cut: bool) -> str:
    """Neutralise terminal escapes, then redact, then (if the capture was cut) drop the held tail.

    Escapes go first so a secret split by one (``AKIA\\x1b[0m...``) is whole again
    when the redactor sees it. The stream redactor holds back any tail that could
    be the start of a secret; when the output was cut, that tail is dropped rather
    than flushed, so a cut never leaves half a secret behind.
    """
    if not raw:
        return ""  # most commands leave stderr (or both) empty: no stream redactor to build
    text = sanitize_terminal(codecs.decode(raw, "utf-8", errors="replace"))
    stream = redactor.stream()
    safe = stream.feed(text)
    if not cut:
        safe += stream.flush()
    return safe


class OutputCleaner:
    """Cleans one output stream chunk by chunk as `clean_output` cleans a whole one.

    Bytes are decoded incrementally (a UTF-8 character may be split), escape sequences
    still open at the end are held, then terminal escapes are neutralised and the text
    goes through one `StreamRedactor`, which holds back what could be the start of a secret.
    """

    def __init__(self, redactor: Redactor) -> None:
        self._redactor = redactor
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stream: StreamRedactor = redactor.stream()
        self._pending = ""

    def reset(self) -> None:
        """Bytes were lost before cleaning: drop what is held (never flush half a secret) and start over."""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stream = self._redactor.stream()
        self._pending = ""

    def feed(self, raw: bytes, *, final: bool = False) -> str:
        """Clean `raw`; with `final`, the stream ended: flush everything held."""
        text = self._pending + self._decoder.decode(raw, final=final)
        self._pending = ""
        if not final:
            tail = UNFINISHED_ESCAPE.search(text, max(0, len(text) - ESCAPE_HOLD_CHARS))
            if tail is not None:
                text, self._pending = text[: tail.start()], text[tail.start() :]
        safe = self._stream.feed(sanitize_terminal(text))
        if final:
            safe += self._stream.flush()
        return safe

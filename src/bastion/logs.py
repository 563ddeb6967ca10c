"""The server's own log (stderr): one line per record, with time and level, and nothing a client can forge.

Log lines quote values that clients choose (a client_id, a path, a User-Agent). A newline or another
control character in such a value would start what reads as a new, forged line (CWE-117), so every
record is escaped after formatting: control characters become `\\n`, `\\x1b`, ... and a backslash
doubles, which keeps the escaping reversible. A record's exception is named on the same line (its
traceback only at DEBUG). Plain text by default: operators read it with journalctl or tail.

`log_format = "json"` (or `serve --log-format json`) writes one JSON object a line instead: `ts`, `level`,
`logger`, `message` and, for a record with an exception, `exc`. JSON escapes every control character
(and, with `ensure_ascii`, U+2028/U+2029), so a value cannot end a line there either.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from types import TracebackType
from typing import Final, Literal, TextIO, TypeAlias

from bastion.safety.redact import escape_hidden

ExcInfo: TypeAlias = tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]

FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT: Final = "%Y-%m-%dT%H:%M:%S%z"
# C0 controls, DEL and the C1 controls: each would let a value end or rewrite a line on a terminal.
_ESCAPES: Final = {code: f"\\x{code:02x}" for code in [*range(0x20), *range(0x7F, 0xA0)]}
_ESCAPES.update({ord("\\"): "\\\\", ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})
# Unicode line and paragraph separators end a line for some readers too.
_ESCAPES.update({0x2028: "\\u2028", 0x2029: "\\u2029"})
# Blank characters (the space separators): a run of them is how a value pads its own text to the start of a
# terminal's next row, where it reads as a line of the server's (found by attack: a client_id of "https://",
# 75 spaces and a forged line, logged at WARNING for any stranger). All but a run's first plain space are written
# as escapes, so padding shows; a value can still pad with visible characters (see SECURITY.md).
_BLANK_RUN: Final = re.compile("[ \u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]{2,}")
_OWN_TEXT: Final = "bastion_own_text"  # a record attribute: `announce`'s lines, whose blanks are the server's
MAX_MESSAGE_CHARS: Final = 4096
"""A record's message, and its exception's text, are cut to this before they are escaped: the SDK logs a client's
strings whole (an unknown prompt's name, a resource's URI), and a 4 MB name of hidden characters cost 1 s of the
event loop to escape and wrote 7.8 MB of log a request (found by attack)."""
MAX_TRACEBACK_CHARS: Final = 64 * 1024
"""A traceback (written at DEBUG only) is cut to this: its last line holds the exception's text."""


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} more characters)"


def _cut_args(record: logging.LogRecord) -> None:
    """Cut a record's long string arguments before they are formatted into its message (a ``%r`` of 4 MB of
    hidden characters is itself 24 MB to build)."""
    args = record.args
    if isinstance(args, tuple) and any(type(arg) is str and len(arg) > MAX_MESSAGE_CHARS for arg in args):
        record.args = tuple(_cut(arg, MAX_MESSAGE_CHARS) if type(arg) is str else arg for arg in args)


def escape(text: str) -> str:
    """`text` on one line: control characters and line separators written as escapes, the invisible format
    characters (bidi overrides, zero-width ones) too, which could reorder or hide part of a line, and every blank
    of a run of blanks but a first plain space."""
    return _BLANK_RUN.sub(_escape_blanks, escape_hidden(text.translate(_ESCAPES)))


def terminal_text(text: str) -> str:
    """`text` safe to print on the administrator's terminal: as `escape`, but its newlines kept (a message of the
    server's own may have several lines) and blanks left alone."""
    return escape_hidden(text.translate(_TERMINAL_ESCAPES))


_TERMINAL_ESCAPES: Final = {code: text for code, text in _ESCAPES.items() if code not in (ord("\n"), ord("\\"))}


def _escape_blanks(match: re.Match[str]) -> str:
    run = match.group()
    first = " " if run[0] == " " else f"\\u{ord(run[0]):04x}"
    return first + "".join(f"\\x{ord(c):02x}" if c == " " else f"\\u{ord(c):04x}" for c in run[1:])


class OneLineFormatter(logging.Formatter):
    """Time, level, logger and message on one escaped line. A record's exception is named on that line;
    its traceback only when the root logger is at DEBUG (an error repeated per request must not write
    megabytes of tracebacks)."""

    def format(self, record: logging.LogRecord) -> str:
        _cut_args(record)
        if getattr(record, _OWN_TEXT, False):  # `announce`: the server's own lines keep their indentation
            return escape_hidden(super().format(record).translate(_ESCAPES))
        return escape(super().format(record))

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = _cut(record.message, MAX_MESSAGE_CHARS)
        return super().formatMessage(record)

    def formatException(self, ei: ExcInfo) -> str:
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            return _cut(super().formatException(ei), MAX_TRACEBACK_CHARS)
        return _cut(f"{type(ei[1]).__name__}: {ei[1]}", MAX_MESSAGE_CHARS)


class JsonFormatter(OneLineFormatter):
    """One JSON object a line: ts, level, logger, message, and exc for a record with an exception."""

    def format(self, record: logging.LogRecord) -> str:
        _cut_args(record)
        entry: dict[str, str] = {
            "ts": self.formatTime(record, self.datefmt),
            "level": record.levelname,
            "logger": record.name,
            "message": _cut(record.getMessage(), MAX_MESSAGE_CHARS),
        }
        if record.exc_info is not None and record.exc_info[0] is not None:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=True)


LogFormat = Literal["text", "json"]


def configure_logging(level: str, stream: TextIO | None = None, log_format: LogFormat = "text") -> None:
    """Send every logger's records to stderr as escaped single lines (text or JSON). Call before the server
    is built: the SDK's `MCPServer()` calls `logging.basicConfig`, which does nothing once the root has a
    handler.
    """
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    formatter = JsonFormatter(datefmt=DATE_FORMAT) if log_format == "json" else OneLineFormatter(FORMAT, DATE_FORMAT)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def announce(text: str) -> None:
    """Tell the operator something at start-up, whatever the log level: each line of `text` as an INFO
    record of `bastion.serve`, through the root's handlers (so it has a time, a level and a logger, in
    the log's format). `text` is the server's and the administrator's (the config's paths and URLs), never a
    client's: its runs of blanks are kept (found by review: the connect help's `claude mcp add` line was printed
    with `\x20` escapes, and a copied command failed); control characters are still escaped."""
    logger = logging.getLogger("bastion.serve")
    for line in text.splitlines():
        record = logger.makeRecord(logger.name, logging.INFO, __file__, 0, "%s", (line,), None, extra={_OWN_TEXT: True})
        for handler in logging.getLogger().handlers:
            handler.handle(record)

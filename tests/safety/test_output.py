"""Output cleaning (bastion.safety.output): a stream cleaned chunk by chunk reads as the whole cleaned at once."""

from __future__ import annotations

from bastion.safety.output import OutputCleaner, clean_output
from bastion.safety.redact import Redactor, sanitize_terminal

RAW = "a\x1b[31mb\x1b]8;;http://x\x07link\x1b]8;;\x1b\\ c\r\nd token=hunter2secret \u00e9\n".encode()


def test_cleaner_matches_whole_stream_cleaning() -> None:
    redactor = Redactor()
    whole = OutputCleaner(redactor).feed(RAW, final=True)
    assert whole == clean_output(redactor, RAW, cut=False)
    stream = redactor.stream()  # the definition, in one piece
    assert whole == stream.feed(sanitize_terminal(RAW.decode())) + stream.flush()
    for size in (1, 2, 3, 7):
        cleaner = OutputCleaner(redactor)
        parts = [cleaner.feed(RAW[i : i + size]) for i in range(0, len(RAW), size)]
        assert "".join(parts) + cleaner.feed(b"", final=True) == whole, size
    assert "\x1b" not in whole
    assert "hunter2secret" not in whole


def test_a_cut_capture_drops_the_held_tail() -> None:
    redactor = Redactor()
    raw = b"ok\ntoken=hunter2sec"  # the end could still be the start of a longer secret: held back
    cut = clean_output(redactor, raw, cut=True)
    assert clean_output(redactor, raw, cut=False).startswith(cut)
    assert "hunter2sec" not in cut

"""Output cleaning (bastion.safety.output): a stream cleaned chunk by chunk reads as the whole cleaned at once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bastion.safety.output import UNFINISHED_ESCAPE, OutputCleaner, clean_output
from bastion.safety.redact import Redactor, sanitize_terminal
from tests.helpers import least_cpu_s

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


# Escape-shaped text: every opener, terminator and body character the two patterns tell apart.
ESCAPE_ALPHABET = list("\x1b\x07\x9c\x9d\x90\x98\x9e\x9f\x9b[]\\PX^_0;a\r\n")


@settings(max_examples=500)
@given(text=st.text(alphabet=st.sampled_from(ESCAPE_ALPHABET), max_size=60), size=st.integers(1, 9))
def test_chunked_cleaning_of_any_escape_shaped_text_matches_the_whole(text: str, size: int) -> None:
    """What is held as an unfinished escape (`UNFINISHED_ESCAPE`) is what `sanitize_terminal` would remove,
    so a stream cut anywhere reads as the whole; no ESC or C1 control ever comes out."""
    redactor = Redactor()
    raw = text.encode()
    whole = clean_output(redactor, raw, cut=False)
    cleaner = OutputCleaner(redactor)
    parts = [cleaner.feed(raw[i : i + size]) for i in range(0, len(raw), size)]
    assert "".join(parts) + cleaner.feed(b"", final=True) == whole
    assert not any(char == "\x1b" or "\x80" <= char <= "\x9f" for char in whole)


def test_an_unfinished_escape_tail_of_c1_openers_is_found_in_linear_time() -> None:
    """Attack: a command prints a run of U+009D (OSC) ending in BEL and one more character, chunk after
    chunk. Each opener of the held tail was tried, and each try scanned the tail to its end: 0.12 s of a
    frozen server per chunk of 4,000. Four times the tail now costs about four times the time, not 16."""
    small, large = ("\x9d" * n + "\x07x" for n in (1_000, 4_000))
    ratio = least_cpu_s(lambda: [UNFINISHED_ESCAPE.search(large) for _ in range(20)]) / max(
        least_cpu_s(lambda: [UNFINISHED_ESCAPE.search(small) for _ in range(20)]), 1e-6
    )
    assert ratio < 8, f"4x the tail took {ratio:.1f}x the time: quadratic"

"""Secret redaction and terminal sanitising for text that leaves a tool.

Redaction is best-effort pattern matching, not a security boundary: it catches the
credential formats listed in `_BUILTIN_RULES`, `key=value` pairs whose key names a
secret, and the exact values an administrator configures. A secret in an unknown
format, or encoded (base64, hex, split by the program), passes through.

Order for output shown to a model or a human: `sanitize_terminal` first, then redact,
so an escape sequence wedged inside a token cannot hide it from the patterns.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import re2  # type: ignore[import-untyped]  # google-re2 ships no type information

from bastion.safety.errors import ConfigError

# Values shorter than this are ignored: redacting every "abc" in output would mangle
# it, and a secret that short is guessable anyway.
MIN_SECRET_VALUE_CHARS: Final = 4
# A stream holds back at least this much of an unfinished line; every built-in
# pattern decides whether it matches within this many characters.
STREAM_HOLD_CHARS: Final = 256
# A stream never holds more than this; past it the held part is emitted redacted.
STREAM_HOLD_CAP_CHARS: Final = 16 * 1024
# A slice of a file (`Redactor.redact_slice`) is redacted as part of this much more on each
# side: every built-in format but a PEM key fits in a line of a few hundred characters, and
# common PEM private keys (RSA up to 8192 bits) in under 7 KiB. Like STREAM_HOLD_CAP_CHARS, a
# bound on cost: a match longer than this may show in a slice that starts past its first
# SLICE_CONTEXT_BYTES bytes. About 12 ms of redaction per call on secret-dense text.
SLICE_CONTEXT_BYTES: Final = 16 * 1024
# Lookbehind context kept from already-emitted text, so a stream matches like `redact`.
_CONTEXT_CHARS: Final = 64
_SHORT_CHARS: Final = 128
# Needles at least this dense (one per so many characters) are not looked up line by line (`_needle_lines`).
_DENSE_NEEDLE_CHARS: Final = 256
_SHORT_CACHE_ENTRIES: Final = 4096

_SECRET_GROUPS: Final = ("secret", "secret2", "secret3")

_KV_KEY: Final = (
    r"(?:[A-Za-z0-9]+[_.-])*"
    r"(?:password|passwd|passphrase|secret|token|api[_-]?key|apikey|access[_-]?key|secret[_-]?key"
    r"|private[_-]?key|client[_-]?secret|auth[_-]?token|credentials?)"
)
# Separators use [ \t], never \s: no built-in pattern but the PEM one crosses a line,
# which is what lets a stream emit every complete line at once.
_KV_VALUE: Final = r"""(?:"(?P<secret>[^"\n]+)(?:"|\Z)|'(?P<secret2>[^'\n]+)(?:'|\Z)|(?P<secret3>[^\s"']+))"""

# (kind, pattern). Earlier rules win when two matches start at the same place, so
# vendor formats come before the generic key=value rule.
_BUILTIN_RULES: Final[tuple[tuple[str, str, tuple[str, ...]], ...]] = (
    (
        "private_key",
        r"(?s)-----BEGIN[ A-Z0-9]*PRIVATE KEY(?: BLOCK)?-----"
        r"(?:.*?-----END[ A-Z0-9]*PRIVATE KEY(?: BLOCK)?-----|.*\Z)",
        ("private key",),
    ),
    ("aws_access_key_id", r"(?<![A-Za-z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Za-z0-9])", ("akia", "asia")),
    (
        "aws_secret_access_key",
        r"(?i:aws_?secret_?(?:access_?)?key)[\"']?[ \t]{0,8}[:=][ \t]{0,8}[\"']?(?P<secret>[A-Za-z0-9/+=]{16,})",
        ("secret",),
    ),
    (
        "github_token",
        r"(?<![A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})",
        ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
    ),
    ("gitlab_token", r"(?<![A-Za-z0-9_-])glpat-[A-Za-z0-9_-]{20,}", ("glpat-",)),
    ("slack_token", r"(?<![A-Za-z0-9_-])xox[abprs]-[A-Za-z0-9-]{10,}", ("xox",)),
    ("slack_webhook", r"hooks\.slack\.com/services/(?P<secret>[A-Za-z0-9_/-]+)", ("hooks.slack.com/services/",)),
    (
        "stripe_key",
        r"(?<![A-Za-z0-9_])(?:sk|rk)_live_[A-Za-z0-9]{10,}|(?<![A-Za-z0-9_])sk_test_[A-Za-z0-9]{10,}",
        ("_live_", "sk_test_"),
    ),
    ("anthropic_key", r"(?<![A-Za-z0-9_-])sk-ant-[A-Za-z0-9_-]{20,}", ("sk-ant-",)),
    ("openai_key", r"(?<![A-Za-z0-9_-])sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}", ("sk-",)),
    ("google_api_key", r"(?<![A-Za-z0-9_-])AIza[0-9A-Za-z_-]{35}", ("aiza",)),
    # RFC 7519 §3: base64url header "{"... always encodes to eyJ; alg "none" has an empty signature.
    ("jwt", r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*", ("eyj",)),
    (
        "authorization",
        r"(?i)(?<![A-Za-z0-9])(?:authorization[\"']?[ \t]{0,8}[:=][ \t]{0,8}[\"']?"
        r"(?:(?:bearer|basic|token|bot)[ \t]{1,8})?(?P<secret>[A-Za-z0-9._~+/=-]{8,})"
        r"|bearer[ \t]{1,8}(?P<secret2>[A-Za-z0-9._~+/=-]{16,}))",
        ("authorization", "bearer"),
    ),
    (
        "url_password",
        r"(?i)\b[a-z][a-z0-9+.-]{0,20}://[^/\s:@'\"]{1,256}:(?P<secret>[^/\s@'\"]{1,256})@",
        ("://",),
    ),
    (
        "credential",
        rf"(?i)(?<![A-Za-z0-9_.-]){_KV_KEY}(?![A-Za-z0-9])[\"']?[ \t]{{0,8}}[:=][ \t]{{0,8}}{_KV_VALUE}",
        ("pass", "secret", "token", "key", "credential"),
    ),
)

_SENSITIVE_KEY: Final = re.compile(rf"(?i)(?:^|[_.-]){_KV_KEY.removeprefix(r'(?:[A-Za-z0-9]+[_.-])*')}$")


def _line_start(window: bytes, at: int) -> int:
    """Where the line holding byte `at` (0 if negative) starts."""
    return window.rfind(b"\n", 0, max(at, 0)) + 1


@dataclass(frozen=True, slots=True)
class _Rule:
    kind: str
    regex: re.Pattern[str]
    groups: tuple[str, ...]
    # Lowercase substrings of which every match contains one: substring tests are far
    # cheaper than running each regex, and most text contains none. Empty: always run.
    needles: frozenset[str]
    # No match crosses a line break: the regex need only run over the lines holding a needle.
    one_line: bool = False


def _rule(kind: str, regex: re.Pattern[str], needles: tuple[str, ...] = ()) -> _Rule:
    groups = tuple(g for g in _SECRET_GROUPS if g in regex.groupindex)
    # Every built-in pattern but the PEM key's matches no line break (separators are [ \t], values exclude \s).
    return _Rule(kind, regex, groups, frozenset(needles), one_line=bool(needles) and kind not in _MULTILINE_KINDS)


_MULTILINE_KINDS: Final = frozenset({"private_key"})
_BUILTINS: Final = tuple(_rule(kind, re.compile(pattern), needles) for kind, pattern, needles in _BUILTIN_RULES)

_ALL_NEEDLES: Final = tuple(sorted({n for rule in _BUILTINS for n in rule.needles}))
_CASE_FOLDS: Final = (("\u0130", "i"), ("\u0131", "i"), ("\u017f", "s"))
"""The letters `re`'s IGNORECASE matches to an ASCII letter that `str.lower` does not lower to it
(İ lowers to two characters, ı and ſ to themselves; the Kelvin sign K lowers to k): found by trying
every code point against every ASCII letter."""


def _fold(text: str) -> str:
    """`text` lower-cased for the needle search, with `_CASE_FOLDS` replaced first.

    A case-insensitive rule matches `paſſword=...` or `Authorızation: ...`; without the fold, no needle
    (`pass`, `authorization`) would be found in them and the rule would not run. One character stays
    one character, so positions in the result are positions in `text`.
    """
    if not text.isascii():
        for letter, ascii_letter in _CASE_FOLDS:
            if letter in text:
                text = text.replace(letter, ascii_letter)
    return text.lower()


_NEEDLE_SET_MIN_CHARS: Final = 256
"""From this length on, the needles present are found by one RE2 pass over the text rather than one
`in` per needle: 12 to 17 us instead of 80 to 90 us for 4 KiB here; below it the loop is cheaper."""


def _needle_set() -> re2.Set:
    """Every needle as a literal, matched on bytes (Latin-1: a byte is a character) in one linear pass."""
    if not all(needle.isascii() for needle in _ALL_NEEDLES):
        raise AssertionError("needles must be ASCII: a UTF-8 byte match would otherwise differ from `in`")
    options = re2.Options()
    options.encoding = re2.Options.Encoding.LATIN1
    found = re2.Set.SearchSet(options)
    for index, needle in enumerate(_ALL_NEEDLES):
        if found.Add(re.escape(needle)) != index:
            raise AssertionError("RE2 numbered the needles out of order")
    found.Compile()
    return found


_NEEDLE_SET: Final = _needle_set()


def _present_needles(lowered: str) -> set[str]:
    """The needles that occur in `lowered`.

    An ASCII needle is in a text exactly when its bytes are in the text's UTF-8 form (surrogatepass: a
    lone surrogate, as a read decoded with surrogateescape holds, becomes bytes above 0x7F, which no
    needle has), so both ways give the same set.
    """
    if len(lowered) < _NEEDLE_SET_MIN_CHARS:
        return {needle for needle in _ALL_NEEDLES if needle in lowered}
    found = _NEEDLE_SET.Match(lowered.encode("utf-8", "surrogatepass"))
    return {_ALL_NEEDLES[index] for index in found or ()}


_PEM_END: Final = re.compile(r"-----END[ A-Z0-9]*PRIVATE KEY(?: BLOCK)?-----")
_PEM_BEGIN: Final = re.compile(rb"-----BEGIN[ A-Z0-9]*PRIVATE KEY")
_PEM_END_BYTES: Final = re.compile(rb"-----END[ A-Z0-9]*PRIVATE KEY(?: BLOCK)?-----")
_WHITESPACE: Final = re.compile(r"\s")
_PEM_TAIL_CHARS: Final = 80

# (start, end, kind, start of the whole match, which may include a key before the secret)
_Span = tuple[int, int, str, int]
_MARKER: Final = re.compile(r"\[REDACTED:[a-z_]+\]")
_MAX_MARKER_CHARS: Final = 40
_CUSTOM: Final = "custom"  # the kind of the administrator's patterns


class Redactor:
    """Replaces secrets in text with ``[REDACTED:<kind>]``.

    Args:
        extra_patterns: administrator regexes (kind ``custom``); if one has a named group
            ``secret`` only that group is replaced. A stream catches a split match only
            if it stays on one line and within `STREAM_HOLD_CHARS`.
        secret_values: exact strings to replace (kind ``secret_value``); values shorter than
            `MIN_SECRET_VALUE_CHARS` are ignored.

    Raises:
        ConfigError: an extra pattern does not compile.
    """

    def __init__(self, extra_patterns: Sequence[str] = (), secret_values: Sequence[str] = ()) -> None:
        rules = list(_BUILTINS)
        for i, pattern in enumerate(extra_patterns):
            try:
                rules.append(_rule(_CUSTOM, re.compile(pattern)))
            except (re.error, TypeError, ValueError) as exc:
                raise ConfigError(f"redaction pattern {i} {pattern!r} is not a valid regex: {exc}") from None
        values = sorted({v for v in secret_values if len(v) >= MIN_SECRET_VALUE_CHARS}, key=len, reverse=True)
        if values:
            rules.append(_rule("secret_value", re.compile("|".join(re.escape(v) for v in values))))
        self._rules: tuple[_Rule, ...] = tuple(rules)
        self._longest_value = len(values[0]) if values else 0
        self._longest_value_bytes = max((len(v.encode("utf-8", "surrogatepass")) for v in values), default=0)
        self._custom = bool(extra_patterns)
        # Audit records repeat the same short strings (tool names, codes, paths): a cache
        # turns ~7 us of needle checks per string into a dictionary lookup.
        self._redact_short = functools.lru_cache(maxsize=_SHORT_CACHE_ENTRIES)(self._redact_uncached)

    def redact(self, text: str) -> str:
        """Return `text` with every recognised secret replaced."""
        if len(text) <= _SHORT_CHARS:
            return self._redact_short(text)
        return self._redact_uncached(text)

    def _redact_uncached(self, text: str) -> str:
        return _apply(text, self._spans(text, 0), 0, len(text))

    def redact_keeping_lines(self, text: str) -> str:
        """`redact`, keeping every line break a secret spans (after its marker): line n of the
        result is line n of `text`, redacted as the whole text is. For line-numbered results
        (search_files), which also match against this so a pattern cannot probe a secret."""
        out: list[str] = []
        pos = 0
        for start, end, kind, _ in self._spans(text, 0):
            out.append(text[pos:start])
            out.append(f"[REDACTED:{kind}]" + "\n" * text.count("\n", start, end))
            pos = end
        out.append(text[pos:])
        return "".join(out)

    def secret_spans(self, text: str) -> list[tuple[int, int]]:
        """Where `text` holds a secret `redact` would hide: (start, end) character offsets, sorted, apart."""
        return [(start, end) for start, end, _, _ in self._spans(text, 0)]

    def redact_then_truncate(self, text: str, max_chars: int) -> tuple[str, bool]:
        """Redact, then keep at most `max_chars` characters.

        Redacting first means the cut can never leave the prefix of a secret behind;
        a cut that would split a ``[REDACTED:...]`` marker drops the whole marker.
        Only the characters before the cut are kept (a secret across it as its marker), and only they and a
        margin past them (`SLICE_CONTEXT_BYTES`, or the longest secret value) are redacted, as `redact_slice`
        redacts a slice's edges: found by attack, the audit log redacted a 4 MiB argument whole to keep 4,096
        characters of it, and held the event loop 2.5 s. A text that secrets shrink keeps no more than its first
        `max_chars` characters: kept past them, a secret cut by the margin's end showed its start (found by
        review). Administrator patterns (which may need any context: a multi-line block) still run over the
        whole text, up to their first match past the cut; only the built-in rules are kept to the window. Found
        by attack: with one administrator pattern, the built-in rules ran over all of a 4 MiB argument of
        `password=` lines, 0.3 s of the event loop a call.

        Returns:
            The text and whether it was cut (whether any of `text` was left out).
        """
        cut = max(max_chars, 0)
        window = text[: cut + max(SLICE_CONTEXT_BYTES, self._longest_value)]
        if self._custom and len(window) < len(text):
            spans = _merge(self._found(window, 0, custom=False) + self._custom_found(text, cut), self._rules)
        else:
            spans = self._spans(window, 0)
        end = min(cut, len(window))
        for start, stop, _, _ in spans:
            if start < end < stop:
                end = stop  # a secret across the cut: kept as its marker, or dropped with it below
        red = _apply(text, spans, 0, end)
        if end == len(text) and len(red) <= cut:
            return red, False
        for m in _MARKER.finditer(red, max(0, cut - _MAX_MARKER_CHARS), cut + _MAX_MARKER_CHARS):
            if m.start() < cut < m.end():
                cut = m.start()
        return red[:cut], True

    def redact_slice(self, window: bytes, start: int, end: int) -> str:
        """The text of ``window[start:end]`` with every secret hidden that redacting all of `window` hides.

        The slice is decoded alone (UTF-8, errors replaced, as a read of just those bytes would
        be); any part of it inside a secret of the whole window becomes that secret's marker, so
        neither one slice nor adjacent slices put together show a secret cut by their edges.
        Give the window `SLICE_CONTEXT_BYTES` of context on each side of the slice.

        Args:
            window: the bytes around the slice, e.g. a file read with a margin.
            start: where the slice starts in `window`, in bytes.
            end: where it ends, in bytes.
        """
        lo, hi = self._needed(window, start, end)
        if (lo, hi) != (0, len(window)):
            return self._redact_window(window[lo:hi], start - lo, end - lo)
        return self._redact_window(window, start, end)

    def _redact_window(self, window: bytes, start: int, end: int) -> str:
        # surrogateescape keeps one character per undecodable byte, so a character offset
        # maps back to a byte offset by encoding the text before it.
        text = window.decode("utf-8", "surrogateescape")
        out: list[str] = []
        pos = start
        char_at = byte_at = 0
        for s, e, kind, _ in self._spans(text, 0):
            secret_start = byte_at + _byte_len(text[char_at:s])
            secret_end = secret_start + _byte_len(text[s:e])
            char_at, byte_at = e, secret_end
            if secret_end <= start:
                continue
            if secret_start >= end:
                break
            out.append(window[pos : max(pos, secret_start)].decode("utf-8", "replace"))
            out.append(f"[REDACTED:{kind}]")
            pos = min(secret_end, end)
        out.append(window[pos:end].decode("utf-8", "replace"))
        return "".join(out)

    def _needed(self, window: bytes, start: int, end: int) -> tuple[int, int]:
        """The part of `window` whose redaction decides the slice's: whole lines around it, and any
        private key still open where they start. No built-in pattern but the PEM one crosses a
        newline (see `_KV_VALUE`), so whole lines are context enough for them and far cheaper than
        32 KiB; an administrator's pattern may cross lines, so with one the whole window counts.
        """
        if self._custom:
            return 0, len(window)
        longest = self._longest_value_bytes
        newline = window.find(b"\n", end)
        hi = len(window) if newline < 0 else newline + 1  # the newline too: a quoted value's \Z must not match early
        hi = min(len(window), max(hi, end + longest))
        lo = _line_start(window, start - longest)
        while True:
            heads = [m.start() for m in _PEM_BEGIN.finditer(window, 0, start) if m.start() < lo]
            # A key still open at `lo` runs from a BEGIN to the first END after it, so from the last
            # BEGIN with no END between it and `lo`. Its BEGIN's line comes in too: a match there
            # that overlaps the key merges with it and names the secret, as in the whole window.
            if not heads or _PEM_END_BYTES.search(window, heads[-1], lo) is not None:
                return lo, hi
            lo = _line_start(window, heads[-1] - longest)

    def is_sensitive_key(self, name: str) -> bool:
        """True when a field called `name` holds a secret (``DB_PASSWORD``, ``api_key``...)."""
        return _SENSITIVE_KEY.search(name) is not None

    def stream(self) -> StreamRedactor:
        """Start redacting a stream of chunks (one per command output stream)."""
        return StreamRedactor(self)

    def _spans(self, text: str, pos: int) -> list[_Span]:
        return _merge(self._found(text, pos), self._rules)

    def _found(self, text: str, pos: int, *, custom: bool = True) -> list[tuple[int, int, int, int]]:
        """Every rule's matches in ``text[pos:]`` (administrator patterns' only if `custom`), unmerged."""
        found: list[tuple[int, int, int, int]] = []
        lowered = _fold(text[pos:])
        present = _present_needles(lowered)
        # Had lowering lengthened a character, positions in `lowered` would not be those in `text`.
        aligned = len(lowered) == len(text) - pos
        for prio, rule in enumerate(self._rules):
            if (rule.needles and rule.needles.isdisjoint(present)) or (not custom and rule.kind == _CUSTOM):
                continue
            if rule.one_line and aligned:
                ranges = _needle_lines(lowered, rule.needles & present, pos)
            else:
                ranges = [(pos, len(text))]
            for range_start, range_end in ranges:
                found += _matches(rule, prio, text, range_start, range_end)
        return found

    def _custom_found(self, text: str, before: int) -> list[tuple[int, int, int, int]]:
        """The administrator patterns' matches over the whole of `text` that start before `before`: those are
        what they find there in the whole text, wherever they end."""
        found: list[tuple[int, int, int, int]] = []
        for prio, rule in enumerate(self._rules):
            if rule.kind == _CUSTOM:
                found += _matches(rule, prio, text, 0, len(text), before=before)
        return found

    def _hold_chars(self) -> int:
        return max(STREAM_HOLD_CHARS, self._longest_value)


def _matches(
    rule: _Rule, prio: int, text: str, pos: int, endpos: int, *, before: int | None = None
) -> list[tuple[int, int, int, int]]:
    """(start, prio, end, start of the whole match) of each match of `rule` in ``text[pos:endpos]`` (that starts
    before `before`, if given): the secret group's span when the rule has one that matched, else the match's;
    empty ones are dropped."""
    found = []
    for m in rule.regex.finditer(text, pos, endpos):
        start, end = m.span()
        if before is not None and start >= before:
            break
        for group in rule.groups:
            if m.group(group) is not None:
                start, end = m.span(group)
                break
        if end > start:
            found.append((start, prio, end, m.start()))
    return found


def _merge(found: list[tuple[int, int, int, int]], rules: Sequence[_Rule]) -> list[_Span]:
    """The matches in text order, overlapping ones merged under the kind of the first (the earlier rule
    when two start at the same place)."""
    found.sort()
    merged: list[_Span] = []
    for start, prio, end, match_start in found:
        if merged and start < merged[-1][1]:
            last = merged[-1]
            merged[-1] = (last[0], max(last[1], end), last[2], min(last[3], match_start))
        else:
            merged.append((start, end, rules[prio].kind, match_start))
    return merged


def _needle_lines(lowered: str, needles: frozenset[str], pos: int) -> list[tuple[int, int]]:
    """The lines of `lowered` holding one of `needles`, as (start, end) in the text that `lowered` is
    from `pos` on, runs of lines merged. Each end is past its line break: `\\Z` then matches only where
    it would in the whole text. A regex that matches no line break finds over these what it finds over
    the whole text: `re` still reads behind a range's start for a lookbehind, as it does there."""
    if sum(lowered.count(needle) for needle in needles) * _DENSE_NEEDLE_CHARS > len(lowered):
        # Needles on most lines (found by attack: lines of `key=`, 0.7 s a MiB in this loop): one pass of the
        # regex over the whole text finds the same, for a tenth of that.
        return [(pos, pos + len(lowered))]
    lines: set[tuple[int, int]] = set()
    for needle in needles:
        at = lowered.find(needle)
        while at >= 0:
            start = lowered.rfind("\n", 0, at) + 1
            end = lowered.find("\n", at) + 1 or len(lowered)
            lines.add((start, end))
            at = lowered.find(needle, end)
    merged: list[tuple[int, int]] = []
    for start, end in sorted(lines):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return [(pos + start, pos + end) for start, end in merged]


def _byte_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogateescape"))


def _apply(text: str, spans: Sequence[_Span], start: int, end: int) -> str:
    out: list[str] = []
    pos = start
    for s, e, kind, _ in spans:
        if s >= end:
            break
        out.append(text[pos:s])
        out.append(f"[REDACTED:{kind}]")
        pos = e
    out.append(text[pos:end])
    return "".join(out)


class StreamRedactor:
    """Redacts a text stream chunk by chunk, holding back what a later chunk could complete.

    The output of all `feed` calls plus `flush` equals `Redactor.redact` of the whole
    text, for the built-in patterns and secret values, as long as no held part grows past
    `STREAM_HOLD_CAP_CHARS`. Past the cap the held part is emitted redacted and an open
    match is followed to its end (the PEM END line, or the next whitespace) and dropped.
    """

    def __init__(self, redactor: Redactor) -> None:
        self._r = redactor
        self._held = ""
        self._ctx = ""
        self._drop_until: re.Pattern[str] | None = None

    def feed(self, chunk: str) -> str:
        """Add `chunk`; return the text that is now safe to emit."""
        self._held += chunk
        if self._drop_until is not None and not self._drop():
            return ""
        buf = self._ctx + self._held
        base = len(self._ctx)
        spans = self._r._spans(buf, base)
        cut = self._cut(buf, base, spans)
        drop: re.Pattern[str] | None = None
        if len(buf) - cut > STREAM_HOLD_CAP_CHARS:
            if spans and spans[-1][1] == len(buf):
                drop = _PEM_END if spans[-1][2] == "private_key" else _WHITESPACE
                cut = len(buf)
            else:
                cut = _move_out_of_spans(len(buf) - self._r._hold_chars(), spans)
        out = _apply(buf, spans, base, cut)
        if cut > base:
            self._ctx = buf[max(0, cut - _CONTEXT_CHARS) : cut]
            self._held = buf[cut:]
        if drop is not None:
            self._drop_until = drop
            # An END line may arrive split; the tail lets the search see all of it.
            self._held = buf[-_PEM_TAIL_CHARS:] if drop is _PEM_END else ""
        return out

    def flush(self) -> str:
        """Return the redacted remainder; the stream can be reused afterwards."""
        out = ""
        if self._drop_until is None:
            buf = self._ctx + self._held
            base = len(self._ctx)
            out = _apply(buf, self._r._spans(buf, base), base, len(buf))
        self._held = ""
        self._ctx = ""
        self._drop_until = None
        return out

    def _drop(self) -> bool:
        """Discard the rest of an over-long match; False while its end is not in sight."""
        assert self._drop_until is not None
        m = self._drop_until.search(self._held)
        if m is None:
            self._held = self._held[-_PEM_TAIL_CHARS:] if self._drop_until is _PEM_END else ""
            return False
        end = m.end() if self._drop_until is _PEM_END else m.start()
        self._ctx = (self._ctx + self._held[:end])[-_CONTEXT_CHARS:]
        self._held = self._held[end:]
        self._drop_until = None
        return True

    def _cut(self, buf: str, base: int, spans: Sequence[_Span]) -> int:
        end = len(buf)
        cut = max(buf.rfind("\n", base) + 1, end - self._r._hold_chars(), base)
        if self._r._longest_value:
            # A configured value may contain newlines: hold any unfinished prefix of it.
            cut = max(min(cut, end - self._r._longest_value + 1), base)
        while True:
            before = cut
            # Token formats are runs without whitespace: never split one, nor emit one that may go on.
            while cut > base and not buf[cut - 1].isspace() and (cut == end or not buf[cut].isspace()):
                cut -= 1
            # Hold a match from its key on, so the next scan sees the key again.
            for s, e, _, ms in spans:
                if min(s, ms) < cut < e or (e == end and min(s, ms) < cut):
                    cut = min(s, ms)
            if cut == before:
                return cut


def _move_out_of_spans(cut: int, spans: Sequence[_Span]) -> int:
    for s, e, _, ms in spans:
        if min(s, ms) < cut < e:
            return min(s, ms)
    return cut


# ECMA-48 §5.4 (CSI), §8.3.89 (OSC) and the string controls DCS/SOS/PM/APC; OSC 8 is
# the hyperlink escape that makes shown text point somewhere else. A string's body never holds the
# start of another string (ECMA-48 §5.6: a command string is made of 08-0D and 20-7E): were an
# opener allowed in it, each opener of an unterminated run would be tried, and each try scan to the
# end of the text, quadratic time with the GIL held (64 KiB of U+009D took 8.5 s of a frozen server).
STRING_BODY_CHAR: Final = r"[^\x07\x1b\x9c\x90\x98\x9d\x9e\x9f]"
"""A character of an escape string's body (`safety.output` holds an unfinished one by the same rule)."""
_STRING_BODY: Final = rf"{STRING_BODY_CHAR}*(?:\x07|\x1b\\|\x9c)"
_ESCAPES: Final = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"
    r"|\x9b[0-?]*[ -/]*[@-~]"
    rf"|[\x1b]\]{_STRING_BODY}"
    rf"|\x9d{_STRING_BODY}"
    rf"|\x1b[PX^_]{_STRING_BODY}"
    rf"|[\x90\x98\x9e\x9f]{_STRING_BODY}"
    r"|\x1b[ -/]*[0-~]"
)
_CONTROLS: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# Trojan Source, CVE-2021-42574: overrides and isolates reorder what is displayed.
_BIDI: Final = re.compile(r"[\u202a-\u202e\u2066-\u2069]")
_SURROGATES: Final = re.compile(r"[\ud800-\udfff]")


# Every character past ASCII that a terminal acts on or shows as nothing: the C1 controls (8-bit CSI and
# OSC), format characters (bidi overrides and isolates, zero-width ones, tags) and the line and paragraph
# separators, i.e. Unicode 14's Cc, Cf, Zl and Zp past U+007F (a test checks them against unicodedata).
HIDDEN_RANGES: Final = (
    (0x0080, 0x009F), (0x00AD, 0x00AD), (0x0600, 0x0605), (0x061C, 0x061C), (0x06DD, 0x06DD), (0x070F, 0x070F),
    (0x0890, 0x0891), (0x08E2, 0x08E2), (0x180E, 0x180E), (0x200B, 0x200F), (0x2028, 0x202E), (0x2060, 0x2064),
    (0x2066, 0x206F), (0xFEFF, 0xFEFF), (0xFFF9, 0xFFFB), (0x110BD, 0x110BD), (0x110CD, 0x110CD),
    (0x13430, 0x13438), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0001, 0xE0001), (0xE0020, 0xE007F),
)  # fmt: skip
_HIDDEN: Final = re.compile("[" + "".join(f"{chr(low)}-{chr(high)}" for low, high in HIDDEN_RANGES) + "]")


def _json_escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def escape_hidden(text: str) -> str:
    """`text` with every hidden character (`HIDDEN_RANGES`) written as a JSON escape (`\\u009b`, a surrogate
    pair past U+FFFF): the same string to a JSON reader, and nothing a terminal acts on or hides."""
    return text if text.isascii() else _HIDDEN.sub(_json_escape, text)


def sanitize_terminal(text: str) -> str:
    """Make program output safe to display.

    Removes complete escape sequences (CSI, OSC including OSC 8 hyperlinks, DCS/SOS/PM/APC,
    other ESC sequences), turns CRLF into LF, and shows every other C0/C1 control, a lone
    CR and DEL as ``\\xNN`` text and bidi overrides/isolates as ``\\uNNNN`` text, so no
    ESC or CR reaches a terminal or can rewrite what was shown. A lone surrogate (a byte of
    a file name that is not UTF-8, as os.fsdecode gives it) becomes ``\\xNN`` too: JSON
    cannot carry it.
    """
    # CRLF first: an escape removed from between a CR and a LF does not make them a line end (a stream
    # cleaned chunk by chunk could not know, and a hidden CR could rewrite a line).
    text = _ESCAPES.sub("", text.replace("\r\n", "\n"))
    text = _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    text = _SURROGATES.sub(_escaped_surrogate, text)
    return _BIDI.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


_ESCAPED_NAME_CATEGORIES: Final = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"})
# Shown as nothing, or as a space, though not in those categories: fillers, the blank braille cell, the
# combining grapheme joiner and the variation selectors. Other combining marks are letters' accents.
INVISIBLE_CODEPOINTS: Final = frozenset(
    {0x034F, 0x115F, 0x1160, 0x2800, 0x3164, 0xFFA0, *range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0)}
)


def sanitize_name(name: str) -> str:
    """A file name safe to show and never mistaken for another.

    Every control, invisible or unassigned character and every space but U+0020 (Unicode categories
    C*, Z*, fillers and variation selectors: ESC, newline, zero-width and bidi marks, no-break
    spaces) is shown as ``\\uNNNN`` (``\\UNNNNNNNN`` past U+FFFF), an undecodable byte (os.fsdecode's lone
    surrogate) as ``\\xNN``, and a backslash doubled. Unlike `sanitize_terminal`, an escape sequence
    is shown, not removed: ``rep\\x1b[0mort.txt`` would otherwise read as ``report.txt``, another file.
    """
    out: list[str] = []
    for char in name:
        point = ord(char)
        if 0xDC80 <= point <= 0xDCFF:
            out.append(f"\\x{point - 0xDC00:02x}")
        elif char == "\\":
            out.append("\\\\")
        elif char != " " and (unicodedata.category(char) in _ESCAPED_NAME_CATEGORIES or point in INVISIBLE_CODEPOINTS):
            out.append(f"\\u{point:04x}" if point <= 0xFFFF else f"\\U{point:08x}")  # fixed width: one reading
        else:
            out.append(char)
    return "".join(out)


def _escaped_surrogate(match: re.Match[str]) -> str:
    point = ord(match.group())
    return f"\\x{point - 0xDC00:02x}" if 0xDC80 <= point <= 0xDCFF else f"\\u{point:04x}"

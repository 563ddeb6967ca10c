"""Redaction and terminal sanitising (corpus entries A095, A097, A098, A100, A101)."""

from __future__ import annotations

import itertools
import json
import re
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bastion.safety import redact as redact_mod
from bastion.safety.errors import ConfigError
from bastion.safety.redact import (
    SLICE_CONTEXT_BYTES,
    STREAM_HOLD_CAP_CHARS,
    Redactor,
    sanitize_name,
    sanitize_terminal,
)
from tests.helpers import least_cpu_s

CORPUS_FILE = Path(__file__).resolve().parents[1] / "attacks" / "attack-corpus.json"
CORPUS = {e["id"]: e for e in json.loads(CORPUS_FILE.read_text())}

AWS_KEY_ID = "AKIAIOSFODNN7EXAMPLE"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl"
PEM_BODY = "b3BlbnNzaC1rZXktdjEAAAAA"
PEM = f"-----BEGIN OPENSSH PRIVATE KEY-----\n{PEM_BODY}\n-----END OPENSSH PRIVATE KEY-----"

# (text, secret that must disappear, kind). All values are fake.
CASES = [
    (f"AWS_ACCESS_KEY_ID={AWS_KEY_ID}", AWS_KEY_ID, "aws_access_key_id"),
    ("ASIAY34FZKBOKMUTVV7A in use", "ASIAY34FZKBOKMUTVV7A", "aws_access_key_id"),
    (f"AWS_SECRET_ACCESS_KEY={AWS_SECRET}", AWS_SECRET, "aws_secret_access_key"),
    (f"aws_secret_access_key = {AWS_SECRET}", AWS_SECRET, "aws_secret_access_key"),
    ("ghp_FAKEfakeFAKEfake0123456789abcdefABCD", "ghp_FAKEfakeFAKEfake0123456789abcdefABCD", "github_token"),
    ("gho_FAKEfakeFAKEfake0123456789abcdefABCD", "gho_FAKEfakeFAKEfake0123456789abcdefABCD", "github_token"),
    ("ghu_FAKEfakeFAKEfake0123456789abcdefABCD", "ghu_FAKEfakeFAKEfake0123456789abcdefABCD", "github_token"),
    ("ghs_FAKEfakeFAKEfake0123456789abcdefABCD", "ghs_FAKEfakeFAKEfake0123456789abcdefABCD", "github_token"),
    ("ghr_FAKEfakeFAKEfake0123456789abcdefABCD", "ghr_FAKEfakeFAKEfake0123456789abcdefABCD", "github_token"),
    ("github_pat_11FAKE0000000000_fakefakefakefake", "github_pat_11FAKE0000000000_fakefakefakefake", "github_token"),
    ("glpat-FAKEfakeFAKEfake1234", "glpat-FAKEfakeFAKEfake1234", "gitlab_token"),
    ("xoxb-000000000000-FAKEfakeFAKE", "xoxb-000000000000-FAKEfakeFAKE", "slack_token"),
    ("xoxp-000000000000-FAKEfakeFAKE", "xoxp-000000000000-FAKEfakeFAKE", "slack_token"),
    ("https://hooks.slack.com/services/T0000/B0000/FAKEfakeFAKE", "T0000/B0000/FAKEfakeFAKE", "slack_webhook"),
    ("sk_live_FAKEfakeFAKEfake00", "sk_live_FAKEfakeFAKEfake00", "stripe_key"),
    ("rk_live_FAKEfakeFAKEfake00", "rk_live_FAKEfakeFAKEfake00", "stripe_key"),
    ("sk_test_FAKEfakeFAKEfake00", "sk_test_FAKEfakeFAKEfake00", "stripe_key"),
    ("sk-FAKEfakeFAKEfake0123456789", "sk-FAKEfakeFAKEfake0123456789", "openai_key"),
    ("sk-proj-FAKEfakeFAKEfake0123456789", "sk-proj-FAKEfakeFAKEfake0123456789", "openai_key"),
    ("sk-ant-api03-FAKEfakeFAKEfake0123456789", "sk-ant-api03-FAKEfakeFAKEfake0123456789", "anthropic_key"),
    ("AIzaSyFAKEfakeFAKEfake0123456789abcdefg", "AIzaSyFAKEfakeFAKEfake0123456789abcdefg", "google_api_key"),
    (f"echo {JWT}", JWT, "jwt"),
    (PEM, PEM_BODY, "private_key"),
    ("password=hunter2hunter2", "hunter2hunter2", "credential"),
    ("passwd: hunter2hunter2", "hunter2hunter2", "credential"),
    ("secret=s3cr3tvalue", "s3cr3tvalue", "credential"),
    ("token=tok123456", "tok123456", "credential"),
    ("api_key=key123456", "key123456", "credential"),
    ('{"DB_PASSWORD": "two words"}', "two words", "credential"),
    ("Authorization: Bearer FAKEfakeFAKEfake0123", "FAKEfakeFAKEfake0123", "authorization"),
    ("postgres://app:pa55word@db/app", "pa55word", "url_password"),
]


@pytest.mark.parametrize(("text", "secret", "kind"), CASES, ids=[c[2] + "-" + c[0][:12] for c in CASES])
def test_builtin_kind_is_redacted(text: str, secret: str, kind: str) -> None:
    out = Redactor().redact(text)
    assert secret not in out
    assert f"[REDACTED:{kind}]" in out


def test_a095_aws_example_credentials_contained() -> None:
    """A095: both halves of the AWS example pair go; the variable names stay readable."""
    out = Redactor().redact(CORPUS["A095"]["input"])
    assert AWS_KEY_ID not in out
    assert AWS_SECRET not in out
    assert "AWS_SECRET_ACCESS_KEY=" in out


def test_a097_private_key_block_contained() -> None:
    out = Redactor().redact(f"before\n{PEM}\nafter")
    assert out == "before\n[REDACTED:private_key]\nafter"


def test_unterminated_private_key_redacts_to_end() -> None:
    out = Redactor().redact(f"x\n-----BEGIN RSA PRIVATE KEY-----\n{PEM_BODY}\nmore")
    assert out == "x\n[REDACTED:private_key]"


def test_a098_jwt_contained() -> None:
    assert Redactor().redact(CORPUS["A098"]["input"]) == "echo [REDACTED:jwt]"


def test_a100_printenv_style_output_contained() -> None:
    """A100: env-style secrets go; ordinary variables such as PWD stay."""
    env = "PWD=/home/u\nGITHUB_TOKEN=abc123def\nSECRET_KEY=xyz789\nDATABASE_PASSWORD=pw0rd1\nmax_tokens=5\n"
    out = Redactor().redact(env)
    for secret in ("abc123def", "xyz789", "pw0rd1"):
        assert secret not in out
    assert "PWD=/home/u" in out
    assert "max_tokens=5" in out


def test_plain_text_unchanged() -> None:
    text = "total 4\ndrwxr-xr-x 2 root root 4096 Jan 1 00:00 src\ntokens: used 5 of 10\n"
    assert Redactor().redact(text) == text


def test_secret_values_redacted_and_short_ones_ignored() -> None:
    r = Redactor(secret_values=["correct horse battery", "abc", ""])
    assert r.redact("pw is correct horse battery!") == "pw is [REDACTED:secret_value]!"
    assert r.redact("abc") == "abc"


def test_extra_pattern_with_secret_group() -> None:
    r = Redactor(extra_patterns=[r"internal-(?P<secret>[0-9a-f]{8})"])
    assert r.redact("id internal-deadbeef") == "id internal-[REDACTED:custom]"


def test_invalid_extra_pattern_is_config_error() -> None:
    with pytest.raises(ConfigError, match=r"redaction pattern 1 '\(unclosed' is not a valid regex") as info:
        Redactor(extra_patterns=["ok", "(unclosed"])
    assert "\n" not in str(info.value)


def test_redaction_happens_before_truncation() -> None:
    """A cut through a secret must not leave its prefix: the secret is gone before the cut."""
    text = "x" * 10 + " " + AWS_KEY_ID + " tail"
    for max_chars in range(len(text) + 1):
        out, truncated = Redactor().redact_then_truncate(text, max_chars)
        assert len(out) <= max_chars
        assert "AKIA" not in out
        assert "[REDACTED" not in out or "[REDACTED:aws_access_key_id]" in out
        assert truncated == (max_chars < len(Redactor().redact(text)))


def test_sensitive_keys() -> None:
    r = Redactor()
    assert r.is_sensitive_key("AWS_SECRET_ACCESS_KEY")
    assert r.is_sensitive_key("db_password")
    assert r.is_sensitive_key("api-key")
    assert not r.is_sensitive_key("tokens")
    assert not r.is_sensitive_key("command")


SECRETS = [AWS_KEY_ID, AWS_SECRET, JWT, PEM_BODY, "ghp_FAKEfakeFAKEfake0123456789abcdefABCD", "two words here"]
SECRET_LINES = [
    f"key {AWS_KEY_ID}",
    f"AWS_SECRET_ACCESS_KEY={AWS_SECRET}",
    f"auth {JWT}.",
    PEM,
    "token ghp_FAKEfakeFAKEfake0123456789abcdefABCD",
    'password: "two words here"',
]
FILLER = st.text(alphabet=st.sampled_from(list("ab c\n=-_.:\"'/")), max_size=40)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    parts=st.lists(st.tuples(FILLER, st.sampled_from(SECRET_LINES)), min_size=1, max_size=4),
    tail=FILLER,
    data=st.data(),
)
def test_stream_never_leaks_a_secret_split_across_chunks(
    parts: list[tuple[str, str]], tail: str, data: st.DataObject
) -> None:
    """For any chunking, the stream emits what `redact` of the whole emits, so no secret.

    Fillers avoid letters that could glue onto a token and make it a different match.
    """
    text = "".join(f"{filler} {secret} " for filler, secret in parts) + tail
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    r = Redactor()
    stream = r.stream()
    out = "".join(stream.feed(c) for c in chunks) + stream.flush()
    for secret in SECRETS:
        assert secret not in out
    assert out == r.redact(text)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=40))
def test_stream_secret_value_split_across_chunks(sizes: list[int]) -> None:
    r = Redactor(secret_values=["multi\nline secret"])
    text = ("pad " * 30 + "multi\nline secret\n") * 5
    stream = r.stream()
    out, pos = [], 0
    for size in sizes:
        out.append(stream.feed(text[pos : pos + size]))
        pos += size
    out.append(stream.feed(text[pos:]))
    out.append(stream.flush())
    assert "".join(out) == r.redact(text)


def test_stream_huge_private_key_is_capped_and_dropped() -> None:
    """A key larger than the hold cap is emitted as one marker; its body never streams out."""
    body = ("QUJDRA" * 10 + "\n") * (2 * STREAM_HOLD_CAP_CHARS // 61)
    text = f"start\n-----BEGIN RSA PRIVATE KEY-----\n{body}-----END RSA PRIVATE KEY-----\nafter\n"
    stream = Redactor().stream()
    out = "".join(stream.feed(text[i : i + 1000]) for i in range(0, len(text), 1000)) + stream.flush()
    assert "QUJDRA" not in out
    assert out == "start\n[REDACTED:private_key]\nafter\n"


def test_stream_holds_at_most_the_cap_for_a_long_line() -> None:
    stream = Redactor().stream()
    emitted = sum(len(stream.feed("x" * 1000)) for _ in range(100))
    assert emitted >= 100 * 1000 - STREAM_HOLD_CAP_CHARS - 1000
    assert len(stream.flush()) + emitted == 100 * 1000


def test_a101_osc8_hyperlink_and_clear_screen_are_stripped() -> None:
    """A101: printf output of the corpus entry: no ESC survives, the visible text stays."""
    output = "\033]8;;http://attacker.example\033\\click\033]8;;\033\\ \033[2J"
    out = sanitize_terminal(output)
    assert "\x1b" not in out
    assert "attacker.example" not in out
    assert out == "click "


def test_sanitize_controls_and_bidi_become_visible() -> None:
    out = sanitize_terminal("a\r\nb\rc\x07d\x85e\u202ef\tg\x1b\x9b\u2066")
    assert out == "a\nb\\x0dc\\x07d\\x85e\\u202ef\tg\\x1b\\x9b\\u2066"


def test_sanitize_bel_terminated_osc_and_other_escapes() -> None:
    out = sanitize_terminal("\x1b]0;title\x07x\x1b(By\x1bPdcs\x1b\\z\x1b[38;5;1mred\x1b[0m")
    assert out == "xyzred"


@pytest.mark.parametrize(
    "text",
    [
        "Authorization: Bearer FAKEfakeFAKEfake0123 done",
        "password=hunter2hunter2 done",
        f"AWS_SECRET_ACCESS_KEY={AWS_SECRET} x",
    ],
)
def test_stream_split_between_key_and_secret(text: str) -> None:
    """A rule that needs the key (``password=``, ``Bearer``) still matches when the key came in an earlier chunk."""
    r = Redactor()
    for cut in range(len(text) + 1):
        stream = r.stream()
        out = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.flush()
        assert out == r.redact(text), cut


# --- slices of a file (read_file with offset and length; issue 13, finding 5) -----------------

# Filler that cannot form or glue onto a secret: no 'r' (bearer, authorization, password...), no
# '=' or ':' (key=value), no '-', '_' or '/' (token prefixes), no capitals or digits; multibyte
# characters so byte offsets and character offsets differ.
SLICE_FILLER = st.text(alphabet=st.sampled_from(list("abcdefghijklmnopqstuvwxyz  \n.,é日€")), max_size=300)
SECRET_VALUE = "ΩMEGA-VALUE-7Q3Z"  # a configured value with a two-byte character in it
LINES_VALUE = "LINE-ONE-X1\nLINE-TWO-Y2"  # a configured value across a newline


def _body(size: int) -> st.SearchStrategy[str]:
    return st.text(alphabet=st.sampled_from(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")), min_size=size, max_size=size)


SLICE_SECRETS = st.one_of(
    _body(16).map(lambda b: f"AKIA{b}"),
    _body(36).map(lambda b: f"ghp_{b}"),
    _body(40).map(lambda b: f"sk-ant-{b}"),
    st.lists(_body(64), min_size=1, max_size=6).map(
        lambda lines: "-----BEGIN RSA PRIVATE KEY-----\n" + "\n".join(lines) + "\n-----END RSA PRIVATE KEY-----"
    ),
    _body(24).map(lambda b: f'api_key = "{b[:12]} {b[12:]}"'),
    st.just(SECRET_VALUE),
    st.just(LINES_VALUE),
)
_MARKERS = re.compile(r"(?:\[REDACTED:[a-z_]+\])+")


def _shows_secret(text: str) -> bool:
    """Whether `text` shows any character of a planted secret: every one has a capital or digit, no filler does."""
    return re.search(r"[A-Z0-9Ω]", _MARKERS.sub("", text)) is not None


def _slice(redactor: Redactor, data: bytes, offset: int, length: int, context: int) -> str:
    start = max(0, offset - context)
    window = data[start : offset + length + context]
    return redactor.redact_slice(window, offset - start, min(offset - start + length, len(window)))


@st.composite
def _planted(draw: st.DrawFn) -> tuple[bytes, list[str]]:
    parts = draw(st.lists(st.tuples(SLICE_FILLER, SLICE_SECRETS), min_size=1, max_size=5))
    text = "".join(f"{filler} {secret}\n" for filler, secret in parts) + draw(SLICE_FILLER)
    return text.encode("utf-8"), [secret for _, secret in parts]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planted=_planted(), data=st.data())
def test_read_slices_never_show_a_secret_that_whole_file_redaction_hides(
    planted: tuple[bytes, list[str]], data: st.DataObject
) -> None:
    """Invariant: for text with secrets at random offsets, whole-file redaction hides every
    secret; then no slice (byte offset, length) shows any character of one, with a context at
    least as long as the longest secret, and however the slice cuts a secret or a multibyte
    character. Does not prove anything for a secret longer than the context (documented cap).
    """
    raw, secrets = planted
    redactor = Redactor(secret_values=[SECRET_VALUE, LINES_VALUE])
    assert not _shows_secret(redactor.redact(raw.decode("utf-8"))), "the generator planted a secret redact misses"
    longest = max(len(secret.encode("utf-8")) for secret in secrets)
    context = data.draw(st.integers(longest, longest + 64), label="context")
    for _ in range(8):
        offset = data.draw(st.integers(0, len(raw)), label="offset")
        length = data.draw(st.integers(1, max(1, len(raw))), label="length")
        shown = _slice(redactor, raw, offset, length, context)
        assert not _shows_secret(shown), (offset, length, shown)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planted=_planted(), data=st.data())
def test_adjacent_read_slices_never_join_back_into_a_secret(
    planted: tuple[bytes, list[str]], data: st.DataObject
) -> None:
    """Invariant: cutting the file into adjacent slices and joining what each shows never
    reconstructs a secret (the 'token in two halves' attack); and, cut at character boundaries,
    the join is whole-file redaction (no extra loss) once a marker repeated by a cut is merged.
    """
    raw, secrets = planted
    redactor = Redactor(secret_values=[SECRET_VALUE, LINES_VALUE])
    text = raw.decode("utf-8")
    boundaries = sorted({len(text[:i].encode("utf-8")) for i in range(len(text) + 1)})
    cuts = sorted(set(data.draw(st.lists(st.sampled_from(boundaries), max_size=12), label="cuts")))
    edges = [0, *[c for c in cuts if 0 < c < len(raw)], len(raw)]
    context = max(len(secret.encode("utf-8")) for secret in secrets)
    joined = "".join(_slice(redactor, raw, a, b - a, context) for a, b in itertools.pairwise(edges))
    assert not _shows_secret(joined)
    for secret in secrets:
        assert secret not in joined
    assert _MARKERS.sub("[R]", joined) == _MARKERS.sub("[R]", redactor.redact(text))


def test_a_token_cut_in_two_by_a_slice_shows_no_half() -> None:
    """The attack of issue 13: read a token as two slices that meet inside it."""
    token = "ghp_" + "Q7" * 18
    raw = f"config\ntoken {token} here\n".encode()
    cut = raw.index(b"Q7") + 10
    redactor = Redactor()
    first = _slice(redactor, raw, 0, cut, SLICE_CONTEXT_BYTES)
    second = _slice(redactor, raw, cut, len(raw) - cut, SLICE_CONTEXT_BYTES)
    assert first == "config\ntoken [REDACTED:github_token]"
    assert second == "[REDACTED:github_token] here\n"
    assert "Q7" not in first + second


def test_slice_of_undecodable_bytes_is_replaced_as_before() -> None:
    """Invariant: a slice is decoded alone, errors replaced, as a plain read of its bytes was:
    a multibyte character cut by the slice shows as U+FFFD, never as a lone surrogate."""
    raw = "é日".encode() + b"\xff"
    redactor = Redactor()
    assert redactor.redact_slice(raw, 1, len(raw)) == "\ufffd日\ufffd"
    assert redactor.redact_slice(raw, 0, len(raw)) == raw.decode("utf-8", "replace")


_BEGIN = "-----BEGIN RSA PRIVATE KEY-----"
_END = "-----END RSA PRIVATE KEY-----"
# Pieces that make redaction decide across lines: key blocks opened, closed or not, certificates
# between them, quoted values left open, configured values across newlines.
_PIECES = st.sampled_from(
    [
        _BEGIN,
        _END,
        "-----BEGIN CERTIFICATE-----",
        "-----END CERTIFICATE-----",
        "\n",
        " ",
        "é",
        'password = "',
        '"',
        "ghp_",
        "Z9Z9Z9Z9Z9Z9",
        "AKIA",
        "token=",
        SECRET_VALUE,
        LINES_VALUE,
        "LINE-ONE-X1\n",
        "plain words",
    ]
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(_PIECES, max_size=60), data=st.data())
def test_slice_redaction_of_its_lines_equals_that_of_the_whole_window(pieces: list[str], data: st.DataObject) -> None:
    """Invariant: redacting only the slice's lines (and an open key before it) decides exactly
    what redacting the whole window decides, for text built to cross lines: keys open, closed
    or interleaved with certificates, open quotes, values across newlines.
    """
    raw = "".join(pieces).encode("utf-8")
    redactor = Redactor(secret_values=[SECRET_VALUE, LINES_VALUE])
    start = data.draw(st.integers(0, len(raw)), label="start")
    end = data.draw(st.integers(start, len(raw)), label="end")
    assert redactor.redact_slice(raw, start, end) == redactor._redact_window(raw, start, end)


@pytest.mark.parametrize(
    "pieces",
    [
        # A key closed exactly where the slice starts, merged with a credential on the slice's line.
        [_BEGIN, _BEGIN, "\n", 'password = "', _END, _BEGIN],
        # A key open on an earlier line, merged there with a credential that starts before it.
        ['password = "', _END, _BEGIN, _BEGIN, 'password = "', "\n", _BEGIN],
    ],
)
def test_slice_names_a_merged_secret_as_the_whole_window_does(pieces: list[str]) -> None:
    """Found by the invariant above: a key open before the slice's lines merged with a match there,
    and the slice named the secret `private_key` where the whole window said `credential` (or the
    reverse). Every slice of these texts now matches the whole window's redaction exactly."""
    raw = "".join(pieces).encode("utf-8")
    redactor = Redactor(secret_values=[SECRET_VALUE, LINES_VALUE])
    for start in range(len(raw) + 1):
        for end in range(start, len(raw) + 1):
            assert redactor.redact_slice(raw, start, end) == redactor._redact_window(raw, start, end), (start, end)


def test_an_administrators_pattern_across_lines_is_judged_on_the_whole_window() -> None:
    """Invariant: an extra pattern may cross lines, so a slice inside its match is hidden even
    when the match starts lines before the slice."""
    redactor = Redactor(extra_patterns=[r"(?s)BEGIN-VAULT.*?END-VAULT"])
    raw = b"head\nBEGIN-VAULT\nline one\nline two\nEND-VAULT\ntail\n"
    start = raw.index(b"line two")
    assert redactor.redact_slice(raw, start, start + 8) == "[REDACTED:custom]"
    assert redactor.redact_slice(raw, raw.index(b"tail"), len(raw)) == "tail\n"


def test_redact_keeping_lines_keeps_line_numbers_across_a_multiline_secret() -> None:
    """Invariant: what search_files numbers lines by has as many lines as the text; the key's lines are gone."""
    text = "a\n-----BEGIN RSA PRIVATE KEY-----\nMIIE\nQWERTY\n-----END RSA PRIVATE KEY-----\nb\n"
    kept = Redactor().redact_keeping_lines(text)
    assert kept.count("\n") == text.count("\n")
    assert kept.split("\n")[5] == "b"
    assert "QWERTY" not in kept
    assert "MIIE" not in kept


# -- which rules run: the needles present ---------------------------------------------------------------

_NEEDLE_TEXT = st.lists(
    st.sampled_from(redact_mod._ALL_NEEDLES)
    | st.text(max_size=30)
    | st.sampled_from(["\udc80", "\udcff", "ключ", "İ", "x" * 300, "KEY", "Bearer ", "\n"]),
    max_size=40,
).map("".join)


@given(_NEEDLE_TEXT)
@settings(max_examples=400)
def test_the_needles_found_are_those_a_substring_test_finds(text: str) -> None:
    lowered = text.lower()
    for sample in (lowered, lowered * 20):  # both sides of the length where one RE2 pass takes over
        assert redact_mod._present_needles(sample) == {n for n in redact_mod._ALL_NEEDLES if n in sample}


def test_a_secret_at_the_end_of_a_large_text_is_still_redacted() -> None:
    """One RE2 pass finds a needle past a mebibyte of text, so its rule still runs."""
    filler = "lorem ipsum dolor sit amet, ключ " * 32_000
    for secret_text, secret in ((f"token={AWS_SECRET}", AWS_SECRET), (f"id {AWS_KEY_ID}", AWS_KEY_ID), (JWT, JWT)):
        redacted = Redactor().redact(filler + secret_text)
        assert secret not in redacted
        assert redacted.startswith(filler)


def _spans_over_the_whole_text(redactor: Redactor, text: str, pos: int) -> list[tuple[int, int, str, int]]:
    """`Redactor._spans` as it was before it ran one-line rules over needle lines only: the oracle."""
    present = {n for n in redact_mod._ALL_NEEDLES if n in redact_mod._fold(text[pos:])}
    found = []
    for prio, rule in enumerate(redactor._rules):
        if not rule.needles or not rule.needles.isdisjoint(present):
            found += redact_mod._matches(rule, prio, text, pos, len(text))
    return redact_mod._merge(found, redactor._rules)


_SECRETISH = st.lists(
    st.sampled_from(
        [
            "password",
            "PassWord",
            "db_",
            "api_key",
            "API-KEY",
            "token",
            "auth_token",
            "secret",
            "credentials",
            "private_key",
            "=",
            ":",
            " ",
            "\t",
            "\n",
            "\r\n",
            '"',
            "'",
            "abcdEFGH12345678xyz",
            "x" * 40,
            AWS_KEY_ID,
            "aws_secret_access_key",
            AWS_SECRET,
            "Authorization: ",
            "Bearer ",
            JWT,
            "ghp_" + "a" * 30,
            "https://",
            "user:pw@",
            "host/",
            "İ",
            "ß",
            "\udc80",
            "ключ",
            "-----BEGIN RSA PRIVATE KEY-----",
            "-----END RSA PRIVATE KEY-----",
            PEM_BODY,
            "sk-ant-" + "b" * 24,
            "xoxb-1234567890ab",
            "ſ",
            "ı",
            "\u212a",
            "ſecret",
            "paſſword",
            "credentıals",
            "Authorızation: ",
        ]
    )
    | st.text(max_size=8),
    max_size=60,
).map("".join)


def _kept_of_the_whole_redaction(redactor: Redactor, text: str, max_chars: int) -> tuple[str, bool]:
    """What `Redactor.redact_then_truncate` keeps, from the spans of the whole text: the oracle of its window."""
    spans = redactor._spans(text, 0)
    end = min(max_chars, len(text))
    for start, stop, _, _ in spans:
        if start < end < stop:
            end = stop
    red = redact_mod._apply(text, spans, 0, end)
    if end == len(text) and len(red) <= max_chars:
        return red, False
    cut = max_chars
    for m in redact_mod._MARKER.finditer(red, max(0, cut - redact_mod._MAX_MARKER_CHARS), cut + 40):
        if m.start() < cut < m.end():
            cut = m.start()
    return red[:cut], True


@given(_SECRETISH, st.integers(min_value=0, max_value=3000), st.booleans())
@example("password=" + "a" * 50, 12, False)
@example("-----BEGIN RSA PRIVATE KEY-----\n" + "A" * 64, 40, False)  # no END: redacted to the text's end
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_a_long_text_cut_is_redacted_as_the_whole_text_is(start: str, max_chars: int, custom: bool) -> None:
    """Found by attack: `redact_then_truncate` redacted a 4 MiB argument whole to keep 4,096 characters (the audit
    log's cap), 2.5 s of the event loop. Only a window past the cut is redacted now. Invariant: a text whose part
    past the window holds no secret is cut exactly as when it was redacted whole (and is called cut whenever it goes
    past the window, a secret running to its end included: what is past the window was not looked at)."""
    redactor = Redactor(extra_patterns=[r"zz\nzz"], secret_values=["pw@host"]) if custom else Redactor()
    text = start + "\n" + "plain words " * (SLICE_CONTEXT_BYTES // 4)
    out, cut = redactor.redact_then_truncate(text, max_chars)
    kept, whole_cut = _kept_of_the_whole_redaction(redactor, text, max_chars)
    assert out == kept
    # A secret the window's end cuts (a PEM key with no END in it) runs to the window's end: the rest of the text
    # was not looked at, so it is called cut, where the whole text's redaction knew the key ran to the end.
    assert cut == whole_cut or (cut and len(text) > max_chars + SLICE_CONTEXT_BYTES)


@pytest.mark.parametrize("last", ["value", "github"])
def test_a_window_shrunk_by_redaction_never_shows_a_secret_cut_by_its_end(last: str) -> None:
    """Found by review: the window past the cut is counted in raw characters, but the cut was made in the redacted
    text. Ten 1,800-character keys shrink to markers, so the redacted window fitted under the cut whole, and a
    secret that the window's end cut in two (a configured secret value, a `ghp_` token whose rule then needs 20
    characters it no longer had) showed its start: 33 of a value's 36 characters in the audit log. Invariant:
    nothing past the first `max_chars` raw characters is kept, so no part of the last secret shows."""
    value = "prod-db-Hunter2-0123456789abcdefghij"
    redactor = Redactor(secret_values=[value])
    keys = "".join(f"SERVICE_{n}_API_KEY={'k' * 1800}\n" for n in range(10))
    secret = value if last == "value" else "ghp_" + "Z" * 36
    window = 4096 + SLICE_CONTEXT_BYTES
    text = keys + "p" * (window - len(keys) - 10) + " " + secret + " tail"
    out, cut = redactor.redact_then_truncate(text, 4096)
    assert cut
    assert secret[:6] not in out
    assert len(out) <= 4096


def test_an_administrators_pattern_needing_context_past_the_window_still_redacts_a_cut_text() -> None:
    """Found by review: an administrator's pattern may need any context (a block from its BEGIN to its END line); with
    only a window past the cut redacted, a 30,000-character block's body showed in the kept 4,096 characters.
    Invariant: with administrator patterns the whole text is redacted, and the block is its marker."""
    redactor = Redactor(extra_patterns=[r"(?s)BEGIN VAULT BLOB.*?END VAULT BLOB"])
    text = "BEGIN VAULT BLOB\n" + "s3cr3t-body " * 2500 + "\nEND VAULT BLOB\nafter"
    out, cut = redactor.redact_then_truncate(text, 4096)
    assert out == "[REDACTED:custom]"  # and nothing past the first 4,096 characters: "after" is left out
    assert cut


def test_a_huge_secret_dense_text_is_redacted_in_a_window_past_the_cut() -> None:
    """The attack's input: 4 MiB of `key=` lines, the redactor's costliest text (a needle on every line), cut to the
    audit log's 4,096 characters. Invariant: what is kept is redacted and cut, and the work is that of the window
    (measured in CPU time against redacting the window alone, which a whole redaction would exceed a hundredfold)."""
    redactor = Redactor()
    text = "key=\n" * 800_000 + "password=hunter2hunter2\n"
    window = text[: 4096 + SLICE_CONTEXT_BYTES]
    out, cut = redactor.redact_then_truncate(text, 4096)
    assert cut
    assert out == window[:4096]
    whole = least_cpu_s(lambda: redactor.redact_then_truncate(text, 4096))
    alone = least_cpu_s(lambda: redactor.redact(window))
    assert whole < 20 * alone + 0.005, (whole, alone)


def test_an_administrators_pattern_leaves_the_built_in_rules_to_the_window_of_a_huge_cut_text() -> None:
    """Found by attack: with one administrator pattern configured, `redact_then_truncate` ran every built-in rule
    over the whole text, 4 MiB of `password=` lines in an audit record's argument: 0.3 s of the event loop a call,
    as often as an agent sends it. Invariant: what is kept is the whole text's redaction, and the work is the
    window's plus one pass of the administrator's pattern over the text (CPU time, against both alone; the whole
    redaction exceeds them a hundredfold)."""
    pattern = r"corp-[0-9a-f]{16}"
    redactor = Redactor(extra_patterns=[pattern])
    text = "password=hunter2xyz\n" * 200_000 + "corp-0123456789abcdef\n"
    out, cut = redactor.redact_then_truncate(text, 4096)
    assert (out, cut) == _kept_of_the_whole_redaction(redactor, text, 4096)
    assert "hunter2xyz" not in out
    window = text[: 4096 + SLICE_CONTEXT_BYTES]
    whole = least_cpu_s(lambda: redactor.redact_then_truncate(text, 4096))
    alone = least_cpu_s(lambda: redactor.redact(window)) + least_cpu_s(lambda: re.findall(pattern, text))
    assert whole < 20 * alone + 0.005, (whole, alone)


@given(_SECRETISH, st.integers(min_value=0, max_value=20), st.booleans())
@example('password="unterminated value\nnext line', 0, False)  # \Z must not match before a line break
@example("İİİİİİİİ\nx password=hunter2222 and more", 0, False)  # lowering lengthens İ: positions shift
@example("İ" * 40 + "token: abcdefgh12345678", 3, True)
@example("export TOKEN_FILE=/run/t\nſecret=hunter2hunter2\n", 0, False)  # found by an attack review
@example("Authorization header follows\nAuthorızation: Basic dXNlcjpodW50ZXIy\n", 0, False)
@example("key=\n" * 80 + "api_key=abcdEFGH12345678xyz\n", 0, False)  # needles dense: one pass over the whole text
@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
def test_spans_are_those_of_every_rule_run_over_the_whole_text(text: str, skip: int, custom: bool) -> None:
    redactor = Redactor(extra_patterns=[r"zz\nzz"], secret_values=["pw@host"]) if custom else Redactor()
    pos = min(skip, len(text))
    assert redactor._spans(text, pos) == _spans_over_the_whole_text(redactor, text, pos)
    assert redactor._spans(text * 8, pos) == _spans_over_the_whole_text(redactor, text * 8, pos)


@pytest.mark.parametrize(
    "text",
    [
        "ſecret=hunter2hunter2",
        "paſſword: hunter2hunter2",
        "credentıals=hunter2hunter2",
        "Authorızation: Basic dXNlcjpodW50ZXIy",
        "Authorİzation: Basic dXNlcjpodW50ZXIy",
        "api_\u212aey=hunter2hunter2",  # the Kelvin sign, which str.lower already makes a k
    ],
)
def test_letters_regex_case_folding_matches_to_ascii_do_not_hide_a_key(text: str) -> None:
    """`re`'s IGNORECASE matches ı and İ to i, ſ to s and K to k: each such key is still a key, alone in a
    text or in a long one (the needle search folds them too)."""
    for sample in (text, "lorem ipsum dolor\n" * 30 + text):
        redacted = Redactor().redact(sample)
        assert "hunter2hunter2" not in redacted
        assert "dXNlcjpodW50ZXIy" not in redacted


@given(st.text(), st.text())
def test_two_different_names_never_show_the_same(first: str, second: str) -> None:
    """Attack: a name crafted to look like another (an escape sequence removed, a zero-width mark, a backslash
    imitating an escape) steered an agent to the wrong file. Shown names are one-to-one with names, and hold no
    control or invisible character."""
    shown = sanitize_name(first)
    assert (shown == sanitize_name(second)) == (first == second)
    assert not any(unicodedata.category(char)[0] in "CZ" and char != " " for char in shown)


def test_a_name_with_an_escape_sequence_is_shown_escaped_not_cleaned() -> None:
    assert sanitize_name("rep\x1b[0mort.txt") == "rep\\u001b[0mort.txt"
    assert sanitize_name("a\u200bb\nc\\d") == "a\\u200bb\\u000ac\\\\d"
    assert sanitize_name("caf\udce9.txt") == "caf\\xe9.txt"
    # Found by review: invisible marks and odd spaces that are not controls showed as nothing, or as a space.
    assert sanitize_name("report\u034f.txt") == "report\\u034f.txt"
    assert sanitize_name("a\u00a0b\u3164c d") == "a\\u00a0b\\u3164c d"
    assert sanitize_name("x\U000e0100") == "x\\U000e0100"
    assert sanitize_name("\ue010" + "0") != sanitize_name("\U000e0100")


@pytest.mark.parametrize("opener", ["\x9d", "\x90", "\x98", "\x9e", "\x9f"])
def test_a_run_of_unterminated_c1_string_openers_is_cleaned_in_linear_time(opener: str) -> None:
    """Attack: a command prints 64 KiB of U+009D (OSC) with no terminator. Each opener began a try that
    scanned to the end of the text, with the GIL held: 8.5 s of a frozen server for one run_command, 26
    minutes for a search over a 1 MiB file. Four times the text now costs about four times the time, not
    16; every opener is still shown as text, none reaches the client."""

    # 16,000 and 64,000 (the attack's size), not 4,000 and 16,000: on a loaded machine the small run, under a
    # millisecond, measured 8.0x once in a full run, for a linear cost (quadratic is 16x).
    small, large = opener * 16_000, opener * 64_000
    ratio = least_cpu_s(lambda: sanitize_terminal(large)) / max(least_cpu_s(lambda: sanitize_terminal(small)), 1e-6)
    assert ratio < 8, f"4x the text took {ratio:.1f}x the time: quadratic"
    assert sanitize_terminal(opener + "title" + opener) == f"\\x{ord(opener):02x}title\\x{ord(opener):02x}"
    assert sanitize_terminal(f"a{opener}x{opener}8;;http://evil\x07b") == f"a\\x{ord(opener):02x}xb"

"""Redaction and terminal sanitising (corpus entries A095, A097, A098, A100, A101)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bastion.safety.errors import ConfigError
from bastion.safety.redact import STREAM_HOLD_CAP_CHARS, Redactor, sanitize_terminal

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

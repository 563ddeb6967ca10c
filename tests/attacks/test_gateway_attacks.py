"""The attack corpus's `deploy.ssh` entries, replayed against a real sshd with bastion's forced command.

What this proves: each entry that carries an SSH_ORIGINAL_COMMAND, sent through the raw
OpenSSH client and through asyncssh with the gateway's own key, is refused by dispatch.py
with exit 126, one line on stderr, and a `refused` record (with the exact request) in the
host's dispatch log, and nothing runs. The NUL entry never reaches dispatch.py: sshd drops
the connection (asyncssh), and no OS lets the ssh CLI carry a NUL in its argv. The channel
entries (pty, port forwarding, client environment) are refused or contained by sshd's
`restrict` and dispatch's clean environment. What it does not prove: that inputs outside
the corpus are refused; tests/gateway covers the parser's rules one by one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from tests.gateway.lab import GatewayLab

CORPUS: list[dict[str, Any]] = json.loads(Path(__file__).with_name("attack-corpus.json").read_text(encoding="utf-8"))
ENTRIES = [entry for entry in CORPUS if entry["tool"] == "deploy.ssh"]
COMMANDS = [
    e for e in ENTRIES if "SSH_ORIGINAL_COMMAND" in e["input"] and "\x00" not in e["input"]["SSH_ORIGINAL_COMMAND"]
]
NUL = [e for e in ENTRIES if "\x00" in e["input"].get("SSH_ORIGINAL_COMMAND", "")]
CHANNEL = {e["id"]: e for e in ENTRIES if "client" in e["input"]}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayLab]:
    started = GatewayLab.start(tmp_path_factory.mktemp("gateway-attacks") / "lab")
    yield started
    started.stop()


def test_corpus_is_fully_covered() -> None:
    covered = {e["id"] for e in COMMANDS} | {e["id"] for e in NUL} | set(CHANNEL)
    assert covered == {e["id"] for e in ENTRIES}
    assert len(ENTRIES) >= 15
    assert set(CHANNEL) == {"A131", "A133", "A134"}


def _assert_refused_and_recorded(lab: GatewayLab, before: int, runs: int, command: str) -> None:
    new = lab.dispatch_records()[before:]
    assert [(r["event"], r["request"]) for r in new] == [("refused", command)]
    assert len(lab.action_runs()) == runs


@pytest.mark.parametrize("entry", COMMANDS, ids=[e["id"] for e in COMMANDS])
def test_raw_ssh_command_is_refused(lab: GatewayLab, entry: dict[str, Any]) -> None:
    command = entry["input"]["SSH_ORIGINAL_COMMAND"]
    before, runs = lab.settled_count(), len(lab.action_runs())
    done = lab.ssh(command)
    assert done.returncode == 126, (entry["id"], done.stderr)
    assert done.stderr.startswith("dispatch: refused: ")
    assert done.stderr.count("\n") == 1
    assert done.stdout == ""
    _assert_refused_and_recorded(lab, before, runs, command)


@pytest.mark.anyio
@pytest.mark.parametrize("entry", COMMANDS, ids=[e["id"] for e in COMMANDS])
async def test_asyncssh_command_is_refused(lab: GatewayLab, entry: dict[str, Any]) -> None:
    command = entry["input"]["SSH_ORIGINAL_COMMAND"]
    before, runs = lab.settled_count(), len(lab.action_runs())
    async with asyncssh.connect("127.0.0.1", **lab.asyncssh_options()) as conn:
        done = await conn.run(command, check=False)
    assert done.exit_status == 126, entry["id"]
    assert "dispatch: refused: " in str(done.stderr)
    _assert_refused_and_recorded(lab, before, runs, command)


@pytest.mark.anyio
@pytest.mark.parametrize("entry", NUL, ids=[e["id"] for e in NUL])
async def test_nul_never_reaches_dispatch(lab: GatewayLab, entry: dict[str, Any]) -> None:
    command = entry["input"]["SSH_ORIGINAL_COMMAND"]
    before, runs = lab.settled_count(), len(lab.action_runs())
    with pytest.raises(ValueError, match="null"):
        lab.ssh(command)
    log_before = len(lab.sshd_log.read_text())
    async with asyncssh.connect("127.0.0.1", **lab.asyncssh_options()) as conn:
        # sshd answers a NUL inside the exec request by dropping the connection.
        with pytest.raises(asyncssh.ConnectionLost):
            await conn.run(command, check=False)
    assert "session_exec_req: parse packet" in lab.sshd_log.read_text()[log_before:]
    assert len(lab.dispatch_records()) == before
    assert len(lab.action_runs()) == runs


def test_a131_pty_is_refused(lab: GatewayLab) -> None:
    before, runs = lab.settled_count(), len(lab.action_runs())
    done = lab.ssh("status biscuit", options=("-tt",))
    assert "PTY allocation request failed" in done.stderr
    assert done.returncode != 0
    assert len(lab.dispatch_records()) == before
    assert len(lab.action_runs()) == runs


def test_a133_local_forward_is_refused(lab: GatewayLab) -> None:
    data, err = lab.probe_local_forward()
    assert data == b""
    assert "administratively prohibited" in err


def test_a134_client_environment_is_contained(lab: GatewayLab) -> None:
    runs = len(lab.action_runs())
    done = lab.ssh("env", options=("-o", "SetEnv=LD_PRELOAD=/tmp/evil.so BASTION_LEAK_Z=1"))
    assert done.returncode == 0
    env = lab.action_runs()[runs]["env"]
    assert "LD_PRELOAD" not in env
    assert set(env) == {"PATH", "LANG"}

"""Fault: the production host's sshd stops while three clients call the gateway, then comes back.

The host is the gateway lab's real OpenSSH server on loopback (tests/gateway/lab.py); bastion is a real
`bastion serve --http` over the lab's config, with a 3-second call timeout. Two ways sshd stops:
frozen (SIGSTOP of sshd and every session it runs: a hung host, the TCP connection stays open) and
killed (SIGKILL of the same tree: a crashed host, the connection is reset). What this proves: every
call made while it is down is answered with a typed error (TIMEOUT or UNAVAILABLE) within its time
limits, never a hang or a traceback; calls made after sshd is back work, over the same server; the
audit log verifies and every answer is in it once. What it does not prove: a host that comes back
with another host key (tests/gateway/test_gateway_tools.py refuses that).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from mcp import Client

from bastion.safety.audit import verify
from tests.gateway.lab import GatewayLab, variant
from tests.helpers import free_port

from .fault_server import Load, Served, answered_calls_are_logged, descendants, internal_errors, until

pytestmark = [pytest.mark.anyio]

CLIENTS = 3
CALL_TIMEOUT_S = 3
CONNECT_TIMEOUT_S = 3
# A call that started while the host was up may wait out both (connect, then the action).
BOUND_S = CALL_TIMEOUT_S + CONNECT_TIMEOUT_S + 5


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[GatewayLab]:
    started = GatewayLab.start(tmp_path / "lab")
    yield started
    for pid, _ in descendants(started.process.pid if started.process else 0):
        _signal(pid, signal.SIGCONT)
    if started.process is not None:
        _signal(started.process.pid, signal.SIGCONT)
    started.stop()


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _served_config(lab: GatewayLab) -> Path:
    port = free_port()
    path = variant(lab, "bastion-faults.toml", "call_timeout_s = 20", f"call_timeout_s = {CALL_TIMEOUT_S}")
    text = path.read_text().replace("connect_timeout_s = 10", f"connect_timeout_s = {CONNECT_TIMEOUT_S}")
    http = f'[http]\nlisten = "127.0.0.1:{port}"\npublic_url = "http://127.0.0.1:{port}"\nauth = false\n'
    path.write_text(text.replace("[[gateway]]", f"{http}\n[[gateway]]", 1))
    return path


async def _status_calls(timed: list[float], load: Load, client: Client, index: int) -> None:
    while not load.stop.is_set():
        started = time.monotonic()
        await load.call(client, "biscuit_status", project="biscuit")
        timed.append(time.monotonic() - started)


def _sshd_tree(lab: GatewayLab) -> list[int]:
    assert lab.process is not None
    return [lab.process.pid, *(pid for pid, _ in descendants(lab.process.pid))]


@pytest.mark.parametrize("how", ["frozen", "killed"])
async def test_sshd_stopped_mid_gateway_call_fails_typed_then_recovers(lab: GatewayLab, how: str) -> None:
    """Invariant: with the host's sshd frozen or killed under load, every gateway call ends with
    TIMEOUT or UNAVAILABLE within its bounds; once sshd is back, calls succeed on the same server."""
    server = Served(_served_config(lab))
    server.start()
    try:
        load = Load(server.mcp_url)
        timed: list[float] = []
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(load.run, CLIENTS, lambda ld, c, i: _status_calls(timed, ld, c, i))
            await until(lambda: load.codes()["OK"] >= 3 * CLIENTS, what="gateway calls before the fault")
            tree = _sshd_tree(lab)
            for pid in tree:
                _signal(pid, signal.SIGSTOP if how == "frozen" else signal.SIGKILL)
            await until(lambda: len(load.answers) - load.codes()["OK"] >= 2 * CLIENTS, BOUND_S * 3, "refusals")
            if how == "frozen":
                for pid in tree:
                    _signal(pid, signal.SIGCONT)
            else:
                assert lab.process is not None
                lab.process.wait(5)
                lab.restart_sshd()
            ok_again = load.codes()["OK"]
            await until(lambda: load.codes()["OK"] >= ok_again + 3 * CLIENTS, BOUND_S * 3, "calls after sshd is back")
            load.stop.set()
        assert load.broken == []
        assert internal_errors(server.log()) == []
    finally:
        server.stop()
    assert set(load.codes()) <= {"OK", "TIMEOUT", "UNAVAILABLE"}, load.codes()
    assert max(timed) < BOUND_S, sorted(timed)[-5:]
    audit = lab.root / "state" / "audit.jsonl"
    report = verify(audit)
    assert report.ok, report.first_error
    answered_calls_are_logged(load.answers, audit)
    print(load.summary(f"sshd {how}"), f"; slowest as the client saw it {max(timed):.1f} s")

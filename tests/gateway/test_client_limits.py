"""The gateway client's limits under hostile callers and hung hosts, against the real sshd lab.

What this proves: a caller that abandons slow calls (it cancels them, or they pass call_timeout_s)
while the host keeps running them (dispatch.py lets an action finish when its client is gone) holds
at most `CALLER_SHARE` of bastion's sessions, each counted until the host closes its channel; past
that it is refused (RESOURCE_LIMIT, saying why) while another caller's calls still run, and its
sessions come back once the host's actions end. Parallel calls to a host that accepts TCP and never
answers share one connect and end within call_timeout_s, not one connect_timeout_s each. A failure
handled late on an old connection does not cut the connection a newer call opened. What it does not
prove: a second SSH connection when the host's MaxSessions is lower (bastion refuses with the reason).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import asyncssh
import pytest
from mcp import Client

from bastion.app import Services, build_server, build_services
from bastion.config import load_config
from bastion.gateway.actions import build_command
from bastion.gateway.client import GatewayClient
from bastion.safety.audit import verify
from bastion.safety.redact import Redactor
from tests.helpers import call

from .lab import DEADLINE_S, GatewayLab, HeldLab, variant

pytestmark = pytest.mark.anyio

CALLER_SHARE = 4  # bastion.gateway.client.CALLER_SHARE: half of its 8 sessions


@asynccontextmanager
async def two_clients(config: Path) -> AsyncIterator[tuple[Client, Client, Services]]:
    """The reader (the attacker, gateway:read) and an operator: two callers of one server."""
    services = build_services(load_config(config))
    try:
        async with (
            Client(build_server(services, caller="reader")) as reader,
            Client(build_server(services, caller="operator")) as operator,
        ):
            yield reader, operator, services
    finally:
        services.close()


async def abandon(client: Client, held: HeldLab) -> dict[str, object] | None:
    """Call the held action and cancel the call once it runs on the host; the result if it ended first."""
    before = held.running()
    ended: list[dict[str, object]] = []
    with anyio.fail_after(DEADLINE_S):
        async with anyio.create_task_group() as tasks:

            async def go() -> None:
                ended.append(await call(client, "biscuit_sleep"))

            tasks.start_soon(go)
            while not ended and held.running() == before:
                await anyio.sleep(0.02)
            tasks.cancel_scope.cancel()
    return ended[0] if ended else None


@pytest.mark.parametrize("how", ["cancelled", "timed_out"])
async def test_reader_abandoning_slow_calls_cannot_block_the_gateway(held: HeldLab, how: str) -> None:
    """Invariant: the calls one caller gave up on hold at most its share of the sessions until the
    host ends them; another caller still gets through, and the share comes back afterwards."""
    config = held.lab.config_path
    if how == "timed_out":
        config = variant(held.lab, "bastion-short.toml", "call_timeout_s = 20", "call_timeout_s = 1")
    async with two_clients(config) as (reader, operator, services):
        refused = []
        for _ in range(12):
            if how == "cancelled":
                result = await abandon(reader, held)
            else:
                with anyio.fail_after(DEADLINE_S):
                    result = await call(reader, "biscuit_sleep")
                assert result["code"] in ("TIMEOUT", "RESOURCE_LIMIT"), result
            if result is not None and result["code"] == "RESOURCE_LIMIT":
                refused.append(result)
        # The reader holds its share, no more; the rest were refused, naming why.
        assert held.running() == CALLER_SHARE
        assert len(refused) == 12 - CALLER_SHARE
        assert "abandoned" in str(refused[0]["reason"])
        # Another caller is not blocked: its calls run, several at once too.
        with anyio.fail_after(DEADLINE_S):
            codes: list[object] = []
            async with anyio.create_task_group() as tasks:
                for _ in range(CALLER_SHARE):
                    tasks.start_soon(lambda: _status(operator, codes))
        assert codes == ["OK"] * CALLER_SHARE
        # Once the host ended the abandoned actions, the reader's sessions are its own again.
        held.settle()
        with anyio.fail_after(DEADLINE_S):
            while (again := await call(reader, "biscuit_status", project="biscuit"))["code"] == "RESOURCE_LIMIT":
                await anyio.sleep(0.02)
        assert again["ok"], again
        audit = services.config.audit_path
    assert verify(audit).ok


async def _status(client: Client, codes: list[object]) -> None:
    codes.append((await call(client, "biscuit_status", project="biscuit"))["code"])


@pytest.fixture
def hung_host() -> Iterator[tuple[int, list[socket.socket]]]:
    """A TCP port that accepts and never says a word (a frozen host); yields it and the accepted sockets."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.05)  # the accept loop checks `stop` this often
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        stop.set()
        thread.join(timeout=DEADLINE_S)
        server.close()
        for conn in accepted:
            conn.close()


def _hung_config(lab: GatewayLab, port: int, connect_s: int, call_s: int) -> Path:
    path = variant(lab, f"bastion-hung-{connect_s}-{call_s}.toml", f"port = {lab.port}", f"port = {port}")
    text = path.read_text().replace("connect_timeout_s = 10", f"connect_timeout_s = {connect_s}")
    path.write_text(text.replace("call_timeout_s = 20", f"call_timeout_s = {call_s}"))
    return path


async def test_parallel_calls_to_a_hung_host_share_one_connect(
    lab: GatewayLab, hung_host: tuple[int, list[socket.socket]]
) -> None:
    """Invariant: calls waiting on one connect get its answer; none waits a connect_timeout_s of its own
    behind the others (12 calls ended at 1, 2, ... 12 s)."""
    port, accepted = hung_host
    config = _hung_config(lab, port, connect_s=1, call_s=3)
    services = build_services(load_config(config))
    try:
        async with Client(build_server(services, caller="a")) as one, Client(build_server(services, caller="b")) as two:
            ended: list[tuple[float, object]] = []
            started = time.monotonic()

            async def status(client: Client) -> None:
                result = await call(client, "biscuit_status", project="biscuit")
                ended.append((time.monotonic() - started, result["code"]))

            with anyio.fail_after(DEADLINE_S):
                async with anyio.create_task_group() as tasks:
                    for index in range(12):
                        tasks.start_soon(status, one if index % 2 else two)
    finally:
        services.close()
    assert [code for _, code in ended] == ["TIMEOUT"] * 12
    assert len(accepted) == 1  # one connect answered all twelve
    assert max(took for took, _ in ended) < 3 + 1.5  # within call_timeout_s (and a margin for a loaded machine)


async def test_call_timeout_covers_the_connect(lab: GatewayLab, hung_host: tuple[int, list[socket.socket]]) -> None:
    """Invariant: a call's whole wait is under call_timeout_s, the connect included."""
    port, _ = hung_host
    config = _hung_config(lab, port, connect_s=20, call_s=1)
    services = build_services(load_config(config))
    try:
        async with Client(build_server(services, caller="a")) as client:
            started = time.monotonic()
            with anyio.fail_after(DEADLINE_S):
                result = await call(client, "biscuit_status", project="biscuit")
            took = time.monotonic() - started
    finally:
        services.close()
    assert result["code"] == "TIMEOUT", result
    assert "nothing was sent" in str(result["reason"])
    assert took < 1 + 3  # not connect_timeout_s (20 s)


async def test_late_failure_on_an_old_connection_does_not_cut_the_new_one(held: HeldLab) -> None:
    """Invariant: a call handling the loss of connection 1 after another call opened connection 2
    closes connection 1 only; the call running on connection 2 ends normally."""
    gateway = load_config(held.lab.config_path).gateway[0]
    client = GatewayClient(gateway, Redactor())
    sleep = build_command(gateway.action_by_name("sleep"), {})  # type: ignore[arg-type]
    try:
        old = await client.connection()
        old.close()
        await old.wait_closed()
        results = []
        with anyio.fail_after(DEADLINE_S):
            async with anyio.create_task_group() as tasks:

                async def run() -> None:
                    results.append(await client.call(sleep, caller="b"))

                tasks.start_soon(run)
                while not held.running():
                    await anyio.sleep(0.02)
                new = await client.connection()
                assert new is not old
                client._drop(old)  # the first call's late failure handling
                held.release.touch()
        assert not new.is_closed()
        assert [r.exit_status for r in results] == [0]
    finally:
        await client.close()


def test_only_the_hosts_refusal_to_open_a_session_counts_as_nothing_sent() -> None:
    """Attack (a review of the spending fix, reproduced with a proxy delaying sshd's answers): the connection
    closed while the exec request's answer was on its way, and asyncssh raised ChannelOpenError("Session
    request failed") although sshd had run the deploy; bastion took it for a refused open, sent the deploy
    again (or gave its approval back) and the host ran it twice. Invariant: only the host's own open
    refusals (RFC 4254 5.1 codes) mean nothing was sent; asyncssh's session-request failures do not."""
    from bastion.gateway import client

    for code in (
        asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED,
        asyncssh.OPEN_CONNECT_FAILED,
        asyncssh.OPEN_UNKNOWN_CHANNEL_TYPE,
        asyncssh.OPEN_RESOURCE_SHORTAGE,
    ):
        assert client._refused_open(asyncssh.ChannelOpenError(code, "refused"))
    for code in (asyncssh.OPEN_REQUEST_SESSION_FAILED, asyncssh.OPEN_REQUEST_PTY_FAILED):
        assert not client._refused_open(asyncssh.ChannelOpenError(code, "Session request failed"))
    assert not client._refused_open(OSError("connection lost"))

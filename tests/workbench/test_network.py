"""Sandbox egress end to end: a real sandbox, the forwarder inside, the proxy on the host,
a real HTTP server on the host's loopback; and what a program that ignores the proxy gets."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import DEFAULT_BLOCKED_RANGES, load_config
from bastion.safety.audit import verify
from bastion.safety.errors import Unavailable
from bastion.workbench import network as network_module
from tests.helpers import call, create, sh

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

FETCH_ARGV = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
FETCH = (
    "python3 -c 'import sys, urllib.request; "
    'print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())\' "{url}"'
)


BODY = b"hello from the host"
HITS: list[str] = []  # the paths the server was asked for: a refusal must add none


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        HITS.append(self.path)
        body = BODY
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://denied.test/")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def web() -> Iterator[int]:
    HITS.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


EGRESS_WAIT_S = 10.0


@contextlib.asynccontextmanager
async def network_client(config_path: Path, network_toml: str) -> AsyncIterator[Client]:
    config_path.write_text(config_path.read_text().replace("[sandboxes.limits]", network_toml + "\n[sandboxes.limits]"))
    services = build_services(load_config(config_path))
    try:
        async with Client(build_server(services, caller="test")) as client:
            yield client
    finally:
        services.close()


@pytest.fixture
async def net_client(demo_config_path: Path, web: int) -> AsyncIterator[Client]:
    """The demo config, plus: allowed.test and denied.test name the host's loopback, which
    this test un-blocks (the default blocks it); the ceiling allows allowed.test only."""
    blocked = [r for r in DEFAULT_BLOCKED_RANGES if r != "127.0.0.0/8"]
    extra = f"""
[sandboxes.network]
allow = ["allowed.test:{web}", "metadata.test"]
blocked_ranges = {json.dumps(blocked)}
hosts = {{ "allowed.test" = ["127.0.0.1"], "denied.test" = ["127.0.0.1"], "metadata.test" = ["169.254.169.254"] }}
"""
    async with network_client(demo_config_path, extra) as client:
        yield client


async def egress_records_once(config_path: Path, count: int) -> list[dict[str, Any]]:
    """The egress records once there are `count`: a connection's record is written as the proxy sees it end,
    which can be just after the command that made it has returned (curl's last connection, closed at its exit).
    Bounded: what is still missing after EGRESS_WAIT_S fails the assertion that counts them."""
    with anyio.move_on_after(EGRESS_WAIT_S):
        while len(egress_records(config_path)) < count:
            await anyio.sleep(0.02)
    return egress_records(config_path)


def egress_records(config_path: Path) -> list[dict[str, Any]]:
    audit = config_path.parent / "state" / "audit.jsonl"
    assert verify(audit).ok
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    return [record for record in lines if record.get("event") == "egress"]


async def test_an_allowed_destination_is_reached_through_the_proxy(net_client: Client, web: int) -> None:
    sandbox = await create(net_client, network_allow=[f"allowed.test:{web}"])
    result = await sh(net_client, sandbox, FETCH.format(url=f"http://allowed.test:{web}/"))
    assert result["detail"]["stdout"] == "hello from the host\n", result


async def test_refusals_are_answered_and_audited(net_client: Client, demo_config_path: Path, web: int) -> None:
    sandbox = await create(net_client, network_allow=[f"allowed.test:{web}", "metadata.test"])
    allowed = await sh(net_client, sandbox, FETCH.format(url=f"http://allowed.test:{web}/"))
    assert allowed["detail"]["stdout"] == BODY.decode() + "\n", allowed
    denied = await sh(net_client, sandbox, FETCH.format(url=f"http://denied.test:{web}/"))
    assert "403" in denied["detail"]["stderr"]
    metadata = await sh(net_client, sandbox, FETCH.format(url="http://metadata.test/latest/meta-data/"))
    assert "403" in metadata["detail"]["stderr"]
    redirect = await sh(net_client, sandbox, FETCH.format(url=f"http://allowed.test:{web}/redirect"))
    assert "403" in redirect["detail"]["stderr"]
    assert HITS == ["/", "/redirect"], "a refused destination was reached"
    # One record per attempt: the redirect is followed on a new connection, checked on its own. A
    # connection's record is written as it ends, and curl ends the redirect's two connections together
    # when it exits: those two come in either order, and so may the first allowed one and the next refusal.
    records = await egress_records_once(demo_config_path, 5)
    seen = [(r["domain"], r["port"], r["decision"]) for r in records]
    assert sorted(seen[:3]) == [
        ("allowed.test", web, "allow"),
        ("denied.test", web, "deny"),
        ("metadata.test", 80, "deny"),
    ]
    assert sorted(seen[3:]) == [("allowed.test", web, "allow"), ("denied.test", 80, "deny")], seen
    assert all(r["sandbox"] == sandbox for r in records)
    fetched = records[0]
    assert fetched["bytes_down"] > len(BODY), fetched  # the response, head and body
    assert fetched["bytes_up"] > 0, fetched
    assert all(r["bytes_up"] == r["bytes_down"] == 0 for r in records if r["decision"] == "deny"), records
    assert records[2]["address"] == "169.254.169.254", records[2]


async def test_an_allowed_name_resolving_to_loopback_is_refused(demo_config_path: Path, web: int) -> None:
    """DNS rebinding: with the default blocked ranges, a name the ceiling and the sandbox allow
    still never leads to the host's loopback, where the web server listens."""
    extra = f"""
[sandboxes.network]
allow = ["allowed.test:{web}"]
hosts = {{ "allowed.test" = ["127.0.0.1"] }}
"""
    async with network_client(demo_config_path, extra) as client:
        sandbox = await create(client, network_allow=[f"allowed.test:{web}"])
        result = await sh(client, sandbox, FETCH.format(url=f"http://allowed.test:{web}/"))
        assert "403" in result["detail"]["stderr"], result
        assert "blocked range 127.0.0.0/8" in result["detail"]["stderr"], result
    assert HITS == [], "the loopback server was reached"
    records = egress_records(demo_config_path)
    assert [(r["domain"], r["decision"], r["address"]) for r in records] == [("allowed.test", "deny", "127.0.0.1")]


async def test_a_program_that_ignores_the_proxy_has_no_route(net_client: Client, web: int) -> None:
    sandbox = await create(net_client, network_allow=[f"allowed.test:{web}"])
    code = (
        f"import socket\nfor host, port in (('127.0.0.1', {web}), ('169.254.169.254', 80), ('1.1.1.1', 53)):\n"
        "    try:\n        socket.create_connection((host, port), timeout=2); print('OPEN', host)\n"
        "    except OSError as exc:\n        print('closed', host, type(exc).__name__)"
    )
    result = await call(net_client, "execute_code", code=code, sandbox_id=sandbox)
    assert "OPEN" not in result["detail"]["stdout"], result
    assert result["detail"]["stdout"].count("closed") == 3


async def test_no_network_by_default_and_the_ceiling_holds(net_client: Client) -> None:
    sandbox = await create(net_client)
    status = await call(net_client, "get_sandbox_status", sandbox_id=sandbox)
    assert status["detail"]["network"] == []
    env = await sh(net_client, sandbox, "env")
    assert "PROXY" not in env["detail"]["stdout"]
    wider = await call(net_client, "create_sandbox", network_allow=["evil.example.com"])
    assert wider["code"] == "POLICY_DENIED"
    malformed = await call(net_client, "create_sandbox", network_allow=["http://x/"])
    assert malformed["code"] == "INVALID_REQUEST"


async def test_closing_a_sandbox_stops_its_proxy(net_client: Client, web: int) -> None:
    first = await create(net_client, network_allow=[f"allowed.test:{web}"])
    second = await create(net_client, network_allow=[f"allowed.test:{web}"])
    closed = await call(net_client, "close_sandbox", sandbox_id=first)
    assert closed["ok"], closed
    result = await sh(net_client, second, FETCH.format(url=f"http://allowed.test:{web}/"))
    assert result["detail"]["stdout"] == "hello from the host\n", result


async def test_a_cancelled_install_leaves_no_registry_access(demo_config_path: Path, web: int) -> None:
    """The registry is reachable only while an install runs, even when the install is cancelled
    the way the SDK cancels a request (an anyio cancel scope, which cancels every later await)."""
    _with_loopback_names(demo_config_path, "registry", "registry.test", web)
    services = build_services(load_config(demo_config_path))
    registry = services.config.sandboxes.network.registry_rules
    fetch = ("python3", "-c", FETCH_ARGV, f"http://registry.test:{web}/")
    try:
        box = await services.sandboxes.create(owner="test")
        async with box.network.widened(box.workspace, registry):
            during = await box.workspace.run_argv("/usr/bin/python3", fetch, timeout_s=20)
        assert during.stdout == BODY.decode() + "\n", during
        with anyio.CancelScope() as scope:
            async with box.network.widened(box.workspace, registry):
                scope.cancel()
                await anyio.sleep(5)
        assert scope.cancelled_caught
        after = await box.workspace.run_argv("/usr/bin/python3", fetch, timeout_s=20)
        assert "403" in after.stderr, after
        assert HITS == ["/"], HITS
    finally:
        services.close()


async def test_an_install_whose_forwarder_fails_to_start_leaves_no_registry_access(
    demo_config_path: Path, web: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: `widened` opened the registry (the proxy's rules widened) before it entered the
    block that narrows them again, so an open that failed after the widening (the forwarder not starting:
    an agent can kill it, its own uid, and hold its port) left the registry reachable for good.
    Invariant: the proxy's rules are the sandbox's own again, and the failure is a typed refusal."""
    _with_loopback_names(demo_config_path, "registry", "registry.test", web)
    services = build_services(load_config(demo_config_path))
    registry = services.config.sandboxes.network.registry_rules

    try:
        box = await services.sandboxes.create(owner="test")
        monkeypatch.setattr(network_module, "_start_forwarder", _no_forwarder)
        with pytest.raises(Unavailable, match="injected"):
            async with box.network.widened(box.workspace, registry):
                pytest.fail("the block ran without a forwarder")
        proxies = services.sandboxes._egress._proxy._proxies  # type: ignore[union-attr]
        assert proxies[box.id].rules == ()  # the sandbox's own: none
    finally:
        services.close()


async def test_a_create_whose_network_fails_to_open_leaves_no_fd_mount_or_loop_device(
    demo_config_path: Path, web: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: when a create's network did not open (its forwarder not starting, or the call
    cancelled meanwhile: a client can do that on purpose), the workspace's jail kept its fd on the
    sandbox's folder, the root of its disk: the unmount went lazy, and the disk, its loop device and its
    image stayed until the server restarted, once per attempt. Invariant: the refusal is typed, and no
    fd, mount or loop device of that sandbox is left."""
    _with_loopback_names(demo_config_path, "allow", "allowed.test", web)
    services = build_services(load_config(demo_config_path))

    sandboxes_dir = str(services.config.sandboxes_dir)
    try:
        monkeypatch.setattr(network_module, "_start_forwarder", _no_forwarder)
        with pytest.raises(Unavailable, match="injected"):
            await services.sandboxes.create(owner="test", network_allow=[f"allowed.test:{web}"])
        held = [fd for fd, target in _fd_targets().items() if target.startswith(sandboxes_dir + "/sb-")]
        assert held == []
        assert sandboxes_dir + "/sb-" not in Path("/proc/self/mountinfo").read_text()
        assert _loops_backed_from(sandboxes_dir) == []  # other tests' loop devices may come and go meanwhile
    finally:
        services.close()


class _Endless(http.server.BaseHTTPRequestHandler):
    """An allowed destination as fast as the host's loopback, with a body that never ends."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(1 << 40))
        self.end_headers()
        chunk = bytes(256 * 1024)
        with contextlib.suppress(OSError):
            while True:
                self.wfile.write(chunk)

    def log_message(self, *args: Any) -> None:
        pass


FLOOD = """
import os, socket, sys, threading, time
host, port = os.environ["HTTP_PROXY"].split("//")[1].rstrip("/").split(":")
url, seconds, total = sys.argv[1], float(sys.argv[2]), []
def pull():
    sock = socket.create_connection((host, int(port)))
    sock.sendall(("GET %s HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n" % url).encode())
    got, end = 0, time.monotonic() + seconds
    while time.monotonic() < end and (data := sock.recv(1 << 20)):
        got += len(data)
    total.append(got)
threads = [threading.Thread(target=pull) for _ in range(8)]
for thread in threads: thread.start()
for thread in threads: thread.join()
print(sum(total))
"""
RATE = 4 * 1024 * 1024
BURST = 1024 * 1024
FLOOD_S = 3.0


async def test_a_sandbox_pulling_a_fast_destination_over_many_connections_is_held_to_its_byte_rate(
    demo_config_path: Path, web: int
) -> None:
    """Found by attack: code in one sandbox pulled an allowed destination's endless body over 8 connections; the
    proxy's relay, one thread of the server in the server's cgroup, moved 1.3 GB/s, half a core outside the
    sandbox's `cpu_cores`, and another sandbox's fetches through its own proxy went from a p90 of 4 to 8 ms to 35
    to 48 ms. Invariant: the sandbox's connections together move no more than its byte budget (the burst, the
    rate, and at most one splice each past it), and another sandbox, with a budget of its own, still fetches."""
    endless = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Endless)
    endless.daemon_threads = True
    threading.Thread(target=endless.serve_forever, daemon=True).start()
    fast = endless.server_address[1]
    blocked = [r for r in DEFAULT_BLOCKED_RANGES if r != "127.0.0.0/8"]
    extra = f"""
[sandboxes.network]
allow = ["allowed.test:{web}", "fast.test:{fast}"]
blocked_ranges = {json.dumps(blocked)}
hosts = {{ "allowed.test" = ["127.0.0.1"], "fast.test" = ["127.0.0.1"] }}
bytes_per_s = {RATE}
byte_burst = {BURST}
"""
    try:
        async with network_client(demo_config_path, extra) as client:
            puller = await create(client, network_allow=[f"fast.test:{fast}"])
            other = await create(client, network_allow=[f"allowed.test:{web}"])
            await sh(client, puller, f"cat > flood.py <<'EOF'\n{FLOOD}\nEOF")
            flooded: dict[str, Any] = {}

            async def flood() -> None:
                flooded.update(await sh(client, puller, f"python3 flood.py http://fast.test:{fast}/ {FLOOD_S}"))

            async with anyio.create_task_group() as group:
                group.start_soon(flood)
                fetched = await sh(client, other, FETCH.format(url=f"http://allowed.test:{web}/"))
            assert fetched["detail"]["stdout"].strip() == BODY.decode()
            assert flooded["detail"]["exit_status"] == 0, flooded["detail"]["stderr"]
            pulled = int(flooded["detail"]["stdout"])
            most = BURST + RATE * (FLOOD_S + 1) + 8 * 1024 * 1024  # a second of slack; a splice of 1 MiB each
            assert RATE <= pulled <= most, f"{pulled / 2**20:.1f} MiB in {FLOOD_S} s at {RATE / 2**20:.0f} MiB/s"
    finally:
        endless.shutdown()
        endless.server_close()


def _fd_targets() -> dict[str, str]:
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return found


def _loops_backed_from(folder: str) -> list[str]:
    """The loop devices whose backing file lies in `folder` (its image may be deleted: "(deleted)")."""
    found = []
    for name in os.listdir("/sys/block"):
        with contextlib.suppress(OSError):
            if Path(f"/sys/block/{name}/loop/backing_file").read_text().startswith(folder + "/"):
                found.append(name)
    return found


def _with_loopback_names(config_path: Path, key: str, name: str, port: int) -> None:
    """Add `[sandboxes.network] key = ["name:port"]`, with `name` resolving to the host's loopback (un-blocked)."""
    blocked = [r for r in DEFAULT_BLOCKED_RANGES if r != "127.0.0.0/8"]
    extra = f"""
[sandboxes.network]
{key} = ["{name}:{port}"]
blocked_ranges = {json.dumps(blocked)}
hosts = {{ "{name}" = ["127.0.0.1"] }}
"""
    config_path.write_text(config_path.read_text().replace("[sandboxes.limits]", extra + "\n[sandboxes.limits]"))


async def _no_forwarder(workspace: object, socket_path: str) -> object:
    raise Unavailable("the egress forwarder did not start (injected)")

"""Kernel attacks from a shell inside a real sandbox (found by attack): memory the sandbox's cgroup never
counted (netlink queues, TCP buffers on cgroup v1), socket families that are not network-namespaced or load
kernel modules, ext4's own ioctl for an inode's generation, and fanotify on the folders sandboxes share.
Each runs through the real tools over the real MCP client, against a real root server and real bubblewrap,
in an agent sandbox (``create_sandbox``) and, where the host's files are the target, in a root-owned host
workspace whose policy allows every program (``open``: the kernel layers must hold on their own).

Each asserts the refusal, that the sandbox's ordinary networking still works afterwards (``ip``,
if_nameindex, getaddrinfo, node, an allowed destination through the egress proxy), and that nothing the
attack aimed at changed. What this does not prove: anything about a kernel bug, cgroup v2 hosts (this
host is hybrid: the v2 path is read from the code and `test_cgroups`), or inotify, which stays allowed
(see `bastion.sandbox.seccomp`).
"""

from __future__ import annotations

import array
import fcntl
import hashlib
import http.server
import json
import os
import shlex
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from bastion.config import DEFAULT_BLOCKED_RANGES, Config
from tests.helpers import DATA_ENV, call, create, demo_config_at, sh

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.bwrap,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="the identity and cgroup layers are a root server's: run as root"),
]

OPEN = "open"  # the host workspace of the config below whose policy allows every program
MIB = 1024 * 1024
# Ids of this test process's own (see test_identity_attacks): servers of other runs start at the default.
HOST_ID_RANGE = f"{0x70000000 + 0x10000 * (1 + os.getpid() % 0x7FF)}:65536"
BODY = b"hello from the host"
FS_IOC_GETVERSION = 0x80087601  # _IOR('v', 1, long)


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def web() -> Iterator[int]:
    """An HTTP server on the host's loopback: the allowed destination of the sandboxes' egress proxy."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def demo_config_path(tmp_path: Path, web: int) -> Path:
    """The demo config with ids of its own, a root-owned host workspace that allows every program, and a
    sandbox network whose allowed name is the host's loopback (which this test un-blocks)."""
    path = demo_config_at(tmp_path / "demo", DATA_ENV if (DATA_ENV / "pyvenv.cfg").is_file() else None)
    text = path.read_text(encoding="utf-8")
    assert text.count("[sandboxes]\n") == 1
    assert text.count("[sandboxes.limits]") == 1
    blocked = [r for r in DEFAULT_BLOCKED_RANGES if r != "127.0.0.0/8"]
    network = f"""[sandboxes.network]
allow = ["allowed.test:{web}"]
blocked_ranges = {json.dumps(blocked)}
hosts = {{ "allowed.test" = ["127.0.0.1"] }}

[sandboxes.limits]"""
    text = text.replace("[sandboxes]\n", f"[sandboxes]\nhost_id_range = {HOST_ID_RANGE!r}\n")
    text = text.replace("[sandboxes.limits]", network)
    (path.parent / OPEN).mkdir()
    text += f'\n[[workspace]]\nid = "{OPEN}"\npath = "{OPEN}"\n[workspace.policy]\nallow = ["*"]\n'
    path.write_text(text, encoding="utf-8")
    return path


def ran(payload: dict[str, Any]) -> dict[str, Any]:
    assert payload["ok"], payload
    found = payload["detail"]
    assert isinstance(found, dict)
    return found


async def run_python(client: Client, where: str, source: str, *args: str) -> dict[str, Any]:
    """Write `source` to a file named after its hash and run it with the sandbox's python3 (isolated, no site)."""
    name = f"probe-{hashlib.sha256(source.encode()).hexdigest()[:12]}.py"
    written = await call(client, "write_file", path=name, content=source, sandbox_id=where)
    assert written["ok"] or written["code"] == "CONFLICT", written
    return ran(await sh(client, where, shlex.join(("python3", "-I", "-S", name, *args)), timeout_s=120))


# What a sandbox's ordinary networking needs: NETLINK_ROUTE (if_nameindex, getaddrinfo's AI_ADDRCONFIG, `ip`),
# unix and loopback sockets, and (with a network) the egress proxy through the forwarder.
NETWORKING = """
import socket, sys, urllib.request
a, b = socket.socketpair()
listener = socket.create_server(("127.0.0.1", 0))
client = socket.create_connection(listener.getsockname())
print("if_nameindex", *[name for _, name in socket.if_nameindex()])
print("addrinfo", *sorted({info[4][0] for info in socket.getaddrinfo("127.0.0.1", 80, flags=socket.AI_ADDRCONFIG)}))
if len(sys.argv) > 1:
    print("egress", urllib.request.urlopen(sys.argv[1], timeout=30).read().decode())
"""
NODE_INTERFACES = 'node -e \'console.log(Object.keys(require("os").networkInterfaces()).join(" "))\''


async def assert_networking_works(client: Client, where: str, url: str | None = None) -> None:
    out = await run_python(client, where, NETWORKING, *([url] if url else []))
    lines = out["stdout"].splitlines()
    assert lines[:2] == ["if_nameindex lo", "addrinfo 127.0.0.1"], out
    if url:
        assert lines[2] == f"egress {BODY.decode()}", out
    ip = ran(await sh(client, where, "ip -o addr show lo"))
    assert "127.0.0.1/8" in ip["stdout"], ip
    if shutil.which("node"):
        node = ran(await sh(client, where, NODE_INTERFACES))
        assert node["stdout"].split() == ["lo"], node


FAMILIES = """
import errno, resource, socket
def attempt(make):
    try:
        make().close()
        return "OK"
    except OSError as exc:
        return errno.errorcode[exc.errno]
families = {"vsock": 40, "packet": 17, "alg": 38, "key": 15, "tipc": 30, "bluetooth": 31, "rds": 21}
for name, family in families.items():
    print(name, attempt(lambda: socket.socket(family, socket.SOCK_SEQPACKET)))
print("socketpair_tipc", attempt(lambda: socket.socketpair(30, socket.SOCK_SEQPACKET)[0]))
print("netlink_usersock", attempt(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 2)))
print("netlink_audit", attempt(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 9)))
print("netlink_route", attempt(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)))
print("nofile", *resource.getrlimit(resource.RLIMIT_NOFILE))
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 20000))
    print("raise OK")
except ValueError:
    print("raise refused")
"""
FAMILIES_REFUSED = {
    "vsock": "EAFNOSUPPORT",
    "packet": "EAFNOSUPPORT",
    "alg": "EAFNOSUPPORT",
    "key": "EAFNOSUPPORT",
    "tipc": "EAFNOSUPPORT",
    "bluetooth": "EAFNOSUPPORT",
    "rds": "EAFNOSUPPORT",
    "socketpair_tipc": "EAFNOSUPPORT",
    "netlink_usersock": "EPROTONOSUPPORT",
    "netlink_audit": "EPROTONOSUPPORT",
    "netlink_route": "OK",
    "nofile": "1024 4096",
    "raise": "refused",
}


async def test_netlink_usersock_flood_and_vsock_sockets_are_refused(client: Client, web: int) -> None:
    """Attack (found by attack): 1,500 NETLINK_USERSOCK sockets sending to themselves queued 281 MB (737 MiB
    gone from the host) with the sandbox's cgroup at 5 of 128 MiB, under the server's open-file limit of
    20,000; AF_VSOCK sockets, not network-namespaced, held a vsock port host-wide. Invariant: in an agent
    sandbox with a network and in a host workspace, netlink opens for NETLINK_ROUTE only (others:
    EPROTONOSUPPORT), AF_VSOCK and every family but unix, inet, inet6 and netlink fail with EAFNOSUPPORT,
    the open-file limit is 1024 (soft) / 4096 (hard) and cannot be raised; and afterwards `ip`,
    if_nameindex, getaddrinfo, node and the egress proxy still work. Does not prove a sandbox's AF_UNIX
    queues are counted (bounded per process by the open-file limit)."""
    box = await create(client, network_allow=[f"allowed.test:{web}"])
    for where in (box, OPEN):
        out = await run_python(client, where, FAMILIES)
        seen = dict(line.split(" ", 1) for line in out["stdout"].splitlines())
        assert seen == FAMILIES_REFUSED, (where, out)
    await assert_networking_works(client, box, f"http://allowed.test:{web}/")
    await assert_networking_works(client, OPEN)


TCP_FILL = """
import socket
listener = socket.create_server(("127.0.0.1", 0), backlog=64)
pairs, queued = [], 0
for _ in range(60):
    sender = socket.create_connection(listener.getsockname())
    pairs.append((sender, listener.accept()[0]))
    sender.setblocking(False)
    try:
        while True:
            queued += sender.send(b"x" * 65536)
    except BlockingIOError:
        pass
print(queued >> 20)
"""


async def test_loopback_tcp_buffers_past_the_memory_limit_are_refused(client: Client) -> None:
    """Attack (found by attack): on cgroup v1 TCP buffers were charged to no group: 54 loopback pairs queued
    402 MB with the sandbox at 4 of 128 MiB, and tcp_mem is one budget for every TCP socket on the host (the
    HTTP transport, the gateway's SSH). Invariant: in a 64 MiB sandbox 60 pairs queue no more than about
    64 MiB (v1: memory.kmem.tcp.limit_in_bytes is the memory limit; v2: memory.max counts them); the
    sandbox runs commands afterwards. Does not prove the host's tcp_mem cannot be reached by many sandboxes
    together (each may hold its memory limit in TCP buffers on v1)."""
    box = await create(client, limits={"memory_bytes": 64 * MIB})
    out = await run_python(client, box, TCP_FILL)
    assert int(out["stdout"]) <= 72, f"{out['stdout'].strip()} MiB queued in a 64 MiB sandbox"
    assert ran(await sh(client, box, "echo alive"))["stdout"] == "alive\n"


SETVERSION = """
import errno, fcntl, os, struct, sys
requests = {"EXT4_IOC_SETVERSION": 0x40086604, "EXT4_IOC32_SETVERSION": 0x40046604, "FS_IOC_SETVERSION": 0x40087602}
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDONLY)
    for name, request in requests.items():
        try:
            fcntl.ioctl(fd, request, struct.pack("q", 4242))
            print(path, name, "OK")
        except OSError as exc:
            print(path, name, errno.errorcode[exc.errno])
    os.close(fd)
"""


def generation(path: Path) -> int | None:
    """The inode's generation as the host reads it (FS_IOC_GETVERSION), or None where the file system has none."""
    fd = os.open(path, os.O_RDONLY)
    try:
        out = array.array("l", [0])
        fcntl.ioctl(fd, FS_IOC_GETVERSION, out, True)
        return out[0]
    except OSError:
        return None
    finally:
        os.close(fd)


async def test_ext4_setversion_on_host_workspace_files_is_refused(client: Client, demo_config: Config) -> None:
    """Attack (found by attack, p_setversion.py): EXT4_IOC_SETVERSION (_IOW('f', 4, long)) went around the
    FS_IOC_SETVERSION rule and changed the generation of a host workspace's files and of its folder on the
    host's ext4. Invariant: it, its 32-bit form and FS_IOC_SETVERSION fail with EPERM on a file and on the
    folder, in a host workspace and an agent sandbox; the host reads the same generations afterwards, and
    reading them inside (lsattr -v) still works. Does not prove other file systems' private ioctls are refused
    live (their numbers are checked in test_seccomp: this host has none of them mounted)."""
    workspace = demo_config.workspace_by_id(OPEN)
    assert workspace is not None
    folder = workspace.path
    (folder / "notes.txt").write_text("the administrator's file\n")
    if generation(folder / "notes.txt") is None:
        pytest.skip("the test's folder is on a file system without inode generations (not ext4)")
    box = await create(client)
    box_folder = demo_config.sandboxes_dir / box / "workspace"
    written = await call(client, "write_file", path="notes.txt", content="x\n", sandbox_id=box)
    assert written["ok"], written
    for where, host in ((OPEN, folder), (box, box_folder)):
        before = {path: generation(path) for path in (host, host / "notes.txt")}
        out = await run_python(client, where, SETVERSION, "notes.txt", ".")
        answers = {line.rsplit(" ", 1)[1] for line in out["stdout"].splitlines()}
        assert answers == {"EPERM"}, (where, out)
        assert len(out["stdout"].splitlines()) == 6, out
        assert {path: generation(path) for path in before} == before, where
        lsattr = ran(await sh(client, where, "lsattr -v notes.txt"))
        assert lsattr["stdout"].split()[0] == str(before[host / "notes.txt"]), lsattr


FANOTIFY = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.fanotify_init(0x200, os.O_RDONLY)  # FAN_CLASS_NOTIF | FAN_REPORT_FID: allowed unprivileged
print("fanotify", "OK" if fd >= 0 else errno.errorcode[ctypes.get_errno()])
fd = libc.inotify_init1(0)
print("inotify", "OK" if fd >= 0 and libc.inotify_add_watch(fd, b"/workspace", 0x100) >= 0 else "FAILED")
"""


async def test_fanotify_watch_of_the_shared_folders_is_refused(client: Client) -> None:
    """Attack (found by attack): unprivileged fanotify (Linux 5.13) would watch what the host and other
    sandboxes open in /usr and the template's environment. Invariant: fanotify_init fails with EPERM in an
    agent sandbox and a host workspace; inotify still works (kept for file watchers: see
    `bastion.sandbox.seccomp` for the leak it leaves, names of files opened in shared folders)."""
    box = await create(client)
    for where in (box, OPEN):
        out = await run_python(client, where, FANOTIFY)
        assert out["stdout"].split() == ["fanotify", "EPERM", "inotify", "OK"], (where, out)

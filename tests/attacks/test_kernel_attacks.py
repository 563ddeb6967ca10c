"""Kernel attacks from a shell inside a real sandbox (found by attack): memory the sandbox's cgroup never
counted (netlink queues, NETLINK_ROUTE's dumps included; TCP buffers on cgroup v1), socket families that
are not network-namespaced or load kernel modules, ext4's own ioctl for an inode's generation, and fanotify
on the folders sandboxes share. Each runs through the real tools over the real MCP client, against a real
root server and real bubblewrap, in an agent sandbox (``create_sandbox``) and, where the host's files are
the target, in a root-owned host workspace whose policy allows every program (``open``: the kernel layers
must hold on their own).

Each asserts the refusal, that the sandbox's ordinary networking still works afterwards (getaddrinfo,
"localhost", node's network interfaces, an allowed destination through the egress proxy; `ip` and
if_nameindex need netlink, which is refused), and that nothing the attack aimed at changed. What this does
not prove: anything about a kernel bug, cgroup v2 hosts (this host is hybrid: the v2 path is read from the
code and `test_cgroups`), or inotify, which stays allowed (see `bastion.sandbox.seccomp`).
"""

from __future__ import annotations

import array
import fcntl
import hashlib
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
from tests.helpers import DATA_ENV, TCP_FILL, call, create, demo_config_at, sh
from tests.sandbox.egress_helpers import Web

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
BODY = b"hello from the host"  # what `Web` answers
FS_IOC_GETVERSION = 0x80087601  # _IOR('v', 1, long)


@pytest.fixture
def web() -> Iterator[int]:
    """An HTTP server on the host's loopback: the allowed destination of the sandboxes' egress proxy."""
    server = Web()
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


# What a sandbox's ordinary networking needs without netlink: unix and loopback sockets, getaddrinfo (with
# AI_ADDRCONFIG glibc assumes both families when netlink is refused; "localhost" from the sandbox's /etc/hosts),
# and (with a network) the egress proxy through the forwarder.
NETWORKING = """
import socket, sys, urllib.request
a, b = socket.socketpair()
listener = socket.create_server(("127.0.0.1", 0))
client = socket.create_connection(listener.getsockname())
print("addrinfo", *sorted({info[4][0] for info in socket.getaddrinfo("127.0.0.1", 80, flags=socket.AI_ADDRCONFIG)}))
print("localhost", *sorted({info[4][0] for info in socket.getaddrinfo("localhost", 80, flags=socket.AI_ADDRCONFIG)}))
if len(sys.argv) > 1:
    print("egress", urllib.request.urlopen(sys.argv[1], timeout=30).read().decode())
"""
NODE_INTERFACES = "node -e 'console.log(JSON.stringify(require(\"os\").networkInterfaces()))'"
NODE_LOOPBACK_V4 = {
    "address": "127.0.0.1",
    "netmask": "255.0.0.0",
    "family": "IPv4",
    "mac": "00:00:00:00:00:00",
    "internal": True,
    "cidr": "127.0.0.1/8",
}
NODE_LOOPBACK_V6 = {
    "address": "::1",
    "netmask": "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
    "family": "IPv6",
    "mac": "00:00:00:00:00:00",
    "internal": True,
    "cidr": "::1/128",
    "scopeid": 0,
}


async def assert_networking_works(client: Client, where: str, url: str | None = None) -> None:
    out = await run_python(client, where, NETWORKING, *([url] if url else []))
    lines = out["stdout"].splitlines()
    assert lines[:2] == ["addrinfo 127.0.0.1", "localhost 127.0.0.1"], out
    if url:
        assert lines[2] == f"egress {BODY.decode()}", out
    if shutil.which("node"):
        node = ran(await sh(client, where, NODE_INTERFACES))
        assert json.loads(node["stdout"]) == {"lo": [NODE_LOOPBACK_V4, NODE_LOOPBACK_V6]}, node


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
    "netlink_usersock": "EAFNOSUPPORT",
    "netlink_audit": "EAFNOSUPPORT",
    "netlink_route": "EAFNOSUPPORT",
    "nofile": "1024 4096",
    "raise": "refused",
}


async def test_netlink_usersock_flood_and_vsock_sockets_are_refused(client: Client, web: int) -> None:
    """Attack (found by attack): 1,500 NETLINK_USERSOCK sockets sending to themselves queued 281 MB (737 MiB
    gone from the host) with the sandbox's cgroup at 5 of 128 MiB, under the server's open-file limit of
    20,000; AF_VSOCK sockets, not network-namespaced, held a vsock port host-wide. Invariant: in an agent
    sandbox with a network and in a host workspace, netlink of every protocol (NETLINK_ROUTE too, since
    `test_netlink_route_dump_flood_is_refused`), AF_VSOCK and every family but unix, inet and inet6 fail with
    EAFNOSUPPORT, the open-file limit is 1024 (soft) / 4096 (hard) and cannot be raised; and afterwards
    getaddrinfo, node's os.networkInterfaces() and the egress proxy still work. Does not prove a sandbox's
    AF_UNIX queues are counted (bounded per process by the open-file limit)."""
    box = await create(client, network_allow=[f"allowed.test:{web}"])
    for where in (box, OPEN):
        out = await run_python(client, where, FAMILIES)
        seen = dict(line.split(" ", 1) for line in out["stdout"].splitlines())
        assert seen == FAMILIES_REFUSED, (where, out)
    await assert_networking_works(client, box, f"http://allowed.test:{web}/")
    await assert_networking_works(client, OPEN)


# The reviewer's flood (r1), bounded: NETLINK_ROUTE sockets with a large receive buffer, sent RTM_GETLINK dumps
# (rtnetlink(7)) they never read, natively and through the 32-bit ABI; then what netlink queues in the namespace.
ROUTE_FLOOD = """
import ctypes, errno, mmap, socket, struct
def attempt(make):
    try:
        make()
        return "OK"
    except OSError as exc:
        return errno.errorcode[exc.errno]
DUMP = struct.pack("=IHHII", 32, 18, 0x301, 1, 0) + bytes(16)  # RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP
held = []
def flood(kind):
    s = socket.socket(socket.AF_NETLINK, kind, 0)
    held.append(s)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 30)
    s.bind((0, 0))
    for _ in range(200):
        s.send(DUMP, socket.MSG_DONTWAIT)
print("route_raw", attempt(lambda: [flood(socket.SOCK_RAW) for _ in range(20)]))
print("route_dgram", attempt(lambda: flood(socket.SOCK_DGRAM)))
# int 0x80 from 64-bit code: i386's socket(2) is 359 (mov eax, 359; mov ebx, family; mov ecx, type; int 0x80).
page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC, flags=mmap.MAP_PRIVATE | 0x40)
code = b"\\x53\\xb8" + (359).to_bytes(4, "little") + b"\\xbb" + (16).to_bytes(4, "little")
code += b"\\xb9" + (3).to_bytes(4, "little") + b"\\xba" + bytes(4) + b"\\xcd\\x80\\x5b\\xc3"
page[: len(code)] = code
rc = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
print("route_i386", "OK" if rc >= 0 else errno.errorcode[-rc])
rows = [line.split() for line in open("/proc/net/netlink").read().splitlines()[1:]]
print("queued", sum(int(row[4]) for row in rows))
"""


async def test_netlink_route_dump_flood_is_refused(client: Client) -> None:
    """Attack (found by review, r1): NETLINK_ROUTE was left open (for `ip`, getaddrinfo, if_nameindex), and its
    receive queues are charged to no memory cgroup: 50 sockets with SO_RCVBUF raised, sent RTM_GETLINK dumps
    they never read, held ~480 MiB of host memory with the sandbox's cgroup at 7 of 64 MiB. Invariant: in a
    64 MiB agent sandbox and in a host workspace, socket(AF_NETLINK, ..., NETLINK_ROUTE) fails with
    EAFNOSUPPORT, raw and datagram, native and through the 32-bit ABI; nothing is queued in the sandbox's
    netlink sockets afterwards (/proc/net/netlink's Rmem, the kernel's own sockets included), and getaddrinfo,
    "localhost", node's os.networkInterfaces() (through bastion's shim) and loopback servers still work. Does
    not prove the host's free memory is untouched (too noisy to measure here): it proves no netlink queue can
    be made."""
    box = await create(client, limits={"memory_bytes": 64 * MIB})
    for where in (box, OPEN):
        out = await run_python(client, where, ROUTE_FLOOD)
        seen = dict(line.split(" ", 1) for line in out["stdout"].splitlines())
        refused = {"route_raw": "EAFNOSUPPORT", "route_dgram": "EAFNOSUPPORT", "route_i386": "EAFNOSUPPORT"}
        assert seen == {**refused, "queued": "0"}, (where, out)
        assert ran(await sh(client, where, "echo alive"))["stdout"] == "alive\n"
        await assert_networking_works(client, where)


LOCALHOST_SERVERS = r"""
import subprocess, sys, time, urllib.request
server = subprocess.Popen([sys.executable, "-I", "-m", "http.server", "--bind", "localhost", "8000"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
deadline = time.monotonic() + 60
while True:
    try:
        asked = urllib.request.urlopen("http://localhost:8000/", timeout=10).status
        print("python", asked, urllib.request.urlopen("http://127.0.0.1:8000/", timeout=10).status)
        break
    except OSError as exc:
        if server.poll() is not None or time.monotonic() > deadline:
            print("python", "failed", server.poll(), exc)
            break
        time.sleep(0.05)  # the server's start, not a timing: the deadline bounds the wait
server.kill()
server.wait()
"""
NODE_LOCALHOST = (
    'node -e \'const http = require("http");'
    ' const server = http.createServer((q, r) => r.end("answered")).listen(0, "localhost", () => {'
    ' http.get({host: "localhost", port: server.address().port}, (r) => { let body = "";'
    ' r.on("data", (d) => body += d); r.on("end", () => { console.log("node", body); server.close(); }); })'
    '.on("error", (e) => { console.log("node", e.code); server.close(); }); })'
    '.on("error", (e) => console.log("node", e.code));\''
)


async def test_localhost_resolves_and_servers_bound_to_it_answer(client: Client) -> None:
    """Found by review (r1): a sandbox had no /etc/hosts, so "localhost" went to DNS, which its namespace does
    not reach (EAI_AGAIN): `python3 -m http.server --bind localhost`, node's listen(port, "localhost") and vite's
    default host failed. Invariant: in an agent sandbox and a host workspace, /etc/hosts names loopback only
    (not the host's file); getaddrinfo and node's dns.lookup resolve localhost to 127.0.0.1 alone, where a
    preview connects; a python and a node server bound to localhost answer a client that asks for localhost
    (python's on 127.0.0.1 too). Does not prove any other name resolves (none should without the egress proxy,
    which resolves on the host)."""
    box = await create(client)
    for where in (box, OPEN):
        hosts = ran(await sh(client, where, "cat /etc/hosts"))
        assert hosts["stdout"] == "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n", where
        out = await run_python(client, where, LOCALHOST_SERVERS)
        assert out["stdout"] == "python 200 200\n", (where, out)
        if shutil.which("node"):
            lookup = 'node -e \'require("dns").lookup("localhost", {all: true}, (e, a) => console.log(e && e.code,'
            lookup += ' a.map((x) => x.address).sort().join(" ")))\''
            assert ran(await sh(client, where, lookup))["stdout"] == "null 127.0.0.1\n", where
            assert ran(await sh(client, where, NODE_LOCALHOST))["stdout"] == "node answered\n", where


async def test_agent_that_drops_node_options_loses_only_the_shim(client: Client) -> None:
    """Attack: a command unsets or replaces NODE_OPTIONS (create_sandbox refuses it: test_settings), dropping
    bastion's node shim. Invariant: the shim is a convenience, not a layer: node then throws the error the
    kernel's refusal gives (ERR_SYSTEM_ERROR from uv_interface_addresses), netlink stays refused, and the
    sandbox's default environment still carries the shim for the next command."""
    box = await create(client)
    dropped = 'env -u NODE_OPTIONS node -e \'try { require("os").networkInterfaces() }'
    dropped += " catch (e) { console.log(e.code) }'"
    assert ran(await sh(client, box, dropped))["stdout"] == "ERR_SYSTEM_ERROR\n"
    replaced = "NODE_OPTIONS=--max-old-space-size=64 " + NODE_INTERFACES
    assert "ERR_SYSTEM_ERROR" in ran(await sh(client, box, replaced + " 2>&1 || true"))["stdout"]
    assert ran(await sh(client, box, 'printf %s "$NODE_OPTIONS"'))["stdout"] == "--require=/opt/bastion/netif.js"
    await assert_networking_works(client, box)


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

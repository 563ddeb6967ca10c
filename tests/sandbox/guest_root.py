"""The program a test sends a microVM guest instead of the relay: the guest's root, on purpose.

`/init` runs what the host writes on the agent port as PID 1's child with every capability (the
relay drops them for commands; this program keeps them). It tries to leave the guest and prints
what each attempt did, one JSON line after `MARKER` on the guest's serial console (the tail the
host keeps of it). Each attempt is recorded as "ok" or the errno's name, so a test can assert the exact
refusal. Standard library only: it runs on the host's /usr, from the guest. Its settings come in
front of it (`program`).
"""

from __future__ import annotations

import json

MARKER = "BASTION-ROOT-REPORT "

# Guessed 9p tags: the host's usual names for its root, /etc and shares, and the next template tags.
GUESSES = ("root", "rootfs", "host", "hostfs", "etc", "home", "share", "fs0", "ws", "ro1", "ro9", "tmp")
# (name, kind, major, minor): the host's disks if they were passed through, memory, I/O ports, KVM.
DEVICES = (
    ("sda", "b", 8, 0),
    ("vda", "b", 254, 0),
    ("nvme0n1", "b", 259, 0),
    ("loop0", "b", 7, 0),
    ("kvm", "c", 10, 232),
    ("mem", "c", 1, 1),
    ("port", "c", 1, 4),
)

SOURCE = r'''
import ctypes, errno, glob, os, select, socket, stat, struct, time

libc = ctypes.CDLL(None, use_errno=True)
P9 = "trans=virtio,version=9p2000.L,msize=262144"
MS_NOSUID, MS_NODEV, MS_REMOUNT, MNT_DETACH = 2, 4, 32, 2
HEADER = struct.Struct(">IcI")
report = {}


def attempt(call):
    try:
        call()
    except socket.timeout:
        return "timeout"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return "ok"


def mount(source, target, fstype="9p", flags=0, data=P9):
    os.makedirs(target, exist_ok=True)
    if libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def umount(target):
    libc.umount2(target.encode(), MNT_DETACH)


def write(path, data=b"root of the guest was here\n"):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path):
    with open(path, "rb") as handle:
        return handle.read(4096)


def capabilities():
    for line in open("/proc/self/status"):
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)


def nine_p():
    paths = glob.glob("/sys/bus/virtio/drivers/9pnet_virtio/virtio*/mount_tag")
    tags = sorted(open(path, "rb").read().strip(b"\0\n").decode() for path in paths)
    seen = {"workspace": sorted(os.listdir("/workspace"))}
    for tag in set(tags) - {"usr", "workspace"}:  # those two are mounted: a 9p channel takes one mount
        mount(tag, "/mnt/tag", data=P9 + ",ro")
        seen[tag] = sorted(os.listdir("/mnt/tag"))[:50]
        umount("/mnt/tag")
    guessed = {}
    for tag in GUESSES:
        guessed[tag] = attempt(lambda: mount(tag, "/mnt/guess"))
        if guessed[tag] == "ok":
            umount("/mnt/guess")
    return {"tags": tags, "seen": seen, "guessed": guessed, "anames": anames()}


def anames():
    """The workspace's channel attached with another attach name: the export's root is QEMU's, not ours."""
    umount("/workspace")
    found = {}
    for aname in ("/", "/etc", "../../../../etc", TARGET_DIR):
        done = attempt(lambda: mount("workspace", "/mnt/aname", data=P9 + ",ro,aname=" + aname))
        found[aname] = sorted(os.listdir("/mnt/aname")) if done == "ok" else done
        if done == "ok":
            umount("/mnt/aname")
    mount("workspace", "/workspace", flags=MS_NOSUID | MS_NODEV)
    return found


def read_only():
    out = {"remount_usr_rw": attempt(lambda: mount("usr", "/usr", flags=MS_REMOUNT, data=""))}
    out["create_in_usr"] = attempt(lambda: write("/usr/bastion-root-was-here"))
    python, release = "/usr/bin/python3", "/usr/lib/os-release"
    out["open_usr_file_for_writing"] = attempt(lambda: os.close(os.open(release, os.O_WRONLY | os.O_APPEND)))
    out["chmod_usr_file"] = attempt(lambda: os.chmod(python, stat.S_IMODE(os.stat(python).st_mode)))
    out["mkdir_in_usr"] = attempt(lambda: os.mkdir("/usr/bastion-root-was-here.d"))
    out["template"] = template()
    return out


def template():
    """The template's read-only folder (tag ro0), mounted read-write by root of the guest."""
    out = {"mount_ro0_rw": attempt(lambda: mount("ro0", "/mnt/ro0"))}
    if out["mount_ro0_rw"] != "ok":
        return out
    shown = "/mnt/ro0/shown.txt"
    out["read"] = read(shown).decode()
    out["overwrite"] = attempt(lambda: write(shown))
    out["truncate"] = attempt(lambda: os.truncate(shown, 0))
    out["chmod"] = attempt(lambda: os.chmod(shown, 0o777))
    out["unlink"] = attempt(lambda: os.unlink(shown))
    out["rename"] = attempt(lambda: os.rename(shown, "/mnt/ro0/moved"))
    out["mkdir"] = attempt(lambda: os.mkdir("/mnt/ro0/new"))
    out["symlink"] = attempt(lambda: os.symlink("/", "/mnt/ro0/link"))
    umount("/mnt/ro0")
    return out


def workspace():
    ws = "/workspace"
    os.symlink(TARGET, ws + "/escape-abs")
    os.symlink("../" * 16 + TARGET.lstrip("/"), ws + "/escape-up")
    os.symlink("/etc", ws + "/escape-etc")
    out = {"read_abs": attempt(lambda: read(ws + "/escape-abs"))}
    out["read_up"] = attempt(lambda: read(ws + "/escape-up"))
    out["write_abs"] = attempt(lambda: write(ws + "/escape-abs"))
    out["read_etc_hostname"] = attempt(lambda: read(ws + "/escape-etc/hostname"))
    out["dotdot_host"] = attempt(lambda: read(ws + "/.." + TARGET))
    out["mknod_block"] = attempt(lambda: os.mknod(ws + "/sda", stat.S_IFBLK | 0o666, os.makedev(8, 0)))
    out["mknod_mem"] = attempt(lambda: os.mknod(ws + "/mem", stat.S_IFCHR | 0o666, os.makedev(1, 1)))
    write(ws + "/planted")
    out["chown_root"] = attempt(lambda: os.chown(ws + "/planted", 0, 0))
    out["chmod_setuid"] = attempt(lambda: os.chmod(ws + "/planted", 0o4755))
    out["chmod_setgid"] = attempt(lambda: os.chmod(ws + "/planted", 0o2755))
    out["create_setuid"] = attempt(lambda: os.close(os.open(ws + "/made-setuid", os.O_WRONLY | os.O_CREAT, 0o4755)))
    out["mkdir_setgid"] = attempt(lambda: os.mkdir(ws + "/setgid-folder", 0o2775))
    out["listing"] = sorted(os.listdir(ws))
    return out


def system_ram():
    total = 0
    for line in open("/proc/iomem"):
        if line.endswith(" : System RAM\n") and not line.startswith(" "):
            start, end = line.split(" : ")[0].split("-")
            total += int(end, 16) - int(start, 16) + 1
    return total


def devices():
    mount("none", "/mnt/dev", "tmpfs", 0, "mode=0755")
    out = {}
    for name, kind, major, minor in DEVICES:
        path = "/mnt/dev/" + name
        os.mknod(path, (stat.S_IFBLK if kind == "b" else stat.S_IFCHR) | 0o600, os.makedev(major, minor))
        out[name] = attempt(lambda: os.close(os.open(path, os.O_RDONLY)))
    umount("/mnt/dev")
    out["block"] = sorted(os.listdir("/sys/block"))
    out["system_ram"] = system_ram()
    return out


def proc():
    return {
        "release": os.uname().release,
        "init": open("/proc/1/cmdline", "rb").read().split(b"\0")[0].decode(),
        "host_pid": attempt(lambda: read("/proc/%d/cmdline" % HOST_PID)),
        "cmdline": open("/proc/cmdline").read().strip(),
    }


def on_socket(family, kind, action, proto=0):
    """What `action(sock)` did on a new socket (or what refused the socket itself)."""
    try:
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        return "socket: " + errno.errorcode.get(exc.errno, str(exc.errno))
    sock.settimeout(5)
    try:
        return attempt(lambda: action(sock))
    finally:
        sock.close()


def network():
    inet, inet6, stream, dgram = socket.AF_INET, socket.AF_INET6, socket.SOCK_STREAM, socket.SOCK_DGRAM
    ping = b"\x08\0\xf7\xff\0\0\0\0"
    return {
        "interfaces": sorted(os.listdir("/sys/class/net")),
        "tcp_gateway": on_socket(inet, stream, lambda s: s.connect(("10.0.2.2", 80))),
        "tcp_host_loopback": on_socket(inet, stream, lambda s: s.connect(("127.0.0.1", WEB_PORT))),
        "tcp6_host_loopback": on_socket(inet6, stream, lambda s: s.connect(("::1", WEB_PORT))),
        "udp_dns": on_socket(inet, dgram, lambda s: s.sendto(b"x", ("10.0.2.3", 53))),
        "raw_icmp": on_socket(inet, socket.SOCK_RAW, lambda s: s.sendto(ping, ("10.0.2.2", 0)), socket.IPPROTO_ICMP),
        "packet_eth0": on_socket(socket.AF_PACKET, socket.SOCK_RAW, lambda s: s.bind(("eth0", 0))),
        "vsock_host": on_socket(socket.AF_VSOCK, stream, lambda s: s.connect((2, 1024))),
    }


def send(port, kind, stream, payload=b""):
    os.write(port, HEADER.pack(len(payload) + 5, kind, stream) + payload)


def ask(port, stream, host):
    """A stream forged on the egress port as root, with a request for `host`: what comes back."""
    request = "GET http://%s/ HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (host, host)
    send(port, b"C", stream)
    send(port, b"D", stream, request.encode())
    inbox, answer, deadline = b"", b"", time.monotonic() + 60
    while time.monotonic() < deadline:
        if not select.select([port], [], [], 1)[0]:
            continue
        inbox += os.read(port, 65536)
        while len(inbox) >= 9 and len(inbox) >= 4 + int.from_bytes(inbox[:4], "big"):
            size, kind, sid = HEADER.unpack(inbox[:9])
            payload, inbox = inbox[9 : 4 + size], inbox[4 + size :]
            if sid != stream:
                continue
            if kind == b"D":
                answer += payload
            elif kind in (b"F", b"X"):
                send(port, b"X", stream)
                return answer.split(b"\r\n")[0].decode() or kind.decode()
    send(port, b"X", stream)
    return "no answer: " + answer[:80].decode(errors="replace")


def egress():
    port = os.open("/dev/vport0p2", os.O_RDWR)
    try:
        return {host: ask(port, 2 * index + 1, host) for index, host in enumerate(EGRESS_HOSTS)}
    finally:
        os.close(port)


report["uid"] = os.getuid()
report["capabilities"] = capabilities()
for section in (nine_p, read_only, workspace, devices, proc, network, egress):
    try:
        report[section.__name__] = section()
    except Exception as exc:
        report[section.__name__] = "crashed: %r" % (exc,)
console = os.open("/dev/ttyS0", os.O_WRONLY | os.O_NOCTTY)
os.write(console, (MARKER + json.dumps(report, sort_keys=True) + "\n").encode())
os.close(console)
while os.read(PORT, 4096):  # stay up, as root, until the host ends the VM
    pass
'''


def program(*, target: str, web_port: int, host_pid: int, egress_hosts: tuple[str, ...]) -> bytes:
    """The attack as /init reads it from the agent port: an 8-byte length, then the source."""
    settings = {
        "MARKER": MARKER,
        "GUESSES": GUESSES,
        "DEVICES": DEVICES,
        "TARGET": target,
        "TARGET_DIR": target.rsplit("/", 1)[0],
        "WEB_PORT": web_port,
        "HOST_PID": host_pid,
        "EGRESS_HOSTS": egress_hosts,
    }
    head = "".join(f"{name} = {value!r}\n" for name, value in settings.items())
    data = ("import json\n" + head + SOURCE).encode()
    return len(data).to_bytes(8, "big") + data


def parse_report(console: str) -> dict[str, object] | None:
    """The report line in the console's text, once it is whole; None before."""
    start = console.find(MARKER)
    end = console.find("\n", start)
    if start < 0 or end < 0:
        return None
    found: dict[str, object] = json.loads(console[start + len(MARKER) : end].strip())
    return found

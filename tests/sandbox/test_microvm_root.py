"""Root inside a microVM guest, on purpose, attacks the boundary (issue 17).

Two guests boot side by side from the product's own VMM argv (`vmm_argv` through `_start_vmm`: the
workspace and /usr over 9p, a template's read-only folder, the serial ports, no NIC), each as its
own host uid, with its own cgroup. Instead of the relay, the host sends each the program of
`guest_root.py`: the guest's root with every capability, which tries to read the host's files,
reach the host's network, egress past the proxy and find the other guest, and prints what each
attempt did on its console. One boot of the pair serves every test here (a TCG boot takes ~20 s).

What this does not prove: QEMU's device emulation (virtio-9p, virtio-serial) could hold bugs a
guest reaches with raw virtqueue requests the Linux 9p client never sends; that is QEMU's to fix,
and its seccomp filter and the VMM's unprivileged uid are what stand behind it.
"""

from __future__ import annotations

import asyncio
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bastion.safety.errors import PathEscape, PolicyDenied
from bastion.safety.paths import Jail
from bastion.sandbox import microvm
from bastion.sandbox._spawn import EGRESS_DIR, SandboxSpec
from bastion.sandbox.cgroups import CgroupLayout, Limits
from bastion.sandbox.identity import DEFAULT_HOST_ID_COUNT, DEFAULT_HOST_ID_FIRST, IdentityPool
from bastion.sandbox.microvm import MicroVMBackend, MicroVMSandbox
from tests.helpers import processes_with
from tests.sandbox.egress_helpers import EgressSetup, egress_setup
from tests.sandbox.guest_root import GUESSES, parse_report, program
from tests.sandbox.microvm_helpers import BOOT_TIMEOUT_S, let_through, microvm_settings

pytestmark = [pytest.mark.microvm, pytest.mark.root]

SECRET = "host secret: the guest must never read or change this\n"
CAP_SYS_ADMIN, CAP_MKNOD, CAP_NET_RAW = 21, 27, 13


@dataclass
class Attacked:
    """What the two guests reported, and what the host saw of them and of itself after."""

    reports: dict[str, dict[str, object]]
    workspaces: dict[str, Path]
    target: Path
    shown: Path
    egress: list[tuple[str, int, str]]
    web_paths: list[str]
    web_port: int = 0
    argvs: dict[str, list[str]] = field(default_factory=dict)
    run_dirs: dict[str, Path] = field(default_factory=dict)
    owners: dict[str, tuple[int, int]] = field(default_factory=dict)
    leftovers: dict[str, object] = field(default_factory=dict)


def section(attacked: Attacked, name: str, guest: str = "a") -> dict[str, object]:
    found = attacked.reports[guest][name]
    assert isinstance(found, dict), found  # else the section crashed: its text says why
    return found


def host_traces(top: Path, layout: CgroupLayout) -> dict[str, object]:
    """What a guest could leave on the host: mounts, loop devices over our files, run folders, cgroups."""
    mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(top) in line]
    backings = Path("/sys/block").glob("loop*/loop/backing_file")
    loops = [str(backing) for backing in backings if str(top) in backing.read_text()]
    run_dirs = sorted(Path(tempfile.gettempdir()).glob(f"bastion-vm-{os.getpid()}-*"))
    return {"mounts": mounts, "loops": loops, "run_dirs": run_dirs, "cgroups": layout.existing()}


async def read_report(box: MicroVMSandbox) -> dict[str, object]:
    """The guest's report from its console, polled until it is whole or the VMM ends."""
    vm = box._vm
    assert vm is not None
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    while time.monotonic() < deadline:
        report = parse_report(vm.console.tail())
        if report is not None:
            return report
        if vm.proc.poll() is not None:
            pytest.fail(f"the guest ended before it reported: {vm.why()}")
        await asyncio.sleep(0.2)  # the host reads the console pipe on its own: nothing to wait on
    pytest.fail("the guest's root did not report in time")


async def attack(boxes: dict[str, MicroVMSandbox], attacked: Attacked) -> None:
    """Start both VMMs, send each the attack instead of the relay, collect the reports, close both."""
    try:
        for name, box in boxes.items():
            vm = box._start_vmm()
            await vm.connect(time.monotonic() + BOOT_TIMEOUT_S, None, box._proxy_path())
            # Its sockets are open: the process is QEMU now (sh, setpriv and the filter's step exec'd).
            attacked.argvs[name] = Path(f"/proc/{vm.proc.pid}/cmdline").read_bytes().decode().split("\0")[:-1]
            attacked.run_dirs[name] = vm.run_dir
            st = vm.run_dir.stat()
            attacked.owners[name] = (st.st_uid, st.st_mode & 0o777)
        names = list(boxes)
        reports = await asyncio.gather(*(read_report(boxes[name]) for name in names))
        attacked.reports = dict(zip(names, reports, strict=True))
    finally:
        pids = [box._vm.proc.pid for box in boxes.values() if box._vm is not None]
        for box in boxes.values():
            await box.aclose(final=True)
        attacked.leftovers["vmm_pids"] = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


def make_box(
    top: Path,
    name: str,
    settings: microvm.MicroVMSettings,
    layout: CgroupLayout,
    pool: IdentityPool,
    binds: tuple[tuple[str, str], ...],
) -> tuple[MicroVMSandbox, Path]:
    """A sandbox over a workspace of its own holding `only-in-<name>`, as a host uid of its own."""
    ws = top / f"ws-{name}"
    ws.mkdir()
    (ws / f"only-in-{name}").write_text(f"guest {name}'s own file\n")
    identity = pool.acquire()
    os.chown(ws, identity.uid, identity.gid)
    os.chown(ws / f"only-in-{name}", identity.uid, identity.gid)
    let_through(ws, top)
    spec = SandboxSpec(workspace=str(ws), read_only_binds=binds, identity=(identity.uid, identity.gid))
    return MicroVMBackend(settings, layout).sandbox(spec, limits=Limits(None, None, 1.0)), ws


@pytest.fixture(scope="module")
def attacked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Attacked]:
    settings = microvm_settings(tmp_path_factory)
    top = tmp_path_factory.mktemp("vmroot")
    let_through(settings.image_dir, tmp_path_factory.getbasetemp())
    target = top / "host-target"
    target.write_text(SECRET)
    target.chmod(0o644)  # readable by anyone: only the VM boundary stands between it and the guest
    shown = top / "shown"
    shown.mkdir()
    (shown / "shown.txt").write_text("read-only for the guest\n")
    let_through(shown, tmp_path_factory.getbasetemp())
    layout = CgroupLayout.detect(base_name=f"bastion-vmroot-{os.getpid()}")
    pool = IdentityPool(DEFAULT_HOST_ID_FIRST, DEFAULT_HOST_ID_COUNT, lock_dir=top / "ids")
    try:
        with egress_setup(top) as net, pytest.MonkeyPatch.context() as patch:
            yield run_attack(top, settings, layout, pool, net, patch, target, shown)
    finally:
        pool.close()
        layout.release()


def run_attack(
    top: Path,
    settings: microvm.MicroVMSettings,
    layout: CgroupLayout,
    pool: IdentityPool,
    net: EgressSetup,
    patch: pytest.MonkeyPatch,
    target: Path,
    shown: Path,
) -> Attacked:
    hosts = (f"denied.test:{net.port}", f"allowed.test:{net.port}", "meta.test:80")
    attack_program = program(target=str(target), web_port=net.port, host_pid=os.getpid(), egress_hosts=hosts)
    patch.setattr(microvm, "guest_program", lambda *_: attack_program)
    # Guest a has a template's read-only folder and egress; guest b neither.
    box_a, ws_a = make_box(
        top, "a", settings, layout, pool, ((str(shown), "/opt/shown"), (str(net.socket_dir), EGRESS_DIR))
    )
    box_b, ws_b = make_box(top, "b", settings, layout, pool, ())
    attacked = Attacked({}, {"a": ws_a, "b": ws_b}, target, shown, [], [])
    attacked.leftovers["before"] = host_traces(top, layout)
    asyncio.run(attack({"a": box_a, "b": box_b}, attacked))
    attacked.leftovers["after"] = host_traces(top, layout)
    attacked.egress = net.records(3)
    attacked.web_paths = list(net.web.paths)
    attacked.web_port = net.port
    return attacked


def test_the_attacker_is_root_of_the_guest_with_every_capability(attacked: Attacked) -> None:
    """The premise: what follows is refused to the guest's root, not to an unprivileged command."""
    for guest in ("a", "b"):
        report = attacked.reports[guest]
        assert report["uid"] == 0
        caps = report["capabilities"]
        assert isinstance(caps, int)
        assert all(caps >> bit & 1 for bit in (CAP_SYS_ADMIN, CAP_MKNOD, CAP_NET_RAW))


def test_root_finds_no_9p_export_but_its_own_under_any_tag_or_attach_name(attacked: Attacked) -> None:
    """The guest's 9p devices are exactly what `vmm_argv` exports (usr, workspace, the template's ro0);
    a guessed tag has no device (ENOENT), and an attach name (aname=/, /etc, ../.., the host path of
    the folder above the workspace) still attaches the export's own root: QEMU ignores it."""
    nine_p = section(attacked, "nine_p")
    assert nine_p["tags"] == ["ro0", "usr", "workspace"]
    assert nine_p["guessed"] == dict.fromkeys(GUESSES, "ENOENT")
    assert nine_p["seen"] == {"ro0": ["shown.txt"], "workspace": ["only-in-a"]}
    anames = ["/", "/etc", "../../../../etc", str(attacked.target.parent)]
    assert nine_p["anames"] == {aname: ["only-in-a"] for aname in anames}


def test_root_remounting_the_read_only_exports_read_write_cannot_write_through_qemu(attacked: Attacked) -> None:
    """The guest's kernel lets its root remount /usr read-write and mount the template's folder
    read-write; QEMU's `readonly=on` answers EROFS to every change, and the host's files are unchanged."""
    read_only = section(attacked, "read_only")
    assert read_only["remount_usr_rw"] == "ok"
    for attempt in ("create_in_usr", "open_usr_file_for_writing", "chmod_usr_file", "mkdir_in_usr"):
        assert read_only[attempt] == "EROFS", attempt
    assert not Path("/usr/bastion-root-was-here").exists()
    template = read_only["template"]
    assert isinstance(template, dict)
    assert template.pop("mount_ro0_rw") == "ok"
    assert template.pop("read") == "read-only for the guest\n"
    assert template == dict.fromkeys(
        ["overwrite", "truncate", "chmod", "unlink", "rename", "mkdir", "symlink"], "EROFS"
    )
    assert sorted(p.name for p in attacked.shown.iterdir()) == ["shown.txt"]
    assert (attacked.shown / "shown.txt").read_text() == "read-only for the guest\n"
    assert section(attacked, "read_only", "b")["template"] == {"mount_ro0_rw": "ENOENT"}


def test_root_escaping_the_workspace_through_links_or_dotdot_finds_only_the_guest(attacked: Attacked) -> None:
    """Links root makes in the workspace, to the host's target file, to `../`x16 and to /etc, resolve
    in the guest (ENOENT there); QEMU follows none on the host; the host's file tools refuse them."""
    workspace = section(attacked, "workspace")
    for attempt in ("read_abs", "read_up", "write_abs", "read_etc_hostname", "dotdot_host"):
        assert workspace[attempt] == "ENOENT", attempt
    assert attacked.target.read_text() == SECRET
    ws = attacked.workspaces["a"]
    assert os.readlink(ws / "escape-abs") == str(attacked.target)  # made as asked, and left a plain link
    with Jail(ws, view_root="/workspace") as jail:
        for link in ("escape-abs", "escape-up", "escape-etc/passwd"):
            with pytest.raises(PathEscape):
                jail.read(link)
        for link in ("escape-abs", "escape-up"):
            with pytest.raises(PolicyDenied, match="writes never follow links"):
                jail.write(link, b"through the link\n")
        with pytest.raises(PathEscape):
            jail.write("escape-etc/passwd", b"through the link\n")
    assert attacked.target.read_text() == SECRET


def test_root_cannot_plant_a_device_node_a_root_owned_or_a_setuid_file_in_the_workspace(attacked: Attacked) -> None:
    """QEMU writes the workspace as the sandbox's uid: mknod of a block or memory device and chown to
    root are EPERM from the host's kernel; a setuid or setgid mode is EPERM from the VMM's seccomp
    filter (the finding this test made: before it, `chmod 4755` left a setuid file on the host)."""
    workspace = section(attacked, "workspace")
    for attempt in ("mknod_block", "mknod_mem", "chown_root", "chmod_setuid", "chmod_setgid", "create_setuid"):
        assert workspace[attempt] == "EPERM", attempt
    assert workspace["mkdir_setgid"] == "ok"  # the guest's kernel drops S_ISGID first: a plain folder
    for ws in attacked.workspaces.values():
        owner = ws.stat().st_uid
        for path in ws.iterdir():
            info = path.lstat()
            assert info.st_uid == owner, path
            assert info.st_mode & (stat.S_ISUID | stat.S_ISGID) == 0, path
            assert stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode) or stat.S_ISLNK(info.st_mode), path


def test_root_making_device_nodes_in_the_guest_reaches_no_host_device(attacked: Attacked) -> None:
    """Nodes root makes on a tmpfs of its own: the host's disks and KVM have no device in the guest
    (ENXIO, ENODEV); /dev/mem and /dev/port open, on the guest's own RAM (at most its 256 MiB, so not
    the host's 24 GiB) and the emulated ports; the only block devices are the guest kernel's loops."""
    devices = section(attacked, "devices")
    assert {name: devices[name] for name in ("sda", "vda", "nvme0n1", "kvm")} == {
        "sda": "ENXIO",
        "vda": "ENXIO",
        "nvme0n1": "ENXIO",
        "kvm": "ENODEV",
    }
    assert (devices["mem"], devices["port"]) == ("ok", "ok")
    ram = devices["system_ram"]
    assert isinstance(ram, int)
    assert 0 < ram <= 256 << 20
    block = devices["block"]
    assert isinstance(block, list)
    assert block
    assert all(name.startswith("loop") for name in block)


def test_root_sees_the_guests_proc_and_kernel_not_the_hosts(attacked: Attacked) -> None:
    proc = section(attacked, "proc")
    assert proc["release"] != os.uname().release
    assert proc["init"] == "/busybox"  # PID 1 is the guest's /init
    assert proc["host_pid"] == "ENOENT"  # this test's own pid, looked up in the guest's /proc
    assert isinstance(proc["cmdline"], str)
    assert "bastion.tmp=" in proc["cmdline"]


def test_root_has_no_network_interface_and_no_route_to_the_host(attacked: Attacked) -> None:
    """Only lo; no route to QEMU's usual gateway or DNS (ENETUNREACH, raw sockets too); the host's
    loopback web server is not the guest's loopback (ECONNREFUSED); no eth0 for a packet socket; no
    vsock transport; and the host's web server saw only the one request the proxy allowed."""
    for guest in ("a", "b"):
        assert section(attacked, "network", guest) == {
            "interfaces": ["lo"],
            "tcp_gateway": "ENETUNREACH",
            "udp_dns": "ENETUNREACH",
            "raw_icmp": "ENETUNREACH",
            "tcp_host_loopback": "ECONNREFUSED",
            "tcp6_host_loopback": "ECONNREFUSED",
            "packet_eth0": "ENODEV",
            "vsock_host": "ECONNRESET",
        }
    assert attacked.web_paths == ["/"]


def test_root_forging_streams_on_the_egress_port_reaches_only_the_proxy(attacked: Attacked) -> None:
    """Root writes the stream port's frames itself: each stream still ends at the sandbox's proxy,
    which refuses a name not allowed and a blocked range (403) and audits every attempt; a guest
    whose sandbox has no egress has every forged stream ended (X)."""
    egress = section(attacked, "egress")
    port = attacked.web_port
    assert egress[f"allowed.test:{port}"] == "HTTP/1.1 200 OK"
    denied = egress[f"denied.test:{port}"]
    assert isinstance(denied, str)
    assert denied.startswith("HTTP/1.1 403 Forbidden: destination denied.test")
    assert egress["meta.test:80"] == (
        "HTTP/1.1 403 Forbidden: meta.test resolves to 169.254.169.254, in the blocked range 169.254.0.0/16"
    )
    # An allowed connection is audited when it ends, which may be after the next refusal: compare sorted.
    assert sorted(attacked.egress) == [
        ("allowed.test", port, "allow"),
        ("denied.test", port, "deny"),
        ("meta.test", 80, "deny"),
    ]
    assert set(section(attacked, "egress", "b").values()) == {"X"}


def test_two_guests_side_by_side_share_no_export_socket_or_uid(attacked: Attacked) -> None:
    """Each guest's 9p devices hold its own workspace only; each VMM names its own workspace and run
    folder only, runs as a uid of its own, and keeps its sockets in a 0700 folder of that uid."""
    assert section(attacked, "nine_p", "b")["seen"] == {"workspace": ["only-in-b"]}
    assert section(attacked, "workspace", "a")["listing"] == [
        "escape-abs",
        "escape-etc",
        "escape-up",
        "only-in-a",
        "planted",
        "setgid-folder",
    ]
    for mine, other in (("a", "b"), ("b", "a")):
        argv = " ".join(attacked.argvs[mine])
        assert str(attacked.workspaces[mine]) in argv
        assert str(attacked.workspaces[other]) not in argv
        assert str(attacked.run_dirs[other].parent) not in argv
        assert f"only-in-{other}" not in str(attacked.reports[mine])
    assert attacked.owners["a"][1] == attacked.owners["b"][1] == 0o700
    assert attacked.owners["a"][0] != attacked.owners["b"][0]
    assert attacked.run_dirs["a"].parent != attacked.run_dirs["b"].parent


def test_the_host_after_the_attack_has_no_vmm_mount_loop_device_run_folder_or_cgroup_left(
    attacked: Attacked,
) -> None:
    empty: dict[str, list[object]] = {"mounts": [], "loops": [], "run_dirs": [], "cgroups": []}
    assert attacked.leftovers["before"] == empty
    assert attacked.leftovers["after"] == empty
    assert attacked.leftovers["vmm_pids"] == []
    for run_dir in attacked.run_dirs.values():
        assert processes_with(str(run_dir)) == []
        assert not run_dir.parent.exists()
    assert attacked.target.read_text() == SECRET
    assert attacked.target.stat().st_mode & 0o7777 == 0o644

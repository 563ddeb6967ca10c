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
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bastion.safety.errors import PathEscape
from bastion.safety.paths import Jail
from bastion.sandbox import microvm
from bastion.sandbox._spawn import EGRESS_DIR, SandboxSpec
from bastion.sandbox.cgroups import CgroupLayout, Limits
from bastion.sandbox.identity import DEFAULT_HOST_ID_COUNT, DEFAULT_HOST_ID_FIRST, IdentityPool
from bastion.sandbox.microvm import MicroVMBackend, MicroVMSandbox, console_tail
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
    loops = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        if str(top) in backing.read_text():
            loops.append(str(backing))
    run_dirs = sorted(Path(tempfile.gettempdir()).glob(f"bastion-vm-{os.getpid()}-*"))
    return {"mounts": mounts, "loops": loops, "run_dirs": run_dirs, "cgroups": layout.existing()}


async def read_report(box: MicroVMSandbox) -> dict[str, object]:
    """The guest's report from its console log, polled until it is whole or the VMM ends."""
    vm = box._vm
    assert vm is not None
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    while time.monotonic() < deadline:
        report = parse_report(console_tail(vm.run_dir / "console.log"))
        if report is not None:
            return report
        if vm.proc.poll() is not None:
            pytest.fail(f"the guest ended before it reported: {vm.why()}")
        await asyncio.sleep(0.2)  # the console is a file QEMU appends to: nothing to wait on
    pytest.fail("the guest's root did not report in time")


async def attack(boxes: dict[str, MicroVMSandbox], attacked: Attacked) -> None:
    """Start both VMMs, send each the attack instead of the relay, collect the reports, close both."""
    try:
        for name, box in boxes.items():
            vm = box._start_vmm()
            attacked.argvs[name] = Path(f"/proc/{vm.proc.pid}/cmdline").read_bytes().decode().split("\0")
            attacked.run_dirs[name] = vm.run_dir
            st = vm.run_dir.stat()
            attacked.owners[name] = (st.st_uid, st.st_mode & 0o777)
            await vm.connect(time.monotonic() + BOOT_TIMEOUT_S, None, box._proxy_path())
        names = list(boxes)
        reports = await asyncio.gather(*(read_report(boxes[name]) for name in names))
        attacked.reports = dict(zip(names, reports, strict=True))
    finally:
        pids = [box._vm.proc.pid for box in boxes.values() if box._vm is not None]
        for box in boxes.values():
            await box.aclose(final=True)
        attacked.leftovers["vmm_pids"] = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


def make_box(
    top: Path, name: str, settings: microvm.MicroVMSettings, layout: CgroupLayout, pool: IdentityPool, binds: tuple
) -> tuple[MicroVMSandbox, Path]:
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
    box_a, ws_a = make_box(top, "a", settings, layout, pool, ((str(shown), "/opt/shown"), (str(net.socket_dir), EGRESS_DIR)))
    box_b, ws_b = make_box(top, "b", settings, layout, pool, ())
    attacked = Attacked({}, {"a": ws_a, "b": ws_b}, target, shown, [], [])
    attacked.leftovers["before"] = host_traces(top, layout)
    asyncio.run(attack({"a": box_a, "b": box_b}, attacked))
    attacked.leftovers["after"] = host_traces(top, layout)
    attacked.egress = net.records(3)
    attacked.web_paths = list(net.web.paths)
    return attacked


def test_print(attacked: Attacked) -> None:
    import json
    print(json.dumps(attacked.reports, indent=1, sort_keys=True))
    print(attacked.egress, attacked.web_paths, attacked.argvs, attacked.run_dirs, attacked.owners, attacked.leftovers)
    for ws in attacked.workspaces.values():
        for p in sorted(ws.iterdir()):
            st = p.lstat()
            print(p, oct(st.st_mode), st.st_uid)
    assert False

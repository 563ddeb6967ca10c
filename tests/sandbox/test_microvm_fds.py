"""The microVM backend at the server's fd limit: typed refusals, no fd kept, no VMM or cgroup left by a close.

Real guests under emulation, as test_microvm.py starts them (the boots are marked `microvm`). The fd limit
is reached as in test_warm_pipes.py: RLIMIT_NOFILE lowered and the rest filled with /dev/null fds
(`fds_left`), restored before anything is asserted.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from bastion.safety.errors import BastionError, Unavailable
from bastion.sandbox._spawn import SANDBOX_PATH, SandboxSpec
from bastion.sandbox.backend import RunOutcome
from bastion.sandbox.cgroups import CgroupLayout
from bastion.sandbox.microvm import MicroVMSandbox, MicroVMSettings
from bastion.sandbox.processes import RingCapture
from bastion.sandbox.warm import destroy_left_groups
from tests.helpers import fds_left, open_fds, processes_with
from tests.sandbox.microvm_helpers import microvm_settings, own_guest

pytestmark = [pytest.mark.anyio, pytest.mark.root]

ENV = {"PATH": SANDBOX_PATH, "HOME": "/workspace", "LANG": "C.UTF-8"}
# Listens on 127.0.0.1:8000 in the guest, answers each connection with "inside\n" and closes it; prints "up".
LISTENER = (
    "import socket\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', 8000)); s.listen(); print('up', flush=True)\n"
    "while True:\n c,_=s.accept(); c.sendall(b'inside\\n'); c.close()\n"
)


@pytest.fixture
def layout() -> Iterator[CgroupLayout]:
    made = CgroupLayout.detect(base_name=f"bastion-vmfds-{os.getpid()}")
    yield made
    made.release()


@pytest.fixture
def settings(tmp_path_factory: pytest.TempPathFactory) -> MicroVMSettings:
    return microvm_settings(tmp_path_factory)


@pytest.fixture
async def guest(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, settings: MicroVMSettings, layout: CgroupLayout
) -> AsyncIterator[MicroVMSandbox]:
    async with own_guest(tmp_path, tmp_path_factory.getbasetemp(), settings, layout) as box:
        yield box


async def sh(box: MicroVMSandbox, script: str) -> RunOutcome:
    return await box.run(
        "/bin/sh", ["sh", "-c", script], cwd="/workspace", env=ENV, timeout_s=60, max_output_bytes=4096
    )


async def until(check: Callable[[], bool], limit_s: float = 60) -> None:
    async with asyncio.timeout(limit_s):
        while not check():
            await asyncio.sleep(0.05)


def run_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob(f"bastion-vm-{os.getpid()}-*"))


async def start_piped(box: MicroVMSandbox) -> Callable[[], Awaitable[None]]:
    """A background command whose stdout the host reads from a pipe (as a code context's is); its ending."""
    process = await box.spawn(
        "/bin/echo", ["echo", "hi"], cwd="/", env=ENV, ring_bytes=4096, stdout=lambda fd: RingCapture(fd, 4096)
    )

    async def end() -> None:
        await process.wait_exit()
        await process.wait_output(60)
        process.close()

    return end


async def start_terminal(box: MicroVMSandbox) -> Callable[[], Awaitable[None]]:
    pty = await box.open_pty("/bin/sh", ["sh"], cwd="/", env=ENV, rows=24, cols=80)

    async def end() -> None:
        await box.kill(pty)
        os.close(pty.fd)

    return end


async def start_preview(box: MicroVMSandbox) -> Callable[[], Awaitable[None]]:
    conn = await box.connect(8000)

    async def end() -> None:
        conn.close()

    return end


STARTS = {"piped-spawn": start_piped, "terminal": start_terminal, "preview": start_preview}


@pytest.mark.microvm
@pytest.mark.parametrize("kind", list(STARTS))
async def test_a_piped_spawn_terminal_or_preview_at_the_fd_limit_is_refused_and_leaves_no_fd_or_stream(
    guest: MicroVMSandbox, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Attack: the server is at its fd limit (other sandboxes' and connections' fds) when a client starts a
    background command whose stdout the host reads through a pipe (a code context), a terminal, or a preview
    connection: the host's pipe or socket pair failed with EMFILE, an untyped OSError reached the client as
    INTERNAL_ERROR (a traceback in the log), and a preview's stream, accepted by the guest, stayed open in
    the stream port for good. Invariant: with 0 to 3 fds free each start works or is refused UNAVAILABLE;
    afterwards the server holds no more fds than before, the stream port no stream, and the guest still runs
    commands. Does not prove anything about the boot's own fds (test_a_boot_at_the_fd_limit_...)."""
    await guest.start()
    if kind == "preview":
        server = await guest.spawn("/usr/bin/python3", ["python3", "-c", LISTENER], cwd="/", env=ENV, ring_bytes=4096)
        await until(lambda: b"up" in server.stdout.read(0, 100)[1], 120)
    assert guest._vm is not None
    egress = guest._vm.egress
    assert egress is not None
    before = open_fds()
    refused: list[BastionError] = []
    for free in range(4):
        end = None
        with fds_left(free):
            try:
                end = await STARTS[kind](guest)
            except BastionError as exc:
                refused.append(exc)
        if end is not None:
            await end()
    await until(lambda: open_fds() <= before and egress.streams == 0)
    assert open_fds() == before, (open_fds() - before, egress.streams)
    assert refused != []
    assert all(isinstance(exc, Unavailable) and "Too many open files" in exc.reason for exc in refused), refused
    assert not [record for record in caplog.records if record.exc_info]
    assert (await sh(guest, "echo works")).stdout == b"works\n"


@pytest.mark.microvm
@pytest.mark.parametrize("later", ["next close", "reaper"])
async def test_a_sandbox_closed_at_the_fd_limit_ends_its_vmm_and_its_cgroup_is_removed_later(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    settings: MicroVMSettings,
    layout: CgroupLayout,
    later: str,
) -> None:
    """Attack: a sandbox closes while the server is out of fds: thawing its VMM's cgroup failed (EMFILE), the
    close raised before it stopped the VMM, and the guest ran on with nobody holding it, in a cgroup kept for
    good. Invariant: such a close still kills and waits for the VMM and removes its folder; the cgroup it
    could not remove goes at the next close of any sandbox, or at the manager's reaper's call
    (`destroy_left_groups`), once fds are free. Nothing is left on the machine."""
    async with own_guest(tmp_path, tmp_path_factory.getbasetemp(), settings, layout) as box:
        others = open_fds()
        assert (await sh(box, "echo up")).stdout == b"up\n"
        vm = box._vm
        assert vm is not None
        assert vm.group is not None
        group, pid, run_dir = vm.group, vm.proc.pid, vm.run_dir
        with fds_left(0, below=min(int(fd) for fd in open_fds() - others)):
            box.close()  # the fds it closes are not reused: its cgroup's removal runs at the limit
        assert not os.path.exists(f"/proc/{pid}")
        assert not run_dir.parent.exists()
        assert any(os.path.exists(path) for path in group.paths)
        if later == "reaper":
            destroy_left_groups()
        else:
            (tmp_path / "other").mkdir()
            other = MicroVMSandbox(SandboxSpec(workspace=str(tmp_path / "other")), settings, cgroups=None, limits=None)
            other._start_vmm()  # a VMM to stop (started, not booted: its close is what counts)
            other.close()
        assert layout.existing() == []


async def test_a_boot_at_the_fd_limit_is_refused_and_leaves_no_fd_folder_or_vmm(
    tmp_path: Path, settings: MicroVMSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """Attack: sandboxes boot while the server is at its fd limit: the seccomp filter's memfd failed with an
    untyped OSError (INTERNAL_ERROR, a traceback in the log). Invariant: with 0 to 5 fds free (not enough for
    the VMM's pipes) every start is refused UNAVAILABLE and leaves no fd, socket folder or VMM behind."""
    box = MicroVMSandbox(SandboxSpec(workspace=str(tmp_path)), settings, cgroups=None, limits=None)
    before, folders = open_fds(), run_dirs()
    refused: list[BastionError] = []
    for free in range(6):
        with fds_left(free):
            try:
                await box.start()
            except BastionError as exc:
                refused.append(exc)
    assert open_fds() == before
    assert run_dirs() == folders
    assert len(refused) == 6
    assert all(isinstance(exc, Unavailable) for exc in refused), refused
    assert not [record for record in caplog.records if record.exc_info]
    box.close()


async def test_a_vmm_whose_ports_cannot_be_opened_at_the_fd_limit_is_refused_and_ended(
    tmp_path: Path, settings: MicroVMSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """Attack: the server's fds run out between the VMM's start and the connection to its ports (other
    clients' work at the same time): the socket failed with an untyped OSError. Invariant: the boot is refused
    UNAVAILABLE, and its close leaves no fd, socket folder or VMM."""
    box = MicroVMSandbox(SandboxSpec(workspace=str(tmp_path)), settings, cgroups=None, limits=None)
    before, folders = open_fds(), run_dirs()
    vm = box._start_vmm()
    with fds_left(0), pytest.raises(Unavailable, match="Too many open files"):
        await vm.connect(time.monotonic() + 60, None, None)
    box.close()
    assert open_fds() == before
    assert run_dirs() == folders
    assert processes_with(str(vm.run_dir)) == []
    assert not [record for record in caplog.records if record.exc_info]

"""Root of a booted microVM guest, on purpose, spends the host's disk and event loop through its console
and its agent channel.

One guest boots for the whole module (a TCG boot takes 20-40 s) with the product's own relay, agent and
host reader, and one addition in front of the relay (`ROOT_HELPER`): a process forked as the guest's root
before the relay starts, which runs what a command asks it (through the guest's /tmp) with the relay's
serial port open. That is the threat model's guest: its root writes any bytes on that port and on its
console. The test that ends the guest runs last.

What this does not prove: what the guest's root costs the host through QEMU's own device emulation
(its CPU and memory are the VMM's cgroup's), nor through the stream port (`_vmegress`, its own tests).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from bastion.safety.errors import Unavailable
from bastion.sandbox import microvm
from bastion.sandbox._spawn import SANDBOX_PATH
from bastion.sandbox._vmegress import FRAME_COST_BYTES, GUEST_BURST_BYTES
from bastion.sandbox.backend import RunOutcome
from bastion.sandbox.cgroups import CgroupLayout, Limits
from bastion.sandbox.microvm import MicroVMSandbox
from tests.helpers import LoopLag
from tests.sandbox.microvm_helpers import microvm_settings, own_guest

pytestmark = [pytest.mark.anyio, pytest.mark.root, pytest.mark.microvm]

CONSOLE_CAP = 65_536  # what the host keeps of a guest's console (microvm._CONSOLE_TAIL_BYTES)

# Put in front of the relay's program: forks the guest's root helper, which runs /tmp/.rq's shell text
# (written by a command) with the serial port as $BPORT, and leaves its output in /tmp/.rs. It polls:
# it runs in the guest, which has nothing to wait on for a file a command writes.
ROOT_HELPER = r"""
import os as _o
if _o.fork() == 0:
    import subprocess as _s, time as _t
    while True:
        try:
            with open("/tmp/.rq") as _f:
                _c = _f.read()
            _o.unlink("/tmp/.rq")
        except FileNotFoundError:
            _t.sleep(0.1)
            continue
        _env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "BPORT": str(PORT)}
        _r = _s.run(["/bin/sh", "-c", _c], capture_output=True, env=_env, pass_fds=(PORT,))
        _st = _o.stat("/workspace")
        with open("/tmp/.rs.t", "wb") as _f:
            _f.write(_r.stdout + _r.stderr + b"rc=%d\n" % _r.returncode)
        _o.chown("/tmp/.rs.t", _st.st_uid, _st.st_gid)
        _o.rename("/tmp/.rs.t", "/tmp/.rs")
"""

# Run by the guest's root: writes agent frames of one kind on the relay's port. `flood KIND SIZE SECONDS`
# repeats a frame of SIZE payload bytes for SECONDS; "M" payloads are valid JSON the host parses.
FRAMES = """
import os, struct, sys, time
port, kind, size, seconds = int(os.environ["BPORT"]), sys.argv[1].encode(), int(sys.argv[2]), float(sys.argv[3])
if kind == b"M":
    payload = b'{"event": "noise", "pad": [' + b"0," * ((size - 30) // 2) + b"0]}"
else:
    payload = b"\\n" * size
frame = struct.pack(">IcI", len(payload) + 5, kind, 0) + payload
sent, end = 0, time.monotonic() + seconds
while sent == 0 or time.monotonic() < end:
    view = memoryview(frame)
    while view:
        view = view[os.write(port, view) :]
    sent += 1
print("sent", sent, len(payload))
"""

# Run by the guest's root: takes the stream port from the guest's own end of it (inside/egress_port.py), then writes
# 9-byte "D" frames for a stream it never opened for SECONDS, reading what the host sends meanwhile.
STREAMS = """
import os, struct, sys, threading, time
seconds = float(sys.argv[1])
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        if b"egress_port.py" in open("/proc/%s/cmdline" % pid, "rb").read():
            os.kill(int(pid), 9)
    except OSError:
        pass
for _ in range(50):
    try:
        port = os.open("/dev/vport0p2", os.O_RDWR)
        break
    except OSError:
        time.sleep(0.1)
threading.Thread(target=lambda: [None for _ in iter(lambda: os.read(port, 65536), b"")], daemon=True).start()
frame = struct.pack(">IcI", 5, b"D", 7)
block = frame * 455
sent, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    view = memoryview(block)
    while view:
        view = view[os.write(port, view) :]
    sent += 455
print("sent", sent)
"""

_original_program = microvm.guest_program


def rooted_program(limits: Limits | None, dests: Sequence[str] = ()) -> bytes:
    """The product's guest program with `ROOT_HELPER` in front."""
    data = ROOT_HELPER.encode() + b"\n" + _original_program(limits, dests)[8:]
    return len(data).to_bytes(8, "big") + data


@dataclass
class Hostile:
    box: MicroVMSandbox
    workspace: Path

    @property
    def vm(self) -> microvm._Guest:
        assert self.box._vm is not None
        return self.box._vm

    async def sh(self, script: str, timeout_s: float = 120) -> RunOutcome:
        env = {"PATH": SANDBOX_PATH}
        return await self.box.run(
            "/bin/sh", ["sh", "-c", script], cwd="/workspace", env=env, timeout_s=timeout_s, max_output_bytes=65536
        )

    async def root(self, command: str, timeout_s: float = 300) -> str:
        """Have the guest's root run `command`; its output. The asking command waits for the answer."""
        script = f"cat > /tmp/.rq.t <<'ROOTEOF'\n{command}\nROOTEOF\nmv /tmp/.rq.t /tmp/.rq\n"
        script += "while [ ! -e /tmp/.rs ]; do sleep 0.1; done; cat /tmp/.rs; rm -f /tmp/.rs"
        outcome = await self.sh(script, timeout_s)
        return (outcome.stdout + outcome.stderr).decode(errors="replace")


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # module-wide: the shared guest lives on one event loop


@pytest.fixture(scope="module")
async def hostile(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Hostile]:
    """One booted guest whose root is the attacker's, as its own host uid, in a cgroup of its own."""
    settings = microvm_settings(tmp_path_factory)
    top = tmp_path_factory.mktemp("vmattacks")
    layout = CgroupLayout.detect(base_name=f"bastion-vmattack-{os.getpid()}")
    try:
        async with own_guest(
            top, tmp_path_factory.getbasetemp(), settings, layout, {"frames.py": FRAMES, "streams.py": STREAMS}
        ) as box:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(microvm, "guest_program", rooted_program)
                await box.start()
                yield Hostile(box, top / "ws")
    finally:
        layout.release()


def host_file_bytes(folder: Path) -> int:
    """Bytes of the regular files in `folder` (the VMM's run folder: its sockets, and once its console log)."""
    return sum(entry.stat().st_size for entry in folder.iterdir() if stat.S_ISREG(entry.lstat().st_mode))


async def measured(hostile: Hostile, command: str) -> tuple[str, float, LoopLag]:
    """`hostile.root(command)`'s output, the share of its time the loop's thread spent on CPU meanwhile, and the
    loop's lag."""
    with LoopLag() as lag:
        cpu, wall = time.thread_time(), time.monotonic()
        out = await hostile.root(command)
        cpu, wall = time.thread_time() - cpu, time.monotonic() - wall
    return out, cpu / wall, lag


async def still_runs(hostile: Hostile) -> None:
    after = await hostile.sh("echo after")
    assert (after.status, after.stdout) == (0, b"after\n")


async def test_guest_root_writing_its_console_without_end_fills_no_host_file(hostile: Hostile) -> None:
    """The guest's console was a file QEMU appended to, in the VMM's folder under the host's /tmp: the
    guest's root wrote it at ~300 KiB/s without cap (a disk filled in days), though the host only ever
    read its last 64 KiB. Now it is the VMM's stdout, a pipe whose newest 64 KiB the host keeps in memory.
    Invariant: 16 times that written leaves no host file larger than the cap, the host still has the
    console's last line (what a failed boot reports), reading it held the loop little, and the guest runs on."""
    run_dir = hostile.vm.run_dir
    assert (await hostile.root("echo up > /dev/ttyS0; echo ok")).startswith("ok")
    out, share, lag = await measured(
        hostile,
        "head -c 1048576 /dev/zero | tr '\\0' A > /dev/ttyS0 && echo the-last-line > /dev/ttyS0 && echo written",
    )
    assert out.startswith("written"), out
    assert host_file_bytes(run_dir) <= CONSOLE_CAP
    assert host_file_bytes(run_dir.parent) == 0
    tail = hostile.vm.console.tail()
    assert "the-last-line" in tail
    assert len(hostile.vm.console.kept) <= CONSOLE_CAP
    assert share < 0.1, f"the loop's thread spent {share:.0%} of its time on CPU"
    assert lag.cpu_worst < 0.1, lag.cpu_worst
    await still_runs(hostile)


async def test_guest_root_flooding_valid_small_messages_holds_a_bounded_share_of_the_event_loop(
    hostile: Hostile,
) -> None:
    """Each "M" frame is JSON the host parses on its event loop: a guest's root writing 1 MiB ones kept
    the server's loop ~65% busy, for every client and sandbox. Now a frame holds at most 16 KiB, and a
    guest's messages draw on a budget (256 KiB a second, a burst of 1 MiB) before they are parsed; past it
    the host stops reading that guest's channel. Invariant: a flood of 8 KiB messages (the costliest JSON
    per byte: an array of zeros) for 4 s costs the loop's thread a small share of its CPU, no tick is
    held long, and a command in the guest still runs and exits afterwards. Not proved: the share under
    many such guests at once (each adds its own ~1%)."""
    out, share, lag = await measured(hostile, "python3 -I /workspace/frames.py M 8192 4")
    fields = out.split()
    assert fields[0] == "sent", out
    assert int(fields[1]) * int(fields[2]) > 2 << 20  # more than the burst: the budget was reached
    assert share < 0.15, f"the loop's thread spent {share:.0%} of its time on CPU"
    assert lag.cpu_worst < 0.1, lag.cpu_worst
    await still_runs(hostile)


async def test_guest_root_flooding_its_stream_port_with_tiny_frames_holds_a_bounded_share_of_the_event_loop(
    hostile: Hostile,
) -> None:
    """Found by attack: the agent port's frames drew on the guest's budget, its stream port's (egress, previews,
    terminals) did not. The guest's root, holding that port itself, wrote 9-byte "D" frames for a stream it never
    opened: the loop's thread was 50 to 80% busy, and another sandbox's `true` went from 0.9 to 23-35 ms (p50).
    Invariant: a 4 s flood, past the budget's burst, costs the loop's thread a small share of its CPU, no tick is
    held long, and a command in the guest still runs afterwards. Takes the guest's stream port for good."""
    out, share, lag = await measured(hostile, "python3 -I /workspace/streams.py 4")
    fields = out.split()
    assert fields[0] == "sent", out
    assert int(fields[1]) > GUEST_BURST_BYTES // FRAME_COST_BYTES  # past the burst: the budget was reached
    assert share < 0.15, f"the loop's thread spent {share:.0%} of its time on CPU"
    assert lag.cpu_worst < 0.1, lag.cpu_worst
    await still_runs(hostile)


async def test_guest_root_sending_an_oversized_message_frame_ends_that_vm(
    hostile: Hostile, caplog: pytest.LogCaptureFixture
) -> None:
    """Runs last: it ends the shared guest. A 1 MiB "M" frame (an array of zeros: ~25 ms of json.loads on
    the loop, each) was within the 1 MiB every frame kind was allowed. Invariant: the frame's header alone
    ends the VM, with one log line; its sandbox's command answers UNAVAILABLE; the loop never parsed it."""
    vmm = hostile.vm.proc
    ended_run = pytest.raises(Unavailable, match="the microVM ended while the command ran")
    with LoopLag() as lag, caplog.at_level(logging.WARNING, logger="bastion.sandbox.microvm"), ended_run:
        await hostile.root(f"python3 -I /workspace/frames.py M {1 << 20} 0")
    assert lag.cpu_worst < 0.1, lag.cpu_worst
    ended = [record.getMessage() for record in caplog.records if "ending it" in record.getMessage()]
    assert len(ended) == 1, ended
    assert f"sent a b'M' frame of {(1 << 20) + 5} bytes" in ended[0]
    assert await asyncio.to_thread(vmm.wait, 30) == -9
    assert not hostile.box.alive

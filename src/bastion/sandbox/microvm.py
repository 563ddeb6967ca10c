"""The microVM backend: each sandbox is a QEMU guest with a kernel of its own. SECURITY BOUNDARY.

The second implementation of `bastion.sandbox.backend` (issue 17). A sandbox is one QEMU
process (`-M pc`, see `vmm_argv` for why not `microvm`) started under the sandbox's unprivileged
host identity, with `-sandbox on` (QEMU's seccomp filter), in a cgroup of its own when it has
limits, and no network device at all. The guest boots Debian's kernel with the initramfs of
`bastion.sandbox.vmimage`, sees the host's /usr read-only and the workspace folder read-write over
virtio-9p (so the file tools and snapshots keep acting on the host folder, as the protocol says),
a private /tmp, and runs the same resident agent (inside/agent.py) behind inside/relay.py, which
carries its messages and each command's stdin, stdout and stderr over one virtio-serial port
(a unix socket on the host). A second port carries numbered streams with flow control
(inside/egress_port.py, `_vmegress.EgressPort`): egress, opened by the guest, where the guest's
forwarder reaches the sandbox's egress proxy (the proxy decides); previews, opened by the host
(`connect`: the guest connects to its own 127.0.0.1:PORT); and terminals (`open_pty`: the agent
opens the pty in the guest, the relay hands its master to the stream port program, which carries
it on a stream the host reserved; a resize is a frame). Descriptors do not cross a serial port,
so what the host hands its callers is one end of a socket pair whose other end is carried.
A template's read-only folders and python_env are 9p exports QEMU opens read-only, which the
relay mounts read-only where the namespace backend binds them. Commands run as PID 1 of a PID
namespace of their own in the guest (the agent's ``pids=per-command``): what a command starts
ends with it, so `leftovers` is always empty.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import logging
import marshal
import os
import signal
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

from bastion.safety.errors import BastionError, Conflict, InvalidRequest, NotFound, ResourceLimit, Unavailable
from bastion.safety.paths import file_replaceable_by, folder_changeable_by, owners_phrase
from bastion.safety.redact import sanitize_terminal
from bastion.sandbox._spawn import (
    EGRESS_DIR,
    EGRESS_SOCKET_NAME,
    IDENTITY_FILES,
    INSIDE_FILES,
    SandboxProcess,
    SandboxSpec,
    start_vmm,
)
from bastion.sandbox._vmegress import FRAME_COST_BYTES, Budget, EgressPort, cut_by_close
from bastion.sandbox.backend import Backend, Process, RunOutcome, Sandbox
from bastion.sandbox.cgroups import CgroupLayout, Limits, SandboxCgroup, Usage
from bastion.sandbox.command_groups import Leftover
from bastion.sandbox.processes import OutputSink, PtyProcess, RingCapture
from bastion.sandbox.vmimage import INITRAMFS_NAME, KERNEL_NAME

# warm.py's retry list of cgroups a close could not remove, shared so that the manager's reaper
# (`destroy_left_groups`) and every later close, of either backend, retry the VMMs' groups too.
from bastion.sandbox.warm import destroy_left_groups, destroy_or_retry, exited, polled

__all__ = [
    "ISOLATION",
    "QEMU",
    "MicroVMBackend",
    "MicroVMProcess",
    "MicroVMPty",
    "MicroVMSandbox",
    "MicroVMSettings",
    "boot_files_problem",
    "guest_binds",
    "missing_boot_files",
    "probe_microvm",
    "recover_run_dirs",
    "vmm_argv",
]

logger = logging.getLogger(__name__)

ISOLATION: Final = "microvm"
QEMU: Final = "/usr/bin/qemu-system-x86_64"
_RELAY: Final = Path(__file__).parent / "inside" / "relay.py"
_RELAY_SOURCE: Final = _RELAY.read_text(encoding="utf-8")  # read once: a boot at the fd limit opens no file for it
_HEADER: Final = struct.Struct(">IcI")
_KILL_WAIT_S: Final = 5.0
_LATE_EXIT_S: Final = 0.05  # at a run's deadline: for an exit already in the channel to be read
_SEND_TIMEOUT_S: Final = 60.0  # a frame the guest's relay has not taken by then: the guest is stuck
_READ_BYTES: Final = 65_536  # also the relay's READ_BYTES: the most output one frame of it carries
# The most payload the relay sends in a frame of each kind (inside/relay.py): an agent event is a few
# hundred bytes (inside/agent.py's protocol; a "pty" error at most 500 characters, escaped), "S" three
# numbers. A frame over its kind's cap, or of a kind the relay never sends, is a hostile guest's: it ends.
_MAX_PAYLOAD: Final = {b"M": 16 << 10, b"S": 64, b"O": _READ_BYTES, b"R": _READ_BYTES, b"o": 0, b"r": 0}
# Every frame draws on the guest's budget (`_vmegress.Budget.per_guest`, shared with its egress port: its reader's
# cost, ~4 us), and the frames the host parses ("M": json.loads, ~30 ns a byte at worst) their size too.
_PARSED: Final = (b"M", b"S")
_EXIT_WAIT_S: Final = 2.0  # how long a VMM that closed its port is given to exit and say why
# A killed VMM whose exit is seen (its pidfd readable) but not yet reapable (a tracer holds its zombie), or with no
# pidfd (at the fd limit): looked at again after pauses growing from the first to the last.
_REAP_CHECK_FIRST_S: Final = 0.001
_REAP_CHECK_LAST_S: Final = 0.02
_VMM_OVERHEAD_BYTES: Final = 192 << 20  # QEMU itself and TCG's translation cache (tb-size below)
_VMM_TASKS: Final = 64  # QEMU's own threads; the guest's processes are the guest kernel's business
_CONSOLE_TAIL_BYTES: Final = 65_536
_CONSOLE_PAUSE_S: Final = 0.05  # between reads of the console: QEMU writes it a byte at a time
_CONSOLE_READS: Final = 16  # reads of the console pipe at most, each time it is read
_PIPED_BACKLOG: Final = 4 << 20  # a spawned command's output its host pipe has not taken yet
_NOBODY: Final = 65534  # the probe's VMM, when bastion runs as root: no sandbox shares this uid
_RUN_PREFIX: Final = "bastion-vm-"  # + the server's pid: recovery finds a crashed server's folders by it
_CONNECT_TIMEOUT_S: Final = 10.0  # a preview's connection: the guest connects on its loopback at once, or refuses
_PTY_START_TIMEOUT_S: Final = 30.0  # a terminal: the agent starts its program under emulation, then the port accepts
_NOTHING_ACCEPTS: Final = "nothing accepts connections on that port in the sandbox"
_MAX_AGENT_ERROR_CHARS: Final = 500
_group_ids = itertools.count(1)


@dataclass(frozen=True)
class MicroVMSettings:
    """How a microVM is made: its boot files, size and accelerator."""

    image_dir: Path
    memory_mib: int = 256
    vcpus: int = 1
    accel: str = "tcg"  # "kvm" where a guest boots under KVM; "tcg" is software emulation
    boot_timeout_s: float = 120.0


def vmm_argv(
    settings: MicroVMSettings, run_dir: Path, workspace: str, tmp_bytes: int, binds: Sequence[str] = ()
) -> list[str]:
    """QEMU's command line for one sandbox; `binds`: host folders exported read-only (tags ro0, ro1...).

    `-M pc`, not `microvm`: on this kind of host, Debian's 6.1 kernel under TCG stops at "could not
    calculate TSC khz" with microvm's ACPI tables, and without them its virtio-mmio devices can only
    be named on the command line, which Debian's kernels are built without. The PC machine costs the
    BIOS (~0.5 s of a cold boot) and nothing else we use. `-cpu max`: QEMU's default model (qemu64) has
    no SSE4.2 or POPCNT, and today's wheels (numpy 2) die on it with SIGILL. The serial console is
    QEMU's stdout, a pipe the host reads into memory (`_Console`), not a file: the guest writes it.
    """
    accel = "kvm" if settings.accel == "kvm" else "tcg,tb-size=64"
    sock, workspace = _opt(str(run_dir / "agent.sock")), _opt(workspace)
    egress = _opt(str(run_dir / "egress.sock"))
    return [
        QEMU,
        *("-M", "pc", "-accel", accel, "-cpu", "max", "-m", str(settings.memory_mib), "-smp", str(settings.vcpus)),
        *("-nodefaults", "-no-user-config", "-nographic", "-no-reboot", "-nic", "none"),
        *("-kernel", str(settings.image_dir / KERNEL_NAME), "-initrd", str(settings.image_dir / INITRAMFS_NAME)),
        *("-append", f"console=ttyS0 quiet panic=-1 bastion.tmp={tmp_bytes}"),
        *("-serial", "stdio"),
        *("-device", "virtio-serial-pci"),
        *("-chardev", f"socket,id=agent,path={sock},server=on,wait=off"),
        *("-device", "virtserialport,chardev=agent,name=bastion.agent,nr=1"),
        *("-chardev", f"socket,id=egress,path={egress},server=on,wait=off"),
        *("-device", "virtserialport,chardev=egress,name=bastion.egress,nr=2"),
        *("-fsdev", "local,id=usr,path=/usr,security_model=none,readonly=on"),
        *("-device", "virtio-9p-pci,fsdev=usr,mount_tag=usr"),
        *("-fsdev", f"local,id=ws,path={workspace},security_model=none"),
        *("-device", "virtio-9p-pci,fsdev=ws,mount_tag=workspace"),
        *_bind_args(binds),
        *("-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"),
    ]


def _bind_args(binds: Sequence[str]) -> list[str]:
    """A template's read-only folders, each a 9p export QEMU refuses to write through (readonly=on)."""
    args = []
    for index, source in enumerate(binds):
        args += ["-fsdev", f"local,id=ro{index},path={_opt(source)},security_model=none,readonly=on"]
        args += ["-device", f"virtio-9p-pci,fsdev=ro{index},mount_tag=ro{index}"]
    return args


def guest_binds(spec: SandboxSpec) -> list[tuple[str, str]]:
    """The spec's read-only binds a guest mounts over 9p: all but the egress folder (a serial port there)."""
    return [(source, dest) for source, dest in spec.read_only_binds if dest != EGRESS_DIR]


def _opt(value: str) -> str:
    """A path as a QEMU option value: a comma is doubled, else `path=/ws,path=/` would export the host's /."""
    return value.replace(",", ",,")


class _Console:
    """A guest's serial console: the VMM's stdout, a pipe whose newest `_CONSOLE_TAIL_BYTES` the host keeps
    in memory. It was a file QEMU appended to, and a guest's root grew it on the host's disk without bound.
    Read at most every `_CONSOLE_PAUSE_S` (the pipe holds 64 KiB meanwhile): QEMU writes it a byte per call,
    and a reader woken for each byte would spend the event loop on a guest that writes without end."""

    def __init__(self, pipe: IO[bytes] | None) -> None:
        self.kept = bytearray()
        self._fd = pipe.fileno() if pipe is not None else -1
        self._loop = asyncio.get_running_loop()
        self._later: asyncio.TimerHandle | None = None
        self._watching = self._fd >= 0
        if self._watching:
            os.set_blocking(self._fd, False)
            self._loop.add_reader(self._fd, self._readable)

    def _readable(self) -> None:
        self._loop.remove_reader(self._fd)
        if self.drain():
            self._later = self._loop.call_later(_CONSOLE_PAUSE_S, self._watch)

    def _watch(self) -> None:
        self._later = None
        if self._watching:
            self._loop.add_reader(self._fd, self._readable)

    def drain(self) -> bool:
        """Take what the pipe holds (in the loop's thread); False once it ended or is no longer watched."""
        if not self._watching:
            return False
        try:
            for _ in range(_CONSOLE_READS):
                data = os.read(self._fd, _CONSOLE_TAIL_BYTES)
                if not data:
                    self.stop()
                    return False
                self.kept += data
                del self.kept[: max(0, len(self.kept) - _CONSOLE_TAIL_BYTES)]
        except BlockingIOError:
            pass
        except OSError:
            self.stop()
            return False
        return True

    def stop(self) -> None:
        """Read no more (in the loop's thread, before the pipe closes: its fd number may then be reused)."""
        if self._watching:
            self._watching = False
            self._loop.remove_reader(self._fd)
        if self._later is not None:
            self._later.cancel()
            self._later = None

    def tail(self) -> str:
        """The newest `_CONSOLE_TAIL_BYTES` the guest (or QEMU) wrote on its console."""
        self.drain()
        return self.kept.decode(errors="replace")


def _oversized(kind: bytes, size: int) -> bool:
    """Whether a frame of `size` bytes after its length is more than the relay sends of its kind, or of
    a kind it never sends."""
    cap = _MAX_PAYLOAD.get(kind)
    return cap is None or not 5 <= size <= 5 + cap


def guest_program(limits: Limits | None, dests: Sequence[str] = ()) -> bytes:
    """What the guest's /init runs: the relay, with the programs of inside/, the identity files, the
    commands' task and memory limits in the guest (None: none) and where to mount the 9p exports
    ro0, ro1... (`dests`, in order) in front."""
    files = {**INSIDE_FILES, **IDENTITY_FILES}  # the agent and the code contexts' kernel and REPL
    pids, memory = (limits.pids, limits.memory_bytes) if limits is not None else (None, None)
    mounts = [(f"ro{index}", dest) for index, dest in enumerate(dests)]
    head = f"FILES = {files!r}\nPIDS = {pids!r}\nMEMORY = {memory!r}\nMOUNTS = {mounts!r}\n"
    source = head + _RELAY_SOURCE
    data = source.encode()
    return len(data).to_bytes(8, "big") + data


class _Stream:
    """One output stream of a command as the host keeps it: the first `cap` bytes (a run) or the
    newest `cap` (a background ring), counting all; or fed into a host pipe (`spawn(stdout=...)`)."""

    def __init__(self, cap: int, *, newest: bool, sink: OutputSink | None = None) -> None:
        self.cap = cap
        self.newest = newest
        self.sink = sink
        self.kept = bytearray()
        self.total = 0
        self.closed = False
        self.ended = asyncio.Event()

    @property
    def start(self) -> int:
        return self.total - len(self.kept) if self.newest else 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        if self.sink is not None:
            self.sink(data)
        if self.newest:
            self.kept += data
            del self.kept[: max(0, len(self.kept) - self.cap)]
        elif len(self.kept) < self.cap:
            self.kept += data[: self.cap - len(self.kept)]

    def end(self) -> None:
        self.closed = True
        self.ended.set()

    def limit(self, cap: int) -> None:
        """A background ring keeps at most the newest `cap` bytes from now on."""
        self.cap = cap
        if self.newest:
            del self.kept[: max(0, len(self.kept) - cap)]

    def read(self, offset: int, limit: int) -> tuple[int, bytes]:
        begin = max(offset, self.start)
        index = begin - self.start
        return begin, bytes(self.kept[index : index + limit])


class _Piped:
    """Feeds a stream's bytes into a host pipe whose read end a caller's reader owns."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pending = bytearray()
        os.set_blocking(fd, False)

    def write(self, data: bytes) -> None:
        """Keep what the pipe cannot take yet, up to _PIPED_BACKLOG: the guest sends without waiting for
        the pipe's reader (which may pause, or read nothing), so past that its bytes are lost, as a full
        ring would lose them, rather than held by the host without bound."""
        if self.fd < 0:
            return
        self.pending += data[: max(0, _PIPED_BACKLOG - len(self.pending))]
        self.flush()

    def flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.pending:
                del self.pending[: os.write(self.fd, self.pending)]
        except BlockingIOError:
            loop.add_writer(self.fd, self.flush)
            return
        except OSError:  # the reader closed its end: nothing more to give it
            self.pending.clear()
        loop.remove_writer(self.fd)
        if self.pending == b"" and self._ending:
            self.close()

    _ending = False

    def end(self) -> None:
        self._ending = True
        if not self.pending:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            asyncio.get_running_loop().remove_writer(self.fd)
            os.close(self.fd)
            self.fd = -1


class MicroVMProcess:
    """A command of a microVM sandbox, as the host sees it (`bastion.sandbox.backend.Process`)."""

    def __init__(self, vm: _Guest, command_id: int, argv: Sequence[str], out: _Stream, err: _Stream) -> None:
        self._vm = vm
        self._id = command_id
        self._argv = tuple(argv)
        self._started = time.monotonic()
        self.out, self.err = out, err
        self.reader: RingCapture | None = None  # spawn(stdout=...)'s reader of the host pipe `out` feeds
        self.status: int | None = None
        self.exited = False
        self.stdin_open = True
        self.exit_event = asyncio.Event()
        self.request_out = False  # its run request is (being) written to the guest

    @property
    def command_id(self) -> int:
        return self._id

    @property
    def argv(self) -> tuple[str, ...]:
        return self._argv

    @property
    def started(self) -> float:
        return self._started

    @property
    def stdout(self) -> _Stream | RingCapture:
        return self.reader if self.reader is not None else self.out

    @property
    def stderr(self) -> _Stream:
        return self.err

    def finish(self, status: int | None) -> None:
        if not self.exited:
            self.status, self.exited, self.stdin_open = status, True, False
        self.exit_event.set()

    async def wait_exit(self) -> None:
        await self.exit_event.wait()

    async def wait_output(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.out.ended.wait()
                await self.err.ended.wait()
                if self.reader is not None:
                    await asyncio.shield(self.reader.done)

    async def write(self, data: bytes, *, timeout_s: float) -> int:
        """The relay buffers what the pipe does not take yet, so everything goes in at once; a guest
        that does not take it within `timeout_s` is ended (Unavailable)."""
        if not self.stdin_open:
            raise Conflict("the process's input is closed")
        await self._vm.send(b"I", self._id, data, timeout_s=timeout_s)
        return len(data)

    def requested(self) -> None:
        self.request_out = True

    def close_stdin(self) -> None:
        if self.stdin_open:
            self.stdin_open = False
            self._vm.send_soon(b"E", self._id)

    def close(self) -> None:
        """Let go of the command. Its output streams end here: a stream's end frame that came after the command
        was forgotten would be ignored, and a piped stdout's host pipe and reader stay open for good."""
        self.close_stdin()
        self.finish(self.status)
        self.out.end()
        self.err.end()
        self._vm.forget(self._id)


class MicroVMPty(PtyProcess):
    """A command on a terminal in the guest. `fd` is the host's end of a socket pair carried to the
    guest's pty master over the stream port; a new size goes there as a frame."""

    def __init__(self, command_id: int, argv: Sequence[str], egress: EgressPort, stream_id: int) -> None:
        super().__init__(command_id, argv, -1)
        self.egress = egress
        self.stream_id = stream_id
        # The agent's answer: None once the program runs, else why it did not start.
        self.opened: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

    def resize(self, rows: int, cols: int) -> None:
        self.egress.resize(self.stream_id, rows, cols)


class _Guest:
    """One booted guest: its VMM process, its cgroup, its console and the serial channel to its relay."""

    def __init__(self, proc: SandboxProcess, run_dir: Path, group: SandboxCgroup | None) -> None:
        self.proc = proc
        self.run_dir = run_dir
        self.group = group
        self.console = _Console(proc.stdout)
        self.budget = Budget.per_guest()  # for the frames it sends, on both ports
        self.sock: socket.socket | None = None
        self.egress: EgressPort | None = None
        self.egress_sock: socket.socket | None = None
        self.sending = asyncio.Lock()  # one frame at a time: concurrent sends must not interleave
        self.commands: dict[int, MicroVMProcess] = {}
        self.ptys: dict[int, MicroVMPty] = {}  # terminals, from their request to their exit
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.gone = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.ids = itertools.count(1)
        self.later: set[asyncio.Task[None]] = set()  # sends from sync callers (close_stdin)
        self.writes: set[asyncio.Task[None]] = set()  # frames being written, each to its end
        # What its relay said before the last exit: /tmp and /dev/shm empty, OOM kills, shared memory.
        self.scratch_empty = True
        self.guest_ooms = 0
        self.guest_shmem = 0

    @property
    def alive(self) -> bool:
        return not self.gone.is_set() and self.proc.poll() is None

    async def connect(
        self, deadline: float, limits: Limits | None, proxy: str | None, dests: Sequence[str] = ()
    ) -> None:
        """Connect to the VMM's agent and egress ports, send the guest its program, start reading.

        Raises:
            Unavailable: the VMM exited, or closed a port, before the guest had its program.
        """
        loop = asyncio.get_running_loop()
        try:
            sock = self.sock = await self.open_port("agent.sock", deadline)
            # QEMU opens its chardevs in argv order: the egress socket is there once the agent's is.
            self.egress_sock = await self.open_port("egress.sock", deadline)
            self.egress = EgressPort(self.egress_sock, proxy, self.run_dir.parent.name, self.budget)
            self.egress.start()
            await loop.sock_sendall(sock, guest_program(limits, dests))
        except ConnectionError:
            # QEMU opens its ports before its accelerator: one that cannot use KVM exits right after.
            raise Unavailable("the VMM exited while starting: " + await self.exit_reason(deadline)) from None
        self.task = loop.create_task(self.read_frames(sock))

    async def exit_reason(self, deadline: float) -> str:
        """Why the VMM is going: its last words once it has exited (waited for until `deadline`, at most
        `_EXIT_WAIT_S`: it closed its port, so it is on its way out)."""
        await _reaped(self.proc, max(0.0, min(deadline - time.monotonic(), _EXIT_WAIT_S)))
        return self.why()  # still running: killed at close

    async def open_port(self, name: str, deadline: float) -> socket.socket:
        sock_path = os.path.join(self.run_dir, name)
        loop = asyncio.get_running_loop()
        while True:
            if self.proc.poll() is not None:
                raise Unavailable("the VMM exited while starting: " + self.why())
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
            except OSError as exc:
                raise _out_of_fds(f"connect to the VMM's {name}", exc) from None
            try:
                await loop.sock_connect(sock, sock_path)
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline:
                    raise Unavailable(f"the VMM did not open its {name} in time") from None
                await asyncio.sleep(0.02)

    async def read_frames(self, sock: socket.socket) -> None:
        """Read frames until the channel ends. A frame larger than the relay sends of its kind (`_MAX_PAYLOAD`)
        ends the VM; a frame waits for the guest's budget (its own cost; a message's size too: `_PARSED`)."""
        loop = asyncio.get_running_loop()
        inbox = bytearray()
        try:
            while data := await loop.sock_recv(sock, _READ_BYTES):
                inbox += data
                while len(inbox) >= 5:
                    size, kind = int.from_bytes(inbox[:4], "big"), bytes(inbox[4:5])
                    if _oversized(kind, size):
                        name = self.run_dir.name
                        logger.warning("microVM %s sent a %r frame of %d bytes: ending it", name, kind, size)
                        self.kill_vmm()
                        return
                    if len(inbox) < 4 + size:
                        break
                    body = bytes(inbox[4 : 4 + size])
                    del inbox[: 4 + size]
                    cost = FRAME_COST_BYTES + (size if kind in _PARSED else 0)
                    if (wait_s := self.budget.spend(cost)) > 0:
                        await asyncio.sleep(wait_s)  # the channel is not read meanwhile: the guest waits
                    self.on_frame(kind, int.from_bytes(body[1:5], "big"), body[5:])
                # sock_recv returns at once while data waits: a guest that always has more would hold the loop.
                await asyncio.sleep(0)
        except OSError:
            return
        finally:
            self.end_all()

    def on_frame(self, kind: bytes, command_id: int, payload: bytes) -> None:
        if kind == b"M":
            self.on_message(payload)
            return
        if kind == b"S":
            self.on_state(payload)
            return
        command = self.commands.get(command_id)
        if command is None:
            return
        stream = command.out if kind in (b"O", b"o") else command.err
        if kind in (b"O", b"R"):
            stream.feed(payload)
        elif kind in (b"o", b"r"):
            stream.end()

    def on_state(self, payload: bytes) -> None:
        fields = payload.split()
        if len(fields) == 3 and all(field.isdigit() and len(field) < 20 for field in fields):
            self.scratch_empty = fields[0] == b"1"
            self.guest_ooms, self.guest_shmem = int(fields[1]), int(fields[2])

    def on_message(self, payload: bytes) -> None:
        try:
            message = json.loads(payload)
        except (ValueError, RecursionError):  # a nesting deeper than the recursion limit: malformed too
            return
        if not isinstance(message, dict):
            return
        if message.get("event") == "ready" and not self.ready.done():
            self.ready.set_result(None)
        elif message.get("event") == "exit":
            command_id, status = message.get("id"), message.get("status")
            if type(command_id) is int and type(status) is int and command_id in self.commands:
                self.commands[command_id].finish(status)
            if type(command_id) is int and type(status) is int and command_id in self.ptys:
                self.ptys.pop(command_id).finish(status)
        elif message.get("event") == "pty":
            self.on_pty(message)

    def on_pty(self, message: Mapping[str, object]) -> None:
        """The agent's answer to a terminal request: its program runs (its master went to the stream
        port), or why not. Only a terminal this host asked for and still waits for is answered."""
        command_id = message.get("id")
        pty = self.ptys.get(command_id) if type(command_id) is int else None
        if pty is None or pty.opened.done():
            return
        error = message.get("error")
        if error is None:
            pty.opened.set_result(None)
            return
        # Cut before it is cleaned: a guest's 1 MiB of NULs (before the frame caps) cost the loop 0.2 s to clean.
        shown = sanitize_terminal(str(error)[: 4 * _MAX_AGENT_ERROR_CHARS])[:_MAX_AGENT_ERROR_CHARS]
        pty.opened.set_result(shown or "no reason given")

    def end_all(self) -> None:
        self.gone.set()
        if not self.ready.done():
            self.ready.set_exception(Unavailable("the guest ended before its agent was ready: " + self.why()))
            self.ready.exception()  # retrieved: nobody awaits it when the VMM failed before its socket
        for command in self.commands.values():
            command.out.end()
            command.err.end()
            command.finish(None)
        for pty in self.ptys.values():
            if not pty.opened.done():
                pty.opened.set_result("the microVM ended")
            pty.finish(None)
        self.ptys.clear()

    async def send(
        self,
        kind: bytes,
        command_id: int,
        payload: bytes = b"",
        *,
        timeout_s: float = _SEND_TIMEOUT_S,
        begun: Callable[[], None] | None = None,
    ) -> None:
        """Send one frame. A guest that does not take it in time ends: the relay always reads, so a
        stuck channel is a hostile or frozen guest, and a frame cut short cannot be taken back."""
        if self.sock is None or not self.alive:
            raise Unavailable("the microVM has ended")
        frame = _HEADER.pack(len(payload) + 5, kind, command_id) + payload
        try:
            async with asyncio.timeout(timeout_s):
                await self.sending.acquire()
                # A caller cancelled halfway (a client gave up) leaves the write to finish, holding the
                # lock: a frame cut short would make the relay read the next frames' bytes as its rest.
                write = asyncio.get_running_loop().create_task(self.write(self.sock, frame))
                self.writes.add(write)
                write.add_done_callback(self.written)
                if begun is not None:
                    begun()  # the frame goes out whole from here, cancelled or not
                try:
                    await asyncio.shield(write)
                except asyncio.CancelledError:
                    if cut_by_close(write):
                        raise Unavailable("the microVM was closed while a frame was being sent") from None
                    raise
        except TimeoutError:
            self.kill_vmm()
            raise Unavailable(f"the microVM did not read its channel within {timeout_s:g} s: it was ended") from None
        except OSError as exc:
            raise Unavailable(f"the microVM's channel broke: {exc.strerror or exc}") from exc

    async def write(self, sock: socket.socket, frame: bytes) -> None:
        try:
            await asyncio.get_running_loop().sock_sendall(sock, frame)
        finally:
            self.sending.release()

    def written(self, write: asyncio.Task[None]) -> None:
        self.writes.discard(write)
        if not write.cancelled():
            write.exception()  # retrieved: its sender, if still waiting, has it too

    def send_soon(self, kind: bytes, command_id: int, payload: bytes = b"") -> None:
        """Send from a sync caller; a guest that ended meanwhile needs it no more."""
        if self.sock is not None and self.alive:
            task = asyncio.get_running_loop().create_task(self.send_quietly(kind, command_id, payload))
            self.later.add(task)
            task.add_done_callback(self.later.discard)

    async def send_quietly(self, kind: bytes, command_id: int, payload: bytes) -> None:
        with contextlib.suppress(Unavailable):
            await self.send(kind, command_id, payload)

    def forget(self, command_id: int) -> None:
        self.commands.pop(command_id, None)

    def why(self) -> str:
        """The last lines the VMM or the guest's console wrote: the reason it did not start."""
        text = self.console.tail()
        lines = [line for line in text.splitlines() if line.strip() and not line.startswith("\x1b")]
        if self.proc.poll() is not None and self.proc.stderr is not None:
            with contextlib.suppress(OSError, ValueError):
                lines += self.proc.stderr.read().decode(errors="replace").splitlines()
        return (lines[-1] if lines else "no reason given")[:300]

    def detach(self) -> None:
        """Stop reading the channels (called in the loop's thread), so their sockets can close under no reader."""
        self.console.stop()
        if self.egress is not None:
            self.egress.close()
        for write in list(self.writes):  # the channel is closing: a frame cut now is read by nobody
            loop = write.get_loop()
            if self.sock is not None and not loop.is_closed():  # now, before its fd number can be reused
                loop.remove_writer(self.sock.fileno())
            write.cancel()
        if self.task is None or self.task.done():
            return
        loop = self.task.get_loop()
        if self.sock is not None and not loop.is_closed():
            loop.remove_reader(self.sock.fileno())
        self.task.cancel()

    def kill_vmm(self) -> None:
        if self.proc.returncode is None:  # once reaped, its pid (its group's id) may be another process's
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        _thaw(self.group)  # a frozen VMM takes its SIGKILL only once thawed

    def stop(self) -> None:
        """Kill the VMM and wait for it; remove its socket folder and its cgroup. Blocking: `astop` on the loop."""
        self.let_go()
        with contextlib.suppress(Exception):  # TimeoutExpired (subprocess is _spawn's): its cgroup's kill is next
            self.proc.wait(timeout=_KILL_WAIT_S)
        self.clean_up()
        self.remove_groups()
        self.end_all()

    async def astop(self) -> None:
        """`stop` on the event loop, holding no worker thread of the loop's default executor while the VMM exits
        (a pidfd the loop watches) or its cgroup is removed (a thread of its own). Found by a review: that
        executor (6 threads on 2 cores) is shared by the whole server, and a close storm of guests slow to
        exit held every thread of it for up to `_KILL_WAIT_S` each."""
        self.let_go()
        try:
            await _reaped(self.proc, _KILL_WAIT_S)
        except asyncio.CancelledError:
            # The loop is closing (asyncio.Runner cancels its tasks): finish as `close`, in the default executor
            # the loop's shutdown waits for, so stops of many VMMs slow to exit run side by side, not in turn
            # (found by review: 5 s each on the loop, and 18 of them pass systemd's stop timeout).
            asyncio.get_running_loop().run_in_executor(None, self.stop)
            raise
        self.clean_up()
        try:
            await asyncio.wrap_future(_in_own_thread(self.remove_groups, "bastion-vm-reap"))
        finally:
            self.end_all()

    def let_go(self) -> None:
        self.kill_vmm()
        for sock in (self.sock, self.egress_sock):
            if sock is not None:
                sock.close()

    def clean_up(self) -> None:
        """Close the VMM's pipes and remove its socket folder, once it exited (or was given up on)."""
        for pipe in (self.proc.stderr, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        _remove_run_dir(self.run_dir)

    def remove_groups(self) -> None:
        """Remove its cgroup, and retry those earlier closes left (blocking: cgroup.kill, then a wait for it empty)."""
        destroy_left_groups()
        if self.group is not None:
            destroy_or_retry(self.group, f"microVM {self.run_dir.parent.name}")


async def _reaped(proc: SandboxProcess, timeout_s: float) -> bool:
    """Wait on the event loop, at most `timeout_s`, until the VMM has exited and is reaped; whether it is. Its
    pidfd, watched by the loop, says when it exits; a zombie a tracer holds is not ours to reap until the tracer
    lets go (wait(2)), so it is looked at again between short pauses, as is a VMM with no pidfd (EMFILE)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    if proc.poll() is not None:
        return True
    try:
        pidfd = os.pidfd_open(proc.pid)  # our unreaped child: its pid cannot have been reused
    except OSError:
        pidfd = -1
    if pidfd >= 0:
        try:
            await exited(pidfd, timeout_s)
        finally:
            os.close(pidfd)
    left = max(0.0, deadline - loop.time())
    return await polled(lambda: proc.poll() is not None, left, _REAP_CHECK_FIRST_S, _REAP_CHECK_LAST_S)


def _in_own_thread(work: Callable[[], None], name: str) -> concurrent.futures.Future[None]:
    """Run `work` in a thread of its own, never in the loop's default executor (see `_Guest.astop`); the future
    settles when it is over, awaited without a worker thread (`asyncio.wrap_future`), and an awaiting call
    cancelled does not cancel it. With no thread to be had (the process's limit), it runs here."""
    done: concurrent.futures.Future[None] = concurrent.futures.Future()
    done.set_running_or_notify_cancel()

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)

    try:
        # Not a daemon: a server exiting waits for a cgroup's removal under way rather than cut it short.
        threading.Thread(target=run, name=name).start()
    except RuntimeError:  # "can't start new thread"
        run()
    return done


def _make_run_dir(identity: tuple[int, int] | None) -> Path:
    """The VMM's folder (its sockets), owned by its uid inside a folder of root's: the
    VMM's uid may write in it but not rename it, so the paths root later reads, connects to and
    removes stay this folder (in /tmp, the owner of an entry may rename it and plant a link)."""
    outer = Path(tempfile.mkdtemp(prefix=f"{_RUN_PREFIX}{os.getpid()}-"))
    outer.chmod(0o711)
    run_dir = outer / "vm"
    run_dir.mkdir(mode=0o700)
    if identity is not None:
        os.chown(run_dir, *identity)
    return run_dir


def _remove_run_dir(run_dir: Path) -> None:
    for name in ("agent.sock", "egress.sock", "console.log"):  # console.log: an older server's (a file then)
        with contextlib.suppress(OSError):  # gone, or a folder the VMM's uid made there: left, never followed
            (run_dir / name).unlink()
    for folder in (run_dir, run_dir.parent):
        with contextlib.suppress(OSError):
            folder.rmdir()


def _out_of_fds(what: str, exc: OSError) -> Unavailable:
    """The refusal of a host fd that could not be made (EMFILE, ENFILE: the server or the machine is out of fds)."""
    return Unavailable(f"cannot {what}: {exc.strerror or exc}: try again later")


def _thaw(group: SandboxCgroup | None) -> None:
    """Thaw a VMM's group before it is killed, if it can be (not at the fd limit): a close must go on to kill
    the VMM whatever this says, and the group's removal, retried later (`destroy_or_retry`), thaws it again."""
    if group is not None:
        try:
            group.thaw()
        except BastionError as exc:
            logger.warning("cgroup %s not thawed: %s", group.name, exc.reason)


def _vm_ooms(vm: _Guest) -> int:
    try:
        host = vm.group.oom_kills() if vm.group is not None else 0
    except (OSError, BastionError):  # its group is gone already
        host = 0
    return vm.guest_ooms + host


def _mib(size: int) -> str:
    return f"{size / 2**20:.0f} MiB"


def recover_run_dirs(temp: Path | None = None) -> list[Path]:
    """Remove the VMM folders (sockets; an older server's console logs) of servers no longer running, after killing any
    VMM still using one (its parent-death signal ends it with the server; this is for when it did not).
    A live server's folders, and anything not made by this account, are left alone. Returns those removed."""
    removed = []
    for outer in sorted((temp or Path(tempfile.gettempdir())).glob(f"{_RUN_PREFIX}*-*")):
        owner = outer.name.removeprefix(_RUN_PREFIX).split("-")[0]
        if not owner.isdigit() or os.path.exists(f"/proc/{owner}") or not _own_folder(outer):
            continue
        for pid in _users_of(outer / "vm"):
            _kill_user(pid, outer / "vm")
        _remove_run_dir(outer / "vm")
        if not outer.exists():
            removed.append(outer)
    return removed


def _own_folder(path: Path) -> bool:
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def _kill_user(pid: int, run_dir: Path) -> None:
    """SIGKILL `pid` if it still names the folder's agent socket: held by a pidfd first, so a pid
    freed after the scan and taken by another process is never what root kills."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if _names(pid, os.fsencode(run_dir / "agent.sock")):
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    finally:
        os.close(pidfd)


def _names(pid: int, needle: bytes) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _users_of(run_dir: Path) -> list[int]:
    """Processes whose command line names the folder's agent socket: a VMM left running."""
    needle = os.fsencode(run_dir / "agent.sock")
    return [
        int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit() and _names(int(entry.name), needle)
    ]


class MicroVMSandbox:
    """One sandbox as a microVM (`bastion.sandbox.backend.Sandbox`)."""

    def __init__(
        self, spec: SandboxSpec, settings: MicroVMSettings, *, cgroups: CgroupLayout | None, limits: Limits | None
    ) -> None:
        if limits is not None and cgroups is None:
            raise Unavailable("resource limits need cgroups, and none are available")
        self.spec = spec
        self.settings = settings
        self._cgroups = cgroups
        self._limits = limits
        self._vm: _Guest | None = None
        self._paused = False
        self._closed = False
        self._asleep = False  # stopped while idle; the next command boots it again
        self._past_ooms = 0  # OOM kills of guests this sandbox had before the current one
        self._stopping: set[asyncio.Task[None]] = set()  # slept guests' VMMs being reaped
        self._start_lock = asyncio.Lock()
        self._starting = False  # a boot under way (read by a pause's worker thread: see `WarmSandbox._starting`)

    @property
    def isolation(self) -> str:
        return ISOLATION

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def asleep(self) -> bool:
        return self._asleep and self._vm is None

    @property
    def alive(self) -> bool:
        """Booted to its agent's "ready" and not ended since."""
        vm = self._vm
        return vm is not None and vm.alive and vm.ready.done() and not vm.ready.cancelled() and not vm.ready.exception()

    async def start(self) -> None:
        async with self._start_lock:
            if self._closed:
                raise Unavailable("the sandbox was closed")
            if self.alive:
                return
            self._starting = True
            try:
                await self._end()
                if self._closed:
                    # Found by review: closed for good while the dead guest was stopped (the stop awaits now): a boot
                    # here would run a VMM nobody closes, under an id the manager hands to another sandbox.
                    raise Unavailable("the sandbox was closed")
                await self._boot()
            finally:
                self._starting = False
            self._asleep = False

    def _proxy_path(self) -> str | None:
        """The host's egress proxy socket of this sandbox: in the folder a namespace sandbox sees at
        /run/bastion (the proxy listens there only while the sandbox has egress)."""
        for source, dest in self.spec.read_only_binds:
            if dest == EGRESS_DIR:
                return os.path.join(source, EGRESS_SOCKET_NAME)
        return None

    def _host_limits(self) -> Limits | None:
        """The VMM's cgroup: the guest's memory plus QEMU's own, QEMU's threads, and the CPU given."""
        if self._limits is None:
            return None
        memory = (self.settings.memory_mib << 20) + _VMM_OVERHEAD_BYTES
        return Limits(memory_bytes=memory, pids=_VMM_TASKS, cpu_cores=self._limits.cpu_cores)

    def _make_group(self) -> SandboxCgroup | None:
        limits = self._host_limits()
        if self._cgroups is None or limits is None:
            return None
        # "<kind>-<server pid>-<n>", as the namespace backend's: recovery finds a crashed server's by its pid.
        return self._cgroups.create(self._cgroups.new_name("vm", next(_group_ids)), limits)

    def _start_vmm(self) -> _Guest:
        problem = boot_files_problem(self.settings.image_dir)
        if problem is not None:
            raise Unavailable(problem)
        run_dir = _make_run_dir(self.spec.identity)
        group: SandboxCgroup | None = None
        try:
            group = self._make_group()
            procs = tuple(os.path.join(path, "cgroup.procs") for path in group.paths) if group else ()
            sources = [source for source, _ in guest_binds(self.spec)]
            argv = vmm_argv(self.settings, run_dir, self.spec.workspace, self.spec.tmp_size_bytes, sources)
            proc = start_vmm(argv, identity=self.spec.identity, cgroup_procs=procs)
        except BaseException as exc:
            if group is not None:
                destroy_or_retry(group, f"microVM {run_dir.parent.name}")
            _remove_run_dir(run_dir)
            if isinstance(exc, OSError):  # the seccomp filter's memfd (EMFILE), before start_vmm's own refusals
                raise _out_of_fds("start the VMM", exc) from None
            raise
        self._vm = _Guest(proc, run_dir, group)
        return self._vm

    async def _boot(self) -> None:
        vm = self._start_vmm()
        deadline = time.monotonic() + self.settings.boot_timeout_s
        try:
            dests = [dest for _, dest in guest_binds(self.spec)]
            await vm.connect(deadline, self._limits, self._proxy_path(), dests)
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await vm.ready
        except TimeoutError:
            await self._end()
            raise Unavailable(f"the microVM did not boot within {self.settings.boot_timeout_s:g} s") from None
        except BaseException:
            await self._end()
            raise

    async def _ready_vm(self) -> _Guest:
        if self._paused:
            raise Conflict("the sandbox is paused: resume it first")
        await self.start()
        assert self._vm is not None
        return self._vm

    async def _launch(
        self,
        vm: _Guest,
        executable: str,
        argv: Sequence[str],
        cwd: str,
        env: Mapping[str, str],
        out: _Stream,
        err: _Stream,
        stdin: bool,
    ) -> MicroVMProcess:
        command_id = next(vm.ids)
        command = MicroVMProcess(vm, command_id, argv, out, err)
        if not stdin:
            command.stdin_open = False
        vm.commands[command_id] = command
        request = {
            "op": "run",
            "id": command_id,
            "exe": executable,
            "argv": list(argv),
            "cwd": cwd,
            "env": dict(env),
            "stdin": stdin,
        }
        try:
            await vm.send(b"M", 0, marshal.dumps(request), begun=command.requested)
        except asyncio.CancelledError:
            if command.request_out:  # it goes out whole: the command may run, with nobody waiting for it
                await asyncio.shield(self._kill_command(vm, command))
            vm.forget(command_id)
            raise
        return command

    async def run(
        self,
        executable: str,
        argv: Sequence[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        timeout_s: float,
        max_output_bytes: int,
        on_output: tuple[OutputSink, OutputSink] | None = None,
    ) -> RunOutcome:
        vm = await self._ready_vm()
        sinks = on_output or (None, None)
        out = _Stream(max_output_bytes, newest=False, sink=sinks[0])
        err = _Stream(max_output_bytes, newest=False, sink=sinks[1])
        ooms_before = self.oom_kills()
        command = await self._launch(vm, executable, argv, cwd, env, out, err, stdin=False)
        timed_out = cancelled = False
        try:
            async with asyncio.timeout(timeout_s):
                await command.wait_exit()
                await command.wait_output(timeout_s)
        except TimeoutError:
            timed_out = not await self._ended_unread(command)
        except asyncio.CancelledError:
            cancelled = True
            await asyncio.shield(self._kill_command(vm, command))
            raise
        finally:
            if timed_out:
                await self._kill_command(vm, command)
            vm.forget(command.command_id)
        outcome = self._outcome(vm, command, timed_out=timed_out, cancelled=cancelled)
        if self.oom_kills() > ooms_before:  # the guest's kernel killed in the commands' group
            return dataclasses.replace(outcome, oom_killed=True, memory_note=self.memory_note())
        return outcome

    @staticmethod
    async def _ended_unread(command: MicroVMProcess) -> bool:
        """At a run's deadline: whether the command had ended, its exit and output in the channel, not yet read.

        Found by attack (a stalled server: a loaded host, a paused VM): the channel's reader is a task, so after a
        stall the deadline's timer ran before it, and `echo done` with 1.5 s of its limit left was answered timed
        out, killed, with exit status 0 and its output."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_LATE_EXIT_S):
                await command.wait_exit()
                await command.out.ended.wait()
                await command.err.ended.wait()
                return command.status is not None
        return False

    def _outcome(self, vm: _Guest, command: MicroVMProcess, *, timed_out: bool, cancelled: bool) -> RunOutcome:
        if command.status is None and not timed_out:
            if self._oom_killed_vm():
                raise ResourceLimit("the microVM ran out of memory and ended under the command")
            raise Unavailable("the microVM ended while the command ran: " + vm.why())
        return RunOutcome(
            status=command.status,
            stdout=bytes(command.out.kept),
            stderr=bytes(command.err.kept),
            stdout_total=command.out.total,
            stderr_total=command.err.total,
            timed_out=timed_out,
            cancelled=cancelled,
        )

    def _oom_killed_vm(self) -> bool:
        return self._vm is not None and self._vm.group is not None and self._vm.group.oom_kills() > 0

    async def _kill_command(self, vm: _Guest, command: MicroVMProcess | MicroVMPty) -> None:
        """Ask the agent to SIGKILL the command (PID 1 of its own namespace: its whole tree goes);
        if the exit is not confirmed in time, end the whole VM."""
        if command.exited:
            return
        try:
            async with asyncio.timeout(_KILL_WAIT_S):
                with contextlib.suppress(Unavailable):
                    await vm.send(b"M", 0, marshal.dumps({"op": "kill", "id": command.command_id}))
                await command.wait_exit()
        except TimeoutError:
            await self._end()

    async def spawn(
        self,
        executable: str,
        argv: Sequence[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        ring_bytes: int,
        stdout: Callable[[int], RingCapture] | None = None,
    ) -> MicroVMProcess:
        vm = await self._ready_vm()
        out = _Stream(ring_bytes, newest=True)
        reader = None
        if stdout is not None:
            reader, out = _host_pipe(stdout)
        err = _Stream(ring_bytes, newest=True)
        try:
            command = await self._launch(vm, executable, argv, cwd, env, out, err, stdin=True)
        except BaseException:
            if reader is not None:  # all or none: the host pipe goes with the command that did not start
                out.ended.set()
                reader.close()
            raise
        command.reader = reader
        return command

    async def open_pty(
        self, executable: str, argv: Sequence[str], *, cwd: str, env: Mapping[str, str], rows: int, cols: int
    ) -> PtyProcess:
        """The agent opens the terminal in the guest and hands its master to the stream port, which
        carries it to the host end of a socket pair (`MicroVMPty.fd`) on a stream reserved here."""
        vm = await self._ready_vm()
        assert vm.egress is not None
        try:
            stream_id = vm.egress.reserve()
        except ConnectionResetError as exc:
            raise Unavailable(f"cannot open a terminal: {exc}") from None
        except OSError as exc:  # its socket pair, at the server's fd limit: nothing was asked of the guest
            raise _out_of_fds("open a terminal", exc) from None
        command_id = next(vm.ids)
        pty = vm.ptys[command_id] = MicroVMPty(command_id, argv, vm.egress, stream_id)
        request = {
            "op": "pty",
            "id": command_id,
            "exe": executable,
            "argv": list(argv),
            "cwd": cwd,
            "env": dict(env),
            "rows": rows,
            "cols": cols,
            "stream": stream_id,
        }
        try:
            async with asyncio.timeout(_PTY_START_TIMEOUT_S):
                await vm.send(b"M", 0, marshal.dumps(request))
                error = await asyncio.shield(pty.opened)
                if error is not None:
                    raise Unavailable(f"the terminal's program did not start: {error}")
                sock = await vm.egress.attach(stream_id, _PTY_START_TIMEOUT_S)
        except BaseException as exc:
            await asyncio.shield(self._give_up_pty(vm, pty))
            if isinstance(exc, TimeoutError):
                raise Unavailable("the microVM did not open the terminal in time") from None
            if isinstance(exc, ConnectionRefusedError):
                raise Unavailable("the microVM's terminal ended before it was connected") from None
            raise
        pty.fd = sock.detach()
        return pty

    async def _give_up_pty(self, vm: _Guest, pty: MicroVMPty) -> None:
        """A terminal not handed out: end its stream, and its program if it started."""
        pty.egress.end_soon(pty.stream_id)
        if pty.opened.done() and pty.opened.result() is None:
            await self._kill_command(vm, pty)
        vm.ptys.pop(pty.command_id, None)

    async def kill(self, process: Process | PtyProcess) -> bool:
        """An exited command left nothing to kill: its PID namespace in the guest ended with it."""
        if self._paused:
            raise Conflict("the sandbox is paused: resume it first")
        if self._vm is None or not isinstance(process, MicroVMProcess | MicroVMPty) or process.exited:
            return False
        await self._kill_command(self._vm, process)
        return True

    def leftovers(self) -> list[Leftover]:
        return []  # each command is PID 1 of its own namespace in the guest: nothing outlives it

    async def connect(self, port: int) -> socket.socket:
        """A socket carried over the stream port to a new connection to 127.0.0.1:`port` in the guest,
        made there by the guest's stream port program. Does not boot a guest that is asleep."""
        if type(port) is not int or not 0 < port < 65536:
            raise InvalidRequest(f"port {port!r} is not a TCP port: give 1 to 65535")
        if self._paused:
            raise Conflict("the sandbox is paused: resume it first")
        vm = self._vm
        if vm is None or not self.alive or vm.egress is None:
            raise Unavailable("the sandbox is not running")
        try:
            return await vm.egress.open_tcp(port, _CONNECT_TIMEOUT_S)
        except TimeoutError:  # before OSError, its base class
            raise Unavailable("the sandbox did not answer the connect in time") from None
        except ConnectionRefusedError:
            raise Unavailable(_NOTHING_ACCEPTS) from None
        except OSError as exc:
            raise Unavailable(f"cannot connect into the sandbox: {exc}") from None

    async def kill_leftover(self, pid: int) -> None:
        raise NotFound(f"no process left running has pid {pid} (microVM commands leave none)")

    def _require_group(self) -> SandboxCgroup:
        if self._vm is None or not self._vm.alive or self._vm.group is None:
            raise Conflict("the sandbox is not running or has no cgroup: run a command in it first")
        if self._starting:  # a VMM frozen while it boots misses its boot deadline (as `WarmSandbox`'s)
            raise Conflict("the sandbox is starting: try again once it runs")
        return self._vm.group

    def pause(self) -> None:
        """Freeze the VMM's cgroup: its vCPUs and device threads stop, the guest's clock jumps on resume. Set, then
        checked against the guest frozen, as `WarmSandbox.pause` (a guest that ended meanwhile is not left paused)."""
        vm = self._vm
        self._require_group().freeze()
        self._paused = True
        if self._vm is not vm or vm is None or not vm.alive:
            self._paused = False
            raise Conflict("the sandbox ended while it was being paused: nothing of it runs")

    def resume(self) -> None:
        self._require_group().thaw()
        self._paused = False

    def usage(self) -> Usage | None:
        if self._vm is None or not self._vm.alive or self._vm.group is None:
            return None
        return self._vm.group.usage()

    def set_limits(self, limits: Limits) -> None:
        if self._cgroups is None:
            raise Unavailable("resource limits need cgroups, and none are available")
        self._limits = limits
        host = self._host_limits()
        if self._vm is not None and self._vm.group is not None and host is not None:
            self._vm.group.set_limits(host)
        if self._vm is not None and self._vm.alive and limits.pids is not None:
            self._vm.send_soon(b"P", limits.pids)  # the guest's own task limit, live
        if self._vm is not None and self._vm.alive and limits.memory_bytes is not None:
            self._vm.send_soon(b"L", 0, str(limits.memory_bytes).encode())  # and its memory limit

    def oom_kills(self) -> int:
        """OOM kills in the guest's commands' group and of the whole VMM, since the sandbox was made."""
        return self._past_ooms + (_vm_ooms(self._vm) if self._vm is not None else 0)

    def _retire(self, vm: _Guest) -> None:
        """Keep a guest's OOM kills past its end (sleep or close)."""
        self._past_ooms += _vm_ooms(vm)

    def memory_note(self) -> str:
        """How much of the commands' memory files in the guest's /tmp and /dev/shm hold, as the namespace
        backend says it (the guest's own count, as its relay gave it at the last exit)."""
        limit = self._limits.memory_bytes if self._limits is not None else None
        if self._vm is None or limit is None:
            return f"the guest has {self.settings.memory_mib} MiB"
        return (
            f"files in /tmp and /dev/shm and shared memory held {_mib(self._vm.guest_shmem)} of its {_mib(limit)} limit"
        )

    def sleep(self) -> bool:
        """Stop an idle guest that holds nothing but files: no command running (what a command starts
        ends with it) and its /tmp and /dev/shm empty (its relay says so before each exit). Its VMM,
        memory and cgroup go; the workspace is the host's folder. The next command boots it again."""
        vm = self._vm
        if vm is None or not self.alive or self._paused or not vm.scratch_empty:
            return False
        if any(not command.exited for command in vm.commands.values()) or vm.ptys:
            return False
        self._vm = None
        self._retire(vm)
        vm.detach()
        vm.kill_vmm()
        self._asleep = True
        self._stop_soon(vm)  # the reaper calls this on the event loop: the VMM's exit is waited for there
        return True

    def _stop_soon(self, vm: _Guest) -> asyncio.Task[None]:
        """Stop `vm` in a task `aclose` waits for, which runs to its end even if whoever awaits it is cancelled."""
        task = asyncio.get_running_loop().create_task(vm.astop())
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)
        return task

    def close(self) -> None:
        vm, self._vm = self._vm, None
        self._paused = False
        if vm is not None:
            self._retire(vm)
            _thaw(vm.group)
            vm.detach()
            vm.stop()

    async def _end(self) -> None:
        """`close` on the event loop, for its own error paths too: a blocking `close` there stalled every
        sandbox's calls while a guest slow to exit was waited for (up to `_KILL_WAIT_S`)."""
        vm, self._vm = self._vm, None
        self._paused = False
        if vm is not None:
            self._retire(vm)
            _thaw(vm.group)
            vm.detach()
            await asyncio.shield(self._stop_soon(vm))

    async def aclose(self, *, final: bool = False) -> None:
        self._closed = self._closed or final
        vm = self._vm
        await self._end()
        if vm is not None and vm.task is not None:
            await asyncio.gather(vm.task, return_exceptions=True)
        await asyncio.gather(*self._stopping, return_exceptions=True)  # a slept guest's VMM, being reaped


def _host_pipe(stdout: Callable[[int], RingCapture]) -> tuple[RingCapture, _Stream]:
    """A spawned command's stdout as a host pipe: `stdout`'s reader of its read end, and the stream feeding
    its write end (closed when the stream ends). Both or neither.

    Raises:
        Unavailable: the pipe could not be made (EMFILE, ENFILE: the server or the machine is out of fds).
    """
    try:
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
    except OSError as exc:
        raise _out_of_fds("make the command's pipe", exc) from None
    piped = _Piped(write_end)
    try:
        reader = stdout(read_end)
    except BaseException:
        piped.close()
        os.close(read_end)
        raise
    out = _Stream(0, newest=True, sink=piped.write)
    out.ended = _EndsPipe(piped)
    return reader, out


class _EndsPipe(asyncio.Event):
    """A piped stdout's end: set when the guest's stream ends, and then the host pipe closes."""

    def __init__(self, piped: _Piped) -> None:
        super().__init__()
        self._piped = piped

    def set(self) -> None:
        super().set()
        self._piped.end()


class MicroVMBackend:
    """The microVM backend: each sandbox a guest with a kernel of its own."""

    name = ISOLATION

    def __init__(self, settings: MicroVMSettings, cgroups: CgroupLayout | None) -> None:
        self.settings = settings
        self._cgroups = cgroups

    def sandbox(self, spec: SandboxSpec, *, limits: Limits | None) -> MicroVMSandbox:
        return MicroVMSandbox(spec, self.settings, cgroups=self._cgroups, limits=limits)


def missing_boot_files(settings: MicroVMSettings) -> str | None:
    """One line naming the first of QEMU and the boot files that is missing; None if all are there."""
    for path in (Path(QEMU), settings.image_dir / KERNEL_NAME, settings.image_dir / INITRAMFS_NAME):
        if not path.exists():
            return f"{path} is missing: run 'make install' (microVM packages and boot files)"
    return None


def boot_files_problem(image_dir: Path) -> str | None:
    """One line refusing the boot files in `image_dir` if a user besides root and this process's could change
    them (the folder, a folder or link on its way, the kernel or the initramfs), or None. Every guest boots
    them with the sandbox's workspace and egress; a file that is missing is judged by its folder (only root
    and this process's user could make it) and left to `missing_boot_files`."""
    owner = (os.geteuid(), os.getegid())
    try:
        who = folder_changeable_by(str(image_dir), owner)
        for name in (KERNEL_NAME, INITRAMFS_NAME):
            path = image_dir / name
            if who is None and os.path.lexists(path):
                who = file_replaceable_by(str(path), owner)
    except OSError as exc:
        return f"the microVM boot files in {image_dir} cannot be examined ({exc.strerror or exc}): fix the folder"
    if who is None:
        return None
    ours = owners_phrase(owner)
    return (
        f"the microVM boot files in {image_dir} could be changed by {who}, and so run in every guest: make the "
        f"folder, its files and the folders above it {ours} and not writable by others (chown, chmod go-w), "
        "or build them elsewhere (python -m bastion.sandbox.vmimage DIR) and set [sandboxes.microvm] image_dir"
    )


async def probe_microvm(settings: MicroVMSettings, timeout_s: float) -> str | None:
    """Boot a tiny guest and run `true` in it: None if it works, else one line saying why not.

    Raises:
        Unavailable: another user could change the boot files (`boot_files_problem`); no guest is started.
    """
    missing = missing_boot_files(settings)
    if missing:
        return missing
    untrusted = boot_files_problem(settings.image_dir)
    if untrusted is not None:  # not KVM's failure: emulation would boot the same files
        raise Unavailable(untrusted)
    # Never QEMU as root: the boot files may be another account's to replace (the default folder lies
    # in /var/lib/bastion), and a root VMM would give that guest's 9p mknod and open the host's disks.
    identity = (_NOBODY, _NOBODY) if os.geteuid() == 0 else None
    with tempfile.TemporaryDirectory(prefix="bastion-vm-probe-") as folder:
        if identity is not None:
            os.chown(folder, *identity)
        tiny = MicroVMSettings(
            settings.image_dir, memory_mib=128, vcpus=1, accel=settings.accel, boot_timeout_s=timeout_s
        )
        box = MicroVMSandbox(SandboxSpec(workspace=folder, identity=identity), tiny, cgroups=None, limits=None)
        try:
            outcome = await box.run(
                "/bin/true", ["true"], cwd="/workspace", env={}, timeout_s=timeout_s, max_output_bytes=1024
            )
        except (Unavailable, Conflict, ResourceLimit) as exc:
            return f"a {settings.accel} guest does not boot here: {exc}"
        finally:
            await box.aclose(final=True)
    return None if outcome.status == 0 else f"a {settings.accel} guest booted but `true` exited {outcome.status}"


def _conforms(backend: MicroVMBackend, sandbox: MicroVMSandbox) -> tuple[Backend, Sandbox]:
    """Never called: mypy checks here that the microVM backend implements the protocol."""
    return backend, sandbox

"""Container semantics in a real bubblewrap sandbox with cgroups: what a command leaves running
lives on until the sandbox closes, a timeout or cancel still kills a command's whole tree, and
nothing a command can do reaches the cgroup files or the agent's descriptors."""

from __future__ import annotations

import asyncio
import os
import select
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from bastion.safety.errors import NotFound
from bastion.sandbox import inside
from bastion.sandbox._spawn import AGENT_PATH, FORWARDER_PATH, INSIDE_FILES, KERNEL_PATH, SANDBOX_PATH, SandboxSpec
from bastion.sandbox.backend import RunOutcome
from bastion.sandbox.cgroups import CgroupLayout, Limits
from bastion.sandbox.processes import DRAIN_PAUSE_S
from bastion.sandbox.warm import WarmSandbox
from tests.helpers import processes_with

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

ENV = {"PATH": SANDBOX_PATH, "HOME": "/workspace", "LANG": "C.UTF-8"}
LIMITS = Limits(memory_bytes=256 << 20, pids=64, cpu_cores=1.0)
MakeBox = Callable[[], WarmSandbox]


@pytest.fixture
async def make_box(tmp_path: Path) -> AsyncIterator[MakeBox]:
    layout = CgroupLayout.detect(base_name=f"bastion-cmdgroups-{os.getpid()}")
    made: list[WarmSandbox] = []

    def make() -> WarmSandbox:
        workspace = tmp_path / f"ws{len(made)}"
        workspace.mkdir()
        made.append(WarmSandbox(SandboxSpec(workspace=str(workspace)), cgroups=layout, limits=LIMITS))
        return made[-1]

    yield make
    for box in made:
        await box.aclose(final=True)
    layout.release()  # refuses while any sandbox or command group is left


@pytest.fixture
def box(make_box: MakeBox) -> WarmSandbox:
    return make_box()


async def sh(box: WarmSandbox, script: str, *, timeout_s: float = 10) -> RunOutcome:
    return await box.run(
        "/bin/sh", ["sh", "-c", script], cwd="/workspace", env=ENV, timeout_s=timeout_s, max_output_bytes=65536
    )


async def until(check: Callable[[], bool]) -> None:
    """Poll `check` (no event tells when another process has started or ended) for at most 10 s."""
    async with asyncio.timeout(10):
        while not check():
            await asyncio.sleep(0.01)


def sleeping(marker: str) -> list[int]:
    """Host pids of `sleep MARKER` processes (not of the shells whose scripts name the marker)."""
    return [pid for pid in processes_with(marker) if _cmdline(pid).startswith(b"sleep\0")]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def command_groups(box: WarmSandbox) -> list[str]:
    """Folders of the sandbox's command groups on the host."""
    group = box._group
    assert group is not None
    home = os.path.dirname(group.home_procs())
    return sorted(entry.path for entry in os.scandir(home) if entry.is_dir())


DAEMONS = {
    "ampersand": "sleep {m} >/dev/null 2>&1 &",
    "ampersand_holding_stdout": "sleep {m} &",
    "nohup": "nohup sleep {m} >/dev/null 2>&1 &",
    "setsid": "setsid sleep {m} >/dev/null 2>&1 &",
    "double_fork": "(sleep {m} >/dev/null 2>&1 &)",
    "self_daemonizing_python": (
        "python3 -c 'import os, sys\n"
        "if os.fork(): sys.exit(0)\n"
        "os.setsid()\n"
        "if os.fork(): os._exit(0)\n"
        "os.closerange(0, 3)\n"
        'os.execvp("sleep", ["sleep", sys.argv[1]])\' {m}'
    ),
}


@pytest.mark.parametrize("way", sorted(DAEMONS))
async def test_a_process_left_running_survives_its_command_until_close(box: WarmSandbox, way: str) -> None:
    marker = f"4301.{sorted(DAEMONS).index(way) + 1}"
    outcome = await sh(box, DAEMONS[way].format(m=marker) + "\necho started")
    assert (outcome.status, outcome.stdout, outcome.timed_out) == (0, b"started\n", False)
    await until(lambda: len(sleeping(marker)) == 1)
    [host_pid] = sleeping(marker)
    seen = await sh(box, f"ps -eo pid=,ppid=,args= | grep '[s]leep {marker}'")
    inner_pid, parent, *_ = seen.stdout.split()
    assert parent == b"1"  # reparented to the agent, PID 1, which reaps it
    assert [(left.pid, left.argv) for left in box.leftovers()] == [(int(inner_pid), (b"sleep", marker.encode()))]
    assert not box.sleep()  # an idle sandbox with a daemon stays awake
    await box.aclose()
    assert not os.path.exists(f"/proc/{host_pid}")
    assert processes_with(marker) == []


async def test_a_web_server_started_with_ampersand_answers_the_next_command(box: WarmSandbox) -> None:
    started = await sh(box, "python3 -m http.server 8001 --bind 127.0.0.1 &")
    assert (started.status, started.timed_out) == (0, False)
    fetch = (
        "python3 -c 'import urllib.request, time\n"
        "for _ in range(200):\n"
        "    try:\n"
        '        print(urllib.request.urlopen("http://127.0.0.1:8001/").status); break\n'
        "    except OSError: time.sleep(0.05)'"
    )
    assert (await sh(box, fetch)).stdout == b"200\n"
    [server] = box.leftovers()
    assert server.argv[:3] == (b"python3", b"-m", b"http.server")


async def test_timeout_kills_the_whole_tree_but_not_what_other_commands_left(box: WarmSandbox) -> None:
    keep, doomed = "4302.5", "4302.75"
    await sh(box, f"setsid sleep {keep} >/dev/null 2>&1 &")
    script = f"setsid sleep {doomed} >/dev/null 2>&1 & (sleep {doomed} &); nohup sleep {doomed} & sleep {doomed}"
    outcome = await sh(box, script, timeout_s=0.5)
    assert outcome.timed_out
    await until(lambda: processes_with(doomed) == [])
    assert len(processes_with(keep)) == 1
    assert [left.argv[1] for left in box.leftovers()] == [keep.encode()]


async def test_cancel_kills_the_whole_tree_including_its_daemon(box: WarmSandbox) -> None:
    marker = "4303.25"
    task = asyncio.create_task(sh(box, f"setsid sleep {marker} >/dev/null 2>&1 & sleep {marker}"))
    await until(lambda: len(sleeping(marker)) == 2)
    victims = sleeping(marker)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in victims))
    assert box.leftovers() == []


async def test_close_leaves_no_process_and_removes_every_command_group(box: WarmSandbox) -> None:
    marker = "4304.5"
    for _ in range(3):
        await sh(box, f"sleep {marker} & setsid sleep {marker} >/dev/null 2>&1 &")
    await until(lambda: len(sleeping(marker)) == 6)
    group = box._group
    assert group is not None
    paths = command_groups(box)
    assert len(paths) >= 3  # each command that left processes holds its own group
    await box.aclose()
    assert processes_with(marker) == []
    assert group.pids() == []
    assert not any(os.path.exists(path) for path in [*paths, *group.paths])


async def test_groups_of_commands_that_left_nothing_are_reused(box: WarmSandbox) -> None:
    for _ in range(20):
        assert (await sh(box, "true")).status == 0
    assert len(command_groups(box)) == 1


async def test_a_left_process_that_exits_frees_its_group(box: WarmSandbox) -> None:
    await sh(box, "sleep 0.05 >/dev/null 2>&1 &")
    await until(lambda: box.leftovers() == [])
    for _ in range(5):
        await sh(box, "true")
    assert len(command_groups(box)) == 1


async def test_fork_bomb_of_left_processes_stays_under_pids_max(box: WarmSandbox) -> None:
    marker = "4305.5"
    outcome = await sh(box, f"for i in $(seq 200); do sleep {marker} >/dev/null 2>&1 & done 2>/dev/null")
    assert not outcome.timed_out
    usage = box.usage()
    assert usage is not None
    assert usage.pids <= 64
    left = box.leftovers()
    assert 0 < len(left) < 64
    for process in left:
        await box.kill_leftover(process.pid)
    assert (await sh(box, "echo alive")).stdout == b"alive\n"


async def test_kill_leftover_ends_only_that_process(box: WarmSandbox) -> None:
    await sh(box, "sleep 4306.25 >/dev/null 2>&1 & sleep 4306.5 >/dev/null 2>&1 &")
    await until(lambda: len(box.leftovers()) == 2)
    first, second = box.leftovers()
    await box.kill_leftover(first.pid)
    assert box.leftovers() == [second]
    assert processes_with("4306.25") == []


async def test_kill_leftover_refuses_a_pid_of_the_host_or_of_another_sandbox(make_box: MakeBox) -> None:
    mine, other = make_box(), make_box()
    for _ in range(3):
        await sh(mine, "/bin/true")  # each takes a pid: the two sandboxes' daemons get different ones
    await sh(mine, "sleep 4307.5 >/dev/null 2>&1 &")
    await sh(other, "sleep 4307.75 >/dev/null 2>&1 &")
    await until(lambda: len(other.leftovers()) == 1 and len(mine.leftovers()) == 1)
    [theirs] = other.leftovers()
    assert theirs.pid != mine.leftovers()[0].pid  # a pid that names a process in the other sandbox only
    for pid in (theirs.pid, os.getpid(), 1, 999_999):
        with pytest.raises(NotFound, match="no process"):
            await mine.kill_leftover(pid)
    assert len(other.leftovers()) == 1


async def test_kill_leftover_refuses_a_running_commands_process(box: WarmSandbox) -> None:
    marker = "4308.5"
    task = asyncio.create_task(sh(box, f"sleep {marker}"))
    await until(lambda: len(sleeping(marker)) == 1)
    inner = int((await sh(box, "pgrep -x sleep")).stdout)
    with pytest.raises(NotFound):
        await box.kill_leftover(inner)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_kill_a_background_process_takes_its_daemon(box: WarmSandbox) -> None:
    marker = "4309.5"
    process = await box.spawn(
        "/bin/sh", ["sh", "-c", f"setsid sleep {marker} & exec sleep {marker}"], cwd="/", env=ENV, ring_bytes=1024
    )
    await until(lambda: len(sleeping(marker)) == 2)
    await box.kill(process)
    await until(lambda: processes_with(marker) == [])


# -- hostile commands ------------------------------------------------------------------------------


async def test_a_command_cannot_reach_any_cgroup_file(box: WarmSandbox) -> None:
    probe = (
        "cat /proc/self/cgroup; ls /sys/fs/cgroup 2>&1; mkdir -p /tmp/cg; "
        "mount -t cgroup2 none /tmp/cg 2>&1 || echo mount-refused; "
        "unshare -Urm sh -c 'mount -t cgroup2 none /tmp/cg && echo 0 > /tmp/cg/cgroup.procs' 2>&1 "
        "|| echo unshare-refused"
    )
    out = (await sh(box, probe)).stdout.decode()
    # Its own command group, as the sandbox's cgroup namespace shows it.
    assert any(line.startswith("0::/c") for line in out.splitlines()), out
    assert "No such file or directory" in out
    assert "mount-refused" in out
    assert "unshare-refused" in out


async def test_a_command_cannot_move_itself_out_of_its_group(box: WarmSandbox) -> None:
    marker = "4310.5"
    escape = (
        f"sh -c 'for f in /proc/1/fd/*; do echo 0 > $f; done; exec sleep {marker}' >/dev/null 2>&1 & sleep {marker}"
    )
    outcome = await sh(box, escape, timeout_s=0.5)
    assert outcome.timed_out
    await until(lambda: processes_with(marker) == [])  # both died with the command's group


async def test_a_command_cannot_read_or_take_the_agents_descriptors(box: WarmSandbox) -> None:
    probe = (
        "import ctypes, errno, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        "results = []\n"
        "for fd in range(16):\n"
        "    for what in ('open', 'readlink'):\n"
        "        try:\n"
        "            os.close(os.open(f'/proc/1/fd/{fd}', os.O_WRONLY)) if what == 'open' else "
        "os.readlink(f'/proc/1/fd/{fd}')\n"
        "            results.append(f'{what} {fd} OK')\n"
        "        except OSError as exc:\n"
        "            results.append(errno.errorcode[exc.errno])\n"
        "pidfd = os.pidfd_open(1)\n"
        "for fd in range(16):\n"  # pidfd_getfd = 438
        "    got = libc.syscall(438, pidfd, fd, 0)\n"
        "    results.append('getfd OK' if got >= 0 else errno.errorcode[ctypes.get_errno()])\n"
        "ctypes.set_errno(0)\n"
        "results.append('ptrace OK' if libc.ptrace(16, 1, 0, 0) == 0 else errno.errorcode[ctypes.get_errno()])\n"
        "for name in ('environ', 'mem'):\n"
        "    try:\n"
        "        open(f'/proc/1/{name}', 'rb').read(1)\n"
        "        results.append(name + ' OK')\n"
        "    except OSError as exc:\n"
        "        results.append(errno.errorcode[exc.errno])\n"
        "print(' '.join(sorted(set(results))))\n"
    )
    outcome = await box.run(
        "/usr/bin/python3", ["python3", "-c", probe], cwd="/", env=ENV, timeout_s=10, max_output_bytes=4096
    )
    assert outcome.status == 0, outcome.stderr
    assert b"OK" not in outcome.stdout, outcome.stdout
    assert set(outcome.stdout.split()) <= {b"EACCES", b"EPERM", b"ENOENT", b"EBADF", b"ENOSYS"}, outcome.stdout


async def test_sigint_or_sigkill_to_the_agent_from_a_command_changes_nothing(box: WarmSandbox) -> None:
    assert (await sh(box, "kill -INT 1; kill -TERM 1; kill -9 1; kill -9 -1; echo sent")).stdout == b"sent\n"
    assert (await sh(box, "echo alive")).stdout == b"alive\n"


# -- nothing of bastion on a command line ----------------------------------------------------------


def _tree(pid: int) -> list[int]:
    found = [pid]
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as handle:
            for child in handle.read().split():
                found += _tree(int(child))
    return found


async def test_every_command_line_in_and_around_the_sandbox_is_short(box: WarmSandbox) -> None:
    """bwrap on the host, the agent, and each command: no program source on any command line."""
    task = asyncio.create_task(sh(box, "sleep 4311.5"))
    await until(lambda: len(sleeping("4311.5")) == 1)
    assert box._proc is not None
    tree = _tree(box._proc.pid)
    assert len(tree) >= 3  # bwrap, the agent, the command
    for pid in tree:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert len(cmdline) < 512, cmdline[:600]
    ps = await sh(box, "ps aux")
    assert ps.status == 0, ps.stderr
    assert len(ps.stdout) < 4096, ps.stdout[:600]
    assert b"/opt/bastion/agent.py" in ps.stdout
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_without_cgroups_each_command_still_has_a_pid_namespace_of_its_own(tmp_path: Path) -> None:
    """The fallback: nothing a command starts outlives it, and the agent's source is off argv too."""
    box = WarmSandbox(SandboxSpec(workspace=str(tmp_path)))
    try:
        marker = "4312.5"
        outcome = await sh(box, f"setsid sleep {marker} >/dev/null 2>&1 & echo $$")
        assert outcome.stdout == b"1\n"
        assert processes_with(marker) == []
        assert box.leftovers() == []
        assert box._proc is not None
        assert all(len(Path(f"/proc/{pid}/cmdline").read_bytes()) < 512 for pid in _tree(box._proc.pid))
    finally:
        await box.aclose(final=True)


def test_every_program_of_inside_is_bound_under_opt_bastion() -> None:
    """What runs inside reaches it as a read-only file, never as `-c <source>` on a command line (node's shim too)."""
    names = {Path(dest).name for dest in INSIDE_FILES}
    files = Path(inside.__file__).parent.iterdir()
    programs = {p.name for p in files if p.suffix in (".py", ".js")} - {"__init__.py", "landlock.py"}
    assert names == programs
    assert {KERNEL_PATH, FORWARDER_PATH, AGENT_PATH} <= set(INSIDE_FILES)
    assert INSIDE_FILES[AGENT_PATH].index("def restrict(") < INSIDE_FILES[AGENT_PATH].index("class Agent")


async def test_a_daemon_writing_forever_feeds_no_progress_after_its_command_returned(box: WarmSandbox) -> None:
    """Attack: an install leaves `while :; do echo x; done &` on the command's stdout. The host drains
    that pipe until it closes (a closed pipe would kill the daemon); it must stop feeding the output
    sink (progress: cleaned, redacted, sent) of a call that is over. Invariant: no chunk reaches it
    after run() returned, though the host read far more than a pipe holds since."""
    seen: list[int] = []
    script = "(while :; do echo xxxxxxxxxxxxxxx; echo >> /workspace/written; done) & echo started"
    sink = (lambda chunk: seen.append(len(chunk))), (lambda chunk: None)
    outcome = await box.run(
        "/bin/sh", ["sh", "-c", script], cwd="/workspace", env=ENV, timeout_s=10, max_output_bytes=4096, on_output=sink
    )
    assert outcome.status == 0
    calls = len(seen)
    written = Path(box.spec.workspace) / "written"
    start = written.stat().st_size
    # 16 bytes of stdout per byte of `written`: 1 MiB more read by the host than a pipe can hold.
    await until(lambda: written.stat().st_size - start > 65536)
    assert len(seen) == calls


async def test_every_signal_a_command_can_send_to_the_agent_changes_nothing(box: WarmSandbox) -> None:
    """Attack: every catchable and uncatchable signal at PID 1 (STOP, SEGV via kill, TERM, HUP...), and
    a flood of SIGCHLD, which the agent does handle. Invariant: the agent answers the next command."""
    every = " ".join(str(n) for n in range(1, 32))
    flood = "i=0; while [ $i -lt 2000 ]; do kill -CHLD 1; i=$((i+1)); done"
    outcome = await sh(box, f"for s in {every}; do kill -$s 1 2>/dev/null; done; {flood}; echo sent")
    assert outcome.stdout == b"sent\n", outcome.stderr
    assert (await sh(box, "echo alive")).stdout == b"alive\n"


async def test_kill_minus_one_ends_the_sandboxs_other_processes_but_not_the_agent(box: WarmSandbox) -> None:
    """Attack: `kill -9 -1` (and `kill -STOP -1`) from a command, while a background process, a daemon
    left by another command and a running command exist. Invariant: the kernel spares PID 1, so the agent
    lives; the host sees each victim end (an exit status, no hang) and the next command runs."""
    left, running = "4312.5", "4312.75"
    await sh(box, f"setsid sleep {left} >/dev/null 2>&1 &")
    background = await box.spawn("/bin/sleep", ["sleep", "4312.25"], cwd="/", env=ENV, ring_bytes=1024)
    other = asyncio.create_task(sh(box, f"sleep {running}"))
    await until(lambda: len(sleeping(left)) == 1 and len(sleeping(running)) == 1)
    # Linux spares the sender too: the shell that sent them lives on.
    assert (await sh(box, "kill -STOP -1; kill -9 -1; echo survived")).stdout == b"survived\n"
    assert (await other).status == 137
    await asyncio.wait_for(background.wait_exit(), 10)
    assert background.exited
    await until(lambda: sleeping(left) == [] and box.leftovers() == [])
    assert (await sh(box, "echo alive")).stdout == b"alive\n"


async def test_a_command_forking_as_fast_as_it_can_while_timed_out_leaves_nothing(box: WarmSandbox) -> None:
    """Attack: a command that keeps forking daemons (setsid, double forks) while its timeout kills it,
    to slip one out between the kill's read of its group and the last fork. Invariant: cgroup.kill
    takes the group whole, forks in flight included: nothing with its marker survives, no leftover."""
    marker = "4313.5"
    forker = (
        "import os\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()\n"
        f"            os.execvp('sleep', ['sleep', '{marker}'])\n"
        "    except OSError:\n"
        "        pass\n"  # at pids.max: keep trying, as each killed sleep frees a slot
    )
    outcome = await box.run(
        "/usr/bin/python3", ["python3", "-c", forker], cwd="/", env=ENV, timeout_s=1, max_output_bytes=4096
    )
    assert outcome.timed_out
    await until(lambda: processes_with(marker) == [])
    assert box.leftovers() == []
    assert (await sh(box, "echo alive")).stdout == b"alive\n"


async def test_a_daemon_writing_forever_after_its_command_is_drained_at_a_bounded_pace(box: WarmSandbox) -> None:
    """Attack: `yes &`, or any process a command leaves writing without end to the command's stdout. The
    host must drain that pipe (a closed one would kill the process), and read at full speed it cost the
    server's event loop 60 % of a core until the sandbox closed. Invariant: after the command returned, one
    64 KiB chunk per DRAIN_PAUSE_S: 20 blocks take at least 18 pauses (the pipe holds one, one is in flight)."""
    writer = (
        "import os\n"
        "while True:\n"
        "    os.write(1, b'y' * 65536)\n"
        "    with open('/workspace/blocks', 'ab') as count:\n"
        "        count.write(b'.')\n"
    )
    script = f'python3 -c "{writer}" & echo started'
    assert (await sh(box, script)).stdout.startswith(b"started")
    blocks = Path(box.spec.workspace) / "blocks"
    await until(blocks.exists)
    start, started = blocks.stat().st_size, time.monotonic()
    await until(lambda: blocks.stat().st_size >= start + 20)
    assert time.monotonic() - started >= 18 * DRAIN_PAUSE_S * 0.9


async def test_a_command_cannot_read_the_agents_memory_map_or_memory(box: WarmSandbox) -> None:
    """Attack: the agent is PID 1 of the command's own PID namespace, same uid: read its /proc/1/maps,
    auxv, stack, syscall, pagemap, or its memory with process_vm_readv (address from a guess, as the map
    is refused). Invariant: all refused (the agent is not dumpable, and keeps capabilities commands lack);
    /proc/1/cmdline names no secret, only the agent's fixed argv."""
    probe = (
        "import ctypes, errno\n"
        "results = []\n"
        "for name in ('maps', 'smaps', 'auxv', 'stack', 'syscall', 'pagemap', 'environ', 'mem'):\n"
        "    try:\n"
        "        open(f'/proc/1/{name}', 'rb').read(1)\n"
        "        results.append(name + ' OK')\n"
        "    except OSError as exc:\n"
        "        results.append(errno.errorcode[exc.errno])\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "buf = ctypes.create_string_buffer(16)\n"
        "local = (ctypes.c_void_p * 2)(ctypes.cast(buf, ctypes.c_void_p), 16)\n"
        "remote = (ctypes.c_void_p * 2)(0x400000, 16)\n"
        "got = libc.process_vm_readv(1, local, 1, remote, 1, 0)\n"
        "results.append('vm_readv OK' if got >= 0 else errno.errorcode[ctypes.get_errno()])\n"
        "print(' '.join(sorted(set(results))))\n"
        "print(open('/proc/1/cmdline', 'rb').read().replace(b'\\0', b' ').decode())\n"
    )
    outcome = await box.run(
        "/usr/bin/python3", ["python3", "-c", probe], cwd="/", env=ENV, timeout_s=10, max_output_bytes=4096
    )
    assert outcome.status == 0, outcome.stderr
    refusals, cmdline = outcome.stdout.decode().splitlines()
    assert set(refusals.split()) <= {"EACCES", "EPERM"}, refusals
    assert cmdline.startswith("/usr/bin/python3 -I -S /opt/bastion/agent.py "), cmdline


async def test_a_command_inherits_no_fd_of_the_agent_and_finds_no_socket_to_reach_it(box: WarmSandbox) -> None:
    """Attack: find a way to speak the agent's protocol from a command: an inherited fd (its socket,
    the cgroup.procs fds), or a named or abstract unix socket it listens on. Invariant: a command holds
    only 0, 1 and 2, and the sandbox's network namespace lists no bound unix socket at all (the agent's
    is an unnamed socketpair)."""
    probe = (
        "import os\n"
        "print(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))\n"
        "rows = open('/proc/net/unix').read().splitlines()[1:]\n"
        "print([row.split()[-1] for row in rows if len(row.split()) > 7])\n"
    )
    outcome = await box.run(
        "/usr/bin/python3", ["python3", "-c", probe], cwd="/", env=ENV, timeout_s=10, max_output_bytes=4096
    )
    assert outcome.status == 0, outcome.stderr
    fds, names = outcome.stdout.decode().splitlines()
    assert fds == "[0, 1, 2, 3]"  # 3: listdir's own handle on /proc/self/fd
    assert names == "[]"


async def test_a_command_cannot_pull_the_agent_into_its_group_to_kill_it_with_its_timeout(box: WarmSandbox) -> None:
    """Attack: write PID 1 into every cgroup.procs fd the command might have inherited (the agent received
    its command group's fd by SCM_RIGHTS, without close-on-exec), then outlive the timeout: the host's
    cgroup.kill of the command's group would take the agent, and the whole sandbox, with it.
    Invariant: the command holds no such fd; the agent lives and answers the next command."""
    pull = (
        "import os\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        os.write(fd, b'1')\n"
        "        print('moved by', fd, flush=True)\n"
        "    except OSError:\n"
        "        pass\n"
        "os.execv('/bin/sleep', ['sleep', '3600'])\n"
    )
    outcome = await box.run(
        "/usr/bin/python3", ["python3", "-c", pull], cwd="/", env=ENV, timeout_s=1, max_output_bytes=4096
    )
    assert outcome.timed_out
    assert b"moved" not in outcome.stdout, outcome.stdout
    assert box.alive
    assert (await sh(box, "echo alive")).stdout == b"alive\n"


async def test_a_terminal_program_inherits_no_fd_of_the_agent(box: WarmSandbox) -> None:
    """Attack: as above, from a program on a terminal (op "pty" also carries its group's cgroup.procs).
    Invariant: it holds only its terminal as 0, 1 and 2."""
    probe = "import os; print('fds', sorted(int(fd) for fd in os.listdir('/proc/self/fd')))"
    pty = await box.open_pty("/usr/bin/python3", ["python3", "-c", probe], cwd="/", env=ENV, rows=24, cols=80)
    seen = b""
    try:
        async with asyncio.timeout(20):
            while b"]" not in seen:
                await until(lambda: bool(select.select([pty.fd], [], [], 0)[0]))
                seen += os.read(pty.fd, 4096)
    finally:
        await box.kill(pty)
        os.close(pty.fd)
    assert b"fds [0, 1, 2, 3]" in seen, seen  # 3: listdir's own handle on /proc/self/fd

"""One server per state folder: a second one refuses to start and leaves the first one's sandboxes alone."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import anyio
import pytest
from mcp import Client

from bastion.app import Services, build_server, build_services
from bastion.config import load_config
from bastion.safety.errors import ConfigError
from bastion.state_lock import PID_FILE, StateLock
from tests.helpers import BASTION, call, create, refused_stdio_start, sh

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]


@pytest.fixture
def config_path(demo_config_path: Path) -> Path:
    """The demo without its inbox: the organizer's journal lock would refuse a second server on its
    own, and most configs have no inbox, so the state folder's lock must be what refuses it here."""
    kept, in_inbox = [], False
    for line in demo_config_path.read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith("["):
            in_inbox = line.startswith(("[[inbox]]", "[inbox.", "[[inbox."))
        if not in_inbox:
            kept.append(line)
    demo_config_path.write_text("".join(kept), encoding="utf-8")
    assert load_config(demo_config_path).inbox == ()
    return demo_config_path


def _tree(folder: Path) -> list[str]:
    if not folder.exists():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


async def test_second_server_on_same_state_folder_refused(config_path: Path) -> None:
    """Invariant: while a server runs, a second `bastion serve` on the same config (so the same
    state folder) exits at start with one line naming the first server's pid, before recovery: the
    first server's sandbox is not snapshotted or deleted, its files and mounts stay, the audit log
    gets nothing from the second process, and the sandbox keeps working. Does not prove anything
    about two servers given different state folders that share other paths."""
    services = build_services(load_config(config_path))
    try:
        async with Client(build_server(services, caller="test")) as client:
            await _second_server_leaves_the_first_alone(client, services, config_path)
    finally:
        services.close()


async def _second_server_leaves_the_first_alone(client: Client, services: Services, config_path: Path) -> None:
    box = await create(client)
    await sh(client, box, "echo kept > kept.txt")
    config = services.config
    # The warm pool refills in the background (new mounts under the state folder): let it finish first.
    with anyio.fail_after(60):
        while services.sandboxes.pool_size < config.sandboxes.warm_pool:
            await anyio.sleep(0.05)
    before = _tree(config.sandboxes_dir / box)
    audit_before = config.audit_path.read_bytes()
    snapshots_before = _tree(config.state_dir / "snapshots")
    mounts_before = Path("/proc/self/mountinfo").read_text().count(str(config.state_dir))

    assert refused_stdio_start(config_path) == (
        f"bastion: state folder {config.state_dir} is in use by another bastion server (pid {os.getpid()}): "
        "stop it, or give this server a state_dir of its own"
    )
    assert _tree(config.sandboxes_dir / box) == before
    assert _tree(config.state_dir / "snapshots") == snapshots_before
    assert config.audit_path.read_bytes() == audit_before
    assert Path("/proc/self/mountinfo").read_text().count(str(config.state_dir)) == mounts_before
    out = await sh(client, box, "cat kept.txt")
    assert out["detail"]["stdout"] == "kept\n"
    listed = await call(client, "list_sandboxes")
    assert [s["sandbox_id"] for s in listed["detail"]["sandboxes"]] == [box]


def test_second_server_in_process_on_same_state_folder_refused(config_path: Path) -> None:
    """Invariant: build_services on a state folder in use raises ConfigError (one line) before it
    opens anything, and the first server's lock (with its pid) holds; once the first server closes,
    the folder can be served again."""
    config = load_config(config_path)
    first = build_services(config)
    try:
        with pytest.raises(ConfigError, match=rf"is in use by another bastion server \(pid {os.getpid()}\)") as caught:
            build_services(config)
        assert "\n" not in str(caught.value)
        assert (config.state_dir / PID_FILE).read_text() == f"{os.getpid()}\n"
    finally:
        first.close()
    again = build_services(config)
    again.close()


def test_state_lock_released_by_a_killed_holder(tmp_path: Path) -> None:
    """Invariant: the kernel drops the lock of a holder killed with SIGKILL, so a crash never leaves
    the folder locked (the next server starts and recovers)."""
    holder = subprocess.Popen(
        [
            str(Path(BASTION).with_name("python")),
            "-c",
            "import sys, pathlib; from bastion.state_lock import StateLock; "
            "StateLock(pathlib.Path(sys.argv[1])).acquire(); print('locked', flush=True); sys.stdin.read()",
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(ConfigError, match=rf"\(pid {holder.pid}\)"):
            StateLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait(30)
        if holder.stdin is not None:
            holder.stdin.close()
        if holder.stdout is not None:
            holder.stdout.close()
    lock = StateLock(tmp_path)
    lock.acquire()
    lock.release()


def test_state_lock_names_no_process_that_is_gone(tmp_path: Path) -> None:
    """Invariant: a pid in server.lock whose process is gone (an earlier server's, before the holder
    wrote its own) is not named as the holder: the message says 'pid unknown' rather than mislead."""
    first = StateLock(tmp_path)
    first.acquire()
    try:
        (tmp_path / PID_FILE).write_text("999999999\n")
        with pytest.raises(ConfigError, match=r"in use by another bastion server \(pid unknown\)"):
            StateLock(tmp_path).acquire()
    finally:
        first.release()


def test_cli_commands_that_read_the_state_folder_work_beside_a_running_server(config_path: Path) -> None:
    """Invariant: the lock is a server's only: `bastion doctor`, `audit verify` and `approvals list`
    on the config of a running server still run (none of them takes the state folder's lock)."""
    config = load_config(config_path)
    services = build_services(config)
    try:
        runs = {
            name: subprocess.run(
                [str(BASTION), *args],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            for name, args in {
                "doctor": ["doctor", "--config", str(config_path)],
                "verify": ["audit", "verify", str(config.audit_path)],
                "approvals": ["approvals", "list", "--config", str(config_path)],
            }.items()
        }
    finally:
        services.close()
    for name, run in runs.items():
        assert "in use by another bastion" not in run.stdout + run.stderr, (name, run.stdout, run.stderr)
    assert runs["verify"].returncode == 0, runs["verify"].stderr
    assert runs["verify"].stdout.startswith("ok: ")
    assert runs["approvals"].returncode == 0, runs["approvals"].stderr
    assert "bastion doctor: " in runs["doctor"].stdout, runs["doctor"].stderr


# The system's interpreter: the one the tests run under may sit where nobody cannot reach it.
_SYSTEM_PYTHON = "/usr/bin/python3"
_FLOCK_AS_NOBODY = (
    "import fcntl, os, sys\n"
    "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
    "try:\n"
    "    os.open(os.path.join(sys.argv[1], 'server.lock'), os.O_RDONLY)\n"
    "    print('lock file opened', flush=True)\n"
    "except PermissionError:\n"
    "    print('locked', flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.mark.root
def test_state_lock_flock_of_a_readable_state_folder_by_a_local_user(tmp_path: Path) -> None:
    """Invariant: a local unprivileged user who can read the state folder (an administrator's 0755
    folder) and holds an flock on it, or tries to open server.lock, cannot keep the server from
    starting: the lock is on a 0600 file only the server's user can open. A second server is still
    refused. Does not prove anything about a user who can write to the folder (refused below)."""
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    first = StateLock(state)
    first.acquire()  # server.lock exists (0600) while the local user tries it
    first.release()
    nobody = subprocess.Popen(
        [_SYSTEM_PYTHON, "-c", _FLOCK_AS_NOBODY, str(state)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        user=65534,
        group=65534,
        extra_groups=[],
    )
    lock = StateLock(state)
    try:
        assert nobody.stdout is not None
        assert nobody.stdout.readline() == "locked\n"  # the folder's flock is theirs; the lock file is not theirs
        lock.acquire()
        assert (state / PID_FILE).read_text() == f"{os.getpid()}\n"
        with pytest.raises(ConfigError, match=rf"in use by another bastion server \(pid {os.getpid()}\)"):
            StateLock(state).acquire()
    finally:
        lock.release()
        nobody.kill()
        nobody.wait(30)
        for pipe in (nobody.stdin, nobody.stdout):
            if pipe is not None:
                pipe.close()


def test_state_lock_refuses_a_state_folder_others_can_write(tmp_path: Path) -> None:
    """Invariant: a state folder writable by group or others (where anyone could replace the lock
    file, the audit log or a sandbox) is refused at start with one line, and nothing is created in it."""
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o1777)
    with pytest.raises(ConfigError, match=r"is writable by group or others: chmod 700 it") as caught:
        StateLock(state).acquire()
    assert "\n" not in str(caught.value)
    assert list(state.iterdir()) == []


@pytest.mark.parametrize("planted", ["fifo", "symlink", "hard link", "readable"])
def test_state_lock_planted_lock_file_refused(tmp_path: Path, planted: str) -> None:
    """Invariant: a server.lock that is a FIFO, a symlink, a hard link or readable by others is refused
    at once with one line (a FIFO never blocks the start, a link's target is never written), since
    someone else may hold it open; the planted entry and any target are left as they were."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    target.chmod(0o600)
    lock_path = state / PID_FILE
    if planted == "fifo":
        os.mkfifo(lock_path, 0o600)
    elif planted == "symlink":
        lock_path.symlink_to(target)
    elif planted == "hard link":
        os.link(target, lock_path)
    else:
        lock_path.write_text("")
        lock_path.chmod(0o644)
    before = os.lstat(lock_path)
    with pytest.raises(ConfigError, match=rf"{PID_FILE} .*: remove it") as caught:
        StateLock(state).acquire()
    assert "\n" not in str(caught.value)
    assert target.read_text() == "keep\n"
    after = os.lstat(lock_path)
    assert (after.st_ino, after.st_mode, after.st_size) == (before.st_ino, before.st_mode, before.st_size)
    assert sorted(p.name for p in state.iterdir()) == [PID_FILE]


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="chowns a folder to an ordinary user")
def test_state_lock_refuses_a_state_folder_a_neighbour_could_rename_away(tmp_path: Path) -> None:
    """Attack: a root-owned, private state folder in a folder an ordinary user (12345) owns, as `bastion init`
    into a folder they made first left it (or as made at start in a sticky folder after they made its parent):
    they could rename it away while the server runs and put a link there, which root's unmounts at stop would
    follow. Invariant: the lock itself refuses it with one line naming the folder and uid 12345 (whoever starts
    a server through it), and creates nothing in it."""
    theirs = tmp_path / "docdemo"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 12345, 12345)
    state = theirs / "state"
    state.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match=rf"^state folder {state} could be replaced by uid 12345, who owns {theirs}:"):
        StateLock(state).acquire()
    assert list(state.iterdir()) == []
    os.chown(theirs, 0, 0)
    lock = StateLock(state)
    lock.acquire()  # root's all the way up: served
    lock.release()

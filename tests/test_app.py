"""`build_services` refuses to start with one line, and a refusal part-way leaves nothing open.

Each test makes one start-up step fail for real (a held lock, a file where a folder must be,
a setuid file, no mkfs, no cgroups) and then checks that what the steps before it opened is
closed: the state lock can be taken again, no fd of this process points into the demo folder
(audit log, journals, workspace and inbox folders), nothing is mounted there, and no thread
the start began is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import anyio
import pytest

from bastion.app import build_services, reap_forever
from bastion.config import Config, load_config
from bastion.organizer import Organizer
from bastion.organizer.folder import Folder
from bastion.organizer.inbox import journal_path
from bastion.organizer.journal import Journal
from bastion.safety.audit import verify
from bastion.safety.errors import ConfigError
from bastion.state_lock import StateLock

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="a root server's start-up")]


def open_fds_under(folder: Path) -> list[str]:
    """The targets of this process's fds that lie in `folder`."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listing's own fd, closed by now
        if target.startswith(f"{folder}/") or target == str(folder):
            found.append(target)
    return found


def mounts_under(folder: Path) -> list[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        points = [line.split()[4] for line in info]
    return [point for point in points if point.startswith(f"{folder}/")]


def assert_nothing_open(config: Config, demo: Path, threads_before: set[threading.Thread]) -> None:
    assert open_fds_under(demo) == []
    assert mounts_under(demo) == []
    assert set(threading.enumerate()) <= threads_before
    lock = StateLock(config.state_dir)
    lock.acquire()  # raises if the failed start still held it
    lock.release()
    for inbox in config.inbox:
        journal = Journal(journal_path(config.state_dir, inbox.id))
        journal.open()  # raises if the failed start still held the journal's lock
        journal.close()


def refused(config: Config, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_services(config)


def test_state_folder_held_by_another_holder(demo_config: Config, demo_config_path: Path) -> None:
    demo_config.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    holder = StateLock(demo_config.state_dir)
    holder.acquire()
    threads = set(threading.enumerate())
    try:
        refused(demo_config, "in use by another bastion server")
        assert not demo_config.audit_path.exists()  # refused before the audit log was opened
        assert open_fds_under(demo_config_path.parent) == [str(demo_config.state_dir / "server.lock")]
    finally:
        holder.release()
    assert_nothing_open(demo_config, demo_config_path.parent, threads)


def test_unusable_audit_log(demo_config: Config, demo_config_path: Path) -> None:
    demo_config.audit_path.mkdir(parents=True)  # a folder where the log must be
    threads = set(threading.enumerate())
    refused(demo_config, "audit log")
    assert_nothing_open(demo_config, demo_config_path.parent, threads)


def test_state_database_that_cannot_be_opened_stops_the_start_with_one_line(
    demo_config: Config, demo_config_path: Path
) -> None:
    """Invariant: a `bastion.db` SQLite cannot use (here not a database; on a full state filesystem,
    "disk I/O error" when its WAL cannot grow, seen by tests/load/test_fault_full_disk.py) stops the
    start with one line saying what to do, not a traceback, and leaves nothing open or mounted."""
    demo_config.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    demo_config.db_path.write_bytes(b"not a database, " * 512)
    demo_config.db_path.chmod(0o600)
    threads = set(threading.enumerate())
    refused(demo_config, r"database .*bastion\.db cannot be opened \(file is not a database\): free space on")
    assert_nothing_open(demo_config, demo_config_path.parent, threads)


def test_journal_held_by_another_holder(demo_config: Config, demo_config_path: Path) -> None:
    [inbox] = demo_config.inbox
    holder = Journal(journal_path(demo_config.state_dir, inbox.id))
    holder.open()
    threads = set(threading.enumerate())
    try:
        refused(demo_config, "journal .* is in use by another bastion")
    finally:
        holder.close()
    assert_nothing_open(demo_config, demo_config_path.parent, threads)


def test_no_disk_quota_tools(demo_config: Config, demo_config_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert demo_config.sandboxes.disk_quota
    monkeypatch.setenv("PATH", str(demo_config_path.parent))  # no mkfs.ext4 there
    threads = set(threading.enumerate())
    refused(demo_config, "sandbox disk quota: mkfs.ext4 is not installed")
    assert_nothing_open(demo_config, demo_config_path.parent, threads)


def test_setuid_file_in_a_host_workspace(demo_config: Config, demo_config_path: Path) -> None:
    planted = demo_config.workspace[0].path / "su"
    planted.write_bytes(b"")
    planted.chmod(0o4755)
    threads = set(threading.enumerate())
    refused(demo_config, r"run with privileges .*: 'su'; ")
    assert_nothing_open(demo_config, demo_config_path.parent, threads)


def test_unreadable_snapshots_stop_recovery(demo_config: Config, demo_config_path: Path) -> None:
    demo_config.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (demo_config.state_dir / "snapshots").write_bytes(b"a file where the snapshot folder must be")
    threads = set(threading.enumerate())
    # The administrator's line names the folder (the client's reasons never name host paths).
    refused(demo_config, "sandbox recovery: the snapshot folder cannot be opened: .*state/snapshots")
    assert_nothing_open(demo_config, demo_config_path.parent, threads)


# Run in a mount namespace whose /sys/fs/cgroup is an empty tmpfs: no cgroup can be found.
NO_CGROUPS = textwrap.dedent(
    """
    import json, os, sys
    from bastion.app import build_services
    from bastion.config import load_config
    from bastion.safety.errors import ConfigError
    from bastion.state_lock import StateLock

    config = load_config(sys.argv[1])
    demo = os.path.dirname(sys.argv[1])
    try:
        build_services(config)
    except ConfigError as exc:
        error = str(exc)
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            pass  # the listing's own fd, closed by now
    lock = StateLock(config.state_dir)
    lock.acquire()
    print(json.dumps({"error": error, "fds": [fd for fd in fds if fd.startswith(demo + "/")]}))
    """
)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_no_cgroups(demo_config_path: Path) -> None:
    config = load_config(demo_config_path)
    script = f'mount -t tmpfs none /sys/fs/cgroup && exec {sys.executable} -c "$0" "$1"'
    done = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script, NO_CGROUPS, str(demo_config_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["error"].startswith("cgroups: ")
    assert result["fds"] == []  # the audit log, the journal, the inbox: closed before the error surfaced
    journal = journal_path(config.state_dir, config.inbox[0].id)
    assert stat.S_ISREG(journal.stat().st_mode)  # the organizer had opened it: the refusal came after
    assert_nothing_open(config, demo_config_path.parent, set(threading.enumerate()))


def test_a_server_starts_without_asyncssh_or_pyte_until_it_needs_them(demo_config_path: Path) -> None:
    """asyncssh is about a seventh of the server's imports (140 ms of a second here), pyte and wcwidth a
    twelfth: only a gateway with a pinned host key, which has tools, loads asyncssh (the demo's has no
    key yet), and only the first terminal loads pyte."""
    code = textwrap.dedent(
        """
        import sys
        import bastion.serve, bastion.transports.http.app
        from bastion.app import build_server, build_services
        from bastion.config import load_config
        services = build_services(load_config(sys.argv[1]))
        try:
            build_server(services, caller="test")
            print(sorted(services.gateways), "asyncssh" in sys.modules, "pyte" in sys.modules)
        finally:
            services.close()
        """
    )
    assert [g.host_key for g in load_config(demo_config_path).gateway] == [None]
    done = subprocess.run([sys.executable, "-c", code, str(demo_config_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[] False False"


def test_config_with_env_secrets_readable_by_others_warns_at_start(
    demo_config_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Attack (/tmp/atk-local/config_mode.sh): `bastion init` wrote bastion.toml 0644, and the token an
    administrator put in a workspace's env was readable by every local user. Now init writes it 0600, and a
    server started on one that holds env values and that others may read logs one warning line naming the file
    and the fix (the value itself is not in it); a private one, or one without env values, logs none."""
    assert stat.S_IMODE(demo_config_path.stat().st_mode) == 0o600
    token = "ghp_neighbourCanReadThis0123456789"
    text = demo_config_path.read_text().replace("env = {}", f'env = {{ GITHUB_TOKEN = "{token}" }}', 1)
    demo_config_path.write_text(text)

    def warnings() -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="bastion.app"):
            build_services(load_config(demo_config_path)).close()
        return [r.getMessage() for r in caplog.records if r.name == "bastion.app" and "config file" in r.getMessage()]

    assert warnings() == []
    demo_config_path.chmod(0o644)
    assert warnings() == [
        f"config file {demo_config_path} holds secret values (env, a package index URL's password) and any user "
        "may read it: chmod 600 it"
    ]
    demo_config_path.write_text(text.replace(f'env = {{ GITHUB_TOKEN = "{token}" }}', "env = {}"))
    assert warnings() == []


def _apply_killed_at_fourth_move(config: Config) -> None:
    """An apply_plan of 8 files killed (SIGKILL) at its fourth move, in a child process: its journal holds
    the unfinished transaction the next start rolls back."""
    [inbox] = config.inbox
    for n in range(8):
        (inbox.path / f"file {n}.pdf").write_bytes(b"%PDF-1.4\n")
    pid = os.fork()
    if pid == 0:  # the server that dies: killed at its fourth move
        try:
            moved = [0]
            rename = Folder.rename

            def dying(self: Folder, *args: object, **kwargs: object) -> None:
                moved[0] += 1
                if moved[0] == 4:
                    os.kill(os.getpid(), signal.SIGKILL)
                rename(self, *args, **kwargs)  # type: ignore[arg-type]

            Folder.rename = dying  # type: ignore[method-assign]
            organizer = Organizer(inbox, config.state_dir)
            organizer.open()
            organizer.apply(organizer.plan()["plan_id"])
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status), status


def _recoveries(config: Config) -> list[dict[str, object]]:
    records = [json.loads(line) for line in config.audit_path.read_text().splitlines()]
    return [record for record in records if record.get("event") == "recovery"]


def test_a_start_after_a_crash_records_its_rollback_in_the_audit_log(demo_config: Config) -> None:
    """Found by attack: an apply_plan killed part-way left a start record with no end, and the next start's
    rollback of its moves was told only on stderr: nothing in the audit chain said the moves were undone.
    The start now appends a `recovery` record before the rollback and one after, saying what it rolled back."""
    [inbox] = demo_config.inbox
    _apply_killed_at_fourth_move(demo_config)
    services = build_services(demo_config)
    services.close()
    before, after = _recoveries(demo_config)
    for record in (before, after):
        assert record["tool"] == "server_start"
        assert record["what"] == "organizer"
        assert record["inbox"] == inbox.id
    assert (before["phase"], after["phase"]) == ("start", "end")
    assert before["message"] == f"inbox {inbox.id!r}: rolling back an interrupted apply of 8 moves"
    assert after["message"] == f"inbox {inbox.id!r}: rolled back an interrupted apply of 8 moves"
    assert verify(demo_config.audit_path).ok
    assert sorted(path.name for path in inbox.path.iterdir()) == [f"file {n}.pdf" for n in range(8)]


def test_a_crash_between_a_rollback_and_its_record_leaves_the_recovery_in_the_chain(demo_config: Config) -> None:
    """Found by review: the start wrote its one `recovery` record after the rollback, so a crash between the
    two (a kill, a full disk) left the moves undone and nothing in the chain. The record of what the start is
    about to roll back is on disk before any file moves."""
    [inbox] = demo_config.inbox
    _apply_killed_at_fourth_move(demo_config)
    pid = os.fork()
    if pid == 0:  # the restart that dies once its files are back, before it could say so
        try:

            def dying(*_: object, **__: object) -> None:
                os.kill(os.getpid(), signal.SIGKILL)

            Journal.end = dying  # type: ignore[method-assign]  # every move put back, not yet journaled
            build_services(demo_config)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status), status
    assert sorted(path.name for path in inbox.path.glob("*.pdf")) == [f"file {n}.pdf" for n in range(8)]
    (started,) = _recoveries(demo_config)
    assert started["phase"] == "start"
    assert started["message"] == f"inbox {inbox.id!r}: rolling back an interrupted apply of 8 moves"
    assert verify(demo_config.audit_path).ok
    # The next start finishes: the journal still held the transaction, so it is rolled back (nothing to move)
    # and recorded again, start and end.
    services = build_services(demo_config)
    services.close()
    assert [record["phase"] for record in _recoveries(demo_config)] == ["start", "start", "end"]
    assert sorted(path.name for path in inbox.path.glob("*.pdf")) == [f"file {n}.pdf" for n in range(8)]


@pytest.mark.anyio
async def test_a_reaper_tick_that_fails_is_logged_once_and_the_next_tick_runs(
    demo_config_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by attack (the server's cgroup at its pids limit): a reaper tick that could not start a thread raised
    out of the reaper's task, which cancelled the server's task group: the whole server ended. Invariant: a tick
    that fails is logged (the same failure once) and the next one runs."""
    text = demo_config_path.read_text().replace(
        "[sandboxes]\nenabled = true\n", "[sandboxes]\nenabled = true\nreap_interval_s = 0.01\n", 1
    )
    demo_config_path.write_text(text)
    services = build_services(load_config(demo_config_path))
    ticks: list[int] = []
    done = anyio.Event()

    async def reap() -> list[str]:
        ticks.append(len(ticks))
        if len(ticks) <= 3:
            raise RuntimeError("can't start new thread")
        done.set()
        return []

    monkeypatch.setattr(services.sandboxes, "reap", reap)
    try:
        with caplog.at_level("ERROR", logger="bastion.app"), anyio.fail_after(30):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(reap_forever, services)
                await done.wait()
                tasks.cancel_scope.cancel()
    finally:
        services.close()
    failures = [r for r in caplog.records if "reaper failed" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in failures]
    assert "can't start new thread" in failures[0].getMessage()

"""`bastion doctor`: real checks on this machine with the demo config, through the CLI."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from bastion.app import build_services
from bastion.cli import main
from bastion.config import Config, load_config
from bastion.doctor import CANARY, CANARY_FILE, Check, canary_check, child_pids, leftovers, userns_check
from bastion.safety.audit import AuditLog
from bastion.safety.errors import ConfigError
from bastion.safety.redact import Redactor
from bastion.sandbox._spawn import probe_bwrap, system_binds
from bastion.sandbox.cgroups import CgroupLayout, Limits
from tests.conftest import clear_privilege_bits
from tests.helpers import passable_folder, temp_socket_folders

STATUSES = {"ok", "warn", "FAIL"}
MNT_DETACH = 2


def _doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, tuple[str, str]], str]:
    """Run `bastion doctor --json ARGS`; return its exit status, check -> (status, detail), and stderr."""
    code = main(["doctor", "--json", *args])
    out, err = capsys.readouterr()
    rows = json.loads(out)
    assert all(set(row) == {"check", "status", "detail"} and row["status"] in STATUSES for row in rows), rows
    return code, {row["check"]: (row["status"], row["detail"]) for row in rows}, err


def _tree(root: Path) -> set[str]:
    return {str(path) for path in root.rglob("*")}


def _our_temp_dirs() -> set[str]:
    """The doctor's and the egress socket folders in the temp folder that this user owns: `make test` runs
    the unprivileged pass beside the root one, whose doctor makes folders of the same names meanwhile."""
    temp = tempfile.gettempdir()
    names = {name for name in os.listdir(temp) if name.startswith("bastion-doctor-")} | temp_socket_folders()
    return {name for name in names if _owner(os.path.join(temp, name)) == os.geteuid()}


def _owner(path: str) -> int | None:
    try:
        return os.lstat(path).st_uid
    except FileNotFoundError:
        return None


def _our_groups(layout: CgroupLayout) -> set[str]:
    """The sandbox cgroups of this process (a sandbox's group is named with its server's pid): other
    workers' and passes' sandboxes come and go meanwhile."""
    return {name for name in layout.existing() if f"-{os.getpid()}-" in name}


def _mounts_under(roots: list[str]) -> set[str]:
    """The host's mounts whose mount point (mountinfo's fifth field) is under one of `roots`."""
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return {line for line in lines if any(f"{line.split()[4]}/".startswith(f"{root}/") for root in roots)}


@pytest.mark.bwrap
def test_demo_config_passes_with_the_canary_refused_and_leaves_nothing(
    capsys: pytest.CaptureFixture[str], demo_config_path: Path
) -> None:
    """Invariant: on this machine every check is ok or warn, a real sandbox starts, the kernel refuses
    the canary, and afterwards no sandbox cgroup, process, mount or file of the doctor remains."""
    layout = CgroupLayout.detect()
    groups, mounts = _our_groups(layout), set(Path("/proc/self/mountinfo").read_text().splitlines())
    tree, temp, children = _tree(demo_config_path.parent), _our_temp_dirs(), set(child_pids())

    code, checks, err = _doctor(capsys, "--config", str(demo_config_path))

    failed = {name: check for name, check in checks.items() if check[0] not in ("ok", "warn")}
    assert not failed, failed
    assert code == 0, checks
    assert err == ""
    for name in ("config", "bwrap", "userns", "seccomp", "cgroups", "audit", "sandbox"):
        assert checks[name][0] == "ok", (name, checks[name])
    assert checks["sandbox"][1].startswith("started in "), checks["sandbox"]
    assert checks["canary"][0] == "ok", checks["canary"]
    assert "unshare(CLONE_NEWUSER) -> EPERM" in checks["canary"][1]
    assert "chmod 04755 -> EPERM" in checks["canary"][1]
    assert "chmod /dev/null -> EPERM" in checks["canary"][1]
    assert checks["sandbox-owner"][0] == "ok", checks["sandbox-owner"]
    assert "never root's" in checks["sandbox-owner"][1]
    assert checks["identity"][0] == "ok", checks["identity"]
    if os.geteuid() == 0:
        assert checks["idmap:default"][0] == "ok", checks
        assert checks["inbox:inbox"][0] == "ok", checks
    assert checks["disk-quota"][0] == ("ok" if os.geteuid() == 0 else "warn")
    # The demo sets no admin password and has a gateway with no key and no pinned host key.
    assert checks["http-auth"][0] == "warn"
    assert "bastion admin set-password" in checks["http-auth"][1]
    assert checks["gateway:biscuit"][0] == "warn"
    assert "no pinned host_key" in checks["gateway:biscuit"][1]

    # Nothing new (other tests' leftovers may still be going away: only additions are the doctor's). The
    # doctor's state folder is one of this user's in the temp folder, gone unless something stays mounted.
    assert _our_groups(layout) <= groups
    ours = [os.path.join(tempfile.gettempdir(), name) for name in _our_temp_dirs()]
    assert _mounts_under([str(demo_config_path.parent), *ours]) <= mounts
    assert _tree(demo_config_path.parent) == tree
    assert _our_temp_dirs() <= temp
    assert set(child_pids()) <= children  # nothing new (a fixture's child may have ended)


CHURN_POINTS = 20
CHURN_CYCLES = 200
MIN_PROBES = 30


@pytest.mark.bwrap
@pytest.mark.root
def test_user_namespace_probe_passes_while_mounts_come_and_go(tmp_path: Path) -> None:
    """Attack (found by the CI): a busy host's mounts change while the doctor probes, as sandboxes start
    and end beside it. The probe bound the host's whole root, and bwrap failed when a mount under it went
    away (its folder removed) before bwrap's read-only remount of it: the doctor said user namespaces did
    not work. A thread mounts a tmpfs on 20 new folders, then unmounts them and removes the folders, for
    CHURN_CYCLES rounds; the doctor probes all along. Every probe passes; the mounts are gone afterwards."""
    libc = ctypes.CDLL(None, use_errno=True)
    points = [bytes(tmp_path / f"churn-{i}") for i in range(CHURN_POINTS)]

    def churn() -> None:
        # As a sandbox's /tmp and /dev/pts come and go: made, mounted, unmounted, removed.
        for _ in range(CHURN_CYCLES):
            for point in points:
                os.mkdir(point)
                libc.mount(b"bastion-churn", point, b"tmpfs", 0, None)
            for point in points:
                libc.umount2(point, 0)
                os.rmdir(point)

    thread = threading.Thread(target=churn)
    thread.start()
    checks: list[Check] = []
    try:
        while thread.is_alive() or len(checks) < MIN_PROBES:
            checks.append(userns_check())
    finally:
        thread.join()
        for point in points:
            libc.umount2(point, MNT_DETACH)
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(point)
    assert [check for check in checks if check.status != "ok"] == []
    assert not _mounts_under([str(tmp_path)])


@pytest.mark.bwrap
def test_bad_value_is_one_fail_line_with_the_message_serve_prints(
    capsys: pytest.CaptureFixture[str], demo_config_path: Path
) -> None:
    text = demo_config_path.read_text()
    demo_config_path.write_text(text.replace("max_sandboxes = 16", "max_sandboxes = -1"))
    assert main(["serve", "--config", str(demo_config_path), "--stdio"]) == 78
    serve_line = capsys.readouterr().err.strip()

    assert main(["doctor", "--config", str(demo_config_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    failed = [line for line in lines if line.startswith("FAIL")]
    assert len(failed) == 1, lines
    assert re.split(r"\s{2,}", failed[0], maxsplit=2) == ["FAIL", "config", serve_line.removeprefix("bastion: ")]
    assert "max_sandboxes" in failed[0]
    assert lines[-1].startswith("bastion doctor: 1 FAIL")


def test_no_config_at_all_is_a_fail(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BASTION_CONFIG", raising=False)
    code, checks, _ = _doctor(capsys)
    assert code == 1
    assert checks["config"] == ("FAIL", checks["config"][1])
    assert "pass --config PATH or set BASTION_CONFIG" in checks["config"][1]


@pytest.mark.bwrap
def test_sandboxes_disabled_skips_the_sandbox_checks(
    capsys: pytest.CaptureFixture[str], demo_config_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also: the config comes from $BASTION_CONFIG, and a file with no [http] section gets no HTTP checks."""
    text = demo_config_path.read_text().replace("[sandboxes]\nenabled = true", "[sandboxes]\nenabled = false")
    text = re.sub(r"^\[http\]\n(?:.*\n)*?\n", "", text, count=1, flags=re.MULTILINE)
    demo_config_path.write_text(text)
    monkeypatch.setenv("BASTION_CONFIG", str(demo_config_path))

    code, checks, _ = _doctor(capsys)

    assert code == 0, checks
    assert checks["sandboxes"][0] == "ok"
    assert "enabled = false" in checks["sandboxes"][1]
    assert not {"sandbox", "canary", "disk-quota"} & set(checks)
    assert not [name for name in checks if name.startswith("http")]
    assert checks["cgroups"][0] == "ok"  # the host workspace still has limits


def test_missing_audit_folder_fails(capsys: pytest.CaptureFixture[str], demo_config_path: Path) -> None:
    text = demo_config_path.read_text().replace("[audit]\n", '[audit]\npath = "no-such-folder/audit.jsonl"\n')
    demo_config_path.write_text(text)
    code, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    assert code == 1
    # The server's own refusal at start (`state_problem`): no test file is written there either.
    assert checks["state"][0] == "FAIL"
    assert "no-such-folder does not exist" in checks["state"][1]
    assert "audit" not in checks
    assert not (demo_config_path.parent / "no-such-folder").exists()


def test_doctor_says_which_isolation_and_fails_a_microvm_template_without_boot_files(
    capsys: pytest.CaptureFixture[str], demo_config_path: Path, tmp_path: Path
) -> None:
    text = demo_config_path.read_text().replace("[sandboxes]\nenabled = true", "[sandboxes]\nenabled = false")
    demo_config_path.write_text(text)
    _, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    assert checks["microvm"] == ("ok", "no template asks for a microVM: every sandbox is isolation = namespaces")
    vm = f'\n[sandboxes.microvm]\nimage_dir = "{tmp_path / "none"}"\n'
    vm += '\n[[template]]\nname = "vm"\nisolation = "microvm"\n'
    demo_config_path.write_text(text + vm)
    code, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    assert code == 1
    assert checks["microvm"][0] == "FAIL"
    assert checks["microvm"][1].startswith("templates vm are refused: ")
    assert "is missing: run 'make install'" in checks["microvm"][1]


@pytest.mark.bwrap
def test_canary_is_allowed_without_seccomp_and_landlock(tmp_path: Path) -> None:
    """The canary can fail: in a bare bubblewrap (no seccomp filter, no Landlock, the server's own
    uid) the same script creates a user namespace, writes at /, sets a setuid bit and may chmod the
    /dev/null it is given (run as root: a copy of the host's node, as the chmod would change the
    host's node's ctime under a test of another worker that watches it), and the check turns that
    into a loud FAIL."""
    args = ["--unshare-user", "--uid", "1000", "--tmpfs", "/", *system_binds()]
    args += ["--bind", str(tmp_path), "/workspace", "--proc", "/proc", "--dev", "/dev"]
    node = tmp_path / "null-copy"
    if os.geteuid() == 0:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        args += ["--dev-bind", str(node), "/dev/null"]
    try:
        status, last = probe_bwrap([*args, "/usr/bin/python3", "-I", "-S", "-c", CANARY])
    finally:
        node.unlink(missing_ok=True)  # a device node: gone at once
    (tmp_path / CANARY_FILE).unlink()  # setuid, and the server's: gone at once
    assert status == 0, last
    result = json.loads(last)
    dev_null = "allowed" if os.geteuid() == 0 else "EPERM"
    assert result == {"unshare": "allowed", "mkdir": "allowed", "setuid": "allowed", "dev-null": dev_null}
    check = canary_check(result)
    assert check.status == "FAIL"
    assert check.detail.startswith("ALLOWED: ")


def test_leftovers_are_named(tmp_path: Path) -> None:
    """Children the caller had before (here: whatever pytest's fixtures run) are not leftovers;
    a child started after is."""
    (tmp_path / "sb-left").mkdir()
    before = set(child_pids())
    assert leftovers(None, set(), tmp_path, before) == f"folder {tmp_path / 'sb-left'}"
    assert leftovers(None, set(), tmp_path / "gone", before) == ""
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert leftovers(None, set(), tmp_path / "gone", before) == f"process {child.pid}"
    finally:
        child.kill()
        child.wait()


@pytest.mark.root
def test_a_sandbox_another_server_makes_during_the_probe_is_not_a_leftover(tmp_path: Path) -> None:
    """Attack (or just a busy host): a server running beside `bastion doctor` creates a sandbox while
    the doctor probes. Its cgroup is new, but not the probe's: the doctor said "cleanup FAIL: closing
    the sandbox left cgroup sb-7082-1" (seen with the suite's workers side by side). Only groups named
    with the doctor's own pid are its leftovers."""
    layout = CgroupLayout.detect()
    before = set(layout.existing())
    no_limits = Limits(memory_bytes=None, pids=None, cpu_cores=None)
    names = (f"sb-{os.getpid() + 100_000}-1", f"sb-{os.getpid()}-99999")  # another server's, then ours
    groups = [layout.create(name, no_limits) for name in names]
    try:
        assert leftovers(layout, before, tmp_path / "gone", set(child_pids())) == f"cgroup {names[1]}"
    finally:
        for group in groups:
            group.destroy()
    assert not set(names) & set(layout.existing())


@pytest.mark.skipif(os.geteuid() != 0, reason="the disk quota (and so this check) needs root")
def test_sandbox_disks_that_overcommit_the_state_filesystem_are_a_warning(
    capsys: pytest.CaptureFixture[str], demo_config_path: Path
) -> None:
    """Invariant: when max_sandboxes x disk_bytes, the snapshots allowed and the reserve cannot fit on the state
    filesystem (the images are sparse), the doctor warns that one agent filling its disk can stop every call,
    and says how to fix it; with room enough it says so. Seen by the fault tests (issue 19): SECURITY.md,
    "Limits". Attack (twenty-sixth session): the snapshots were left out of the sum, and a filesystem the
    doctor called large enough was filled by two snapshots and two full disks."""
    text = demo_config_path.read_text()
    small = "max_sandboxes = 1\nmax_snapshot_bytes = 1073741824"
    demo_config_path.write_text(text.replace("max_sandboxes = 16", "max_sandboxes = 10000"))
    code, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    status, detail = checks["state-room"]
    assert (code, status) == (0, "warn"), detail
    assert detail.startswith("10001 sandboxes x 2 GiB + 16 GiB of snapshots + the 256 MiB reserve = "), detail
    assert "holds the audit log too: one agent filling its disk can stop every call" in detail
    demo_config_path.write_text(text.replace("max_sandboxes = 16", small))
    _, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    assert checks["state-room"][0] == "ok", checks["state-room"]
    free = shutil.disk_usage(demo_config_path.parent).free
    demo_config_path.write_text(text.replace("max_sandboxes = 16", f"max_sandboxes = 1\nmax_snapshot_bytes = {free}"))
    _, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    status, detail = checks["state-room"]
    assert status == "warn", detail  # the disks and the reserve fit; with the snapshots allowed they do not
    assert "max_snapshot_bytes" in detail, detail


def test_an_audit_burst_the_audit_filesystem_cannot_hold_a_few_times_is_a_warning(
    capsys: pytest.CaptureFixture[str], demo_config_path: Path
) -> None:
    """Left alone by the twenty-sixth session, then checked: its attack spent the default 64 MiB audit burst on a
    48 MiB audit filesystem in 5 s, and every client's calls were then AUDIT_UNAVAILABLE; nothing told the
    administrator the burst did not fit. Invariant: a burst that fits fewer than four times in the free space
    is a warning naming the key to lower; the default on a roomy filesystem is ok."""
    text = demo_config_path.read_text()
    _, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    assert checks["audit-room"][0] == "ok", checks["audit-room"]
    free = shutil.disk_usage(demo_config_path.parent).free
    demo_config_path.write_text(text.replace("[audit]\n", f"[audit]\ncaller_burst_bytes = {free // 2}\n"))
    code, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    status, detail = checks["audit-room"]
    assert (code, status) == (0, "warn"), detail
    assert "one client can fill it in seconds" in detail, detail
    assert "lower caller_burst_bytes" in detail, detail


def test_a_repository_workspace_whose_git_is_the_agents_is_a_warning(
    capsys: pytest.CaptureFixture[str], demo_config_path: Path
) -> None:
    """A host workspace's `.git` written by an agent runs as whoever next types git there (SECURITY.md, "A
    repository in a host workspace"). Invariant: no check without a repository; ok with `protect_git` on; a
    warning naming the workspace with it off."""
    _, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    assert "git" not in checks
    workspace = load_config(demo_config_path).workspace[0]
    (workspace.path / ".git").mkdir()
    _, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    assert checks["git"][0] == "ok", checks["git"]
    text = demo_config_path.read_text()
    assert text.count("protect_git = true") == 1
    demo_config_path.write_text(text.replace("protect_git = true", "protect_git = false"))
    code, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    status, detail = checks["git"]
    assert (code, status) == (0, "warn"), detail
    assert f"workspace {workspace.id}" in detail, detail
    assert "protect_git = false" in detail, detail


def test_sandboxes_that_could_fill_the_hosts_file_table_are_a_warning(
    capsys: pytest.CaptureFixture[str], demo_config_path: Path
) -> None:
    """Attack (found by attack): fs.file-max is one count for the host; a sandbox's open files cost its memory
    cgroup about 390 bytes each, so a few sandboxes within their memory limits could fill it, and opens then
    fail in the others and in host services. Unless the host's limit is high (systemd 240+ raises it at boot),
    the doctor warns and says how to fix it; with few, small sandboxes it says they fit."""
    file_max = int(Path("/proc/sys/fs/file-max").read_text())
    text = demo_config_path.read_text()
    demo_config_path.write_text(text.replace("max_sandboxes = 16", "max_sandboxes = 10000"))
    _, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    status, detail = checks["file-table"]
    memory = load_config(demo_config_path).sandboxes.limits.memory_bytes
    needed = 10000 * (memory // 384)
    if needed > file_max:
        assert status == "warn", detail
        assert f"can hold {needed:,} open files, more than the host's fs.file-max of {file_max:,}" in detail
        assert "sysctl -w fs.file-max=9223372036854775807" in detail
    demo_config_path.write_text(text.replace("max_sandboxes = 16", "max_sandboxes = 1"))
    _, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    if memory // 384 <= file_max:
        assert checks["file-table"][0] == "ok", checks["file-table"]


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="a root server's check")
def test_a_workspace_another_user_could_replace_fails_as_serve_refuses_it(
    capsys: pytest.CaptureFixture[str], demo_config_path: Path
) -> None:
    """The doctor says what `serve` refuses (tests/workbench/test_workspace.py): a root-owned workspace whose
    parent another user owns could be swapped for a folder of theirs. The config and the state folder stay
    in a folder of root's (in the other user's, the config itself is refused: see below)."""
    config = _moved_to_a_root_folder(demo_config_path)
    os.chown(demo_config_path.parent, 12345, 12345)
    code, checks, _ = _doctor(capsys, "--config", str(config))
    assert code == 1
    assert checks["idmap:default"][0] == "FAIL"
    assert "could be replaced by another folder by uid 12345" in checks["idmap:default"][1]
    assert checks["inbox:inbox"][0] == "FAIL"  # the demo's inbox beside it, root's too
    assert "could be replaced by another folder by uid 12345" in checks["inbox:inbox"][1]


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="a root server's check")
def test_setuid_files_an_older_bastions_agent_left_in_a_host_workspace_fail_as_serve_refuses_them(
    capsys: pytest.CaptureFixture[str], demo_config: Config, demo_config_path: Path
) -> None:
    """Found by attack (an upgrade from the first wave, whose commands ran as the host's root: an agent's
    `cp -p /usr/bin/su su-x` left a setuid-root file in the host workspace): serve refused to start, naming one
    file per start, and the doctor said "no FAIL". Invariant: the doctor fails the workspace with serve's own
    line, and both name every such file."""
    planted = [demo_config.workspace[0].path / name for name in ("su-x", "newgrp-x")]
    for path in planted:
        path.write_bytes(b"x")
        path.chmod(0o4755)
    try:
        with pytest.raises(ConfigError) as refused:
            build_services(demo_config)
        code, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
        assert code == 1
        assert checks["idmap:default"] == ("FAIL", str(refused.value))
        assert all(repr(path.name) in str(refused.value) for path in planted), str(refused.value)
    finally:
        for path in planted:
            path.chmod(0o644)


def test_an_audit_log_whose_last_record_a_crash_tore_fails_as_serve_refuses_it(
    capsys: pytest.CaptureFixture[str], demo_config: Config, demo_config_path: Path
) -> None:
    """Found by attack (an upgrade after a crash): a server killed mid-record leaves a last line without its
    newline; serve refused it ("audit log X: audit log X ends in a torn record", the path said twice) and the
    doctor said ok. Invariant: the doctor fails `audit` with serve's own line, which names the log once."""
    log = demo_config.audit_path
    log.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    log.write_bytes(b'{"seq": 0, "event": "sta')
    log.chmod(0o600)
    with pytest.raises(ConfigError) as refused:
        build_services(demo_config)
    assert str(refused.value).count(str(log)) == 2  # "... a torn record: run `bastion audit verify LOG` ..."
    assert str(refused.value).startswith(f"audit log {log} ends in a torn record")
    code, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    assert code == 1
    assert checks["audit"] == ("FAIL", str(refused.value))


def test_an_audit_log_left_mid_rotation_is_ok_as_serve_finishes_the_rotation(
    capsys: pytest.CaptureFixture[str], demo_config: Config, demo_config_path: Path
) -> None:
    """The doctor's tail check reads what serve's start reads: a crash between a rotation's link and unlink
    leaves the log also linked as its newest rotated file, two links, which serve's start finishes. Invariant:
    the doctor says ok (it said "has 2 hard links: remove the other links"), and the log is left as it was."""
    log = _log_of_one_record(demo_config)
    os.link(log, log.with_name(f"{log.name}.1"))
    _, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    assert checks["audit"][0] == "ok", checks["audit"]
    assert os.stat(log).st_nlink == 2
    services = build_services(demo_config)
    try:
        assert os.stat(log.with_name(f"{log.name}.1")).st_nlink == 1  # serve finished it
    finally:
        services.close()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="a root server's check")
def test_the_refusal_of_deep_agent_named_privileged_files_stays_one_short_line(demo_config: Config) -> None:
    """Found by review: the start's refusal named up to ten files by their whole paths, and ten setuid files 12
    folders of 250 non-UTF-8 bytes deep (as an older bastion's root agent could leave them) made a line of 195,876
    characters for the terminal, the journal and the doctor. Invariant: one line, each name cut to its end."""
    root = demo_config.workspace[0].path
    name = b"\xff" * 250
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(12):
            os.mkdir(name, 0o755, dir_fd=fd)
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        for index in range(12):
            leaf = os.open(b"tool-%02d" % index, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
            os.fchmod(leaf, 0o4755)
            os.close(leaf)
    finally:
        os.close(fd)
    try:
        with pytest.raises(ConfigError) as refused:
            build_services(demo_config)
        line = str(refused.value)
        assert "\n" not in line
        assert len(line) < 4096, f"a refusal of {len(line):,} characters"
        assert line.count("tool-") == 10, line
        assert "(the first 10; there may be more)" in line
    finally:
        clear_privilege_bits(root)


def test_a_missing_log_beside_a_rotated_file_serve_refuses_fails_in_the_doctor(
    capsys: pytest.CaptureFixture[str], demo_config: Config, demo_config_path: Path
) -> None:
    """Found by review: a crash between a rotation's unlink and the new log's open leaves only `<log>.N`, which a
    start goes on from and judges; here group-writable. The doctor said ok ("made at start"), serve refused.
    Invariant: the doctor fails with serve's line."""
    log = _log_of_one_record(demo_config)
    rotated = log.with_name(f"{log.name}.1")
    os.rename(log, rotated)
    rotated.chmod(0o660)
    _, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    assert not log.exists()  # the doctor made nothing
    with pytest.raises(ConfigError) as refused:
        build_services(demo_config)
    assert checks["audit"] == ("FAIL", str(refused.value))


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="chattr +i needs root")
def test_an_immutable_audit_log_fails_in_the_doctor_as_serve_refuses_it(
    capsys: pytest.CaptureFixture[str], demo_config: Config, demo_config_path: Path
) -> None:
    """Found by review: serve opens the log for appending, the doctor's check read it; an immutable log (`chattr
    +i`, an administrator "protecting" it) passed the doctor and stopped serve. Invariant: the doctor fails it."""
    log = demo_config.audit_path
    log.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    log.write_bytes(b"")
    log.chmod(0o600)
    subprocess.run(["chattr", "+i", str(log)], check=True)
    try:
        with pytest.raises(ConfigError) as refused:
            build_services(demo_config)
        _, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
        assert checks["audit"] == ("FAIL", str(refused.value))
    finally:
        subprocess.run(["chattr", "-i", str(log)], check=True)


def _log_of_one_record(config: Config) -> Path:
    """The config's audit log, made by `AuditLog` with one record in it."""
    log = config.audit_path
    log.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    audit = AuditLog(log, redactor=Redactor())
    audit.open()
    audit.append({"event": "before the crash"})
    audit.close()
    return log


def _moved_to_a_root_folder(demo_config_path: Path) -> Path:
    """The demo config, moved with its state folder to a folder of root's beside the demo's; the workspace and
    the inbox stay where they are (named by absolute path)."""
    demo = demo_config_path.parent
    admin = demo.parent / "admin"
    admin.mkdir(mode=0o755)
    text = demo_config_path.read_text()
    for name in ("workspace", "inbox"):
        assert text.count(f'path = "{name}"') == 1, name
        text = text.replace(f'path = "{name}"', f'path = "{demo / name}"')
    config = admin / "bastion.toml"
    config.write_text(text)
    config.chmod(0o600)
    return config


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="a root server's check")
def test_neighbour_owned_folder_above_the_state_folder_fails_as_serve_refuses_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, demo_config_path: Path
) -> None:
    """The doctor says what `serve` refuses (tests/attacks/test_neighbour_attacks.py): a state folder in a folder
    an ordinary user (12345) owns, who could swap it for a link while the server runs; and writes no test file
    into that folder's audit log folder meanwhile."""
    neighbour = tmp_path / "neighbour"
    neighbour.mkdir(mode=0o755)
    os.chown(neighbour, 12345, 12345)
    text = demo_config_path.read_text().replace('state_dir = "state"', f'state_dir = "{neighbour / "state"}"')
    demo_config_path.write_text(text)
    code, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    assert code == 1
    status, detail = checks["state"]
    assert status == "FAIL"
    assert detail.startswith(f"state folder {neighbour / 'state'} could be replaced by uid 12345, who owns {neighbour}")
    assert "audit" not in checks
    assert list(neighbour.iterdir()) == []


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="a root server's check")
def test_config_a_neighbour_can_replace_fails_to_load(
    capsys: pytest.CaptureFixture[str], demo_config_path: Path
) -> None:
    """A root doctor loads the config as `serve` does: one in a folder an ordinary user owns is refused."""
    os.chown(demo_config_path.parent, 12345, 12345)
    code, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    assert code == 1
    status, detail = checks["config"]
    assert status == "FAIL"
    assert f"could be replaced by uid 12345, who owns {demo_config_path.parent}" in detail


def test_config_with_env_secrets_readable_by_others_warns(
    capsys: pytest.CaptureFixture[str], demo_config_path: Path
) -> None:
    """Attack: `bastion init` wrote bastion.toml 0644 and an administrator put a token in a workspace's env, which
    every local user could then read. The doctor warns while the file holds env values and others may read it."""
    assert stat.S_IMODE(demo_config_path.stat().st_mode) == 0o600
    _, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    assert "config-secrets" not in checks  # no env value yet
    text = demo_config_path.read_text().replace("env = {}", 'env = { GITHUB_TOKEN = "ghp_neighbourCanReadThis0123" }')
    demo_config_path.write_text(text)
    _, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    assert "config-secrets" not in checks  # 0600: only its owner reads it
    demo_config_path.chmod(0o644)
    _, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
    status, detail = checks["config-secrets"]
    assert status == "warn"
    assert detail == (
        f"config file {demo_config_path} holds secret values (env, a package index URL's password) and any user "
        "may read it: chmod 600 it"
    )
    assert "ghp_" not in detail


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_a_sticky_audit_folder_where_a_neighbour_planted_a_fifo_fails_as_serve_refuses_it(
    capsys: pytest.CaptureFixture[str], demo_config_path: Path
) -> None:
    """Attack (tests/test_serve_audit_folder.py): `[audit] path` in a root-owned sticky folder, where uid 65534
    made ``audit.jsonl.1`` a FIFO. The doctor fails `state` with serve's line (it said ok: the sticky bit passed),
    and writes no test file into that folder nor opens the FIFO."""
    with passable_folder() as folder:
        logs = folder / "logs"
        logs.mkdir()
        logs.chmod(0o1777)
        planted = logs / "audit.jsonl.1"
        nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
        subprocess.run([*nobody, "mkfifo", "-m", "644", str(planted)], check=True, timeout=30)
        text = demo_config_path.read_text().replace("[audit]\n", f'[audit]\npath = "{logs / "audit.jsonl"}"\n', 1)
        demo_config_path.write_text(text)
        code, checks, _ = _doctor(capsys, "--config", str(demo_config_path))
        assert code == 1
        assert checks["state"] == (
            "FAIL",
            f"the audit log's folder {logs} could be replaced by any user: they may write {logs}: make it and every "
            "folder above it root's and not writable by others (chown, chmod go-w), or choose another [audit] path",
        )
        assert "audit" not in checks
        assert list(logs.iterdir()) == [planted]
        assert os.lstat(planted).st_uid == 65534

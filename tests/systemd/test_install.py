"""`bastion install-service` into a temporary root (--prefix): the machine itself is never touched.

What this proves: --dry-run says every step and creates nothing; an install creates the account (a
real systemd-sysusers writing the prefix's passwd and group), the folders with their modes and owners,
a config laid out for the service, and the unit with this environment's ExecStart; a second run changes
nothing; a config that exists is never rewritten; --as-root adds the root drop-in and the config keeps
disk_quota = true, and going back removes the drop-in; a link planted where a folder or the unit
should be is refused or replaced, never followed; bad names and paths are refused with one line and
exit 2. What it does not prove: that systemd runs the unit (scripts/test-service.sh does, in
systemd-nspawn), nor `systemctl daemon-reload` (skipped under a prefix).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from bastion.cli import main
from tests.helpers import BASTION

pytestmark = pytest.mark.skipif(
    shutil.which("systemd-sysusers") is None, reason="systemd-sysusers is not installed (Debian: package systemd)"
)


def install(prefix: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in this process (a subprocess per call cost a second of imports each)."""
    argv = ["install-service", "--prefix", str(prefix), "--exec", str(BASTION), *args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def test_the_command_runs_as_a_process(tmp_path: Path) -> None:
    argv = [str(BASTION), "install-service", "--prefix", str(tmp_path / "root"), "--dry-run"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert "would create /etc/systemd/system/bastion.service" in result.stdout


def account(prefix: Path, name: str) -> list[str] | None:
    for line in (prefix / "etc/passwd").read_text().splitlines():
        if line.split(":")[0] == name:
            return line.split(":")
    return None


def mode_and_owner(path: Path) -> tuple[int, int, int]:
    st = os.lstat(path)
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


def test_dry_run_says_every_step_and_creates_nothing(tmp_path: Path) -> None:
    prefix = tmp_path / "root"
    result = install(prefix, "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "would create user bastion (systemd-sysusers)" in lines
    assert "would create /var/lib/bastion (0700 bastion:bastion)" in lines
    assert "would create /etc/bastion/bastion.toml (0640 root:bastion)" in lines
    assert "would create /etc/systemd/system/bastion.service" in lines
    assert not prefix.exists()


def test_install_creates_account_folders_config_and_unit(tmp_path: Path) -> None:
    prefix = tmp_path / "root"
    result = install(prefix)
    assert result.returncode == 0, result.stderr
    entry = account(prefix, "bastion")
    assert entry is not None
    uid, gid = int(entry[2]), int(entry[3])
    assert entry[5:] == ["/var/lib/bastion", "/usr/sbin/nologin"]
    assert mode_and_owner(prefix / "etc/bastion") == (0o750, 0, gid)
    assert mode_and_owner(prefix / "var/lib/bastion") == (0o700, uid, gid)
    assert mode_and_owner(prefix / "srv/bastion/workspace") == (0o750, uid, gid)
    assert mode_and_owner(prefix / "etc/bastion/bastion.toml") == (0o640, 0, gid)
    config = tomllib.loads((prefix / "etc/bastion/bastion.toml").read_text())
    assert config["state_dir"] == "/var/lib/bastion"
    assert config["workspace"][0]["path"] == "/srv/bastion/workspace"
    assert config["sandboxes"]["disk_quota"] is False  # the user bastion cannot mount a disk per sandbox
    unit = (prefix / "etc/systemd/system/bastion.service").read_text()
    assert f"ExecStart={BASTION} serve --config /etc/bastion/bastion.toml --http" in unit
    assert "User=bastion" in unit
    assert not (prefix / "etc/systemd/system/bastion.service.d/root.conf").exists()
    assert "systemctl daemon-reload" in result.stdout  # under a prefix: said, not run


def test_second_install_changes_nothing(tmp_path: Path) -> None:
    prefix = tmp_path / "root"
    assert install(prefix).returncode == 0
    before = {path: path.stat().st_mtime_ns for path in prefix.rglob("*")}
    again = install(prefix)
    assert again.returncode == 0, again.stderr
    steps = [line for line in again.stdout.splitlines() if line.startswith(("create", "update", "fix", "remove"))]
    assert steps == []
    assert {path: path.stat().st_mtime_ns for path in prefix.rglob("*")} == before


def test_existing_config_is_kept(tmp_path: Path) -> None:
    prefix = tmp_path / "root"
    assert install(prefix).returncode == 0
    config = prefix / "etc/bastion/bastion.toml"
    config.write_text("# the administrator's own\n")
    result = install(prefix, "--as-root")
    assert result.returncode == 0, result.stderr
    assert "ok /etc/bastion/bastion.toml (kept as it is)" in result.stdout
    assert config.read_text() == "# the administrator's own\n"


def test_a_config_the_service_account_could_rewrite_is_given_back_to_root(tmp_path: Path) -> None:
    """Root reads the config too (`template build`, `admin`): one the account bastion owns, or that its
    group may write, would let the service choose what root runs. Its text is kept, not its owner."""
    prefix = tmp_path / "root"
    assert install(prefix).returncode == 0
    entry = account(prefix, "bastion")
    assert entry is not None
    uid, gid = int(entry[2]), int(entry[3])
    config = prefix / "etc/bastion/bastion.toml"
    config.write_text("# the administrator's own\n")
    os.chown(config, uid, gid)
    config.chmod(0o660)
    result = install(prefix)
    assert result.returncode == 0, result.stderr
    assert "fix /etc/bastion/bastion.toml (0640 root:bastion, text kept as it is)" in result.stdout
    assert mode_and_owner(config) == (0o640, 0, gid)
    assert config.read_text() == "# the administrator's own\n"


def test_as_root_adds_the_drop_in_and_going_back_removes_it(tmp_path: Path) -> None:
    prefix = tmp_path / "root"
    result = install(prefix, "--as-root")
    assert result.returncode == 0, result.stderr
    drop_in = prefix / "etc/systemd/system/bastion.service.d/root.conf"
    assert "CapabilityBoundingSet=CAP_SYS_ADMIN" in drop_in.read_text()
    assert not (prefix / "etc/passwd").exists()  # no account: root runs it
    assert mode_and_owner(prefix / "var/lib/bastion") == (0o711, 0, 0)  # passable by the sandboxes' ids
    assert tomllib.loads((prefix / "etc/bastion/bastion.toml").read_text())["sandboxes"]["disk_quota"] is True
    back = install(prefix)
    assert back.returncode == 0, back.stderr
    assert "remove /etc/systemd/system/bastion.service.d/root.conf" in back.stdout
    assert not drop_in.exists()


def test_link_where_a_folder_should_be_is_refused_not_followed(tmp_path: Path) -> None:
    """A link planted at /srv/bastion (say, to /etc) must not be chowned to the service's account."""
    prefix = tmp_path / "root"
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    (prefix / "srv").mkdir(parents=True)
    (prefix / "srv/bastion").symlink_to(victim)
    result = install(prefix)
    assert result.returncode == 1
    assert result.stderr.strip().endswith("is not a folder (a link or a file): move it away, then install again")
    assert len(result.stderr.strip().splitlines()) == 1
    assert mode_and_owner(victim) == (0o755, 0, 0)


def test_link_planted_as_the_unit_is_replaced_not_followed(tmp_path: Path) -> None:
    prefix = tmp_path / "root"
    victim = tmp_path / "victim.conf"
    victim.write_text("precious\n")
    units = prefix / "etc/systemd/system"
    units.mkdir(parents=True)
    (units / "bastion.service").symlink_to(victim)
    (units / ".bastion.service.new").symlink_to(victim)  # the temporary name too
    result = install(prefix)
    assert result.returncode == 0, result.stderr
    assert victim.read_text() == "precious\n"
    assert not (units / "bastion.service").is_symlink()
    assert "ExecStart=" in (units / "bastion.service").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--user", "root"], "for root use --as-root"),
        (["--user", "x;id"], "must be an account name"),
        (["--user", "Bastion"], "must be an account name"),
        (["--exec", "relative/bastion"], "must be an absolute path"),
        (["--exec", "/opt/my bastion/bin/bastion"], "without spaces"),
        (["--exec", "/opt/%h/bastion"], "without spaces"),
    ],
)
def test_bad_names_and_paths_are_refused(tmp_path: Path, args: list[str], message: str) -> None:
    result = install(tmp_path / "root", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "root").exists()


def test_relative_prefix_is_refused(tmp_path: Path) -> None:
    result = install(Path("relative"))
    assert result.returncode == 2
    assert "--prefix relative must be an absolute path" in result.stderr


def test_a_program_that_cannot_run_is_refused_before_any_step() -> None:
    """On this machine (no --prefix) the unit's ExecStart must exist; checked before anything changes."""
    result = install(Path("/"), "--exec", "/nonexistent/bin/bastion", "--dry-run")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "bastion: --exec /nonexistent/bin/bastion is not an executable file: name the bastion the service should run"
    ]
    assert result.stdout == ""


@pytest.mark.parametrize("hole", ["folder-owner", "world-writable-script", "link-of-theirs"])
def test_an_exec_other_users_can_rewrite_is_refused(tmp_path: Path, hole: str) -> None:
    """ExecStart runs as root with --as-root (as the service's account without): a script in a folder a
    local user owns, that others can write, or reached through a link of theirs (judged as the link, not by
    where it leads now: found 2026-12-06) is theirs to replace."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give the folder to another uid")
    folder = tmp_path / "alice" / "bin"
    folder.mkdir(parents=True)
    script = folder / "bastion"
    script.write_text(f"#!{sys.executable}\n")
    script.chmod(0o755)
    named = script
    if hole == "folder-owner":
        os.chown(tmp_path / "alice", 12345, 12345)
        who = f"uid 12345, who owns {tmp_path / 'alice'}, and so could replace {script}"
    elif hole == "world-writable-script":
        script.chmod(0o757)
        who = f"any user: they may write {script}"
    else:
        sticky = tmp_path / "sticky"
        sticky.mkdir(mode=0o777)
        sticky.chmod(0o1777)
        named = sticky / "bastion"
        named.symlink_to(script)
        os.lchown(named, 12345, 12345)
        who = f"uid 12345, who owns {named} in the sticky folder {sticky}, and so could replace {named}"
    result = install(Path("/"), "--exec", str(named), "--as-root", "--dry-run")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"bastion: --exec {named}: {who}; the service would run what they put there: install bastion where only "
        "root writes (e.g. /opt/bastion)"
    ]
    assert result.stdout == ""


NOBODY = 65534  # the other local user of these attacks


def shared_tmp(tmp_path: Path) -> Path:
    """A folder like /tmp: everyone writes it, the sticky bit keeps each entry its maker's."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    return sticky


def entries(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


@pytest.mark.parametrize("hole", ["link-in-tmp", "folder-of-theirs", "new-in-tmp"])
def test_install_refuses_a_prefix_another_user_could_redirect(tmp_path: Path, hole: str) -> None:
    """Attack (found by review): building an image as root with --prefix /tmp/image, where another user had
    planted `image -> ` a folder of theirs (or owned a folder on the way, or could make `image` first in the
    sticky /tmp). Root's unit and config went into their folder, and they rewrote its ExecStart before the
    image shipped. Now the prefix and the folders above it are judged first: refused, nothing written."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give the folder to another uid")
    sticky = shared_tmp(tmp_path)
    theirs = sticky / "nob"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    if hole == "link-in-tmp":
        prefix = sticky / "image"
        prefix.symlink_to(theirs)
        os.chown(prefix, NOBODY, NOBODY, follow_symlinks=False)
        who = f"whoever may change the symbolic link {prefix} on its path (give the real path)"
    elif hole == "folder-of-theirs":
        prefix = theirs / "image"
        who = f"uid {NOBODY}, who owns {theirs}"
    else:
        prefix = sticky / "image"
        who = f"any user: they may write {sticky}"
    result = install(prefix, "--as-root")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"bastion: --prefix {prefix} could be changed by {who}, and so the unit and config installed there: "
        "install into a folder root's alone, reached through no symbolic link"
    ]
    assert result.stdout == ""
    assert entries(sticky) == (["image", "nob"] if hole == "link-in-tmp" else ["nob"])
    assert entries(theirs) == []


def test_a_prefix_through_dot_dot_is_refused(tmp_path: Path) -> None:
    """`..` after a link is resolved by the kernel from where the link leads, not as the text judged."""
    (tmp_path / "image").mkdir()
    prefix = tmp_path / "image" / ".." / "image"
    result = install(prefix, "--dry-run")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"bastion: --prefix {prefix} goes through '..': give the folder's real path"]
    assert entries(tmp_path) == ["image"]

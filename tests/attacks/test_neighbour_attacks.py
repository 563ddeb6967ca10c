"""A local user (uid 12345, an ordinary neighbour on the host) against a root server's own paths.

README shows `bastion init /tmp/docdemo`. A neighbour who made /tmp/docdemo first owned the folder holding
the state folder and the config: while the server ran, they renamed `state` away and put a link there, and
at stop root's unmounts (by path) followed it to the host's /tmp, /dev/shm and /dev/pts; or they swapped
root's bastion.toml for theirs, and root's next `serve` ran it. Each test makes the neighbour's folder as
they would (made by root here, then given to uid 12345 with chown: no account is created) and checks that
root refuses at start, or at init, with one line naming the folder and who, and that nothing was mounted,
created or written there.

What this does not prove: anything about folders another user may change through a means these checks do
not read (a group whose members come from a directory service is counted as others; a capability), or
about paths other than the state folder, the audit log's folder, the config file and `bastion init`'s folder.
"""

from __future__ import annotations

import os
import stat
import struct
import subprocess
from pathlib import Path

import pytest

from bastion.app import build_services
from bastion.cli import EXIT_CONFIG, main
from bastion.config import load_config
from bastion.demo import init_demo
from bastion.safety.errors import ConfigError
from tests.helpers import DATA_ENV, demo_config_at

pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="the neighbour attacks are against a root server"),
]

NEIGHBOUR = 12345
ACL_NO_ID = 0xFFFFFFFF  # an ACL entry's id when its tag names none (include/uapi/linux/posix_acl.h)
# The system's interpreter: the one the tests run under may sit where the neighbour cannot reach it.
SYSTEM_PYTHON = "/usr/bin/python3"


def neighbours_folder(path: Path, mode: int = 0o755) -> Path:
    """A folder the neighbour made (theirs, as `mkdir` as uid 12345 would leave it)."""
    path.mkdir(mode=mode)
    path.chmod(mode)
    os.chown(path, NEIGHBOUR, NEIGHBOUR)
    return path


def as_neighbour(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run Python `code` as uid 12345 (no supplementary groups)."""
    return subprocess.run(
        [SYSTEM_PYTHON, "-I", "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        user=NEIGHBOUR,
        group=NEIGHBOUR,
        extra_groups=[],
    )


def mounts_under(folder: Path) -> list[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        points = [line.split()[4] for line in info]
    return [point for point in points if point == str(folder) or point.startswith(f"{folder}/")]


def demo_with(tmp_path: Path, **settings: str) -> Path:
    """The demo config, root's, with top-level `settings` (state_dir) or an [audit] path replaced."""
    path = demo_config_at(tmp_path / "demo", DATA_ENV if (DATA_ENV / "pyvenv.cfg").is_file() else None)
    text = path.read_text(encoding="utf-8")
    if "state_dir" in settings:
        text = text.replace('state_dir = "state"', f'state_dir = "{settings["state_dir"]}"', 1)
    if "audit" in settings:
        text = text.replace("[audit]\n", f'[audit]\npath = "{settings["audit"]}"\n', 1)
    path.write_text(text, encoding="utf-8")
    return path


# -- the state folder ------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["made at start", "made by init"])
def test_neighbour_swaps_state_folder_for_a_link_refused_at_start(tmp_path: Path, state: str) -> None:
    """Attack: the state folder sits in a folder the neighbour made (`bastion init /tmp/docdemo` into theirs);
    while the server runs they `mv state state.real; ln -s fake state`, and at stop root unmounts through the
    link. Invariant: the root server refuses to start, with one line naming the folder, uid 12345 and the fix,
    before it locks, mounts or opens anything: nothing is mounted under the test's folder, and the neighbour's
    folder holds what it held (a state folder root made there earlier is left empty)."""
    docdemo = neighbours_folder(tmp_path / "docdemo")
    if state == "made by init":
        (docdemo / "state").mkdir(mode=0o700)
    config = load_config(demo_with(tmp_path, state_dir=str(docdemo / "state")))
    before = sorted(docdemo.rglob("*"))

    with pytest.raises(ConfigError) as caught:
        build_services(config).close()  # closed if served anyway, so a failure leaves no mount

    assert str(caught.value) == (
        f"state folder {docdemo / 'state'} could be replaced by uid {NEIGHBOUR}, who owns {docdemo}: make it and "
        "every folder above it root's and not writable by others (chown, chmod go-w), or choose a state_dir "
        "elsewhere"
    )
    assert mounts_under(tmp_path) == []
    assert sorted(docdemo.rglob("*")) == before


def test_neighbour_state_folder_in_a_sticky_folder_refused_and_roots_own_served(tmp_path: Path) -> None:
    """Attack: in a root-owned sticky folder others may write (/tmp), the neighbour makes the state folder's
    name first. Invariant: a state folder there is refused while it is the neighbour's (nothing is created in
    it, nothing mounted), and served once it is root's: made by root at start, it is root's 0700 (later 0711),
    and the neighbour cannot rename it away (the sticky bit), so no link can take its place."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    theirs = neighbours_folder(shared / "state", 0o700)
    config = load_config(demo_with(tmp_path, state_dir=str(theirs)))

    with pytest.raises(ConfigError, match=rf"could be replaced by uid {NEIGHBOUR}, who owns {theirs}:"):
        build_services(config).close()
    assert list(theirs.iterdir()) == []
    assert mounts_under(tmp_path) == []

    theirs.rmdir()
    services = build_services(config)  # made by root at start, in the sticky folder
    try:
        info = os.lstat(theirs)
        assert (info.st_uid, stat.S_ISDIR(info.st_mode)) == (0, True)
        moved = as_neighbour("import os, sys; os.rename(sys.argv[1], sys.argv[1] + '.real')", str(theirs))
        assert moved.returncode != 0
        assert "PermissionError" in moved.stderr, moved.stderr
    finally:
        services.close()
    assert mounts_under(tmp_path) == []


def test_neighbour_owned_audit_folder_refused_at_start(tmp_path: Path) -> None:
    """Attack: a custom [audit] path in a folder the neighbour owns: they could swap the folder and with it the
    log root appends to. Invariant: refused at start with one line naming the folder and uid 12345; no audit
    file is written there and nothing is made in the state folder."""
    logs = neighbours_folder(tmp_path / "logs")
    config = load_config(demo_with(tmp_path, audit=str(logs / "audit.jsonl")))

    with pytest.raises(ConfigError) as caught:
        build_services(config).close()

    assert str(caught.value).startswith(
        f"the audit log's folder {logs} could be replaced by uid {NEIGHBOUR}, who owns {logs}: "
    )
    assert list(logs.iterdir()) == []
    assert list(config.state_dir.iterdir()) == []  # as `bastion init` made it: not locked, nothing in it
    assert mounts_under(tmp_path) == []


# -- the config file -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("plant", "said"),
    [
        ("folder", f"could be replaced by uid {NEIGHBOUR}, who owns {{folder}}: keep it in a folder only root"),
        ("owner", f"is owned by uid {NEIGHBOUR}, who could change what root serves: chown it to root"),
        ("mode", "may be written by any user: chmod go-w it"),
        ("group", f"may be written by the members of group {NEIGHBOUR}: chmod go-w it"),
        ("acl", f"may be written by uid {NEIGHBOUR} (an ACL entry): chmod go-w it"),
    ],
)
def test_neighbour_swaps_roots_config_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, plant: str, said: str
) -> None:
    """Attack (/tmp/atk-local/init_neighbour_dir.sh): the neighbour owns the config's folder and replaces
    bastion.toml with theirs (a workspace at /etc), or the file is theirs, or they may write it (mode, group, ACL).
    Invariant: root's `bastion serve` exits 78 with one line naming the file and who, and serves nothing: the
    workspace the neighbour's config names is not touched and nothing is made in the state folder."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "kept").write_text("root's\n")
    config = demo_with(tmp_path)
    folder = config.parent
    text = config.read_text(encoding="utf-8").replace('path = "workspace"', f'path = "{target}"')
    config.write_text(text, encoding="utf-8")
    if plant == "folder":
        os.chown(folder, NEIGHBOUR, NEIGHBOUR)
    elif plant == "owner":
        os.chown(config, NEIGHBOUR, NEIGHBOUR)
    elif plant == "mode":
        config.chmod(0o666)
    elif plant == "acl":  # u::rw- u:12345:rw- g::r-- m::rw- o::--- (what `setfacl -m u:12345:rw` leaves)
        entries = [(0x01, 6, ACL_NO_ID), (0x02, 6, NEIGHBOUR), (0x04, 4, ACL_NO_ID), (0x10, 6, ACL_NO_ID)]
        entries.append((0x20, 0, ACL_NO_ID))
        raw = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)
        os.setxattr(config, "system.posix_acl_access", raw)
    else:
        os.chown(config, 0, NEIGHBOUR)
        config.chmod(0o660)

    code = main(["serve", "--config", str(config), "--stdio"])

    err = capsys.readouterr().err
    assert code == EXIT_CONFIG
    assert err.startswith(f"bastion: config file {config} "), err
    assert said.format(folder=folder) in err
    assert err.count("\n") == 1
    assert sorted(p.name for p in target.iterdir()) == ["kept"]
    assert list((folder / "state").iterdir()) == []  # as `bastion init` made it: not locked, nothing in it


# -- bastion init ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("made", "said"),
    [
        ("by the neighbour", f"is owned by uid {NEIGHBOUR}, not you: choose a folder of your own"),
        ("open to all", "may be written by any user: chmod go-w it, or choose another folder"),
        ("by the neighbour in a sticky folder", f"is owned by uid {NEIGHBOUR}, not you"),
    ],
)
def test_neighbour_made_init_folder_first_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, made: str, said: str
) -> None:
    """Attack: `bastion init /tmp/docdemo` as root into a folder a neighbour made first (or one anyone may
    write): root filled it, the neighbour swapped bastion.toml for theirs, and root's serve ran it. Invariant:
    init exits 78 with one line naming the folder, and writes nothing into it."""
    parent = tmp_path
    if made == "by the neighbour in a sticky folder":
        parent = tmp_path / "tmp"
        parent.mkdir()
        parent.chmod(0o1777)
    docdemo = parent / "docdemo"
    if made == "open to all":
        docdemo.mkdir()
        docdemo.chmod(0o777)
    else:
        neighbours_folder(docdemo)

    code = main(["init", str(docdemo)])

    err = capsys.readouterr().err
    assert code == EXIT_CONFIG
    assert err.startswith(f"bastion: {docdemo} {said}"), err
    assert err.count("\n") == 1
    assert list(docdemo.iterdir()) == []


def test_init_makes_a_new_folder_in_a_sticky_folder_roots_with_a_private_config(tmp_path: Path) -> None:
    """README's `bastion init /tmp/docdemo`, the folder not there yet: root makes it (root's, 0755, so the
    neighbour can neither write nor rename it in the sticky folder), writes bastion.toml 0600 whatever the
    umask, and the config loads and its state folder is accepted."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    old = os.umask(0)
    try:
        config = init_demo(shared / "docdemo")
    finally:
        os.umask(old)
    info = os.lstat(shared / "docdemo")
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o755)
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    moved = as_neighbour("import os, sys; os.rename(sys.argv[1], sys.argv[1] + '.x')", str(shared / "docdemo"))
    assert "PermissionError" in moved.stderr, moved.stderr
    loaded = load_config(config)
    assert loaded.state_dir == shared / "docdemo" / "state"

"""A template's python_env as the root server trusts it: refused at load when another local user could change it.

Its python runs every execute_code cell of the template's sandboxes (bound read-only at /opt/bastion/env), and
its site-packages' ``.pth`` files run with it. Another user (uid 4242 here, named by no account) who could
replace the venv, a folder on the way to it, its ``bin``, ``lib`` or site-packages, ``pyvenv.cfg`` or
``bin/python`` (or what it links to) would put code into every sandbox of the template. Not proven: files
deeper in the venv (a package's own folder) are not judged.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bastion.cli import main
from bastion.config import load_config
from bastion.safety.errors import ConfigError
from tests.helpers import demo_config_at, refused_stdio_start

BOB = (4242, 4242)
SITE = "lib/python{}.{}/site-packages".format(*sys.version_info[:2])

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another uid needs root"),
]


def _venv(path: Path) -> Path:
    """A venv as `bastion template build` makes one (`python3 -m venv`, without pip: the layout is the same)."""
    subprocess.run(["/usr/bin/python3", "-I", "-m", "venv", "--without-pip", str(path)], check=True, cwd="/")
    return path


def _tree(root: Path) -> dict[str, tuple[int, int, str]]:
    """Each entry under `root`: owner, mode and, for a link, where it points (a file's text is not changed)."""
    found = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        target = os.readlink(path) if path.is_symlink() else ""
        found[str(path.relative_to(root))] = (info.st_uid, info.st_mode, target)
    return found


def _acl_write_for(path: Path, uid: int, *, default: bool = False) -> None:
    """An ACL entry letting `uid` write `path`, which its mode bits (0755) do not show (`default`: what is
    made in the folder `path` later)."""
    entries = [
        (0x01, 7, 0xFFFFFFFF),
        (0x02, 7, uid),
        (0x04, 5, 0xFFFFFFFF),
        (0x10, 7, 0xFFFFFFFF),
        (0x20, 5, 0xFFFFFFFF),
    ]
    raw = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)
    os.setxattr(path, "system.posix_acl_default" if default else "system.posix_acl_access", raw)


def _link_python_into_bobs_folder(srv: Path, env: Path) -> None:
    bobs = srv / "bob"
    bobs.mkdir()
    (bobs / "python3").symlink_to("/usr/bin/python3")  # his to repoint at a script of his
    os.chown(bobs, *BOB)
    (env / "bin" / "python").unlink()
    (env / "bin" / "python").symlink_to(bobs / "python3")


# What bob is given, and the words naming him in the refusal. `srv` is the folder holding the venv `env`.
ATTACKS: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "owns-a-folder-above": (lambda srv, env: os.chown(srv, *BOB), "uid 4242, who owns {srv}"),
    "may-write-a-folder-above": (lambda srv, env: srv.chmod(0o777), "any user: they may write {srv}"),
    "may-add-names-to-the-sticky-venv": (lambda srv, env: env.chmod(0o1777), "any user: they may write {env}"),
    "may-write-bin": (lambda srv, env: (env / "bin").chmod(0o777), "any user: they may write {env}/bin"),
    "owns-site-packages": (lambda srv, env: os.chown(env / SITE, *BOB), "uid 4242, who owns {env}/" + SITE),
    "has-an-acl-entry-on-lib": (lambda srv, env: _acl_write_for(env / "lib", BOB[0]), "uid 4242 (an ACL entry)"),
    "may-write-pyvenv-cfg": (lambda srv, env: (env / "pyvenv.cfg").chmod(0o666), "they may write {env}/pyvenv.cfg"),
    "controls-what-bin-python-links-to": (_link_python_into_bobs_folder, "uid 4242, who owns {srv}/bob"),
    # Found by review: only six entries were judged at first; any file of the venv may run.
    "owns-a-pth-file-in-roots-site-packages": (
        lambda srv, env: _owned_by_bob(env / SITE / "bob.pth", "import os\n"),
        "uid 4242, who owns {env}/" + SITE + "/bob.pth",
    ),
    "owns-debians-extra-site-folder": (
        lambda srv, env: _owned_by_bob(env / "local" / "lib" / "python3.11" / "dist-packages" / "bob.pth", ""),
        "uid 4242, who owns {env}/local",
    ),
    "has-a-default-acl-on-site-packages": (
        lambda srv, env: _acl_write_for(env / SITE, BOB[0], default=True),
        "uid 4242 (an ACL entry): a default ACL of {env}/" + SITE,
    ),
}


def _owned_by_bob(file: Path, text: str) -> None:
    """`file` (and the folders made for it under the venv) given to bob, as if he had written it."""
    made = [folder for folder in reversed(file.parents) if not folder.exists()]
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(text)
    for entry in [*made, file]:
        os.chown(entry, *BOB)


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_python_env_another_user_could_change_is_refused_at_load(tmp_path: Path, attack: str) -> None:
    """Attack: another local user can change what a template's venv runs (each way in ATTACKS) and so runs
    code in every sandbox of the template, as the agent. The config is refused at load (serve, doctor) with
    one line naming who and through what; the venv is left as it was. Not proven: what runs if an
    administrator loosens the folders after the server started (the check is at start)."""
    srv = tmp_path / "srv"
    srv.mkdir(mode=0o755)
    env = _venv(srv / "env")
    config = demo_config_at(tmp_path / "demo", env)
    assert load_config(config).template[0].python_env == env  # as built: accepted
    setup, words = ATTACKS[attack]
    setup(srv, env)
    before = _tree(env)
    with pytest.raises(ConfigError) as refused:
        load_config(config)
    line = str(refused.value)
    assert line.startswith(f"template 'python-data' python_env {env} could be changed by "), line
    assert words.format(srv=srv, env=env) in line
    assert "\n" not in line
    assert _tree(env) == before


def test_a_python_env_reached_through_a_link_another_user_can_repoint_is_refused(tmp_path: Path) -> None:
    """Attack: the configured path goes through a link in bob's folder; he repoints it at a venv of his
    after the check. Refused whoever owns the link: the real path is what to configure."""
    env = _venv(tmp_path / "env")
    bobs = tmp_path / "bob"
    bobs.mkdir()
    (bobs / "env").symlink_to(env)
    os.chown(bobs, *BOB)
    config = demo_config_at(tmp_path / "demo", env)  # init writes the real path: the link is written by hand
    config.write_text(config.read_text().replace(str(env), str(bobs / "env")))
    with pytest.raises(ConfigError, match="symbolic link") as refused:
        load_config(config)
    assert f"could be changed by whoever may change the symbolic link {bobs / 'env'}" in str(refused.value)
    assert (bobs / "env").readlink() == env


def test_serve_refuses_a_python_env_another_user_could_change_before_anything_starts(tmp_path: Path) -> None:
    """Attack: bob owns the venv's site-packages, where a ``.pth`` of his runs with every cell. `serve` exits
    78 with the one line before it makes its state (no sandbox, no audit log); the .pth is left for the
    administrator to see, and nothing on the host ran the venv's python."""
    env = _venv(tmp_path / "env")
    mark = tmp_path / "pth-ran"
    (env / SITE / "bob.pth").write_text(f"import os; os.close(os.open({str(mark)!r}, os.O_CREAT | os.O_WRONLY))\n")
    os.chown(env / SITE, *BOB)
    config = demo_config_at(tmp_path / "demo", env)
    lines = [refused_stdio_start(config)]
    assert f"python_env {env} could be changed by uid 4242, who owns {env / SITE}" in lines[0]
    assert list((tmp_path / "demo" / "state").iterdir()) == []
    assert not mark.exists()
    assert (env / SITE / "bob.pth").exists()


def test_doctor_names_the_python_env_another_user_could_change(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The doctor loads the config as `serve` does: its config check fails with serve's line."""
    env = _venv(tmp_path / "env")
    (env / "bin").chmod(0o777)
    config = demo_config_at(tmp_path / "demo", env)
    code = main(["doctor", "--json", "--config", str(config)])
    rows = {row["check"]: row for row in json.loads(capsys.readouterr().out)}
    assert code == 1
    assert rows["config"]["status"] == "FAIL"
    assert f"python_env {env} could be changed by any user: they may write {env / 'bin'}" in rows["config"]["detail"]


def test_a_venv_only_root_can_change_passes_in_a_sticky_folder_too(tmp_path: Path) -> None:
    """Not a refusal: what `template build` makes (root's, 0755, bin/python a link to /usr/bin/python3) passes,
    in a sticky folder like /tmp as well when the venv itself is root's; `template build` itself loads the
    config without the check (`envs_built=False`), since it is making the venv."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    env = _venv(shared / "env")
    config = demo_config_at(tmp_path / "demo", env)
    assert load_config(config).template[0].python_env == env
    (env / "bin").chmod(0o777)
    assert load_config(config, envs_built=False).template[0].python_env == env


def test_uvs_lock_file_writable_by_all_is_not_a_refusal(tmp_path: Path) -> None:
    """Not a refusal: uv leaves an empty `.lock` (0666) at a venv's top for anyone's uv to lock it; nothing
    in the venv reads it. Every other file of the venv is judged."""
    env = _venv(tmp_path / "env")
    (env / ".lock").touch()
    (env / ".lock").chmod(0o666)
    config = demo_config_at(tmp_path / "demo", env)
    assert load_config(config).template[0].python_env == env
    (env / "bin" / "activate").chmod(0o666)
    with pytest.raises(ConfigError, match=f"any user: they may write {env / 'bin' / 'activate'}"):
        load_config(config)


def test_init_names_the_real_path_of_a_python_env_given_through_a_link(tmp_path: Path) -> None:
    """Not a refusal: `bastion init --python-env` through a link (a checkout whose environment is a link to
    another's) writes where the link leads, which loads; the link itself in a config is refused."""
    env = _venv(tmp_path / "real-env")
    (tmp_path / "link").symlink_to(env)
    config = demo_config_at(tmp_path / "demo", tmp_path / "link")
    assert load_config(config).template[0].python_env == env
    linked = config.with_name("linked.toml")
    linked.write_text(config.read_text().replace(str(env), str(tmp_path / "link")))
    linked.chmod(0o600)
    with pytest.raises(ConfigError, match="symbolic link"):
        load_config(linked)

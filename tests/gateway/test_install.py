"""Installation helpers and config checks: keygen, the authorized_keys line, the demo, refusals."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from bastion.cli import main
from bastion.config import load_config
from bastion.demo import init_demo
from bastion.gateway.keys import dispatch_source

LINE = re.compile(
    r'^restrict,from="127\.0\.0\.1",command="/usr/bin/python3 -I /opt/bastion-gateway/dispatch\.py '
    r'--config /etc/bastion-gateway/dispatch\.toml" ssh-ed25519 [A-Za-z0-9+/=]+ bastion-gateway-biscuit$'
)


def test_keygen_then_authorized_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = init_demo(tmp_path / "demo")
    assert main(["gateway", "authorized-keys", "--config", str(config), "biscuit"]) == 1  # no key yet: not found
    assert "keygen" in capsys.readouterr().err
    assert main(["gateway", "keygen", "--config", str(config), "biscuit"]) == 0
    key = tmp_path / "demo" / "state" / "gateway" / "biscuit_ed25519"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    capsys.readouterr()
    assert main(["gateway", "authorized-keys", "--config", str(config), "biscuit"]) == 0
    line = capsys.readouterr().out.strip()
    assert LINE.match(line), line
    assert line.endswith(Path(f"{key}.pub").read_text().strip())
    # A key is never overwritten: it may already be installed on a host.
    before = key.read_bytes()
    assert main(["gateway", "keygen", "--config", str(config), "biscuit"]) == 1  # refused: CONFLICT
    assert key.read_bytes() == before


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="the folder is given to another user (chown needs root)")
def test_keygen_never_writes_root_s_key_through_another_users_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Attack (found 2026-12-06): key_path names a folder not made yet in a sticky folder; another user
    links that name to a folder of theirs. keygen followed the link: root's new key was in their folder,
    and they could swap in a key of their own before `authorized-keys` printed the line to install."""
    config = init_demo(tmp_path / "demo")
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    theirs = sticky / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    planted = sticky / "keys"
    planted.symlink_to(theirs)
    os.lchown(planted, 65534, 65534)
    text = config.read_text().replace('key_path = "state/gateway/biscuit_ed25519"', f'key_path = "{planted}/biscuit"')
    config.write_text(text)
    assert main(["gateway", "keygen", "--config", str(config), "biscuit"]) == 78
    err = capsys.readouterr().err
    assert err == (
        f"bastion: gateway 'biscuit' key folder {planted}: whoever may change the symbolic link {planted} on its "
        "path (give the real path); choose a key_path in a folder of root's\n"
    )
    assert os.listdir(theirs) == []


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="the folder is given to another user (chown needs root)")
def test_authorized_keys_refuses_a_key_another_user_could_replace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Attack: the key sits in a folder another user owns (made so by an older keygen, or by hand): they may
    swap in their own key, and the printed line would install it on the production host. Refused."""
    config = init_demo(tmp_path / "demo")
    assert main(["gateway", "keygen", "--config", str(config), "biscuit"]) == 0
    folder = tmp_path / "demo" / "state" / "gateway"
    os.chown(folder, 65534, 65534)
    capsys.readouterr()
    assert main(["gateway", "authorized-keys", "--config", str(config), "biscuit"]) == 78
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"bastion: gateway 'biscuit' key {folder}/biscuit_ed25519: uid 65534, who owns {folder}")
    assert err.endswith("; make a new key elsewhere\n")


def test_dispatch_script_is_printed_and_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gateway", "dispatch-script"]) == 0
    assert capsys.readouterr().out == dispatch_source()
    out = tmp_path / "dispatch.py"
    assert main(["gateway", "dispatch-script", "--output", str(out)]) == 0
    assert out.read_text() == dispatch_source()
    assert stat.S_IMODE(out.stat().st_mode) & 0o111


@pytest.mark.root  # dispatch.py trusts the example only in folders that are root's
def test_demo_has_biscuit_and_a_target_example(tmp_path: Path) -> None:
    config = load_config(init_demo(tmp_path / "demo"))
    biscuit = config.gateway_by_name("biscuit")
    assert biscuit is not None
    assert biscuit.host == "127.0.0.1"
    assert biscuit.host_key is None  # harmless until a target is pinned
    approvals = {a.name: a.approval for a in biscuit.action}
    assert approvals["deploy"] is True
    assert approvals["status"] is False
    example = tmp_path / "demo" / "gateway" / "dispatch.toml"
    from bastion.gateway import dispatch

    target = dispatch.load_config(str(example))
    assert set(target.actions) == set(approvals)


def test_authorized_keys_line_is_always_one_line(tmp_path: Path) -> None:
    """Even a GatewayConfig that skipped validation cannot make the printed entry two entries."""
    from bastion.gateway.keys import authorized_keys_line, generate_key
    from bastion.safety.errors import ConfigError

    biscuit = load_config(init_demo(tmp_path / "demo")).gateway_by_name("biscuit")
    assert biscuit is not None
    generate_key(biscuit)
    assert LINE.match(authorized_keys_line(biscuit))
    for update in (
        {"from_addresses": ("127.0.0.1\n",)},
        {"dispatch_config": '/etc/x.toml" ssh-ed25519 AAAA'},
        {"remote_python": "/usr/bin/python3\nssh-ed25519"},
    ):
        with pytest.raises(ConfigError, match="one well-formed line"):
            authorized_keys_line(biscuit.model_copy(update=update))


def _with_gateway(tmp_path: Path, old: str, new: str) -> Path:
    path = init_demo(tmp_path / "demo")
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('key_path = "state/gateway/biscuit_ed25519"', 'key_path = "workspace/key"', "an agent could read it"),
        ('# host_key = "ssh-ed25519 AAAA..."', 'host_key = "ssh-ed25519 not base64!"', "host_key"),
        ('name = "status"', 'name = "actions"', "actions"),
        ('from_addresses = ["127.0.0.1"]', 'from_addresses = ["1.2.3.4\\",command=\\"sh"]', "from address"),
        ('dispatch_path = "/opt/bastion-gateway/dispatch.py"', 'dispatch_path = "/opt/x y.py"', "absolute path"),
        # A trailing line break would split the authorized_keys line in two.
        ('from_addresses = ["127.0.0.1"]', 'from_addresses = ["127.0.0.1\\n"]', "from address"),
        ('remote_python = "/usr/bin/python3"', 'remote_python = "/usr/bin/python3\\n"', "absolute path"),
        (
            'dispatch_config = "/etc/bastion-gateway/dispatch.toml"',
            'dispatch_config = "/etc/bastion-gateway/dispatch.toml\\n"',
            "absolute path",
        ),
        ('name = "logs"', 'name = "status"', "action twice"),
        ("# webhook_url", 'webhook_url = "file:///etc/passwd"\n#', "webhook_url"),
    ],
)
def test_config_refusals(tmp_path: Path, old: str, new: str, message: str) -> None:
    from bastion.safety.errors import ConfigError

    path = _with_gateway(tmp_path, old, new)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


@pytest.mark.root
def test_readme_install_recipe_gives_a_config_dispatch_trusts(tmp_path: Path) -> None:
    """The README's step 4 (`install -o root -g root -m 0644 -D`) gives a config dispatch.py reads; the same
    file left group-writable, or in a folder others may write, is refused (issue 13, finding 7)."""
    import os
    import subprocess

    from bastion.gateway import dispatch

    if os.geteuid() != 0:
        pytest.skip("needs root: the recipe installs the config as root's")
    example = tmp_path / "demo" / "gateway" / "dispatch.toml"
    init_demo(tmp_path / "demo")
    installed = tmp_path / "etc" / "bastion-gateway" / "dispatch.toml"
    recipe = ["install", "-o", "root", "-g", "root", "-m", "0644", "-D", str(example), str(installed)]
    subprocess.run(recipe, check=True, timeout=30)
    assert set(dispatch.load_config(str(installed)).actions) == {"status", "logs", "deploy", "restart", "rollback"}
    installed.chmod(0o664)
    with pytest.raises(dispatch.Untrusted, match="writable by group or others"):
        dispatch.load_config(str(installed))
    installed.chmod(0o644)
    installed.parent.chmod(0o777)
    with pytest.raises(dispatch.Untrusted, match="writable by group or others"):
        dispatch.load_config(str(installed))

"""Start-up refusals: each bad config stops the server with one clear line and a non-zero exit."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.cli import EXIT_CONFIG, main
from bastion.config import load_config
from bastion.demo import init_demo

BASTION = Path(sys.executable).parent / "bastion"


def _edit(config: Path, old: str, new: str) -> None:
    text = config.read_text()
    assert old in text, old
    config.write_text(text.replace(old, new, 1))


def _refusal(capsys: pytest.CaptureFixture[str], config: Path) -> str:
    code = main(["serve", "--config", str(config), "--stdio"])
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    return init_demo(tmp_path / "demo")


def test_demo_config_loads(config: Path) -> None:
    loaded = load_config(config)
    assert loaded.default_workspace == "default"
    assert loaded.workspace[0].path == config.parent / "workspace"
    assert loaded.audit_path == config.parent / "state" / "audit.jsonl"
    assert loaded.inbox[0].path == config.parent / "inbox"


def test_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert "does not exist" in _refusal(capsys, tmp_path / "nope.toml")


def test_invalid_toml(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    config.write_text("state_dir = [unclosed\n")
    assert "not valid TOML" in _refusal(capsys, config)


def test_unknown_key(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    _edit(config, 'log_level = "WARNING"', 'log_level = "WARNING"\nallow_everything = true')
    assert "unknown key 'allow_everything'" in _refusal(capsys, config)


def test_unknown_nested_key(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    _edit(config, "timeout_s = 30", "timeout_s = 30\nshell = true")
    assert "unknown key 'workspace.0.shell'" in _refusal(capsys, config)


def test_workspace_root_missing(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    _edit(config, 'path = "workspace"', 'path = "gone"')
    assert "does not exist" in _refusal(capsys, config)


def test_workspace_root_not_a_directory(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    (config.parent / "file").write_text("x")
    _edit(config, 'path = "workspace"', 'path = "file"')
    assert "is not a directory" in _refusal(capsys, config)


def test_workspace_root_is_filesystem_root(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    _edit(config, 'path = "workspace"', 'path = "/"')
    assert "home folder" in _refusal(capsys, config)


def test_audit_log_inside_workspace(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    _edit(config, "fail_closed = true", 'fail_closed = true\npath = "workspace/audit.jsonl"')
    line = _refusal(capsys, config)
    assert "audit log" in line
    assert "move it out of the workspace" in line


def test_database_inside_workspace(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    _edit(config, 'state_dir = "state"', 'state_dir = "workspace/state"')
    assert "inside workspace" in _refusal(capsys, config)


def test_state_inside_inbox(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    _edit(config, 'state_dir = "state"', 'state_dir = "inbox/.state"')
    assert "inside inbox" in _refusal(capsys, config)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="the link is given to another user (lchown needs root)")
def test_a_state_dir_link_another_user_planted_is_refused_and_its_target_untouched(
    capsys: pytest.CaptureFixture[str], config: Path, tmp_path: Path
) -> None:
    """Attack (found 2026-12-06): state_dir names a folder not made yet in a sticky folder (as /tmp is);
    another user plants a link there to a folder of root's. Resolved at load, the link was judged by its
    target: root chmodded that folder 0711 and wrote its state into it. Now a state_dir that is not its own
    real path is refused, in one line, and the target is left as it was."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    (victim / "precious.txt").write_text("root's\n")
    planted = sticky / "bastion-state"
    planted.symlink_to(victim)
    os.lchown(planted, 65534, 65534)
    _edit(config, 'state_dir = "state"', f'state_dir = "{planted}"')
    line = _refusal(capsys, config)
    assert line == (
        f"bastion: state_dir {planted} goes through a symbolic link (to {victim}): give its real path, so that "
        "no one who may change a link on the way can move the server's state"
    )
    assert stat.S_IMODE(victim.stat().st_mode) == 0o755
    assert sorted(os.listdir(victim)) == ["precious.txt"]


def test_invalid_redaction_regex(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    _edit(config, "patterns = []", 'patterns = ["(unclosed"]')
    assert "not a valid regex" in _refusal(capsys, config)


def test_policy_with_neither_allow_nor_deny(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    text = config.read_text()
    start = text.index("allow = [")
    end = text.index("\n", text.index("deny = ["))
    config.write_text(text[:start] + text[end + 1 :])
    assert "neither allow nor deny" in _refusal(capsys, config)


@pytest.mark.parametrize("name", ["LD_PRELOAD", "GIT_SSH_COMMAND", "PYTHONPATH", "NODE_OPTIONS", "PATH"])
def test_dangerous_environment_names_refused(capsys: pytest.CaptureFixture[str], config: Path, name: str) -> None:
    _edit(config, "env = {}", f'env = {{ {name} = "x" }}')
    assert name in _refusal(capsys, config)


def test_default_workspace_must_exist(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    _edit(config, 'default_workspace = "default"', 'default_workspace = "other"')
    assert "names no [[workspace]]" in _refusal(capsys, config)


def test_refusal_through_the_real_command(config: Path) -> None:
    config.write_text("nonsense = \n")
    proc = subprocess.run(
        [str(BASTION), "serve", "--config", str(config), "--stdio"], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == EXIT_CONFIG
    assert len(proc.stderr.strip().splitlines()) == 1


def test_init_never_overwrites(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    before = config.read_text()
    assert main(["init", str(config.parent)]) == EXIT_CONFIG
    assert "already exists" in capsys.readouterr().err
    assert config.read_text() == before


def test_init_with_a_python_env_makes_python_data_the_default(tmp_path: Path) -> None:
    """The demo's create_sandbox() gets numpy, pandas and matplotlib when their environment was built."""
    env = tmp_path / "data-env"
    (env / "bin").mkdir(parents=True)
    (env / "pyvenv.cfg").write_text("home = /usr/bin\n")
    assert main(["init", str(tmp_path / "demo"), "--python-env", str(env)]) == 0
    loaded = load_config(tmp_path / "demo" / "bastion.toml")
    assert loaded.sandboxes.default_template == "python-data"
    assert loaded.template[0].python_env == env


def test_init_refuses_a_python_env_that_is_not_one(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Before, it wrote a config naming the folder, which then refused to load."""
    assert main(["init", str(tmp_path / "demo"), "--python-env", str(tmp_path / "missing")]) == EXIT_CONFIG
    assert "is not a virtual environment" in capsys.readouterr().err
    assert not (tmp_path / "demo" / "bastion.toml").exists()


def test_init_without_python_env_never_looks_in_a_source_checkout(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """An installed wheel has no checkout: init names the system's Python and how to get python-data."""
    assert main(["init", str(tmp_path / "demo")]) == 0
    loaded = load_config(tmp_path / "demo" / "bastion.toml")
    assert loaded.sandboxes.default_template == "default"
    assert loaded.template == ()
    assert "see --python-data" in capsys.readouterr().out
    assert "bastion template build python-data" in (tmp_path / "demo" / "bastion.toml").read_text()


def test_init_takes_a_python_env_or_builds_one_not_both(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["init", str(tmp_path / "demo"), "--python-env", str(tmp_path), "--python-data"])
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("inside", ["state/organizer", "state/sandboxes", "state/gateway"])
def test_workspace_inside_the_state_folder_is_refused(
    capsys: pytest.CaptureFixture[str], config: Path, inside: str
) -> None:
    """Invariant: no workspace overlaps the state folder (database, audit log, sandboxes' disks, gateway
    keys), which its commands and file tools would otherwise reach; the line names the settings to change,
    and the refused start leaves the state folder as it was."""
    state = config.parent / "state"
    (config.parent / inside).mkdir(parents=True, exist_ok=True)
    (config.parent / inside / "kept").write_text("state data")
    before = sorted(state.rglob("*"))
    _edit(config, 'path = "workspace"', f'path = "{inside}"')
    line = _refusal(capsys, config)
    assert f"workspace 'default' ({config.parent / inside}) and the state folder {state} overlap" in line
    assert "change the workspace's path or state_dir" in line
    assert sorted(state.rglob("*")) == before
    assert (config.parent / inside / "kept").read_text() == "state data"


@pytest.mark.parametrize(("workspace", "inbox"), [("workspace", "workspace/inbox"), ("inbox/ws", "inbox")])
def test_inbox_overlapping_a_workspace_is_refused(
    capsys: pytest.CaptureFixture[str], config: Path, workspace: str, inbox: str
) -> None:
    """Invariant: an inbox and a workspace never share files: an agent's commands would move files under
    the organizer's journal (or the organizer theirs)."""
    for folder in (workspace, inbox):
        (config.parent / folder).mkdir(parents=True, exist_ok=True)
    _edit(config, 'path = "inbox"', f'path = "{inbox}"')
    _edit(config, 'path = "workspace"', f'path = "{workspace}"')
    line = _refusal(capsys, config)
    assert f"inbox 'inbox' ({config.parent / inbox}) and workspace 'default' ({config.parent / workspace})" in line
    assert "overlap: change one of their paths" in line


def test_init_writes_the_config_only_its_owner_can_read(tmp_path: Path) -> None:
    """Attack (/tmp/atk-local/config_mode.sh): bastion.toml, where env secrets go, was written with the umask's
    mode (0644) and read by a local user. Invariant: `bastion init` writes it 0600 whatever the umask, and never
    through a link planted at its name."""
    old = os.umask(0)
    try:
        config = init_demo(tmp_path / "demo")
    finally:
        os.umask(old)
    assert stat.S_IMODE(config.stat().st_mode) == 0o600


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_pip_index_url_password_is_redacted_from_output_and_audit(config: Path) -> None:
    """Attack (/tmp/atk-local/pipcreds.py): a private index's `user:token@` in [sandboxes] pip_index_url was not a
    configured secret, so output or audit records that carried it showed it. Invariant: the password, the whole
    userinfo and the password %-decoded are redacted from a command's output as configured values, and the
    audit log holds none of them."""
    token = "s3cr3tIndexToken%2Fx"
    _edit(
        config,
        "[sandboxes]\nenabled = true\n",
        f'[sandboxes]\nenabled = true\npip_index_url = "https://deploy:{token}@pypi.internal.example/simple"\n',
    )
    loaded = load_config(config)
    assert {f"deploy:{token}", token, "s3cr3tIndexToken/x"} <= set(loaded.secret_values())
    services = build_services(loaded)
    try:
        async with Client(build_server(services, caller="test")) as client:
            result = await client.call_tool("run_command", {"command": f"echo deploy:{token} s3cr3tIndexToken/x"})
    finally:
        services.close()
    assert result.structured_content is not None
    stdout = result.structured_content["detail"]["stdout"]
    assert "s3cr3tIndexToken" not in stdout
    assert stdout.count("[REDACTED:secret_value]") == 2, stdout
    assert "s3cr3tIndexToken" not in loaded.audit_path.read_text()


@pytest.mark.parametrize(
    ("line", "number"), [("timeout_s = 30", "nan"), ("idle_timeout_s = 1800", "inf"), ("idle_timeout_s = 1800", "nan")]
)
def test_a_nan_or_infinite_number_in_the_config_is_refused(
    capsys: pytest.CaptureFixture[str], config: Path, line: str, number: str
) -> None:
    """Attack (repro_nan.py, from a client): a NaN time limit passed every `<=` check and became an event-loop
    timer that upset the loop's others. TOML has `nan` and `inf` too, and a bound such as `gt=0` let `inf`
    through: a config naming either is refused at load, saying the number must be finite."""
    _edit(config, line, f"{line.split(' = ')[0]} = {number}")
    assert "finite" in _refusal(capsys, config)
